"""Session(executor="resident") writes its epochs after the first into the
session's arena (checkpoint/arena_route.py): a host session's on the consumer
thread (the CPU twin), a CuPy session's by the persistent kernel; where the
regions or the tier do not allow it, the session's own path runs on the
consumer and the executor says why."""

from __future__ import annotations

import numpy as np
import pytest

from concordia import Session
from concordia.checkpoint.arena_route import VIA, VIA_CONSUMER, ArenaRoute
from concordia.errors import ExecutorError
from concordia.policy import Policy

from .state import LOG_SIZE, SEGMENT


def test_a_host_sessions_epochs_go_into_the_arena_on_the_consumer(shm_log):
    """The CPU twin of the device's route: the first epoch is the session's
    own (the bases); the next ones are arena epochs written on the consumer
    thread, durable on return (the session's epoch names them, a fresh
    reader of the log finds them committed), listed at once and counted
    once the session takes them on, each recovered exactly."""
    from concordia.wal.log import Log

    with Session(shm_log, size=LOG_SIZE, segment_size=SEGMENT, executor="resident",
                 policy=Policy(retain=False)) as s:
        a = np.zeros((16, 1024), np.uint32)
        s.register("a", a, detect="shadow", page_bytes=4096)
        first = s.checkpoint()
        assert s.resident.info()["route"]["why"].startswith("the regions take no single table pass")
        assert VIA_CONSUMER not in set(first.via.values())
        states, given = {first.epoch: a.copy()}, []
        for t in range(1, 6):
            a[t, :t] = t
            st = s.checkpoint()
            assert st.executor == "resident" and set(st.via.values()) == {VIA_CONSUMER}, s.resident.info()
            assert st.pages == {"a": 1} and st.epoch == first.epoch + t and s.epoch == st.epoch
            states[st.epoch] = a.copy()
            given.append(st)
        info = s.resident.info()
        assert info["route"] == {"via": VIA_CONSUMER, "epochs": 5, "why": None, "lost": 0}
        assert info["device_epoch_handler"] is False
        assert list(s.checkpoints)[1:] == given and s.checkpoint_totals.count == 1  # counted when taken on
        reader = Log.open(shm_log, writable=False)
        try:
            assert int(reader.last_committed_epoch) == first.epoch + 5  # durable before the session took them on
        finally:
            reader.close()
        s.settle()
        assert len(s.checkpoints) == 6 and all(a is b for a, b in zip(list(s.checkpoints)[1:], given))  # listed once
        assert all(st.log_at is not None for st in given) and s.checkpoint_totals.count == 6
        assert s.log.verify()["corrupt"] == 0
        for epoch, want in states.items():
            np.testing.assert_array_equal(s.recover(epoch)["a"], want, err_msg=f"epoch {epoch}")


def test_a_file_tier_and_a_named_stream_take_the_sessions_own_path(tmp_path, shm_log):
    with Session(f"file:{tmp_path / 'log'}", size=LOG_SIZE, segment_size=SEGMENT, executor="resident") as s:
        a = np.zeros(1 << 16, np.uint8)
        s.register("a", a, detect="shadow")
        s.checkpoint()
        a[7] = 1
        st = s.checkpoint()
        assert st.executor == "resident" and st.pages["a"] == 1 and VIA_CONSUMER not in set(st.via.values())
        assert s.resident.info()["route"]["why"] == "the log's tier needs a persist call (msync) before a commit"
    with Session(shm_log, size=LOG_SIZE, segment_size=SEGMENT, executor="resident") as s:
        a = np.zeros(1 << 16, np.uint8)
        s.register("a", a, detect="shadow")
        s.checkpoint()
        a[9] = 1
        st = s.checkpoint(stream=object())  # any stream named: the host regions' path ignores it
        assert VIA_CONSUMER not in set(st.via.values())
        assert s.resident.info()["route"]["why"].startswith("a stream was named")


