"""A resumable digest of a blend's first n samples: what lets a resumed run be longer.

Lengthening a run (more ``train.steps``) on resume builds a longer blend, whose fingerprint
differs from the checkpoint's in ``num_samples`` only. The blend is prefix-stable by
construction (the interleave, ``interleave``; each corpus's order, one seeded permutation per
epoch, ``blend.corpus_order``; the per-shard indices, which do not depend on the length), so the
samples already trained on come first in the longer blend. That is a property of the code that
built each blend, so it is checked, not assumed: the loader state records this digest of the
samples consumed, and a resume into a longer blend hashes the same prefix of it and compares.

What is hashed is what a sample reads (``BlendedSamples.identities``): its corpus and its number
in that corpus's order. The digest is a sha256 chain: each link hashes the one before and the
next ``LINK`` samples; the digest of n samples hashes the last whole link and the rest. A record
holds both (``{"chain", "sha256"}``), so a resume into the same blend carries the chain on
without rehashing the past; only a lengthened resume (or a checkpoint without a record) rehashes
its prefix, about 10 bytes a sample.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

LINK = 1 << 16  # samples per chain link: a record hashes at most this many new ones beyond them
_START = hashlib.sha256(b"goodput.blend-prefix/1").digest()

Identities = Callable[[int, int], bytes]  # (first, stop) -> what samples [first, stop) read


class PrefixDigest:
    """The digest of the first n samples of one blend, for any n, advanced lazily."""

    def __init__(self, identities: Identities) -> None:
        self._identities = identities
        self._links = 0
        self._chain = _START

    def resume(self, num_samples: int, chain: str) -> None:
        """Carry on from a record of this same blend, made at ``num_samples``."""
        self._links, self._chain = num_samples // LINK, bytes.fromhex(chain)

    def record(self, num_samples: int) -> dict[str, str]:
        """``{"chain": every whole link, "sha256": the digest of num_samples samples}``."""
        whole = num_samples // LINK
        if whole < self._links:  # an earlier prefix than the chain covers: start over
            self._links, self._chain = 0, _START
        while self._links < whole:
            first = self._links * LINK
            self._chain = _hash(self._chain, self._identities(first, first + LINK))
            self._links += 1
        rest = self._identities(whole * LINK, num_samples)
        return {"chain": self._chain.hex(), "sha256": _hash(self._chain, rest).hex()}


def _hash(chain: bytes, identities: bytes) -> bytes:
    link = hashlib.sha256(chain)
    link.update(identities)
    return link.digest()
