"""Every executor CUDA source compiles to PTX for sm_90 in every variant the
host builds (nothing runs here; this keeps the sources from rotting)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from concordia.executor.persistent import ALL_OPS_MASK, KERNEL_SOURCE, compile_options
from concordia.tools.bench.kernels import EXECUTOR_BENCH_SOURCE
from concordia.executor.ring import Op

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not installed")


def ptx(tmp_path, src, options):
    out = tmp_path / "k.ptx"
    r = subprocess.run([NVCC, "--ptx", "-arch=sm_90", *options, str(src), "-o", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return out.read_text()


@pytest.mark.parametrize("child", [True, False])
@pytest.mark.parametrize("ops", [ALL_OPS_MASK, (1 << Op.PING) | (1 << Op.QUIESCE) | (1 << Op.STOP) | (1 << Op.CHECKPOINT)])
def test_executor_variants_compile(tmp_path, child, ops):
    text = ptx(tmp_path, KERNEL_SOURCE, compile_options(child=child, ops_mask=ops))
    for name in ("cx_executor", "cx_checkpoint", "cx_copy", "cx_scatter"):
        assert f".entry {name}(" in text
    assert "ld.acquire.sys" in text and "st.release.sys" in text
    executor = text.split(".entry cx_executor(")[1].split(".entry")[0]
    assert ".shared" not in executor
    if child and ops & (1 << Op.CHECKPOINT):
        assert "LaunchDevice" in text      # handlers are child grids
    if not child:
        assert "LaunchDevice" not in text


def test_bench_kernels_compile(tmp_path):
    text = ptx(tmp_path, EXECUTOR_BENCH_SOURCE, ())
    assert ".entry cx_noop(" in text and ".entry cx_naive_spin(" in text
