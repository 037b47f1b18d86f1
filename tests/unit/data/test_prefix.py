"""The resumable prefix digest: any n, any order of records, carried across a resume."""

import hashlib

import pytest

from goodput.data import prefix
from goodput.data.prefix import PrefixDigest


def identities(first, stop):
    return b"".join(i.to_bytes(8, "little") for i in range(first, stop))


@pytest.fixture(autouse=True)
def short_links(monkeypatch):
    monkeypatch.setattr(prefix, "LINK", 4)


def test_the_digest_is_a_chain_of_links_then_the_rest():
    link = hashlib.sha256(b"goodput.blend-prefix/1").digest()
    for first in (0, 4):
        link = hashlib.sha256(link + identities(first, first + 4)).digest()
    assert PrefixDigest(identities).record(10) == {
        "chain": link.hex(),
        "sha256": hashlib.sha256(link + identities(8, 10)).hexdigest(),
    }


def test_records_agree_in_any_order_and_across_a_resume():
    fresh = {n: PrefixDigest(identities).record(n) for n in range(14)}
    assert len({r["sha256"] for r in fresh.values()}) == 14
    digest = PrefixDigest(identities)
    assert [digest.record(n) for n in (3, 9, 13, 5, 0)] == [fresh[n] for n in (3, 9, 13, 5, 0)]

    def past_unread(first, stop):
        assert first >= 8, "a resumed digest rehashed samples its chain covers"
        return identities(first, stop)

    resumed = PrefixDigest(past_unread)
    resumed.resume(9, fresh[9]["chain"])
    assert resumed.record(13) == fresh[13]