@pytest.mark.parametrize("xp", ["numpy", pytest.param("cupy", marks=pytest.mark.gpu)])
def test_a_table_larger_than_an_arena_takes_it_by_its_last_epoch_and_a_lost_epoch_is_written_whole(shm_log, xp):
    """A 2 MiB region with 1 MiB segments: no arena holds every page of it,
    so epochs are tried with room for twice the last one's records.  A
    step's few pages go into the arena; an epoch that rewrites the region
    whole does not fit what is left, is lost (detected, nothing written),
    and that same call writes it whole on the session's path; the route goes
    on with the next epoch.  Every epoch recovers exactly.  On the device the
    persistent kernel's plan finds the epoch does not fit (status LOST)."""
    xp = pytest.importorskip(xp)
    via = VIA if xp is not np else VIA_CONSUMER
    with Session(shm_log, size=16 << 20, segment_size=1 << 20, executor="resident",
                 policy=Policy(retain=False)) as s:
        a = xp.zeros(2 << 20, np.uint8)
        s.register("a", a, detect="shadow", page_bytes=4096)
        host = a.get if xp is not np else a.copy
        states = {s.checkpoint().epoch: host()}
        vias = []
        for t, write in enumerate([lambda: a.__setitem__(5, 1), lambda: a.__setitem__(slice(None), 3),
                                   lambda: a.__setitem__(9, 4), lambda: a.__setitem__(4096 * 7, 5)]):
            write()
            st = s.checkpoint()
            states[st.epoch] = host()
            vias.append((st.pages["a"], set(st.via.values()) == {via}))
            if t == 1:  # (the route's `why` then says why this call took the session's path)
                lost_why = s.resident.route.lost_why
                assert s.resident.info()["route"]["lost"] == 1, s.resident.info()
                assert lost_why.startswith(f"epoch {st.epoch} wrote more"), lost_why
                assert lost_why.endswith("every region's next checkpoint is whole, on the session's path")
        # the whole rewrite: lost in the arena, written whole (512 pages of 4 KiB) by the same call
        assert vias[0] == (1, True) and vias[1] == (512, False), vias
        assert vias[3] == (1, True), vias  # the route took the epochs on again
        assert s.resident.info()["route"]["lost"] == 1 and s.runner.arenas_lost == 1
        s.settle()
        assert s.log.verify()["corrupt"] == 0
        assert [st.epoch for st in s.checkpoints] == sorted(states)
        for epoch, want in states.items():
            got = s.recover(epoch)["a"]
            np.testing.assert_array_equal(got.get() if hasattr(got, "get") else got, want, err_msg=f"epoch {epoch}")


def test_epochs_of_more_than_a_quarter_segment_are_tried_two_an_arena(shm_log):
    """1 MiB segments, epochs of 80 pages (320 KiB) of a 2 MiB region: twice
    the last epoch is more than half a segment holds, yet each epoch is tried
    rather than refused, two in each arena (a segment: after the first, twice
    it still fits; after the second, not, and the rest of the segment is too
    small for another); none is lost, and every epoch recovers exactly."""
    with Session(shm_log, size=32 << 20, segment_size=1 << 20, executor="resident") as s:
        a = np.zeros(2 << 20, np.uint8)
        s.register("a", a, detect="shadow", page_bytes=4096)
        states = {s.checkpoint().epoch: a.copy()}
        vias = []
        for t in range(1, 6):
            a[4096 * 80 * (t % 6):4096 * 80 * (t % 6 + 1):4096] = t
            st = s.checkpoint()
            assert st.pages["a"] == 80
            states[st.epoch] = a.copy()
            vias.append(set(st.via.values()))
        assert all(v == {VIA_CONSUMER} for v in vias), vias
        s.settle()
        assert s.runner.arenas == 3 and s.runner.arenas_lost == 0  # five epochs, two an arena
        assert s.log.verify()["corrupt"] == 0
        for epoch, want in states.items():
            np.testing.assert_array_equal(s.recover(epoch)["a"], want, err_msg=f"epoch {epoch}")


def _steady_epochs(shm_log, pages: int, n: int, first_small: int = 0, kib: int = 2048):
    """A region of `kib` KiB with 1 MiB segments (no arena holds every page of it):
    `first_small` epochs of one page, then `n` of `pages` pages each; returns
    the session's (pages written, via the consumer's arena) per epoch, the
    route's lost epochs, and checks every epoch recovers exactly."""
    with Session(shm_log, size=32 << 20, segment_size=1 << 20, executor="resident",
                 policy=Policy(retain=False)) as s:
        a = np.zeros(kib << 10, np.uint8)
        s.register("a", a, detect="shadow", page_bytes=4096)
        states = {s.checkpoint().epoch: a.copy()}
        got = []
        for t in range(first_small + n):
            if t < first_small:
                a[4096 * t] += 1
            else:
                a[4096 * (t % 5):4096 * (t % 5 + pages):4096] += 1  # `pages` pages, shifted each epoch
            st = s.checkpoint()
            states[st.epoch] = a.copy()
            got.append((st.pages["a"], set(st.via.values()) == {VIA_CONSUMER}))
        lost = s.resident.info()["route"]["lost"]
        s.settle()
        assert s.log.verify()["corrupt"] == 0
        for epoch, want in states.items():
            np.testing.assert_array_equal(s.recover(epoch)["a"], want, err_msg=f"epoch {epoch}")
    return got, lost


