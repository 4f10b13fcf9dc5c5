"""Every `.cu` source compiles to PTX for sm_90 (nvcc) in every
specialisation the product and its benchmark use, and the loader's
specialisation checks hold.  No GPU needed."""

from __future__ import annotations

import shutil

import pytest

from concordia.gpu_kernels import jit
from concordia.gpu_kernels.errors import KernelCompileError, KernelInputError

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (CUDA toolkit) not installed")


def _id(spec):
    name, defines = spec
    return name + "".join(f"-{v}" for v in defines.values())


@needs_nvcc
@pytest.mark.parametrize("spec", jit.CI_SPECS, ids=[_id(s) for s in jit.CI_SPECS])
def test_source_compiles_to_sm90_ptx(spec):
    name, defines = spec
    ptx = jit.nvcc_ptx(name, defines)
    assert ".target sm_90" in ptx
    for k in jit.kernels_in(name, defines):
        assert f".entry {k}(" in ptx, k


def test_every_source_file_is_covered():
    names = {p.stem for p in jit.SOURCE_DIR.glob("*.cu") if not p.stem.startswith("executor")}
    assert names == {n for n in jit.KERNELS if jit.source_path(n).parent == jit.SOURCE_DIR}
    assert names <= {name for name, _ in jit.CI_SPECS}


@needs_nvcc
def test_the_benchmarks_kernels_compile_through_the_same_loader():
    from concordia.tools.bench import kernels

    for name, defines in kernels.SPECS:
        assert jit.source_path(name).parent == kernels.BENCH_DIR
        ptx = jit.nvcc_ptx(name, defines)
        for k in jit.KERNELS[name]:
            assert f".entry {k}(" in ptx, k


def test_source_inlines_the_common_header():
    text = jit.source("stage")
    assert '#include "common.cuh"' not in text and "crc_tables_build" in text


@needs_nvcc
def test_nvcc_reports_a_bad_specialisation_in_one_line():
    with pytest.raises(KernelCompileError) as e:
        jit.nvcc_ptx("kv_scan", {"PAGE_BYTES": 4096, "KV_BLOCK_SIZE": 16})  # layout incomplete
    assert "\n" not in str(e.value) and "kv_scan.cu" in str(e.value)


def test_specialisation_checks():
    with pytest.raises(KernelInputError, match="PAGE_BYTES"):
        jit.nvcc_ptx("stage", {})
    with pytest.raises(KernelInputError, match="multiple of 64"):
        jit.nvcc_ptx("shadow_diff", {"PAGE_BYTES": 1000})
    with pytest.raises(KernelInputError, match="no kernel module"):
        jit.nvcc_ptx("nope", {})


def test_gpu_launchers_say_when_cupy_is_missing():
    pytest.importorskip("numpy")
    try:
        import cupy  # noqa: F401
    except Exception:
        pass
    else:
        pytest.skip("CuPy present: the GPU tests cover the launchers")
    import numpy as np

    from concordia.gpu_kernels import gpu
    from concordia.gpu_kernels.errors import GpuUnavailableError

    with pytest.raises(GpuUnavailableError, match="CuPy"):
        gpu.shadow_diff(np.zeros(64, np.uint8), np.zeros(64, np.uint8), page_bytes=64)


@needs_nvcc
def test_the_text_nvrtc_receives_compiles_alone(tmp_path):
    """jit.source() is what NVRTC compiles: it must stand alone (no include path)."""
    import subprocess

    defs = ["-DPAGE_BYTES=4096", "-DKV_BLOCK_SIZE=16", "-DKV_HEADS=8", "-DKV_HEAD_DIM=128", "-DKV_DTYPE_BYTES=2"]
    for name in jit.KERNELS:
        f = tmp_path / f"{name}.cu"
        f.write_text(jit.source(name))
        res = subprocess.run(["nvcc", "--ptx", "-arch=sm_90", *jit.NVRTC_OPTIONS, *defs, str(f),
                              "-o", str(tmp_path / f"{name}.ptx")], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr


@needs_nvcc
def test_the_checkpoint_helpers_compile_to_sm90_ptx(tmp_path):
    """gpu.py's own source (compaction, scatter, the stream holds) compiles
    for Hopper with the options NVRTC gets, every kernel present."""
    import subprocess

    from concordia.gpu_kernels import gpu

    src = tmp_path / "helpers.cu"
    src.write_text(gpu._HELPERS_SOURCE)
    out = tmp_path / "helpers.ptx"
    res = subprocess.run([shutil.which("nvcc"), "--ptx", "-arch=sm_90", *jit.NVRTC_OPTIONS, str(src), "-o", str(out)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    ptx = out.read_text()
    for k in ("compact_flags", "scatter_u32", *gpu.HOLD_KERNELS):
        assert f".entry {k}(" in ptx, k
