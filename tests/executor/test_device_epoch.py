"""The device's EPOCH handler (gpu_kernels/executor.cu with CX_EPOCH,
concordia/checkpoint/device_epoch.py): the descriptor the host writes is the
struct the kernel reads, field by field; the variant compiles with the table
pass's kernels in its module; a session whose epochs the kernel cannot take
is refused in one line naming why; and on the H200 the persistent kernel
runs a session's epochs into its arena, each completion saying so, each
epoch recovering its state."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

from concordia.checkpoint import arena
from concordia.checkpoint.device_epoch import (EPOCH_DESC, GROUP, MAX_GROUPS, MAX_PAGE_SIZES, SMALL_PAGES, STAMPS,
                                               compile_defines, module_page_sizes, why_not)
from concordia.executor.persistent import compile_options
from concordia.checkpoint.table import DET_FINGERPRINT, DET_POSITIONS, DET_SHADOW, POSITIONS
from concordia.executor.ring import Op, Status

from .kernel_structs import CU, struct_fields

NVCC = shutil.which("nvcc")


def test_the_descriptor_and_the_words_are_the_kernels_structs():
    assert struct_fields("cx_group") == list(GROUP.names)
    desc = struct_fields("cx_epoch_desc")
    assert desc[-1] == f"groups[CX_MAX_GROUPS]" and desc[:-1] == list(EPOCH_DESC.names[:-1])
    assert re.search(rf"#define CX_MAX_GROUPS {MAX_GROUPS}\b", CU)
    assert re.search(rf"#define CX_STAMPS {len(STAMPS)}\b", CU)
    assert EPOCH_DESC.itemsize == 8 * (len(desc) - 1) + MAX_GROUPS * GROUP.itemsize
    words = struct_fields("cx_arena_words")
    assert words == list(arena.WORDS.names)
    assert arena.WORDS.itemsize == 64
    assert re.search(rf"#define ST_NO_ROOM {int(Status.NO_ROOM)}\b", CU) and int(Op.EPOCH) == 7
    assert re.search(rf"#define ST_LOST {int(Status.LOST)}\b", CU)
    assert re.search(rf"#define DET_FINGERPRINT {DET_FINGERPRINT}\b", CU) and re.search(rf"#define DET_SHADOW "
                                                                                       rf"{DET_SHADOW}\b", CU)


def test_a_positions_rows_state_is_the_kernels_struct():
    from concordia.gpu_kernels import jit

    table_cu = jit.source("table")
    body = table_cu[table_cu.index("struct PositionsState {"):]
    body = body[body.index("{") + 1:body.index("};")]
    names = []
    for kind, decl in re.findall(r"(u64|i64)\s+([^;]+);", body):
        for n in decl.split(","):
            names.append((n.strip(), "<u8" if kind == "u64" else "<i8"))
    assert names == [(n, POSITIONS.fields[n][0].str) for n in POSITIONS.names]
    assert re.search(rf"#define DET_POSITIONS {DET_POSITIONS}\b", table_cu)


def test_the_gate_is_as_long_on_both_sides_of_the_layers():
    from concordia.checkpoint.device_epoch import GATE_WORDS
    from concordia.executor import step_trigger

    assert step_trigger.GATE_WORDS == GATE_WORDS == 8 and "gate + 4" in CU and "gate[4]" not in CU and "gate[0]" in CU
    assert "gate + 6" in CU and "gate[5]" not in CU and "gate[6]" not in CU  # [4..5] and [6..7]: u64s, the last
    assert "gate + 8" not in CU and "gate[7]" not in CU
    assert re.search(rf"#define CX_TRIGGER_LEFT {step_trigger.TRIGGER_LEFT:#x}\b", CU)


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
@pytest.mark.parametrize("sizes", [(4096,), (1024, 4096, 65536, 64)], ids=["one-size", "four-sizes"])
def test_the_epoch_variant_compiles_with_the_table_pass_in_its_module(tmp_path, sizes):
    from concordia.gpu_kernels import jit

    src = tmp_path / "executor_epoch.cu"
    src.write_text(CU.replace('#include "table.cu"', jit.source("table"), 1))
    out = tmp_path / "k.ptx"
    opts = compile_options(child=True, ops_mask=(1 << Op.EPOCH) | (1 << Op.PING) | (1 << Op.QUIESCE)
                           | (1 << Op.STOP)) + compile_defines(sizes)
    r = subprocess.run([NVCC, "--ptx", "-arch=sm_90", *opts, str(src), "-o", str(out)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    for name in ("cx_executor", "cx_epoch_driver", "cx_epoch_small", "cx_epoch_close", "cx_epoch_stage",
                 "cx_epoch_read", "cx_epoch_copy", "table_plan", "table_finalize", "table_commit",
                 "table_positions"):
        assert f".entry {name}(" in text, name
    # the detectors are the templates' instances: the host pass's kernels of one size are not built here
    assert ".entry table_fingerprint(" not in text and ".entry table_shadow(" not in text
    driver = text.split(".entry cx_epoch_driver(")[1].split(".entry")[0]
    assert driver.count("LaunchDeviceV2") >= 8  # detection, plan, stage, read, copy, finalize, commit, close
    small = text.split(".entry cx_epoch_small(")[1].split(".entry")[0]
    assert "LaunchDeviceV2" not in small and small.count("bar.sync") >= 4  # one block, phases between barriers
    # the detection of each page size the module is built for, a kernel of its own each, and no other
    built = sorted(int(n) for n in re.findall(r"\.entry _Z\d+table_fingerprint_pbILj(\d+)E", text))
    assert built == sorted(sizes) == sorted(int(n) for n in re.findall(r"\.entry _Z\d+table_shadow_pbILj(\d+)E", text))


def test_an_epoch_module_is_built_for_each_page_size_its_table_scans(tmp_path):
    """compile_defines names PAGE_BYTES and then CX_PAGE_BYTES_1..3 (the
    executor's dispatch takes no more), each size once; module_page_sizes
    are the sizes of a table's shadow and fingerprint rows, not those of
    rows whose pages the host lists."""
    from concordia import Session
    from concordia.checkpoint.table import RegionTable

    assert compile_defines(4096) == ("-DCX_EPOCH", "-DPAGE_BYTES=4096")
    assert compile_defines((1024, 65536)) == ("-DCX_EPOCH", "-DPAGE_BYTES=1024", "-DCX_PAGE_BYTES_1=65536")
    for bad in [(), (64, 64), tuple(64 * (i + 1) for i in range(MAX_PAGE_SIZES + 1))]:
        with pytest.raises(ValueError, match=f"1 to {MAX_PAGE_SIZES} distinct page sizes"):
            compile_defines(bad)
    assert f"#ifdef CX_PAGE_BYTES_{MAX_PAGE_SIZES - 1}" in CU and f"CX_PAGE_BYTES_{MAX_PAGE_SIZES}" not in CU
    with Session(f"file:{tmp_path / 'p.log'}", size=16 << 20, segment_size=4 << 20) as s:
        s.register("a", np.zeros(8192, np.uint8), detect="shadow", page_bytes=1024)
        s.register("b", np.zeros(8192, np.uint8), detect="fingerprint", page_bytes=4096)
        s.register("c", np.zeros(1 << 17, np.uint8), detect="shadow", page_bytes=65536)
        s.register("d", np.zeros(8192, np.uint8), kind="adapter", page_bytes=512,
                   slot_versions=np.zeros(4, np.uint64), pages_per_slot=4)
        s.checkpoint()  # the regions' digests, which a table starts from
        assert module_page_sizes(RegionTable(list(s.region_set))) == (1024, 4096, 65536)


@pytest.mark.parametrize("sizes, positions, why", [
    ((1024, 4096, 65536, 64), False, None),
    ((1024, 4096, 65536, 64, 128), False, "have 5 page sizes; the EPOCH handler is built for at most 4"),
    ((1024, 4096, 65536, 64), True, "9 detection groups; the EPOCH handler takes 8")],
    ids=["four-sizes", "five-sizes", "nine-groups"])
def test_what_one_epoch_module_cannot_detect_is_named(tmp_path, sizes, positions, why, monkeypatch):
    """why_not over a device table pass's table (here a stand-in with the
    label and groups a DeviceTablePass has): at most MAX_PAGE_SIZES page
    sizes of scanned rows, and at most MAX_GROUPS detection groups, four
    sizes of both detectors already making eight (a positions group is a
    ninth)."""
    import types

    from concordia import Session
    from concordia.checkpoint.table import RegionTable
    from concordia.executor import persistent

    monkeypatch.setattr(persistent, "host_order_why", lambda: None)  # any host: the table is what is checked
    with Session(f"file:{tmp_path / 'w.log'}", size=32 << 20, segment_size=8 << 20) as s:
        for pb in sizes:
            s.register(f"s{pb}", np.zeros(4 * pb, np.uint8), detect="shadow", page_bytes=pb)
            s.register(f"f{pb}", np.zeros(4 * pb, np.uint8), detect="fingerprint", page_bytes=pb)
        s.checkpoint()
        table = RegionTable(list(s.region_set))
    # a static cache's rows by positions: a group of their own (page sizes read from the table)
    groups = list(table.groups) + ([(DET_POSITIONS, 4096)] if positions else [])
    tpass = types.SimpleNamespace(label="gpu-mapped", table=table, groups=groups)
    assert len(tpass.groups) == 2 * len(sizes) + positions
    assert why_not(tpass, types.SimpleNamespace(persist_path="none")) == (
        None if why is None else f"the regions scanned by shadow copies or fingerprints {why}" if "sizes" in why
        else why)


def test_a_session_the_device_cannot_take_is_named(tmp_path, shm_log):
    from concordia import Session

    with Session(shm_log, size=16 << 20, segment_size=4 << 20, staging="mapped", executor="host") as s:
        s.register("a", np.zeros(8192, np.uint8))
        s.checkpoint()
        why = why_not(s.runner.table_pass(s.log), s.log.backend)
        assert why == "the regions take no device table pass (CuPy regions, one mapped staging path)"


@pytest.fixture
def shm_log():
    from tests.session.conftest import _fresh_shm_log

    yield from _fresh_shm_log()


@pytest.mark.gpu
@pytest.mark.parametrize("small_pages", [SMALL_PAGES, 0], ids=["one-block", "driver"])
@pytest.mark.parametrize("stamps", [False, True], ids=["plain", "stamped"])
def test_the_persistent_kernel_runs_a_sessions_epochs_into_its_arena(shm_log, stamps, small_pages):
    import cupy as cp

    from concordia import Session
    from concordia.checkpoint.device_epoch import DeviceEpochs
    from concordia.policy import Policy

    rng = np.random.default_rng(3)
    with Session(shm_log, size=64 << 20, segment_size=8 << 20, policy=Policy(retain=False), executor="host") as s:
        kv = cp.asarray(rng.standard_normal((64, 1024)).astype(np.float32))
        lora = cp.asarray(rng.standard_normal(8192).astype(np.float32))
        s.register("kv", kv, detect="shadow", page_bytes=4096)
        s.register("lora", lora, kind="adapter", detect="fingerprint", page_bytes=4096)
        s.checkpoint()
        kv[0, :16] += 0  # CuPy's kernels used below, loaded before the executor is resident
        lora *= np.float32(1)
        kv.get(), lora.get()
        cp.cuda.get_current_stream().synchronize()
        dev = DeviceEpochs(s, stamps=stamps, small_pages=small_pages)
        assert dev.path == ("small" if small_pages else "driver")
        states, comps, phases = {}, [], []
        try:
            for t in range(1, 9):
                kv[t, : 16 * t] += 1
                if t % 2:
                    lora *= np.float32(0.5)
                cp.cuda.get_current_stream().synchronize()
                c = dev.epoch()
                assert c.op == Op.EPOCH and c.status == Status.OK, (c, dev.submitter)
                comps.append(c)
                states[s.runner.arena.word("last_epoch")] = (kv.get(), lora.get())
                if stamps:
                    phases.append(dev.phases())
        finally:
            dev.close()
        assert dev.snapshot_epochs == 8  # each epoch's records fit the snapshot: staged there, then copied
        if stamps:  # every phase stamped, in order, for each epoch (a stamp left at 0 would show as negative)
            assert len(phases) == 8 and all(list(p) == list(STAMPS[1:]) for p in phases)
            assert all(0 <= us < 1e6 for p in phases for us in p.values()), phases
        assert [c.pages for c in comps[1::2]] == [1] * 4  # kv's one row (lora unchanged at even steps)
        assert all(c.lsn_last > c.lsn_first > 0 for c in comps)
        assert s.epoch == max(states)
        assert s.log.verify()["corrupt"] == 0  # every page and record CRC the device wrote checks on the host
        for epoch, (k, l) in states.items():
            got = s.recover(epoch)
            assert np.asarray(got["kv"].get() if hasattr(got["kv"], "get") else got["kv"]).tobytes() == k.tobytes()
            assert np.asarray(got["lora"].get() if hasattr(got["lora"], "get") else got["lora"]).tobytes() == \
                l.tobytes()


def _three_sizes(s, cp):
    """Regions of three page sizes, two detectors (1 KiB shadow, 4 KiB fingerprint, 64 KiB shadow: 16
    pages each) registered in `s` and checkpointed, CuPy's kernels loaded before an executor is resident."""
    regions = {"small": (cp.zeros(4096, cp.float32), "shadow", 1024),
               "mid": (cp.zeros(1 << 14, cp.float32), "fingerprint", 4096),
               "big": (cp.zeros(1 << 18, cp.float32), "shadow", 65536)}
    for name, (a, detect, pb) in regions.items():
        s.register(name, a, detect=detect, page_bytes=pb)
    s.checkpoint()
    for a, _, _ in regions.values():
        a[1] += np.float32(0)
    cp.cuda.get_current_stream().synchronize()
    return {name: (a, pb) for name, (a, _, pb) in regions.items()}


