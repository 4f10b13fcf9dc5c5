"""Kernels and helpers that only the benchmarks use, kept beside them and out
of the product: the device-memory read ceiling (`bandwidth.cu`, through the one
loader `gpu_kernels.jit`) and the executor's baselines (`executor_bench.cu`,
and the CHECKPOINT handler launched from the host).

CuPy is imported lazily: importing this module needs no GPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from concordia.executor import persistent
from concordia.executor.errors import ExecutorError
from concordia.gpu_kernels import jit

from ..common import require_cupy

BENCH_DIR = Path(__file__).resolve().parent
EXECUTOR_BENCH_SOURCE = BENCH_DIR / "executor_bench.cu"

# the read ceiling of bench checkpoint, a module of the one kernel loader
jit.register("bandwidth", BENCH_DIR, kernels=("read_probe", "spin_probe"))
SPECS = (("bandwidth", {}),)


def load_bench_kernels() -> dict:
    """cx_noop and cx_naive_spin (executor_bench.cu), loaded now."""
    if persistent.any_resident():
        raise ExecutorError("module load while a persistent executor is resident", where="bench kernels")
    require_cupy(ExecutorError, where="bench kernels", hint="the executor's baselines need a CUDA device")
    names = ("cx_noop", "cx_naive_spin")
    mod = jit.load(persistent.kernel_source(EXECUTOR_BENCH_SOURCE), (), names, where="executor_bench.cu")
    return {n: mod.get_function(n) for n in names}


def direct_checkpoint(module, scratch, stream, n_sm: int, src, shadow, out, out_ids,
                      nbytes: int, page_bytes: int) -> int:
    """The CHECKPOINT handler launched from the host (the baseline): reset the
    counter, launch the same grid the executor would, read the page count back,
    synchronise `stream` only.  Returns pages found."""
    import cupy

    fn = module.load().functions["cx_checkpoint"]
    npages = -(-nbytes // page_bytes)
    grid = max(1, min(-(-npages // 8), n_sm * 8))
    with stream:
        cupy.cuda.runtime.memsetAsync(scratch.data.ptr, 0, 64, stream.ptr)
        fn((grid,), (256,), (src, shadow, out, out_ids, np.uint64(nbytes), np.uint64(page_bytes), scratch))
        pages = scratch[:1].get(stream=stream)
    return int(pages[0])
