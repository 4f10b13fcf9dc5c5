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


def test_a_copy_torn_by_the_rewrite_is_taken_again_until_the_writer_is_done(two_versions, monkeypatch):
    before, after = two_versions
    n = len(V.slot_copy(np.frombuffer(after, np.uint8), 0))
    torn = bytearray(after)
    torn[F.SUPERBLOCK_SIZE:n] = before[F.SUPERBLOCK_SIZE:n]  # the new header over the old table
    with pytest.raises(CorruptionError, match="CRC mismatch"):
        F.decode_superblock(memoryview(V.slot_copy(np.frombuffer(bytes(torn), np.uint8), 0)))
    monkeypatch.setattr(V, "SLOT_SETTLE_S", 0.0)
    arr = Rewritten(torn, torn, torn, after)  # torn while the writer writes, then whole
    got = Volume._decode_slot(arr, 0, "superblock slot A @ 0x0")
    assert got.sequence == F.decode_superblock(memoryview(V.slot_copy(np.frombuffer(after, np.uint8), 0))).sequence


def test_a_slot_that_stays_torn_is_damage_after_it_settles(two_versions, monkeypatch):
    before, after = two_versions
    n = len(V.slot_copy(np.frombuffer(after, np.uint8), 0))
    torn = bytearray(after)
    torn[F.SUPERBLOCK_SIZE:n] = before[F.SUPERBLOCK_SIZE:n]
    monkeypatch.setattr(V, "SLOT_SETTLE_S", 0.0)
    arr = Rewritten(torn)
    with pytest.raises(CorruptionError, match="superblock CRC mismatch"):
        Volume._decode_slot(arr, 0, "superblock slot A @ 0x0")
    assert arr.reads == 2 * (V.SLOT_QUIET + 1)  # a header and a whole copy each time, until SLOT_QUIET agree
