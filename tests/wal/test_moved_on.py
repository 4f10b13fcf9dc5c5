"""`Log.moved_on`, asked of a read-only open beside a writer in one process:
its answers (a commit since, a superblock written since, nothing new, a yes
kept), and the volume it asks them of, which it opens again only when a byte
such an open reads has changed: that volume is the one an open makes now,
whatever the writer did to the superblock slots or the segment headers."""

from __future__ import annotations

import numpy as np
import pytest

from concordia.wal import Log
from concordia.wal import format as F
from concordia.wal.volume import Volume

from .helpers import commit_pages

MiB = 1 << 20
PAGE = 4096


@pytest.fixture
def pair(tmp_path):
    """A writer that committed epoch 1 and a read-only open of its log."""
    path = f"file:{tmp_path / 'm.log'}"
    w = Log.create(path, size=8 * MiB, segment_size=MiB)
    w.define_region("r", np.uint8, (64 * PAGE,), PAGE, "opaque")
    commit_pages(w, 1)
    ro = Log.open(path, writable=False)
    yield w, ro
    ro.close()
    if not w.backend.closed:
        w.close()


@pytest.fixture
def opens(monkeypatch):
    """The volume opens made from here on, counted."""
    real = Volume.open.__func__
    made = []

    def counted(cls, target, **kw):
        made.append(target)
        return real(cls, target, **kw)

    monkeypatch.setattr(Volume, "open", classmethod(counted))
    return made


def _same_volume(a: Volume, b: Volume) -> bool:
    return (a.superblock == b.superblock and a.live_segments() == b.live_segments()
            and a.adopted == b.adopted and a.slot_problems == b.slot_problems and a.short == b.short)


def test_nothing_new_is_no_and_the_volume_is_not_opened_again(pair, opens):
    w, ro = pair
    assert ro.moved_on() is False and len(opens) == 1   # the first question opens the volume
    assert ro.moved_on() is False and ro.moved_on() is False
    assert len(opens) == 1   # neither slot nor header changed: the first open's volume answered
    ids = np.arange(2, dtype=np.uint32)
    w.appender.append_page_batch(2, 0, ids, np.full((2, PAGE), 9, np.uint8))   # an epoch begun, not committed
    w.appender.sync()   # which withdraws a header epoch 1's commit prepared: a byte an open reads
    assert ro.moved_on() is False
    asked = len(opens)
    assert ro.moved_on() is False and ro.moved_on() is False and len(opens) == asked


def test_a_commit_since_is_yes_and_a_yes_is_kept(pair):
    w, ro = pair
    assert ro.moved_on() is False
    commit_pages(w, 2)
    assert ro.moved_on() is True
    w.close()
    assert ro.moved_on() is True and ro.moved_on() is True


@pytest.mark.parametrize("change", ["settable field", "segment added", "segments freed"])
def test_a_superblock_written_since_is_yes(pair, change):
    w, ro = pair
    assert ro.moved_on() is False   # the volume asked is kept from here
    vol = w.volume
    seq = vol.superblock.sequence
    if change == "settable field":
        vol.write_superblock(retain_epochs=3)
    elif change == "segment added":
        vol.take_segment(vol.live_segments()[-1])   # no record in it: only the superblock says so
    else:
        vol.free_segments([s.index for s in vol.live_segments()])
    assert vol.superblock.sequence == seq + 1
    assert ro.moved_on() is True and ro.moved_on() is True


def test_a_log_formatted_again_under_it_is_yes(pair, tmp_path):
    w, ro = pair
    assert ro.moved_on() is False
    seq = ro.volume.superblock.sequence
    w.close()
    again = Log.create(f"file:{tmp_path / 'm.log'}", size=8 * MiB, segment_size=MiB, overwrite=True)
    again.define_region("r", np.uint8, (64 * PAGE,), PAGE, "opaque")
    commit_pages(again, 1)
    assert again.volume.superblock.sequence == seq   # the same sequence: only the uuid tells
    assert ro.moved_on() is True
    again.close()