def test_a_new_tables_first_arena_is_not_a_segments_rest_too_small_for_its_epochs(shm_log):
    """After the bases (a new table: no epoch of it known yet) the first arena
    is a segment, not whatever the segment being written has left (a
    guess of ARENA_MIN_BYTES is no guess): a 2600 KiB region, whose bases
    leave 462 KiB of the segment, and epochs of 120 pages (480 KiB), each
    written into an arena, none lost.  Before, the first arena was that rest,
    the epoch was lost and written whole, the loss made the table new, and
    every later epoch went the same way: 650 pages each."""
    got, lost = _steady_epochs(shm_log, 120, 6, kib=2600)
    assert got == [(120, True)] * 6 and lost == 0, (got, lost)


def test_epochs_two_arenas_in_a_row_lost_take_the_sessions_path(shm_log):
    """A 4 MiB region, epochs of one page, then of 300 pages (1.2 MiB, more
    than a 1 MiB segment holds): the first large one is lost in its arena
    and written whole (1024 pages), and so is the next (one loss is as
    often a one-off: a new prompt's cache); the table made after the second
    loss knows what the lost ones needed (`RegionTable.arena_hint`), so no
    arena is tried for the next ones (`too_large`): each writes its 300
    pages on the session's path, with no further loss.  Before, each was
    lost and written whole."""
    got, lost = _steady_epochs(shm_log, 300, 5, first_small=3, kib=4096)
    assert got[:3] == [(1, True)] * 3, got
    assert got[3:] == [(1024, False)] * 2 + [(300, False)] * 3 and lost == 2, (got, lost)


def test_the_session_hands_the_route_to_its_resident_executor_only(shm_log):
    with Session(shm_log, size=LOG_SIZE, segment_size=SEGMENT, executor="resident") as s:
        assert isinstance(s.resident.route, ArenaRoute) and s.resident.route.session is s
    with Session(shm_log, size=LOG_SIZE, segment_size=SEGMENT) as s:
        assert s.resident is None


def test_a_failed_arena_epoch_makes_the_next_checkpoint_whole_on_the_sessions_path(shm_log, monkeypatch):
    """An arena epoch that fails after detection moved on: the error reaches
    the caller, every region's next checkpoint is whole, and the route stays
    off for these regions, saying why."""
    import concordia.checkpoint.table as table

    with Session(shm_log, size=LOG_SIZE, segment_size=SEGMENT, executor="resident") as s:
        a = np.zeros(1 << 16, np.uint8)
        s.register("a", a, detect="shadow", page_bytes=4096)
        s.checkpoint()
        a[7] = 1

        def broken(*args, **kw):
            raise ExecutorError("the commit could not be written", where="arena")

        monkeypatch.setattr(table, "write_commit", broken)
        with pytest.raises(ExecutorError, match="could not be written"):
            s.checkpoint()
        monkeypatch.undo()
        route = s.resident.route
        assert not route.active and route.failed == s.region_set.version
        a[4096 * 3] = 2
        st = s.checkpoint()
        assert VIA_CONSUMER not in set(st.via.values()) and st.pages["a"] == 16  # whole: 16 pages of 4 KiB
        why = s.resident.info()["route"]["why"]
        assert why.startswith("the last arena epoch failed: ExecutorError") and why.endswith("written"), why
        assert s.log.verify()["corrupt"] == 0
        got = s.recover()["a"]
        assert int(got[7]) == 1 and int(got[4096 * 3]) == 2


