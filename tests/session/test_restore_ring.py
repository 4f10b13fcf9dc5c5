"""RECOVER on the device, where no GPU exists: the descriptor the host writes
is the struct the kernel reads; a recovery laid out as runs and run by a CPU
executor's RECOVER handler (the kernel's numpy twin) over the task ring
restores what the host applier restores, region for region, on every tier
and page size; a damaged page is named as the host applier names it; a
descriptor reaching outside the log or a region is refused with nothing
written; and a session with no resident executor has no ring to offer."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

from concordia.executor.cpu import CpuExecutor, numpy_operators, recover_handler
from concordia.executor.host import Submitter
from concordia.executor.recover import RECOVER_DESC, RUN, apply_runs, runs_table
from concordia.executor.ring import Op, Ring, Status, TaskView
from concordia.restore.ring import ONE_CHUNK, apply_plan_ring_host, describe, runs_of
from concordia.restore.device import transfer_plan
from concordia.restore.run import ring_of
from concordia.wal import Log
from concordia.wal.apply import apply_plan_numpy
from concordia.wal.errors import CorruptionError
from concordia.wal.planner import plan

from tests.executor.kernel_structs import CU, struct_fields

from .test_restore_transfer import _damaged_adapter_page, _history, _one_checkpoint

def test_the_descriptor_and_the_runs_are_the_kernels_structs():
    assert struct_fields("cx_recover_run") == list(RUN.names) and RUN.itemsize == 8 * len(RUN.names)
    assert struct_fields("cx_recover_desc") == list(RECOVER_DESC.names)
    assert RECOVER_DESC.itemsize == 8 * len(RECOVER_DESC.names)
    assert re.search(rf"#define OP_RECOVER {int(Op.RECOVER)}\b", CU)


def _same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert got[name].tobytes() == want[name].tobytes(), name


def test_a_ring_recovery_restores_what_the_host_applier_restores(persistent_log):
    _history(persistent_log)
    log = Log.open(persistent_log, writable=False, check_pages=False)
    try:
        p = plan(log)
        _same(apply_plan_ring_host(log, p), apply_plan_numpy(log, p))
        tr = transfer_plan(log, p, chunk_bytes=ONE_CHUNK)
        runs = runs_of(tr)
        # every run reads pages of its region's size from a 64-byte aligned offset, in the plan's page order
        assert tr.chunks == 1 and runs.size >= len(tr.regions) and (runs["off"] % 64 == 0).all()
        assert (np.diff(runs["first"].astype(np.int64)) > 0).all() and int(runs["first"][0]) == 0
    finally:
        log.close()


def test_a_ring_recovery_of_some_regions_restores_only_those(shm_log):
    with _one_checkpoint(shm_log, 1) as (state, log):
        got = apply_plan_ring_host(log, plan(log), regions=["sched"])
    assert list(got) == ["sched"] and got["sched"].tobytes() == state["sched"].tobytes()


def damage_is_named_as_the_host_names_it(spec: str, apply) -> None:
    """On a log of `_history` with one page of "adapter" damaged (`spec`: a
    file: or shm: log), `apply(log, plan)` raises the host applier's
    CorruptionError word for word, naming the damaged page's offset."""
    import os

    from tests.conftest import SHM_DIR

    _history(spec, epochs=1)
    kind, _, name = spec.partition(":")
    log_off = _damaged_adapter_page(spec if kind == "file" else f"file:{os.path.join(SHM_DIR, name)}")
    log = Log.open(spec, writable=False, check_pages=False)
    try:
        p = plan(log, check_pages=False)   # the recovery is the one to meet the damage
        with pytest.raises(CorruptionError) as got:
            apply(log, p)
        with pytest.raises(CorruptionError) as host:
            apply_plan_numpy(log, p)
    finally:
        log.close()
    assert str(got.value) == str(host.value) and f"@ {log_off:#x}" in str(got.value)


def test_a_damaged_page_is_named_as_the_host_applier_names_it(file_log):
    damage_is_named_as_the_host_names_it(file_log, apply_plan_ring_host)


