"""A GPU kernel writes through the device address of a registered mapping and
the bytes appear in the backend's own view (needs a CUDA device)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from concordia.devmem import open_backend

pytestmark = pytest.mark.gpu

FILL = r"""
extern "C" __global__ void fill(unsigned char* p, unsigned long long n, unsigned int seed) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        p[i] = (unsigned char)((i * 131ull + seed) & 0xff);
}
"""


def expected(n, seed):
    i = np.arange(n, dtype=np.uint64)
    return ((i * 131 + seed) & 0xFF).astype(np.uint8)


def gpu_fill(reg, seed):
    import cupy

    kernel = cupy.RawKernel(FILL, "fill")
    dev = reg.as_cupy()
    kernel((256,), (256,), (dev, np.uint64(reg.nbytes), np.uint32(seed)))
    cupy.cuda.runtime.deviceSynchronize()


@pytest.fixture
def shm():
    name = f"concordia-gpu-{os.getpid()}"
    b = open_backend(f"shm:{name}", size=8 << 20, create=True)
    yield b
    b.close()
    os.unlink(f"/dev/shm/{name}")


@pytest.mark.parametrize("chunk", [1 << 30, 1 << 20])
def test_kernel_writes_into_shm_through_the_device_pointer(shm, chunk):
    from concordia.devmem.cuda_host import register

    with register(shm, chunk_bytes=chunk) as reg:
        assert reg.nbytes == shm.size and reg.device_ptr
        assert len(reg.chunks) == -(-shm.size // chunk)
        gpu_fill(reg, seed=7)
        assert np.array_equal(shm.array, expected(shm.size, 7))
    assert not reg.registered
    reg.unregister()                                   # idempotent
    with register(shm) as again:                       # and registrable again
        gpu_fill(again, seed=9)
    assert np.array_equal(shm.array, expected(shm.size, 9))


def test_other_processes_see_what_the_gpu_wrote(shm):
    from concordia.devmem.cuda_host import register

    with register(shm) as reg:
        gpu_fill(reg, seed=3)
    with open(shm.path, "rb") as f:
        assert np.array_equal(np.frombuffer(f.read(), dtype=np.uint8), expected(shm.size, 3))


@pytest.mark.parametrize("spec", ["memory:", "pinned:"])
def test_kernel_writes_into_memory_and_pinned(spec):
    from concordia.devmem.cuda_host import register

    with open_backend(spec, size=1 << 20) as b:
        with register(b) as reg:
            gpu_fill(reg, seed=11)
        assert np.array_equal(b.array, expected(b.size, 11))