@pytest.mark.gpu
def test_a_cupy_sessions_checkpoints_run_on_the_persistent_kernel(shm_log):
    """The first checkpoint (the bases) takes the consumer thread; the next
    ones are EPOCH tasks: durable when they return (the session's epoch names
    them), listed at once, each recovered exactly; a
    region of a new page size registered midway builds the handler again,
    for both sizes; a named stream takes the consumer's path."""
    import cupy as cp

    rng = np.random.default_rng(5)
    with Session(shm_log, size=64 << 20, segment_size=8 << 20, executor="resident",
                 policy=Policy(retain=False)) as s:
        kv = cp.asarray(rng.standard_normal((64, 1024)).astype(np.float32))
        lora = cp.asarray(rng.standard_normal(8192).astype(np.float32))
        s.register("kv", kv, detect="shadow", page_bytes=4096)
        s.register("lora", lora, kind="adapter", detect="fingerprint", page_bytes=4096)
        first = s.checkpoint()
        assert VIA not in set(first.via.values())
        states, given = {first.epoch: (kv.get(), lora.get())}, []
        for t in range(1, 7):
            kv[t, : 16 * t] += 1  # queued on the current stream: the epoch waits for it
            if t % 2:
                lora *= np.float32(0.5)
            st = s.checkpoint()
            assert st.executor == "resident" and set(st.via.values()) == {VIA}, (st.via, s.resident.info())
            assert st.pages["kv"] == 1 and st.pages["lora"] == (8 if t % 2 else 0)  # lora: 8 pages, all changed
            assert s.epoch == st.epoch  # durable: committed in the arena, before the session takes it on
            states[st.epoch] = (kv.get(), lora.get())
            given.append(st)
        info = s.resident.info()
        assert info["device_epoch_handler"] is True and info["route"] == {"via": VIA, "epochs": 6, "why": None,
                                                                          "lost": 0}
        assert all(a is b for a, b in zip(list(s.checkpoints)[1:], given))  # listed at once
        s.settle()
        assert len(s.checkpoints) == 7  # and once

        extra = cp.arange(1 << 16, dtype=cp.float32)   # of a page size the handler was not built for
        s.register("extra", extra, detect="shadow", page_bytes=65536)
        st = s.checkpoint()  # the new region's base: the consumer thread
        states[st.epoch] = (kv.get(), lora.get(), extra.get())
        extra[5] = -1
        kv[10, 0] = 2
        st = s.checkpoint()
        assert set(st.via.values()) == {VIA} and st.pages["extra"] == 1 and st.pages["kv"] == 1, st.pages
        assert s.resident.route.engine.page_sizes == (4096, 65536)  # one module, a detector for each size
        states[st.epoch] = (kv.get(), lora.get(), extra.get())

        kv[9, 0] = 3
        st = s.checkpoint(stream=cp.cuda.get_current_stream())
        assert VIA not in set(st.via.values()) and s.resident.info()["route"]["why"].startswith("a stream was named")
        states[st.epoch] = (kv.get(), lora.get(), extra.get())

        assert s.log.verify()["corrupt"] == 0
        for epoch, want in states.items():
            got = s.recover(epoch, absent="keep")  # "extra" has no state before its first epoch
            for name, w in zip(("kv", "lora", "extra"), want):
                g = got[name]
                assert np.asarray(g.get() if hasattr(g, "get") else g).tobytes() == w.tobytes(), (epoch, name)


@pytest.mark.gpu
def test_auto_takes_the_resident_path_after_the_first_epoch_where_the_device_handler_takes_the_regions(
        shm_log, tmp_path):
    """executor="auto" (the default): the first epoch on the caller's
    thread, then the persistent kernel's EPOCH handler for a CuPy session on
    shm, each epoch recovered exactly; on a file the tier needs a persist
    call, and the session keeps the caller's thread, saying why."""
    import cupy as cp

    from concordia.executor.resident import AUTO_HOST_WHY, AUTO_RESIDENT_WHY

    rng = np.random.default_rng(9)
    with Session(shm_log, size=64 << 20, segment_size=8 << 20, policy=Policy(retain=False)) as s:
        kv = cp.asarray(rng.standard_normal((64, 1024)).astype(np.float32))
        s.register("kv", kv, detect="shadow", page_bytes=4096)
        first = s.checkpoint()
        assert first.executor == "host" and s.resident is not None
        assert s.executor_info == {"asked": "auto", "decided": True, "decided_at": first.epoch,
                                   "executor": "resident", "why": AUTO_RESIDENT_WHY, "commit_by": "executor"}
        states = {first.epoch: kv.get()}
        for t in range(1, 5):
            kv[t, :8] += 1
            st = s.checkpoint()
            assert st.executor == "resident" and set(st.via.values()) == {VIA}, (st.via, s.resident.info())
            assert st.pages["kv"] == 1 and s.epoch == st.epoch
            states[st.epoch] = kv.get()
        assert s.log.verify()["corrupt"] == 0
        for epoch, want in states.items():
            g = s.recover(epoch)["kv"]
            assert np.asarray(g.get() if hasattr(g, "get") else g).tobytes() == want.tobytes(), epoch
    with Session(f"file:{tmp_path / 'f.log'}", size=64 << 20, segment_size=8 << 20) as s:
        s.register("kv", cp.zeros(1 << 16, cp.float32), detect="shadow")
        s.checkpoint()
        assert s.resident is None and s.executor_info["executor"] == "host"
        assert s.executor_info["why"].endswith(AUTO_HOST_WHY) and s.checkpoint().executor == "host"