def test_the_twin_flags_the_damaged_page_and_counts_it():
    """apply_runs on hand-made runs: two regions, two page sizes, a run read
    from the middle of a record; one page's stored CRC is wrong."""
    from concordia.gpu_kernels import reference as ref

    rng = np.random.default_rng(5)
    log = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    runs = runs_table([0, 3, 5], [4096, 1024, 8192], [1, 0, 4], [0, 3, 5], [256, 512, 256], [0, 1, 0])
    pages = 7
    crcs = np.concatenate([ref.crc32c_pages(log[4096:4096 + 768], page_bytes=256),
                           ref.crc32c_pages(log[1024:2048], page_bytes=512),
                           ref.crc32c_pages(log[8192:8704], page_bytes=256)]).astype(np.uint32)
    crcs[4] ^= 1
    regions = [np.zeros(6 * 256, np.uint8), np.zeros(2 * 512, np.uint8)]
    bad = np.zeros(pages, np.uint8)
    assert apply_runs(log, runs, crcs, regions, bad) == (6, 3 * 256 + 2 * 512 + 2 * 256, 1)
    assert bad.tolist() == [0, 0, 0, 0, 1, 0, 0]
    assert regions[0][256:1024].tobytes() == log[4096:4864].tobytes()
    assert regions[0][1024:1536].tobytes() == log[8192:8704].tobytes() and not regions[0][:256].any()
    assert regions[1].tobytes() == log[1024:2048].tobytes()


#: descriptors of one run of two 1 KiB pages into one 4 KiB region, each reaching outside the log (8 KiB),
#: its region or the CRC table (two entries), or not laid out as the kernel takes them: what differs
#: from the one that fits (first 0, off 0, id 0, crc 0, page bytes 1024, region 0)
REFUSED = {"past the log": dict(off=8192 - 1024), "past the region": dict(id=3), "a CRC past the table": dict(crc=1),
           "a page size not of 16 bytes": dict(page_bytes=1000), "a page size of 2^31": dict(page_bytes=1 << 31),
           "no region": dict(region=1), "runs not from page 0": dict(first=1), "a source not 16-byte aligned": dict(off=8)}


def refused_runs(case: str) -> np.ndarray:
    """The one run of REFUSED[case] (`RUN`)."""
    run = {"first": 0, "off": 0, "id": 0, "crc": 0, "page_bytes": 1024, "region": 0, **REFUSED[case]}
    return runs_table(*([run[k]] for k in RUN.names))


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_descriptor_reaching_outside_the_log_or_a_region_is_refused_with_nothing_written(case):
    log = np.arange(8192, dtype=np.uint32).view(np.uint8)[:8192].copy()
    region = np.zeros(4096, np.uint8)
    table = np.array([[region.ctypes.data, region.size]], np.uint64)
    runs = refused_runs(case)
    crcs = np.zeros(2, np.uint32)
    bad = np.zeros(2, np.uint8)
    desc = describe(log=log.ctypes.data, log_bytes=log.size, runs=runs.ctypes.data, n_runs=runs.size, pages=2,
                    crc_table=crcs.ctypes.data, n_crcs=crcs.size, regions=table.ctypes.data, n_regions=1,
                    bad=bad.ctypes.data)
    r = recover_handler(TaskView(1, int(Op.RECOVER), 0, 0, 0, (desc.ctypes.data,) + (0,) * 6))
    assert r.status == Status.BAD_ARGS
    assert not region.any() and not bad.any()


