"""A read-only open beside a writer reads each superblock slot from one copy
of its bytes (`volume.settled_slot_copy`): a slot the writer rewrites while
it is read is either the old version or the new one, never the fields of one
checked by the CRC of the other; a copy torn by the rewrite is taken again
until the writer is done; a slot whose bytes stay damaged is damage.

The writer here is played by a mapping that hands out the slot's bytes of
one version, then of the next (two real superblocks of one log), in the
order a reader's reads meet them."""

from __future__ import annotations

import numpy as np
import pytest

from concordia.wal import Log
from concordia.wal import format as F
from concordia.wal import volume as V
from concordia.wal.errors import CorruptionError
from concordia.wal.volume import Volume

from .helpers import commit_pages, image

MiB = 1 << 20


class Rewritten:
    """A mapping whose reads return `versions[k]` for the k-th read on
    (the last version from then on): a writer rewriting the slot between the
    reads of a reader."""

    def __init__(self, *versions):
        self.versions = [np.frombuffer(bytes(v), np.uint8) for v in versions]
        self.size = self.versions[0].size
        self.reads = 0

    def __getitem__(self, key):
        v = self.versions[min(self.reads, len(self.versions) - 1)]
        self.reads += 1
        return v[key]


@pytest.fixture
def two_versions(tmp_path):
    """The superblock area of one log before and after its writer rolled
    into new segments (slot A rewritten in between), and slot A's offset."""
    path = f"file:{tmp_path / 'l.log'}"
    w = Log.create(path, size=16 * MiB, segment_size=MiB)
    w.define_region("r", np.uint8, (256 * 4096,), 4096, "opaque")
    for e in range(1, 3):
        commit_pages(w, e, pages=200)
    before = bytes(image(w.backend))
    for e in range(3, 7):
        commit_pages(w, e, pages=200)
    after = bytes(image(w.backend))
    w.close()
    a_old = F.decode_superblock(memoryview(V.slot_copy(np.frombuffer(before, np.uint8), 0)))
    a_new = F.decode_superblock(memoryview(V.slot_copy(np.frombuffer(after, np.uint8), 0)))
    assert a_old.sequence != a_new.sequence and a_old.next_lsn != a_new.next_lsn  # slot A was rewritten
    return before, after


def test_a_slot_rewritten_between_its_header_and_its_table_reads_as_one_version(two_versions):
    before, after = two_versions
    want = F.decode_superblock(memoryview(V.slot_copy(np.frombuffer(after, np.uint8), 0)))
    for first_reads in range(0, 4):  # the rewrite lands after the reader's 0, 1, 2 or 3 reads
        arr = Rewritten(*([before] * first_reads + [after]))
        got = Volume._decode_slot(arr, 0, "superblock slot A @ 0x0")
        old = F.decode_superblock(memoryview(V.slot_copy(np.frombuffer(before, np.uint8), 0)))
        assert (got.sequence, got.next_lsn, got.segments) in {(want.sequence, want.next_lsn, want.segments),
                                                              (old.sequence, old.next_lsn, old.segments)}


def _torn(before: bytes, after: bytes, upto: int) -> bytes:
    """`after`'s slot A with its table's bytes from `upto` on still `before`'s: a rewrite under way."""
    n = len(V.slot_copy(np.frombuffer(after, np.uint8), 0))
    torn = bytearray(after)
    torn[upto:n] = before[upto:n]
    return bytes(torn)


def test_a_copy_torn_by_the_rewrite_is_taken_again_while_the_writer_writes(two_versions, monkeypatch):
    before, after = two_versions
    n = len(V.slot_copy(np.frombuffer(after, np.uint8), 0))
    # the new header over the old table, then the new table under the old header
    early, later = _torn(before, after, F.SUPERBLOCK_SIZE), before[:F.SUPERBLOCK_SIZE] + after[F.SUPERBLOCK_SIZE:]
    assert early != later and len(later) == len(after) >= n
    for torn in (early, later):
        with pytest.raises(CorruptionError, match="CRC mismatch"):
            F.decode_superblock(V.slot_copy(np.frombuffer(torn, np.uint8), 0))
    monkeypatch.setattr(V, "SLOT_SETTLE_S", 0.0)
    # each copy is two reads (the header, then the slot): torn early, torn later, then whole
    arr = Rewritten(early, early, later, later, after)
    got = Volume._decode_slot(arr, 0, "superblock slot A @ 0x0")
    assert got.sequence == F.decode_superblock(V.slot_copy(np.frombuffer(after, np.uint8), 0)).sequence


def test_a_slot_that_reads_the_same_twice_is_damage_and_is_not_settled_again(two_versions, monkeypatch):
    before, after = two_versions
    torn = _torn(before, after, F.SUPERBLOCK_SIZE)
    monkeypatch.setattr(V, "SLOT_SETTLE_S", 0.0)
    bad = {}
    arr = Rewritten(torn)
    with pytest.raises(CorruptionError, match="superblock CRC mismatch"):
        Volume._decode_slot(arr, 0, "superblock slot A @ 0x0", bad=bad)
    assert arr.reads == 4 and bad == {0: V.slot_copy(arr, 0)}  # two copies alike: damage, remembered
    arr.reads = 0
    with pytest.raises(CorruptionError, match="superblock CRC mismatch"):
        Volume._decode_slot(arr, 0, "superblock slot A @ 0x0", bad=bad)
    assert arr.reads == 2  # the same bytes found damaged before: one copy (a follower's next poll)
    arr.reads = 0
    with pytest.raises(CorruptionError, match="superblock CRC mismatch"):
        Volume._decode_slot(arr, 0, "superblock slot A @ 0x0", settle=False)  # a writable open
    assert arr.reads == 2