@pytest.mark.parametrize("executor", ["host", "resident"])
def test_the_step_policy_counts_from_each_checkpoint_whichever_path_takes_it(shm_log, executor):
    """Policy(every_steps=3): step() checkpoints at steps 3, 6, 9 and 12 on
    both paths; an arena epoch (which never calls back into the session's
    own path) resets the policy as the session's path does."""
    with Session(shm_log, size=LOG_SIZE, segment_size=SEGMENT, executor=executor,
                 policy=Policy(every_steps=3)) as s:
        a = np.zeros(1 << 16, np.uint8)
        s.register("a", a, detect="shadow")
        at = []
        for step in range(1, 13):
            a[step] = step
            if s.step() is not None:
                at.append(step)
        assert at == [3, 6, 9, 12]
        if executor == "resident":
            assert s.checkpoints[-1].via["a"] == VIA_CONSUMER  # the arena epochs were among them
        assert int(s.recover()["a"][12]) == 12


def test_an_arena_epoch_runs_the_before_checkpoint_hooks_as_the_sessions_path_does(shm_log):
    """A hook that mirrors host state into a registered array (as the
    transformers integration writes its counters) runs before every arena
    epoch reads the regions: each epoch holds what the hook wrote."""
    with Session(shm_log, size=LOG_SIZE, segment_size=SEGMENT, executor="resident",
                 policy=Policy(retain=False)) as s:
        mirror = np.zeros(1024, np.int64)
        count = [0]

        def hook():
            count[0] += 1
            mirror[0] = count[0]

        s.register("mirror", mirror, detect="shadow", page_bytes=4096)
        s.before_checkpoint(hook)
        epochs = {}
        for _ in range(4):
            st = s.checkpoint()
            epochs[st.epoch] = (int(mirror[0]), set(st.via.values()))
        assert [v[0] for v in epochs.values()] == [1, 2, 3, 4]
        assert all(v[1] == {VIA_CONSUMER} for v in list(epochs.values())[1:]), epochs
        s.settle()
        for epoch, (want, _) in epochs.items():
            assert int(s.recover(epoch)["mirror"][0]) == want, epoch


class _StoppedEngine:
    """A stand-in for DeviceEpochs whose armed trigger stopped with `status`
    (no GPU here): its swap raises as DeviceEpochs.rotate does, and closing it
    is recorded."""

    def __init__(self, status):
        self.trigger_status, self.armed, self.closed = status, (1, None, None, 0), False
        self.fired_logged = 0

    where = "caller"

    class tpass:
        class table:
            @staticmethod
            def unchanged():
                return True

    @property
    def faulted(self):
        from concordia.executor.step_trigger import is_fault

        return is_fault(self.trigger_status)

    def rotate(self):
        raise ExecutorError(f"disarming the trigger failed with status {self.trigger_status}", where="device trigger")

    ensure_arena = rotate  # an epoch's arena swap meets the same stopped trigger

    def close(self):
        self.closed = True


@pytest.mark.parametrize("status, faulted", [(4, True), (7, False)], ids=["timed-out", "lost"])
def test_a_swap_that_finds_the_trigger_faulted_makes_every_regions_next_checkpoint_whole(shm_log, status, faulted):
    """An arena swap that finds the kernel's trigger stopped on a fault (a
    timed-out epoch: its detection may have moved past pages no commit holds)
    fails the route, and every region's next checkpoint is whole; an epoch
    lost for room closes the engine and leaves the route on."""
    with Session(shm_log, size=LOG_SIZE, segment_size=SEGMENT, executor="resident",
                 policy=Policy(retain=False)) as s:
        a = np.zeros((16, 1024), np.uint32)
        s.register("a", a, detect="shadow", page_bytes=4096)
        s.checkpoint()
        route = s.resident.route
        engine = route.engine = _StoppedEngine(status)
        route.version = s.region_set.version
        with pytest.raises(ExecutorError, match=f"status {status}"):
            route.rotate()
        assert engine.closed and route.engine is None
        assert (route.failed is not None) == faulted
        a[3, 0] = 1
        st = s.checkpoint()
        if faulted:
            assert st.pages == {"a": 16}  # whole: pages changed in the failed epoch's window are not lost
        np.testing.assert_array_equal(s.recover()["a"], a)
        # an epoch whose arena swap meets the stopped trigger takes the session's path, nothing raised
        route.failed, engine = None, _StoppedEngine(status)
        route.engine, route.version = engine, s.region_set.version
        assert route.checkpoint("manual", where="caller") is None and engine.closed and route.engine is None
        assert (route.failed is not None) == faulted and (route.lost == 1) != faulted
        a[5, 0] = 1
        st = s.checkpoint()
        assert st.pages == {"a": 16} or not faulted
        np.testing.assert_array_equal(s.recover()["a"], a)
