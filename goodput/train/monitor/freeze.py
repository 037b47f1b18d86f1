"""The bf16 freeze detector: weights whose updates round away in their storage precision.

Why. Stored with round-to-nearest, ``w + Δ`` comes back as ``w`` whenever |Δ| is below half the
spacing of representable values at ``w``. bf16 keeps 8 significant bits: at 1.0 the spacing is
2⁻⁷ above and 2⁻⁸ below, so an RMSNorm gain initialised to 1.0 loses every update smaller than
~2e-3–3.9e-3, while the small-init matrices (spacing ~1e-4 at 0.02) keep theirs and the loss
still falls. That was the seed's run: pure-bf16 weights, every RMSNorm gain at exactly 1.0 for
17,000 steps, lm-eval at the random baseline. The fix is ``precision = "fp32-master"`` (fp32
master weights, bf16 compute), or stochastic rounding / Kahan-compensated updates.

What is measured, every ``interval`` steps, per tensor:

- the share of its entries with a non-zero (finite) gradient whose stored bits are the same
  after ``optimizer.step()`` as before: their update rounded away. This is the *applied* change,
  not the intended one: it needs no optimizer's update formula (AdamW, Muon, SOAP, Sophia, any
  weight decay, clipping, learning rate all included), no fp32 recomputation of the update, and
  it sees exactly what the storage kept. An entry whose intended update was exactly 0 although
  its gradient was not also counts; that is rare and cannot carry a tensor past the threshold.
- whether the tensor has not changed AT ALL since the previous check (``interval`` steps ago).
  Small tensors (``COPY_LIMIT_BYTES`` of local values or less: the norm gains, biases) keep a
  copy of their bits, compared exactly. Larger ones keep a fingerprint of two Python integers
  (``Fingerprints``): exact integer sums of the raw bits, each 16-bit word times a random
  weight. No floating-point rounding can hide a change (a float sum can absorb a change of one
  unit in the last place) and no reduction order can make an unchanged tensor look changed
  (integer addition is associative), so "changed" is never wrong; a change is missed only when
  its word differences are orthogonal to the secret random weights, which for any given change
  has probability at most 2⁻²³ per sum (Schwartz–Zippel: a nonzero polynomial of degree 2 in
  weights drawn from 2²⁴ − 1 values), at most 2⁻⁴⁶ for both.

A tensor is frozen when its share exceeds ``threshold``, or when it has not changed since the
previous check although its gradient is non-zero now.

Memory and cost. ``before_step`` copies this rank's local values (``to_local()`` of a DTensor:
FSDP shards, tensor-parallel pieces) of every tensor with a gradient: one transient copy of the
local shard in the weights' own dtype (2 bytes per bf16 entry), on due steps only, freed by
``after_step`` (or ``discard``). An exact per-entry comparison needs the before-value of every
entry, since the step updates all tensors at once; nothing smaller is exact. Kept between
checks: the copies of small tensors, two integers per larger tensor, and per device two
2¹⁸-entry int64 weight vectors (4 MiB). ``after_step`` makes a few passes over the local values
and gradients (a handful of elementwise kernels per tensor, the fingerprint in 2¹⁸-word chunks),
with one device-to-host transfer in all.

Across ranks: each rank's per-name (rounded-away count, counted entries, unchanged) is gathered
over the world (``all_gather_object``: a small dict, every ``interval`` steps; with NCCL the
current CUDA device must be set, as the trainer does). Counts are summed: FSDP and
tensor-parallel shards add up to the whole tensor, replicated copies count alike in numerator
and denominator, pipeline stages contribute different names. A tensor is unchanged when every
rank's part is.

Wiring: call ``before_step()`` just before ``optimizer.step()`` on a due step (gradients
present, after clipping) and ``after_step(step)`` right after it, before ``zero_grad``; the
optimizer's ``register_step_pre_hook`` / ``register_step_post_hook`` are exactly those points.
A step the non-finite guard skipped: call ``discard()`` (or nothing: the next ``before_step``
replaces the copy). Nothing here is saved in checkpoints: after a resume the first check has no
previous one, so "unchanged" needs one more interval; the share works from the first check.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from goodput.train.dtensors import local_tensor

COPY_LIMIT_BYTES = 64 * 1024  # tensors up to this size (local values) keep a copy, not a hash
CHUNK_WORDS = 2**18  # fingerprint chunk, in 16-bit words; bounds the int64 sums below 2^57
WEIGHT_RANGE = 2**24  # fingerprint weights are drawn from [1, WEIGHT_RANGE)
FINGERPRINT_SEED = 0x6F6F64  # any fixed value: training never sees the weights
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_Kept = torch.Tensor | tuple[int, int]  # between checks: a small tensor's copy, or a fingerprint


@dataclass(frozen=True, slots=True)
class TensorFreeze:
    """One tensor at one check, over every rank holding a part of it."""

    rounded_away: int  # entries with a non-zero gradient whose bits did not change
    counted: int  # entries with a non-zero, finite gradient
    unchanged: bool  # no bit changed since the previous check (False at the first one)

    @property
    def share(self) -> float:
        return self.rounded_away / self.counted if self.counted else 0.0


@dataclass(frozen=True, slots=True)
class FreezeReport:
    step: int
    previous_check: int | None  # the step of the check before, in this process
    threshold: float
    tensors: dict[str, TensorFreeze]  # every tensor with a gradient on some rank

    @property
    def frozen_fraction(self) -> float:
        """All rounded-away entries over all counted entries (the metric)."""
        counted = sum(tensor.counted for tensor in self.tensors.values())
        rounded = sum(tensor.rounded_away for tensor in self.tensors.values())
        return rounded / counted if counted else 0.0

    @property
    def frozen_tensors(self) -> list[str]:
        """Names, sorted, of the tensors whose share is over the threshold or that did not
        change since the previous check although their gradient is non-zero."""
        return sorted(
            name
            for name, tensor in self.tensors.items()
            if tensor.share > self.threshold or (tensor.unchanged and tensor.counted > 0)
        )

    def warning(self) -> str | None:
        """One line naming every frozen tensor with its share, the step and the fix; None when
        no tensor is frozen."""
        frozen = self.frozen_tensors
        if not frozen:
            return None
        since = f"unchanged since step {self.previous_check}"
        parts = [
            f"{name} {self.tensors[name].share:.0%}"
            + (f" ({since})" if self.tensors[name].unchanged else "")
            for name in frozen
        ]
        return (
            f"warning: bf16 freeze: step {self.step}: {len(frozen)} tensor(s) are not training, "
            "their updates round away in the weights' precision (share of entries with a "
            f"non-zero gradient whose update was lost): {', '.join(parts)}; fix: set "
            'precision = "fp32-master" in [parallel] to keep fp32 master weights (bf16 compute)'
        )


class Fingerprints:
    """Exact integer fingerprints of tensors' bits (the module docstring's argument).

    The tensor's storage is read as 16-bit words (8-bit for 1-byte dtypes) x_j. Chunk c holds
    words j of [c·C, (c+1)·C); per chunk, s_k(c) = Σ x_j · r_k[j − c·C] for two random weight
    vectors r_1, r_2 (k = 1, 2); the fingerprint is (Σ_c a_c · s_1(c), Σ_c b_c · s_2(c)) with
    random per-chunk multipliers a_c, b_c, in unbounded Python integers. Each is a polynomial of
    degree 2 in the random draws, linear in the word differences of a change, so a nonzero change
    vanishes in it with probability ≤ 2/(WEIGHT_RANGE − 1)."""

    def __init__(self, seed: int = FINGERPRINT_SEED) -> None:
        self._rng = random.Random(seed)
        self._seed = seed
        self._multipliers: list[tuple[int, int]] = []
        self._weights: dict[torch.device, torch.Tensor] = {}

    def chunk_sums(self, tensor: torch.Tensor) -> torch.Tensor:
        """Per chunk, the two weighted sums, as an int64 [chunks, 2] tensor on the tensor's
        device (not yet read: the caller reads all tensors' sums in one transfer)."""
        words = _words(tensor)
        weights = self._weights_on(words.device)
        sums = []
        for start in range(0, len(words), CHUNK_WORDS):
            chunk = words[start : start + CHUNK_WORDS].to(torch.int64)
            sums.append((chunk * weights[:, : len(chunk)]).sum(1))
        if not sums:
            return torch.zeros((0, 2), dtype=torch.int64, device=words.device)
        return torch.stack(sums)

    def combine(self, chunk_sums: list[list[int]]) -> tuple[int, int]:
        """The fingerprint from ``chunk_sums``' values."""
        while len(self._multipliers) < len(chunk_sums):
            draw = self._rng.randrange
            self._multipliers.append((draw(1, WEIGHT_RANGE), draw(1, WEIGHT_RANGE)))
        first = sum(a * s1 for (a, _), (s1, _) in zip(self._multipliers, chunk_sums, strict=False))
        second = sum(b * s2 for (_, b), (_, s2) in zip(self._multipliers, chunk_sums, strict=False))
        return first, second

    def of(self, tensor: torch.Tensor) -> tuple[int, int]:
        return self.combine(self.chunk_sums(tensor).tolist())

    def _weights_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._weights:
            generator = torch.Generator().manual_seed(self._seed)
            weights = torch.randint(1, WEIGHT_RANGE, (2, CHUNK_WORDS), generator=generator)
            self._weights[device] = weights.to(device)
        return self._weights[device]


class FreezeDetector:
    """Every ``interval`` steps, per tensor: the share of its updates that rounded away, and
    whether it changed at all since the previous check; merged over the ranks.
    ``named_parameters``: the parallelized model's (after ``fully_shard`` and tensor
    parallelism, whose DTensors replace the original parameters); ``group``: the ranks to merge
    over (None: the whole world)."""

    def __init__(
        self,
        named_parameters: Sequence[tuple[str, torch.Tensor]],
        interval: int = 100,
        threshold: float = 0.5,
        *,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"freeze detector: interval {interval!r} must be a positive integer")
        if not (isinstance(threshold, int | float) and 0 <= threshold < 1):
            raise ValueError(f"freeze detector: threshold {threshold!r} must be in [0, 1)")
        names = [name for name, _ in named_parameters]
        if len(set(names)) != len(names):
            raise ValueError("freeze detector: parameter names must be unique")
        self.parameters = list(named_parameters)
        self.interval, self.threshold, self.group = interval, float(threshold), group
        self.fingerprints = Fingerprints()
        self._before: dict[str, torch.Tensor] = {}  # this step's copies, due steps only
        self._previous: dict[str, _Kept] = {}
        self._previous_step: int | None = None

    def due(self, step: int) -> bool:
        return step % self.interval == 0

    def before_step(self) -> None:
        """Copy this rank's local values of every tensor with a gradient (call just before
        ``optimizer.step()``)."""
        self._before = {}
        with torch.no_grad():
            for name, parameter in self.parameters:
                if parameter.grad is not None:
                    self._before[name] = local_tensor(parameter.detach()).clone()

    def discard(self) -> None:
        """Forget the copies (the step did not happen: the non-finite guard skipped it)."""
        self._before = {}

    def after_step(self, step: int) -> FreezeReport:
        """Compare with the copies (call right after ``optimizer.step()``, before
        ``zero_grad``); a collective over the group: every rank calls it on the same steps."""
        assert self._before or not any(p.grad is not None for _, p in self.parameters), (
            "after_step without before_step on this step"
        )
        with torch.no_grad():
            local = self._local_counts()
        self._before = {}
        report = FreezeReport(step, self._previous_step, self.threshold, _merge(local, self.group))
        self._previous_step = step
        return report

    def _local_counts(self) -> dict[str, tuple[int, int, bool]]:
        names: list[tuple[str, _Kept | None, bool]] = []  # name, what was kept, copied or not
        pending = []  # per tensor: its device values, read in one transfer
        previous, self._previous = self._previous, {}
        for name, parameter in self.parameters:
            before = self._before.get(name)
            if before is None or parameter.grad is None:
                continue
            after, grad = local_tensor(parameter.detach()), local_tensor(parameter.grad)
            counted_mask = (grad != 0) & torch.isfinite(grad)
            same = _bits(after) == _bits(before)
            sums = torch.stack([(same & counted_mask).sum(), counted_mask.sum()]).to(torch.int64)
            last = previous.get(name)
            copied = after.numel() * after.element_size() <= COPY_LIMIT_BYTES
            if copied:
                self._previous[name] = after.clone()
                changed = (
                    (_bits(after) != _bits(last)).any().to(torch.int64).reshape(1)
                    if isinstance(last, torch.Tensor) and last.shape == after.shape
                    else torch.ones(1, dtype=torch.int64, device=after.device)
                )
                pending.append(torch.cat([sums, changed]))
            else:
                pending.append(torch.cat([sums, self.fingerprints.chunk_sums(after).flatten()]))
            names.append((name, last, copied))
        counts: dict[str, tuple[int, int, bool]] = {}
        for (name, last, copied), values in zip(names, _read(pending), strict=True):
            rounded, counted, rest = values[0], values[1], values[2:]
            if copied:  # rest is [changed]
                unchanged = isinstance(last, torch.Tensor) and rest[0] == 0
            else:
                fingerprint = self.fingerprints.combine(
                    [rest[i : i + 2] for i in range(0, len(rest), 2)]
                )
                self._previous[name] = fingerprint
                unchanged = isinstance(last, tuple) and fingerprint == last
            counts[name] = (rounded, counted, unchanged)
        return counts


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values as integers of the same width: equal exactly when the bits are."""
    return tensor.view(_INT_OF_SIZE[tensor.element_size()])


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's storage as a flat run of 16-bit words (bytes for 1-byte dtypes)."""
    flat = tensor.detach().reshape(-1)
    return flat.view(torch.int8 if flat.element_size() == 1 else torch.int16)


def _read(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Each 1-D int64 tensor as a list of ints: one transfer per device, not one per value."""
    out: list[list[int]] = [[] for _ in tensors]
    by_device: dict[torch.device, list[int]] = {}
    for index, tensor in enumerate(tensors):
        by_device.setdefault(tensor.device, []).append(index)
    for indices in by_device.values():
        flat = torch.cat([tensors[i] for i in indices]).tolist()
        offset = 0
        for i in indices:
            out[i] = flat[offset : offset + len(tensors[i])]
            offset += len(tensors[i])
    return out


def _merge(
    local: dict[str, tuple[int, int, bool]], group: dist.ProcessGroup | None
) -> dict[str, TensorFreeze]:
    """Every rank's counts by name: summed, and unchanged only where every part is."""
    parts: list[dict[str, tuple[int, int, bool]] | None] = [local]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, local, group=group)
    merged: dict[str, TensorFreeze] = {}
    for part in parts:
        assert part is not None
        for name, (rounded, counted, unchanged) in part.items():
            seen = merged.get(name)
            if seen is not None:
                rounded, counted = rounded + seen.rounded_away, counted + seen.counted
                unchanged = unchanged and seen.unchanged
            merged[name] = TensorFreeze(rounded, counted, unchanged)
    return dict(sorted(merged.items()))