def test_the_volume_asked_is_the_one_an_open_makes_now(pair, opens):
    """Changes to the bytes an open reads that write no new superblock: a
    header prepared in a free segment (adopted by an open), then zeroed
    again; the older superblock slot damaged (an open then reads more than
    the slots and headers, so its volume is not kept), then mended.  After
    each the answer is no, asked of the volume a fresh open makes."""
    w, ro = pair
    vol = w.volume
    arr = w.backend.array

    def asked_is_fresh() -> bool:
        assert ro.moved_on() is False
        return _same_volume(ro._volume_now(), Volume.open(ro.backend, writable=False))

    assert asked_is_fresh()
    prepared = vol.prepare_segment(vol.live_segments()[-1])
    assert len(Volume.open(ro.backend, writable=False).adopted) == 1
    assert asked_is_fresh()
    vol.zero_header(prepared.index)
    assert asked_is_fresh()
    older = (vol.superblock.sequence + 1) % 2 * vol.superblock.slot_bytes
    assert vol.superblock.sequence >= 1   # the older slot holds a superblock
    saved = arr[older + 100].copy()
    arr[older + 100] ^= 0xFF
    assert Volume.open(ro.backend, writable=False).slot_problems
    asked = len(opens)
    assert asked_is_fresh() and asked_is_fresh()
    assert len(opens) - asked == 6   # each question opened the volume again (plus the test's own)
    arr[older + 100] = saved
    assert asked_is_fresh()
    asked = len(opens)
    assert ro.moved_on() is False and ro.moved_on() is False and len(opens) == asked


def test_the_bytes_compared_cover_both_slots_and_every_segment_header(pair):
    """A byte changed in either slot or in any segment's header has the
    question open the volume again; one past them does not."""
    w, ro = pair
    sb = ro.volume.superblock
    arr = w.backend.array
    assert ro.moved_on() is False
    kept = ro._reopened[0]
    places = [0, sb.slot_bytes - 1, sb.slot_bytes, 2 * sb.slot_bytes - 1]
    places += [sb.segments_off + i * sb.segment_bytes + d for i in range(sb.segment_count)
               for d in (0, F.SEGMENT_HEADER_SIZE - 1)]
    for at in places:
        arr[at] ^= 0x01
        ro._volume_now()
        arr[at] ^= 0x01
        assert ro._reopened is None or ro._reopened[0] is not kept, at
        assert ro.moved_on() is False
        kept = ro._reopened[0]
    free = next(i for i, e in enumerate(sb.segments) if e.state == F.SEG_FREE)
    at = sb.segments_off + free * sb.segment_bytes + F.SEGMENT_HEADER_SIZE   # a free segment's first record slot
    arr[at] ^= 0x01
    assert ro._volume_now() is kept
    arr[at] ^= 0x01


def test_a_volume_opened_while_a_writer_wrote_is_not_kept(pair, monkeypatch):
    """A header written between the question's look at the bytes and its open
    (the open adopts it), then withdrawn (the bytes are as they were at the
    look): the next question opens again instead of answering from a volume
    that adopted a header no longer there."""
    w, ro = pair
    vol = w.volume
    w.appender.sync()   # no header prepared by epoch 1's commit stays: the one below is the only one
    real = Volume.open.__func__
    prepared = []

    def racing(cls, target, **kw):
        if not prepared:   # the writer prepares a header just before this open reads
            prepared.append(vol.prepare_segment(vol.live_segments()[-1]))
        return real(cls, target, **kw)

    monkeypatch.setattr(Volume, "open", classmethod(racing))
    assert ro.moved_on() is False
    monkeypatch.undo()
    assert prepared[0] is not None and Volume.open(ro.backend, writable=False).adopted   # an open takes it in
    vol.zero_header(prepared[0].index)   # withdrawn, as a writer's sync does
    assert ro.moved_on() is False
    assert _same_volume(ro._volume_now(), Volume.open(ro.backend, writable=False))
    assert not ro._volume_now().adopted


def test_a_log_of_too_many_headers_to_copy_is_opened_afresh_each_time(pair, opens, monkeypatch):
    """Past _REOPEN_MAX_BYTES of slots and headers nothing is copied or kept: each question opens the
    volume, as before the reuse, and the answers are the same."""
    from concordia.wal import log as log_mod

    monkeypatch.setattr(log_mod, "_REOPEN_MAX_BYTES", 1024)
    w, ro = pair
    assert ro.moved_on() is False and ro.moved_on() is False and len(opens) == 2
    assert ro._reopened is None
    commit_pages(w, 2)
    assert ro.moved_on() is True
