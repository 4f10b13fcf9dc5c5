"""Retention at real write rates: a session that checkpoints every step keeps
its log from filling (bases and compaction paced by the bytes the
checkpoints write, a region that never changes based again once its base
holds the log), and a checkpoint the log cannot take now coalesces instead
of raising (`Session.checkpoint(on_full="coalesce")`): nothing is written,
no detector moves, one LogPressureWarning per run of them, and the next
checkpoint that commits carries the pages."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from concordia import Session
from concordia.errors import LogFullError, LogPressureWarning, SessionError
from concordia.policy import Policy
from concordia.retention import record_bytes
from concordia.wal import Log
from concordia.wal.planner import plan

from .test_bad_input import one_line

MiB = 1 << 20
SEGMENT = 1 * MiB  # the smallest segment FORMAT.md allows


class Decode:
    """A decode loop's state: a KV cache that gains a row in every layer each
    step and wraps around, three small arrays rewritten whole each step (the
    counters and positions a decoder keeps), and adapter weights that never
    change (a LoRA during generation).  About 1.7% of the state is
    rewritten each step, the small arrays included."""

    def __init__(self, layers: int = 8, rows: int = 96, row_bytes: int = 2048):
        rng = np.random.default_rng(32)
        self.rows = rows
        self.kv = np.zeros((layers, rows, row_bytes), np.uint8)   # 1.5 MiB, a row is half a page
        self.lora = rng.integers(0, 256, 1 << 20, dtype=np.uint8)  # 1 MiB, never written
        self.small = [np.zeros(1024, np.uint32) for _ in range(3)]  # a page each, rewritten whole

    def arrays(self) -> dict:
        return {"kv": self.kv, "lora": self.lora, **{f"small{i}": a for i, a in enumerate(self.small)}}

    def register(self, s: Session) -> None:
        s.register("kv", self.kv, kind="kv")
        s.register("lora", self.lora, kind="adapter")
        for i, a in enumerate(self.small):
            s.register(f"small{i}", a)

    def state_bytes(self) -> int:
        """Log bytes of one full image of the state."""
        return sum(record_bytes(a.nbytes, 4096) for a in self.arrays().values())

    def step(self, t: int) -> None:
        self.kv[:, t % self.rows, :] = t % 251 + 1
        for i, a in enumerate(self.small):
            a[:] = 3 * t + i


def decode_in_four_states(shm_log: str, **kw) -> tuple[Decode, Session, str]:
    """A `Decode` registered in a session on a log of four images of its state
    (file tier, placed in /dev/shm so that every-step syncs cost little;
    shm_log, the fixture, removes it); `kw` goes to the Session."""
    d = Decode()
    segments = -(-4 * d.state_bytes() // SEGMENT)
    log = "file:/dev/shm/" + shm_log.split(":", 1)[1]
    s = Session(log, size=(segments + 1) * SEGMENT, segment_size=SEGMENT, overwrite=True, **kw)
    d.register(s)
    return d, s, log


def _recover_fresh(log: str) -> dict:
    """What a fresh read-only session beside the writer recovers (the newest commit)."""
    with Session(log, create=False) as r:
        return r.recover()


def _same(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)


@pytest.mark.slow
def test_ten_thousand_every_step_checkpoints_never_fill_a_log_of_four_states(shm_log):
    # Every step checkpoints, with the default policy, into a log of 4x the
    # state (the failure: "all 127 segments are live" within ~200
    # steps, because the adapter that never changes kept its first base and
    # so every byte written after it).  The log is a file (the msync tier),
    # placed in /dev/shm so that 10,000 syncs cost little; shm_log removes it.
    d, s, log = decode_in_four_states(shm_log)
    state = d.state_bytes()
    capacity = s.retention.capacity()
    assert capacity >= 4 * state
    most_live = 0
    for t in range(1, 10_001):
        d.step(t)
        st = s.checkpoint(on_full="coalesce")  # what the generate() integration asks
        assert not st.coalesced, (t, s.retention.pacing)
        most_live = max(most_live, capacity - s.retention.free_bytes())
        if t == 1_000:
            assert _same(_recover_fresh(log), d.arrays())
    assert s.checkpoint_totals.count == 10_000 and s.checkpoint_totals.coalesced == 0
    assert s.retention.error is None, s.retention.error
    counts = dict(s.retention.counts)
    assert counts["segments_freed"] > 100 and counts.get("scans", 0) == 0, counts
    # the log never held more than 4 images of the state, nor came within a
    # segment of full (a checkpoint of the whole state would have fitted)
    assert most_live <= 4 * state and capacity - most_live >= SEGMENT, (most_live / state, counts)
    # the adapter that never changes was based again as the log turned over:
    # its base is recent, not the first one
    assert plan(s.log).regions["lora"].base_epoch > 9_000
    s.close()
    assert _same(_recover_fresh(log), d.arrays())


def _whole_state_fits(s: Session) -> bool:
    """Whether the log could take a checkpoint of every page now, as a
    checkpoint that may coalesce asks (`EpochRunner.room`): the records in the
    free space, and what is left enough for retention to go on with."""
    from concordia.checkpoint.epoch import space_after
    from concordia.wal.compaction import free_space

    space = free_space(s.log)
    plan_ = s.runner.reservations(s.log, space.capacity, pages="whole")
    left = space_after(space, plan_, s.runner.last_log_bytes, len(s.regions))
    return left is not None and s.retention.room(left)


def _fill_until_the_whole_state_no_longer_fits(s: Session, kv, t: int = 0) -> int:
    """A few rows of `kv` rewritten and checkpointed each step (a hundred
    steps at the least, so that bases are taken at such steps, none
    coalescing) until the log could not take a checkpoint of the whole
    state; the last step."""
    for _ in range(1_000):
        t += 1
        kv[(4 * t) % 1024:(4 * t) % 1024 + 4, :64] = t % 251 + 1
        assert not s.checkpoint(on_full="coalesce").coalesced, t
        if t >= 100 and not _whole_state_fits(s):
            return t
    raise AssertionError("the log never filled past a checkpoint of the whole state")


def test_a_checkpoint_the_log_cannot_take_coalesces_and_the_next_one_carries_its_pages(shm_log):
    # A log of about four states, a few rows rewritten each step (a hundred
    # steps at the least, so that bases are taken at such steps), until the
    # log could not take a checkpoint of the whole state; then a burst
    # rewrites every page: the checkpoint coalesces (nothing written, epoch
    # None, one warning), recovery still gives the last committed epoch
    # exactly, and retention frees what it can meanwhile, so the next
    # checkpoint commits and carries every page of the burst.  Twice: each
    # run of pressure warns once.
    kv = np.zeros((1024, 4096), np.uint8)  # 4 MiB
    with Session(shm_log, size=17 * SEGMENT, segment_size=SEGMENT, overwrite=True) as s:
        s.register("kv", kv)
        t = 0
        for burst in (1, 2):
            t = _fill_until_the_whole_state_no_longer_fits(s, kv, t)
            committed, epoch = kv.copy(), s.epoch
            kv[:] = 250 + burst  # every page
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                st = s.checkpoint(on_full="coalesce")
            assert st.coalesced and st.epoch is None and st.pages == {} and st.bytes == st.log_bytes == 0
            assert st.to_json()["coalesced"] is True and "coalesced" not in s.checkpoints[-2].to_json()
            assert s.epoch == epoch and s.retention.coalescing == 1
            assert [w.category for w in caught] == [LogPressureWarning]
            one_line(caught[0].message, shm_log.split(":", 1)[1], "coalesced", "bytes free")
            assert _same(_recover_fresh(shm_log), {"kv": committed})
            st = s.checkpoint(on_full="coalesce")  # no new write: the burst's pages, carried
            assert not st.coalesced and st.epoch == epoch + 1 and st.pages["kv"] == 1024, st
            assert s.retention.coalescing == 0
            assert _same(_recover_fresh(shm_log), {"kv": kv})
        assert s.checkpoint_totals.coalesced == s.retention.counts["coalesced"] == 2


def test_coalesced_checkpoints_warn_once_per_run_and_move_no_detector(shm_log):
    # A log of three states that writes of nearly the whole state overwhelm (every
    # page but the last of each region: a write of all of it is its own base, an
    # image, and commits; the next test): every
    # checkpoint of the burst coalesces, one warning for the run, and one more
    # once retention has nothing left to free (every region based at the
    # newest epoch, only it kept), naming the log such bursts need.  No
    # detector moved meanwhile: once the arrays hold the committed bytes again
    # the next checkpoint finds no page, commits, and ends the run; the next
    # burst warns again.
    kv = np.zeros((512, 4096), np.uint8)  # 2 MiB
    other = np.zeros(64 << 10, np.uint8)
    with Session(shm_log, size=8 * SEGMENT, segment_size=SEGMENT, overwrite=True) as s:
        s.register("kv", kv)
        s.register("other", other, detect="fingerprint")
        for t in range(1, 21):
            kv[t, :8] = t
            other[t] = t
            assert not s.checkpoint(on_full="coalesce").coalesced
        committed = {"kv": kv.copy(), "other": other.copy()}
        epoch = s.epoch
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = []
            for t in range(6):
                kv[:-1] = 100 + t
                other[:-4096] = 100 + t
                got.append(s.checkpoint(on_full="coalesce").coalesced)
                if not got[-1]:  # a burst step that fitted is the newest commit
                    committed = {"kv": kv.copy(), "other": other.copy()}
        assert got[-4:] == [True] * 4 and s.retention.coalescing == got.count(True) >= 4, got
        assert [w.category for w in caught] == [LogPressureWarning] * 2
        one_line(caught[0].message, "coalesced", "bytes free")
        need = 3 * record_bytes(kv.nbytes, 4096) + 3 * record_bytes(other.nbytes, 4096) + 2 * SEGMENT
        one_line(caught[1].message, "freed all it can", f"based at epoch {s.epoch}",
                 f"a log of at least {-(-need // MiB)} MiB", "three images")
        assert s.retention.exhausted and s.retention.pacing["exhausted"] and s.retention.counts["exhausted"] == 1
        assert _same(_recover_fresh(shm_log), committed) and s.epoch == epoch + got.count(False)
        kv[:] = committed["kv"]
        other[:] = committed["other"]
        st = s.checkpoint(on_full="coalesce")
        assert not st.coalesced and st.pages == {"kv": 0, "other": 0}, st
        assert s.retention.coalescing == 0 and not s.retention.exhausted
        kv[:-1] = 7
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert s.checkpoint(on_full="coalesce").coalesced
        assert len(caught) == 1
        assert s.checkpoint_totals.coalesced == s.retention.counts["coalesced"] == got.count(True) + 1


def test_checkpoints_that_rewrite_the_whole_state_commit_on_a_log_of_three_states(shm_log):
    # The same log, the same regions, every page rewritten at every step: each
    # such epoch is its regions' base (image entries, FORMAT.md §12.2), so a
    # switch right after it frees everything before it and writes no BASE record:
    # nothing coalesces, and every epoch restores exactly
    kv = np.zeros((512, 4096), np.uint8)  # 2 MiB
    other = np.zeros(64 << 10, np.uint8)
    with Session(shm_log, size=8 * SEGMENT, segment_size=SEGMENT, overwrite=True) as s:
        s.register("kv", kv)
        s.register("other", other, detect="fingerprint")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for t in range(1, 41):
                kv[:] = t
                other[:] = t
                st = s.checkpoint(on_full="coalesce")
                assert not st.coalesced and st.epoch == t, (t, st)
        assert not caught and s.retention.error is None
        counts = s.retention.counts
        assert counts["images"] >= 2 * 30 and counts["segments_freed"] > 0, dict(counts)
        assert counts["bases"] < counts["images"], dict(counts)   # the images cost no BASE records
        assert _same(_recover_fresh(shm_log), {"kv": kv, "other": other})


@pytest.mark.parametrize("executor", ["host", "resident"])
def test_on_full_raise_keeps_the_log_full_error_and_a_bad_value_is_refused(shm_log, executor):
    # with the resident executor the epoch runs on its thread, which calls
    # Session.checkpoint again: the caller's on_full holds there too
    a = np.zeros((64, 1024), np.uint32)  # 256 KiB
    with Session(shm_log, size=4 * SEGMENT, segment_size=SEGMENT, overwrite=True,
                 policy=Policy(retain=False), executor=executor) as s:
        s.register("a", a)
        with pytest.raises(SessionError) as err:
            s.checkpoint(on_full="drop")
        one_line(err.value, "on_full", "'raise' or 'coalesce'", "'drop'")
        assert s.epoch == 0
        with pytest.raises(LogFullError) as full:
            for t in range(1, 100):
                a[:] = t  # every page, every checkpoint: the log only grows
                s.checkpoint()
        one_line(full.value, "segments are live")
        last = s.epoch
        a[:] = 1000
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            st = s.checkpoint(on_full="coalesce")  # the same log: coalesces instead
        assert st.coalesced and s.epoch == last and len(caught) == 1 and st.executor == executor
        assert s.checkpoint_totals.coalesced == 1
        with pytest.raises(LogFullError):
            s.checkpoint()  # and the next plain one raises again


def test_the_pacing_is_measured_from_what_the_checkpoints_write(shm_log):
    # rate: record bytes per checkpoint, weighted to the newest; need: what a
    # base of the whole state uses up at that rate; the log is short below it
    a = np.zeros((256, 1024), np.uint32)  # 1 MiB, 256 pages
    with Session(shm_log, size=12 * SEGMENT, segment_size=SEGMENT, overwrite=True) as s:
        s.register("a", a)
        for t in range(1, 41):
            a[(8 * t) % 256:(8 * t) % 256 + 8, 0] = t  # 8 pages a checkpoint
            st = s.checkpoint()
        p = s.retention.pacing
        assert p["rate"] == pytest.approx(st.log_bytes, rel=0.01) and p["peak"] >= p["rate"]
        assert p["need"] > record_bytes(a.nbytes, 4096) + p["headroom"]
        assert p["short"] == (p["free"] < p["need"]) and p["coalescing"] == 0
        assert set(s.retention.to_json()) >= {"counts", "error", "busy", "free_bytes", "capacity", "floor_epoch"}
    with Log.open(shm_log, writable=False) as log:
        assert log.verify()["corrupt"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("tier,via", [("shm", "gpu-mapped"), ("file", "gpu-ring")])
def test_device_regions_coalesce_and_are_carried_as_host_ones_are(shm_log, tmp_path, tier, via):
    # the same burst on a CuPy region: the room is asked of the device
    # detector without advancing it, and the carried pages take the device path
    import cupy as cp

    kv = cp.zeros((1024, 4096), cp.uint8)  # 4 MiB on the device
    log = shm_log if tier == "shm" else f"file:{tmp_path / 'gpu.log'}"
    with Session(log, size=17 * SEGMENT, segment_size=SEGMENT, overwrite=True, executor="host") as s:
        s.register("kv", kv)
        _fill_until_the_whole_state_no_longer_fits(s, kv)
        committed, epoch = cp.asnumpy(kv), s.epoch
        kv[:] = 251
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            st = s.checkpoint(on_full="coalesce")
        assert st.coalesced and s.epoch == epoch and len(caught) == 1
        assert _same(_recover_fresh(log), {"kv": committed})
        st = s.checkpoint(on_full="coalesce")
        assert not st.coalesced and st.pages["kv"] == 1024 and st.via["kv"] == via, st
        assert _same(_recover_fresh(log), {"kv": cp.asnumpy(kv)})