def _touch_one_page_each(regions, t, cp) -> dict:
    """Page t % 16 of every region changed (one element); what each holds now."""
    for a, pb in regions.values():
        a[(t % 16) * (pb // 4)] += np.float32(t)
    cp.cuda.get_current_stream().synchronize()
    return {name: a.get() for name, (a, _) in regions.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("small_pages", [SMALL_PAGES, 0], ids=["one-block", "driver"])
def test_one_epoch_module_detects_regions_of_several_page_sizes(shm_log, small_pages):
    """Three page sizes among the scanned rows: one module, its detection
    built for each (`compile_defines`), takes every epoch on the device, one
    page a region each time, and each recovers its state."""
    import cupy as cp

    from concordia import Session
    from concordia.checkpoint.device_epoch import DeviceEpochs
    from concordia.policy import Policy

    with Session(shm_log, size=64 << 20, segment_size=8 << 20, policy=Policy(retain=False), executor="host") as s:
        regions = _three_sizes(s, cp)
        assert why_not(s.runner.table_pass(s.log), s.log.backend) is None
        dev = DeviceEpochs(s, small_pages=small_pages)
        assert dev.page_sizes == (1024, 4096, 65536) and dev.path == ("small" if small_pages else "driver")
        states, comps = {}, []
        try:
            for t in range(1, 7):
                want = _touch_one_page_each(regions, t, cp)
                c = dev.epoch()
                assert c.op == Op.EPOCH and c.status == Status.OK, (c, dev.submitter)
                comps.append(c)
                states[s.runner.arena.word("last_epoch")] = want
        finally:
            dev.close()
        assert [c.pages for c in comps] == [3] * 6  # the changed page of each region, no other
        assert s.log.verify()["corrupt"] == 0
        for epoch, want in states.items():
            got = s.recover(epoch)
            for name, a in want.items():
                g = got[name]
                assert np.asarray(g.get() if hasattr(g, "get") else g).tobytes() == a.tobytes(), (epoch, name)


@pytest.mark.gpu
@pytest.mark.parametrize("small_pages", [SMALL_PAGES, 0], ids=["one-block", "driver"])
def test_a_descriptor_naming_a_page_size_the_module_lacks_is_refused_before_launch(shm_log, small_pages,
                                                                                  monkeypatch):
    """A descriptor whose 64 KiB group names a size the module was not built
    for (as no host builds it): the kernel refuses the epoch before it
    launches anything (BAD_ARGS), so nothing is detected or written and the
    arena's words stay as they were; the next, true descriptor's epoch then
    finds each region's changed page, as the detectors' state was untouched,
    and recovers its state."""
    import cupy as cp

    from concordia import Session
    from concordia.checkpoint import device_epoch
    from concordia.policy import Policy

    real, bad = device_epoch.describe, [True]

    def unbuilt(tpass, *args, **kw):
        d = real(tpass, *args, **kw)
        for g in d[0]["groups"][:int(d[0]["n_groups"])]:
            if bad[0] and int(g["page_bytes"]) == 65536:
                g["page_bytes"] = 32768
        return d

    monkeypatch.setattr(device_epoch, "describe", unbuilt)
    with Session(shm_log, size=64 << 20, segment_size=8 << 20, policy=Policy(retain=False), executor="host") as s:
        regions = _three_sizes(s, cp)
        dev = device_epoch.DeviceEpochs(s, small_pages=small_pages)
        try:
            want = _touch_one_page_each(regions, 1, cp)
            words = s.runner.arena.words.copy()
            c = dev.epoch()
            assert c.status == Status.BAD_ARGS and c.pages == 0, c
            assert s.runner.arena.words.tobytes() == words.tobytes()   # nothing written, the words as they were
        finally:
            dev.close()
        bad[0] = False
        dev = device_epoch.DeviceEpochs(s, small_pages=small_pages)   # a true descriptor this time
        try:
            c = dev.epoch()
            assert c.status == Status.OK and c.pages == 3, (c, dev.submitter)
            epoch = s.runner.arena.word("last_epoch")
        finally:
            dev.close()
        assert s.log.verify()["corrupt"] == 0
        got = s.recover(epoch)
        for name, a in want.items():
            g = got[name]
            assert np.asarray(g.get() if hasattr(g, "get") else g).tobytes() == a.tobytes(), name


def _rows_state(count):
    """The (64, 1024) float32 state after steps 1..count, step k adding k to row k % 64."""
    a = np.zeros((64, 1024), np.float32)
    for k in range(1, count + 1):
        a[k % 64] += np.float32(k)
    return a


def _rows_and_gate(s, *load):
    """Region "a" (the (64, 1024) float32 rows of `_rows_state`) registered in `s` and
    checkpointed, and a trigger's counter and gate; CuPy's kernels (and each of `load`, called
    once) loaded before the executor is resident."""
    import cupy as cp

    from concordia.checkpoint.device_epoch import GATE_WORDS

    a = cp.zeros((64, 1024), cp.float32)
    s.register("a", a, detect="shadow", page_bytes=4096)
    s.checkpoint()
    for fn in load:
        fn()
    a[1] += np.float32(0)
    counter, gate = cp.zeros(1, cp.uint64), cp.zeros(GATE_WORDS, cp.uint32)
    cp.cuda.get_current_stream().synchronize()
    return a, counter, gate


def _each_recovers_its_step(s, fired):
    """Each (epoch, count) the trigger logged recovers region "a" as it was after step `count`."""
    for epoch, count in fired:
        got = s.recover(epoch)["a"]
        assert np.asarray(got.get() if hasattr(got, "get") else got).tobytes() == _rows_state(count).tobytes(), epoch


@pytest.mark.gpu
@pytest.mark.parametrize("snapshot_max", [None, 0], ids=["snapshot", "no-snapshot"])
def test_a_device_trigger_commits_epochs_while_the_caller_holds_the_gil(shm_log, snapshot_max):
    """64 decode steps queued on the device, each followed by the step gate;
    the trigger armed every 8 counts; the caller then spins in pure Python
    (holding the GIL) for 2.5 s.  Epochs commit on the device alone, each at
    a step boundary, and each recovers the state of the step it logged:
    through the snapshot (the gate let go before the records reach the
    arena, the next steps queued behind it running at once) or, with none,
    staged straight into the arena with the gate held."""
    import time

    import cupy as cp

    from concordia import Session
    from concordia.checkpoint.device_epoch import DeviceEpochs
    from concordia.executor.step_trigger import TRIGGER_LEFT
    from concordia.policy import Policy

    with Session(shm_log, size=64 << 20, segment_size=8 << 20, policy=Policy(retain=False), executor="host") as s:
        a, counter, gate = _rows_and_gate(s)
        dev = DeviceEpochs(s, snapshot_max=snapshot_max)
        try:
            dev.trigger(8, counter, gate)
            for k in range(1, 65):
                a[k % 64] += np.float32(k)
                dev.step_gate(counter, gate)
            t0, spins = time.perf_counter(), 0
            while time.perf_counter() - t0 < 2.5:  # the stall: pure Python, the GIL held
                spins += 1
            fired = dev.fired()
            # 0, or left once idle after its last epoch (TRIGGER_LEFT: a device-wide synchronize need not wait)
            assert dev.trigger_status in (0, TRIGGER_LEFT) and len(fired) >= 1, (fired, dev.trigger_status)
            # the rest, however loaded the device: each gate lets its step go once its epoch is taken
            cp.cuda.get_current_stream().synchronize()
        finally:
            dev.close()  # the last epoch may still be crossing the bus when the stream has run: closing waits
        fired, snapped = dev.fired(), dev.snapshot_epochs
        counts = [c for _, c in fired]
        assert counts == [8 * (i + 1) for i in range(8)], counts  # each at its multiple: the step held there
        assert snapped == (8 if snapshot_max is None else 0), snapped
        _each_recovers_its_step(s, fired)


@pytest.mark.gpu
@pytest.mark.parametrize("small_pages", [SMALL_PAGES, 0], ids=["one-block", "driver"])
def test_a_step_that_rewrites_everything_once_the_gate_goes_leaves_the_epoch_before_it_whole(shm_log, small_pages):
    """Each step rewrites the whole 4 MiB region and the trigger takes every
    step.  The gate goes once the epoch is staged in the snapshot, so the
    next step's rewrite runs while the records are still crossing the bus
    into the arena: each epoch holds its own step's values, every page."""
    import cupy as cp

    from concordia import Session
    from concordia.checkpoint.device_epoch import GATE_WORDS, DeviceEpochs
    from concordia.policy import Policy

    n = 1 << 20  # float32: 1,024 pages of 4 KiB, the most the one-block path takes
    with Session(shm_log, size=512 << 20, segment_size=64 << 20, policy=Policy(retain=False), executor="host") as s:
        a = cp.zeros(n, cp.float32)
        s.register("a", a, detect="shadow", page_bytes=4096)
        s.checkpoint()
        a += np.float32(0)  # CuPy's kernel loaded before the executor is resident
        counter, gate = cp.zeros(1, cp.uint64), cp.zeros(GATE_WORDS, cp.uint32)
        cp.cuda.get_current_stream().synchronize()
        dev = DeviceEpochs(s, small_pages=small_pages)
        assert dev.path == ("small" if small_pages else "driver")
        try:
            dev.trigger(1, counter, gate)
            for _ in range(4):
                a += np.float32(1)
                dev.step_gate(counter, gate)
            cp.cuda.get_current_stream().synchronize()
        finally:
            dev.close()
        fired = dev.fired()
        assert [c for _, c in fired] == [1, 2, 3, 4] and dev.snapshot_epochs == 4, (fired, dev.snapshot_epochs)
        assert s.log.verify()["corrupt"] == 0
        for epoch, count in fired:
            got = s.recover(epoch)["a"]
            got = np.asarray(got.get() if hasattr(got, "get") else got)
            assert np.array_equal(got, np.full(n, count, np.float32)), (epoch, count, np.unique(got)[:8])


#: a one-thread kernel that holds its stream for `ns` nanoseconds (the producer's slow step)
NAP = r"""
extern "C" __global__ void nap(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}
"""


@pytest.mark.gpu
def test_an_armed_kernel_stays_for_steps_queued_behind_slow_work_and_leaves_once_they_ran(shm_log):
    """Steps whose work holds the producer's stream for 120 ms each, far
    longer than an armed kernel idles (50 ms), queued all at once with the
    host's count of them (`mark_queued`): the kernel stays until each has
    run, so every due step gets its epoch; once the stream has drained it
    leaves (its log says TRIGGER_LEFT), so a device-wide synchronize returns."""
    import cupy as cp

    from concordia import Session
    from concordia.checkpoint.device_epoch import DeviceEpochs
    from concordia.executor.step_trigger import TRIGGER_LEFT
    from concordia.policy import Policy

    with Session(shm_log, size=64 << 20, segment_size=8 << 20, policy=Policy(retain=False), executor="host") as s:
        nap = cp.RawKernel(NAP, "nap")
        a, counter, gate = _rows_and_gate(s, lambda: nap((1,), (1,), (np.uint64(1000),)))
        dev = DeviceEpochs(s)
        try:
            dev.trigger(2, counter, gate)
            for k in range(1, 7):
                nap((1,), (1,), (np.uint64(120_000_000),))
                a[k % 64] += np.float32(k)
                dev.mark_queued(k)  # as the step trigger does: counted before its gate is queued
                dev.step_gate(counter, gate)
            cp.cuda.get_current_stream().synchronize()
            words = gate.get()
            cp.cuda.Device().synchronize()  # the stream drained: the armed kernel leaves, this returns
            # read once it left: the stream runs on once the last epoch has read every region
            fired, status = dev.fired(), dev.trigger_status
        finally:
            dev.close()
        assert [c for _, c in fired] == [2, 4, 6], fired
        assert status == TRIGGER_LEFT, status
        # the gate counted its holds: the three due steps, each for as long as its epoch took (> 0 ns)
        assert int(words[3]) == 3 and int(words[4:6].view(np.uint64)[0]) > 0 and int(words[0]) == 0, words
        _each_recovers_its_step(s, fired)


@pytest.mark.gpu
@pytest.mark.parametrize("small_pages", [SMALL_PAGES, 0], ids=["one-block", "driver"])
def test_an_epoch_that_outruns_its_timeout_commits_nothing_it_read_after(shm_log, small_pages):
    """A child grid that outruns the control warp's timeout is cancelled
    before its commit (executor.cu: claim_commit): the epoch commits nothing
    and every region's next checkpoint is whole; one that claimed its commit
    first had read every region and is waited for.  Either way the log
    verifies and each committed epoch recovers its state."""
    import cupy as cp

    from concordia import Session
    from concordia.checkpoint.device_epoch import DeviceEpochs
    from concordia.executor.errors import ExecutorError
    from concordia.policy import Policy

    rng = np.random.default_rng(5)
    with Session(shm_log, size=64 << 20, segment_size=8 << 20, policy=Policy(retain=False), executor="host") as s:
        kv = cp.asarray(rng.standard_normal((64, 1024)).astype(np.float32))
        s.register("kv", kv, detect="shadow", page_bytes=4096)
        s.checkpoint()
        states = {s.epoch: kv.get()}
        kv[1, :64] += 1
        cp.cuda.get_current_stream().synchronize()
        dev = DeviceEpochs(s, small_pages=small_pages, child_timeout_s=1e-9)  # a timeout no child meets
        try:
            try:
                status = dev.epoch().status
            except ExecutorError:  # the executor left faulted (a timeout) before its completion was read
                status = Status.TIMEOUT
        finally:
            dev.close()  # a faulted executor has left: closing it raises nothing
        assert status in (Status.TIMEOUT, Status.OK), status
        if status == Status.OK:  # claimed before the timeout: committed whole
            states[s.epoch] = kv.get()
        else:
            assert s.epoch == max(states)  # cancelled: nothing of it committed
        kv[2, :64] += 1
        s.checkpoint()  # after a cancelled epoch, every region whole
        states[s.epoch] = kv.get()
        assert s.log.verify()["corrupt"] == 0
        for epoch, k in states.items():
            got = s.recover(epoch)["kv"]
            assert np.asarray(got.get() if hasattr(got, "get") else got).tobytes() == k.tobytes(), epoch
