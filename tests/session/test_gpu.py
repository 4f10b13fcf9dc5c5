"""The Session and the demo on a CUDA device (CuPy arrays; torch CUDA tensors through DLPack)."""

from __future__ import annotations

import numpy as np
import pytest

from concordia import Session

from .state import LOG_SIZE, SEGMENT

pytestmark = pytest.mark.gpu


def _cp():
    import cupy

    return cupy


def test_cupy_regions_checkpoint_and_recover_on_device(shm_log):
    cp = _cp()
    kv = cp.arange(1 << 18, dtype=cp.float32).reshape(4, 16, 2, 8, 2, 128)
    ad = cp.ones((4, 2, 64, 8), cp.float32)
    with Session(shm_log, size=LOG_SIZE, segment_size=SEGMENT) as s:
        s.register("kv", kv, kind="kv", page_bytes=4096)
        s.register("adapter", ad, kind="adapter", page_bytes=4096)
        first = s.checkpoint()
        kv[1, 2, 0, 3] = -1.0
        ad[2, 1, 5] = 3.0
        second = s.checkpoint()
        assert second.pages == {"kv": 1, "adapter": 1} and first.base
    with Session(shm_log, create=False) as s:
        got = s.recover(device="cupy")
        assert isinstance(got["kv"], cp.ndarray)
        assert bool((got["kv"] == kv).all()) and bool((got["adapter"] == ad).all())
        host = s.recover()
        assert np.array_equal(host["kv"], kv.get())


def test_file_log_restores_through_bounce_buffers(file_log):
    cp = _cp()
    a = cp.random.default_rng(1).random(3 << 20, dtype=cp.float32)
    with Session(file_log, size=64 << 20, segment_size=16 << 20) as s:
        s.register("a", a, kind="kv", page_bytes=65536)
        s.checkpoint()
    with Session(file_log, create=False) as s:
        got = s.recover(device="cupy")["a"]
    assert bool((got == a).all())


def test_torch_cuda_tensor_through_dlpack(shm_log):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    t = torch.arange(1 << 16, dtype=torch.float16, device="cuda").reshape(256, 256)
    with Session(shm_log, size=LOG_SIZE, segment_size=SEGMENT) as s:
        s.register("t", t, kind="adapter", page_bytes=4096)
        s.checkpoint()
        t[7] = 0.5
        assert s.checkpoint().pages["t"] == 1
        got = s.recover()["t"]
        on_gpu = s.recover(device="cupy")["t"]
    # a region registered as a tensor comes back as a tensor of its dtype:
    # on the host by default, on the GPU with device="cupy"
    assert isinstance(got, torch.Tensor) and got.dtype == t.dtype and tuple(got.shape) == tuple(t.shape)
    assert got.device.type == "cpu" and torch.equal(got, t.cpu())
    assert isinstance(on_gpu, torch.Tensor) and on_gpu.is_cuda and torch.equal(on_gpu, t)


def test_gpu_demo_is_bit_identical(tmp_path):
    from concordia.demo import run_demo

    rep = run_demo(log=f"file:{tmp_path / 'demo.log'}", steps=48, kill_at=21, every=4, device="gpu")
    assert rep["device"] == "gpu"
    assert rep["identical"], rep["compared"]


WRITE_PAGES = r"""
extern "C" __global__ void write_pages(float* a, const long long* pages, int npages, int per_page, float v) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)npages * per_page) return;
  a[pages[i / per_page] * per_page + i % per_page] = v + (float)(i % 7);
}
"""


def test_store_tracked_region_checkpoints_what_instrumented_kernels_wrote(shm_log):
    # detect="stores": the checkpoint logs exactly the pages an instrumented
    # kernel wrote, found without a scan; a copy the tracker cannot see is
    # found by the fingerprint cross-check (check_every) and logged then; the
    # recovered state equals the live one after every checkpoint
    cp = _cp()
    from concordia import instrument

    instrument.disable()
    instrument.enable(track_stores=True)
    try:
        write = cp.RawModule(code=WRITE_PAGES).get_function("write_pages")
        per_page = 4096 // 4
        a = cp.zeros(256 * per_page, dtype=cp.float32)
        rng = np.random.default_rng(3)
        with Session(shm_log, size=LOG_SIZE, segment_size=SEGMENT) as s:
            r = s.register("a", a, kind="kv", page_bytes=4096, detect="stores", check_every=3)
            assert s.checkpoint().base == ["a"]
            for step in range(6):
                pages = np.sort(rng.choice(np.r_[0:5, 6:256], size=int(rng.integers(1, 20)), replace=False))
                n = pages.size * per_page
                write(((n + 255) // 256,), (256,), (a, cp.asarray(pages), np.int32(pages.size),
                                                   np.int32(per_page), np.float32(step + 1)))
                if step == 3:  # a device-to-device copy into page 5: no kernel, not tracked
                    src = cp.full(per_page, -9.0, cp.float32)
                    cp.cuda.runtime.memcpy(a.data.ptr + 5 * 4096, src.data.ptr, 4096,
                                           cp.cuda.runtime.memcpyDeviceToDevice)
                cp.cuda.Device().synchronize()
                st = s.checkpoint()
                expect = set(pages.tolist())
                if step == 5:      # the third checkpoint since the cross-check at step 2
                    expect.add(5)
                assert st.pages["a"] == len(expect), (step, st.pages, sorted(expect))
            assert r.missed_pages == 1
        assert instrument._hook.regions == []      # the session's close stopped tracking the region
        with Session(shm_log, create=False) as s:
            got = s.recover(device="cupy")["a"]
        assert bool((got == a).all())
    finally:
        instrument.disable()
