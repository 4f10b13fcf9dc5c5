"""The table pass on the device (gpu_kernels/table.cu) against its numpy
twin: 1, 16 and 1,024 CuPy regions of mixed detectors (shadow, fingerprint,
slot versions listed by the host) and page sizes (64 to 4096 bytes, short
last pages) through `Session` on a registered shm mapping must leave the same
records, the same commits (digests included) and recover the same bytes."""

from __future__ import annotations

import numpy as np
import pytest

from concordia import Session

from .staging_cases import assert_same_log
from .state import assert_same
from .table_cases import make_regions, run

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    import cupy

    return cupy


@pytest.fixture
def two_shm_logs():
    from .conftest import _fresh_shm_log

    a, b = _fresh_shm_log(), _fresh_shm_log()
    yield next(a), next(b)
    for g in (a, b):
        next(g, None)


@pytest.mark.parametrize("n", [1, 16, 1024])
def test_device_table_pass_writes_the_twins_records(cp, two_shm_logs, n):
    twin = run(two_shm_logs[0], make_regions(n), staging="mapped")
    stats, contents, got, truth = run(two_shm_logs[1], make_regions(n), to_device=cp.asarray)
    assert [st.table_pass for st in twin[0]] == [False, True, True, True]
    assert [st.table_pass for st in stats] == [False, True, True, True]
    assert all(set(st.via.values()) == {"gpu-mapped"} for st in stats)
    assert all(st.device_reads <= 2 for st in stats)
    assert_same_log(contents, twin[1])
    assert [st.pages for st in stats] == [st.pages for st in twin[0]]
    assert [st.log_bytes for st in stats] == [st.log_bytes for st in twin[0]]
    assert_same(got, truth)
    assert_same(twin[2], truth)


def test_device_epoch_larger_than_a_segment_goes_region_by_region(cp, two_shm_logs):
    def go(log, to_device):
        arrays = [np.random.default_rng(i).integers(0, 255, 3 << 20, dtype=np.uint8) for i in range(3)]
        live = [to_device(a) if to_device else a for a in arrays]
        out = []
        with Session(log, size=64 << 20, segment_size=4 << 20, overwrite=True, staging="auto"
                     if to_device else "mapped", executor="host") as s:
            for i, a in enumerate(live):
                s.register(f"r{i}", a, page_bytes=4096, detect="fingerprint")
            s.checkpoint()
            for a, d in zip(arrays, live):
                a[::4096] ^= 1
                if to_device:
                    d.set(a)
            out.append(s.checkpoint())
            arrays[1][5] ^= 1
            if to_device:
                live[1].set(arrays[1])
            out.append(s.checkpoint())
            got = {k: np.asarray(v) for k, v in s.recover().items()}
        return out, got, {f"r{i}": a for i, a in enumerate(arrays)}

    twin, twin_got, truth = go(two_shm_logs[0], None)
    dev, dev_got, _ = go(two_shm_logs[1], cp.asarray)
    assert [st.pages for st in dev] == [st.pages for st in twin] == [{f"r{i}": 768 for i in range(3)},
                                                                     {"r0": 0, "r1": 1, "r2": 0}]
    assert all(st.table_pass for st in dev)
    assert_same(dev_got, truth)
    assert_same(twin_got, truth)