def test_the_cpu_executors_ring_carries_a_recover_task_and_its_counts():
    """The protocol: RECOVER tasks on a CPU executor's ring, each completion
    counting the pages applied, the bytes read and (lsn_first) the pages
    damaged; a refused descriptor's completion says BAD_ARGS."""
    from concordia.gpu_kernels import reference as ref

    rng = np.random.default_rng(9)
    log = rng.integers(0, 256, 1 << 15, dtype=np.uint8)
    runs = runs_table([0, 2], [1024, 4096], [0, 2], [0, 2], [512, 512], [0, 0])
    crcs = np.concatenate([ref.crc32c_pages(log[1024:2048], page_bytes=512),
                           ref.crc32c_pages(log[4096:5120], page_bytes=512)]).astype(np.uint32)
    region = np.zeros(4 * 512, np.uint8)
    table = np.array([[region.ctypes.data, region.size]], np.uint64)
    bad = np.zeros(4, np.uint8)
    desc = describe(log=log.ctypes.data, log_bytes=log.size, runs=runs.ctypes.data, n_runs=runs.size, pages=4,
                    crc_table=crcs.ctypes.data, n_crcs=crcs.size, regions=table.ctypes.data, n_regions=1,
                    bad=bad.ctypes.data)
    ring = Ring.allocate(8)
    sub = Submitter(ring, CpuExecutor(ring, numpy_operators(), idle_exit_s=1.0))
    try:
        ok = sub.call(Op.RECOVER, args=(desc.ctypes.data,))
        crcs[3] ^= 1
        damaged = sub.call(Op.RECOVER, args=(desc.ctypes.data,))
        desc["log_bytes"] = 4096   # the second run now reads past the log's end
        refused = sub.call(Op.RECOVER, args=(desc.ctypes.data,))
    finally:
        sub.stop()
    assert (ok.status, ok.pages, ok.bytes, ok.lsn_first) == (Status.OK, 4, 2048, 0)
    assert (damaged.status, damaged.pages, damaged.bytes, damaged.lsn_first) == (Status.OK, 3, 2048, 1)
    assert bad.tolist() == [0, 0, 0, 1] and region[:1024].tobytes() == log[1024:2048].tobytes()
    assert refused.status == Status.BAD_ARGS


def test_a_session_asks_its_resident_executor_for_a_ring(shm_log, file_log):
    """`ring_of`: no resident executor, no ring; with one, an engine where CuPy
    and a device are there, else why not; a file log: why, naming its tier."""
    from concordia import Session
    from concordia.restore.ring import RingRecovery

    assert ring_of(None, object()) is None
    with Session(shm_log, size=16 << 20, segment_size=4 << 20, executor="resident") as s:
        engine, why = ring_of(s.resident, s.log)()
        if engine is not None:   # a GPU: a kernel of the recoveries' own, kept for the session's next ones
            assert isinstance(engine, RingRecovery) and why is None and s.resident.device_recovery is engine.kernel
        else:
            assert "CuPy" in why or "CUDA" in why, why
    with Session(file_log, size=16 << 20, segment_size=4 << 20, executor="resident") as s:
        assert ring_of(s.resident, s.log)() == (None, "a file log cannot be mapped for the GPU")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("with_epoch", [False, True], ids=["recover", "recover+epoch"])
def test_the_recover_variant_compiles_with_the_table_pass_in_its_module(tmp_path, with_epoch):
    """executor.cu with CX_RECOVER (alone, and beside CX_EPOCH as one module):
    the control warp launches cx_recover as a child grid."""
    from concordia.checkpoint.device_epoch import compile_defines
    from concordia.executor.persistent import compile_options
    from concordia.gpu_kernels import jit

    src = tmp_path / "executor_recover.cu"
    src.write_text(CU.replace('#include "table.cu"', jit.source("table"), 1))
    ops = (1 << Op.RECOVER) | (1 << Op.PING) | (1 << Op.QUIESCE) | (1 << Op.STOP)
    opts = compile_options(child=True, ops_mask=ops | ((1 << Op.EPOCH) if with_epoch else 0)) + ("-DCX_RECOVER",)
    if with_epoch:
        opts += compile_defines(4096)
    out = tmp_path / "k.ptx"
    r = subprocess.run([shutil.which("nvcc"), "--ptx", "-arch=sm_90", *opts, str(src), "-o", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert ".entry cx_recover(" in text and (".entry cx_epoch_driver(" in text) == with_epoch
    control = text.split(".entry cx_executor(")[1].split(".entry")[0]
    assert "LaunchDeviceV2" in control


def test_a_file_log_has_no_ring_and_says_why(file_log):
    """A page-cache file cannot be mapped for the GPU: its device recovery
    takes the caller's pipeline, and `why_not` names the tier."""
    from concordia.restore.ring import why_not

    _history(file_log, epochs=1)
    log = Log.open(file_log, writable=False, check_pages=False)
    try:
        assert why_not(log) == "a file log cannot be mapped for the GPU"
    finally:
        log.close()
