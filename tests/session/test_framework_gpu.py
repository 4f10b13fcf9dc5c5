"""Framework tensors on the GPU: a checkpoint is ordered after the producer's
stream (a write queued behind GEMMs on a non-default PyTorch stream is in the
epoch without any synchronise), `recover(into=...)` restores bfloat16 CUDA
tensors on the device pipeline straight into their memory, and the bad
device inputs are one-line errors naming the region."""

from __future__ import annotations

import subprocess
import sys

import pytest

from concordia import Session
from concordia.errors import RecoverMismatchError, ShapeChangedError

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch", reason="PyTorch is not installed here")
if not torch.cuda.is_available():
    pytest.skip("this PyTorch build has no CUDA device", allow_module_level=True)

SIZE, SEGMENT = 512 << 20, 64 << 20


def _queue_behind_gemms(side, x, value, n=4, dim=8192):
    """On stream `side`: a few large GEMMs, then x.fill_(value) (all queued, none waited for)."""
    a = torch.randn(dim, dim, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        for _ in range(n):
            a = a @ a
            a = a / a.abs().amax().clamp(min=1)
        x.fill_(value)
    return a


def test_a_write_queued_on_a_side_stream_is_in_the_checkpoint(shm_log):
    x = torch.zeros(16 << 20, dtype=torch.bfloat16, device="cuda")  # 32 MiB
    side = torch.cuda.Stream()
    with Session(shm_log, size=SIZE, segment_size=SEGMENT, executor="host") as s:
        s.register("x", x, kind="kv", page_bytes=65536)
        s.checkpoint()
        for trial in range(1, 6):
            keep = _queue_behind_gemms(side, x, float(trial))
            with torch.cuda.stream(side):
                s.checkpoint()  # no synchronise: the order comes from the producer's stream
            got = s.recover()["x"]
            assert got.dtype == torch.bfloat16 and not got.is_cuda
            assert bool((got == float(trial)).all()), f"trial {trial}: the epoch does not hold the write"
            del keep


def test_a_stream_given_at_checkpoint_orders_a_cupy_producer(shm_log):
    cp = pytest.importorskip("cupy")
    x = cp.zeros(8 << 20, cp.float32)
    side = cp.cuda.Stream(non_blocking=True)
    a = cp.random.standard_normal((8192, 8192), dtype=cp.float32)
    cp.cuda.get_current_stream().synchronize()
    with Session(shm_log, size=SIZE, segment_size=SEGMENT, executor="host") as s:
        s.register("x", x, page_bytes=65536)
        s.checkpoint()
        with side:
            for _ in range(3):
                a = a @ a
                a /= cp.abs(a).max()
            x.fill(5)
        s.checkpoint(stream=side)  # called outside `with side:`, the stream says who wrote
        got = s.recover()["x"]
    assert (got == 5).all()


def test_recover_into_bf16_cuda_tensors_on_the_device_pipeline(shm_log):
    kv = [torch.randn(64, 4096, device="cuda").to(torch.bfloat16) for _ in range(4)]
    with Session(shm_log, size=SIZE, segment_size=SEGMENT) as s:
        for i, t in enumerate(kv):
            s.register(f"kv{i}", t, kind="kv", page_bytes=65536)
        s.checkpoint()
    targets = {f"kv{i}": torch.zeros_like(t) for i, t in enumerate(kv)}
    with Session(shm_log, create=False) as s:
        out = s.recover(into=targets)
        assert set(s.last_recovery.via.values()) == {"device pipeline"}
        # later work on the caller's current stream sees the restored bytes
        sums = [t.float().sum() for t in out.values()]
    for i, t in enumerate(kv):
        assert out[f"kv{i}"] is targets[f"kv{i}"]
        assert torch.equal(targets[f"kv{i}"].view(torch.int16), t.view(torch.int16))
        assert float(sums[i]) == float(t.float().sum())


def test_recover_returns_cuda_tensors_with_device_cupy(shm_log):
    t = torch.randn(1000, device="cuda").to(torch.float8_e4m3fn)
    with Session(shm_log, size=SIZE, segment_size=SEGMENT) as s:
        s.register("f8", t, page_bytes=256)
        s.checkpoint()
        got = s.recover(device="cupy")["f8"]
    assert got.is_cuda and got.dtype == torch.float8_e4m3fn
    assert torch.equal(got.view(torch.uint8), t.view(torch.uint8))


def test_a_damaged_page_is_named_on_the_device_path(shm_log):
    from concordia.gpu_kernels import reference as ref
    from concordia.wal import Log
    from concordia.wal.errors import CorruptionError
    from concordia.wal.planner import plan

    t = torch.ones(1 << 16, device="cuda", dtype=torch.bfloat16)
    with Session(shm_log, size=SIZE, segment_size=SEGMENT) as s:
        s.register("kv", t, page_bytes=4096)
        s.checkpoint()
        t[-1] = 5  # the last commit holds the last page only: page 0 stays in epoch 1's record
        s.checkpoint()
    log = Log.open(shm_log, writable=False, check_pages=False)
    try:  # a payload byte of page 0 in its record
        (b,) = [src.batch for src in plan(log).regions["kv"].sources if int(src.batch.page_ids[0]) == 0]
        assert b.epoch == 1
        off = b.offset + ref.payload_offset(int(b.page_ids.size)) + 100
    finally:
        log.close()
    with open(f"/dev/shm/{shm_log.split(':', 1)[1]}", "r+b") as f:
        f.seek(off)
        byte = f.read(1)[0]
        f.seek(off)
        f.write(bytes([byte ^ 0xFF]))
    cp = pytest.importorskip("cupy")
    from concordia.restore.run import restore

    target = torch.full_like(t, 3.0)
    view = cp.from_dlpack(target.reshape(-1).view(torch.uint8)).view(cp.uint16)
    log = Log.open(shm_log, writable=False, check_pages=False)
    try:  # planned without page checks, so that the device pipeline is the one to find it
        with pytest.raises(CorruptionError, match="page CRC mismatch for page 0 of region 'kv'"):
            restore(log, plan=plan(log, check_pages=False), device=True, into={"kv": (view, cp)})
    finally:
        log.close()
    assert torch.equal(target, torch.full_like(t, 3.0))   # the damage left the target as it was
    from concordia.errors import ConcordiaError

    with pytest.raises(ConcordiaError, match="segment|page|corrupt|damaged"):  # the product path refuses it too
        with Session(shm_log, create=False) as s:                               # (at open, plan or restore)
            s.recover(into={"kv": target})


def test_device_mismatches_are_refused_naming_the_region(shm_log):
    t = torch.zeros(4096, device="cuda", dtype=torch.bfloat16)
    with Session(shm_log, size=SIZE, segment_size=SEGMENT, executor="host") as s:
        s.register("kv", t, page_bytes=4096)
        s.checkpoint()
        with pytest.raises(RecoverMismatchError, match=r"^region 'kv': the target tensor is on a GPU, "
                                                       r"device='numpy' was asked for"):
            s.recover(into={"kv": torch.ones_like(t)}, device="numpy")
        with pytest.raises(RecoverMismatchError, match=r"^region 'kv': cannot recover bfloat16 data into a "
                                                       r"float16 tensor"):
            s.recover(into={"kv": torch.ones(4096, device="cuda", dtype=torch.float16)})
        t.data = t.data.cpu()  # moved after register
        with pytest.raises(ShapeChangedError, match=r"^region 'kv': the registered array cannot be read: "
                                                    r"it moved from cuda:0 to cpu"):
            s.checkpoint()


def test_a_cuda_tensor_without_cupy_is_named():
    code = ("import sys; sys.modules['cupy'] = None\n"
            "import torch\n"
            "from concordia import Session\n"
            "from concordia.errors import ConcordiaError\n"
            "s = Session('memory:', size=64 << 20, segment_size=16 << 20)\n"
            "try:\n"
            "    s.register('kv', torch.zeros(64, device='cuda'))\n"
            "except ConcordiaError as e:\n"
            "    print(e); print('regions', len(s.log.regions))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("region 'kv': a CUDA tensor needs CuPy to be protected or restored into")
    assert "regions 0" in p.stdout


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "bool", "int64", "complex64", "float32"])
def test_a_cuda_tensor_is_seen_in_place_in_its_layout(dtype):
    """`adapt` views a CUDA tensor by its address: the view is the tensor's
    bytes in their layout (a slice at an offset of its storage included), a
    later write through PyTorch is seen, and the view keeps the tensor."""
    cp = pytest.importorskip("cupy")
    import gc
    import weakref

    import numpy as np

    from concordia.regions.arrays import adapt

    tdt = getattr(torch, dtype)
    base = torch.arange(3 * 4096, device="cuda", dtype=torch.float32).to(tdt)
    t = base[4096:].view(3 - 1, 4096)           # contiguous, at an offset of its storage
    a, xp, owner = adapt(t, "region 't'")
    assert xp is cp and owner is t and a.shape == (2, 4096) and a.data.ptr == t.data_ptr()
    want = t.cpu().view(torch.uint8).numpy().tobytes()
    assert a.view(np.uint8).get().tobytes() == want
    t.fill_(1)
    torch.cuda.synchronize()
    assert a.view(np.uint8).get().tobytes() == t.cpu().view(torch.uint8).numpy().tobytes()
    one = torch.full((), 7, dtype=torch.int64, device="cuda")   # a 0-dim word
    w, _, _ = adapt(one, "region 'w'")
    assert w.shape == () and int(w.get()) == 7
    ref = weakref.ref(t)
    del t, base, owner
    gc.collect()
    assert ref() is not None, "the view does not hold the tensor it reads"
    assert a.view(np.uint8).get().tobytes() == ref().cpu().view(torch.uint8).numpy().tobytes()


#: GPU cycles the side stream or CuPy's stream is held for (torch.cuda._sleep): 0.1-0.2 s at H100/H200 clocks,
#: far longer than the host's part of a 32 MiB recovery, so that what is not ordered shows every time
HOLD_CYCLES = 200_000_000


@pytest.mark.parametrize("late", ["writes", "copies"])
@pytest.mark.parametrize("registered", [False, True])
def test_a_recovery_on_a_side_stream_is_ordered_in_it(shm_log, monkeypatch, registered, late):
    """recover(into=...) inside `torch.cuda.stream(side)`: the copies into
    the tensors follow a write queued on `side` before the call, held there
    on the device ("writes"), and precede the reads queued on `side` after
    it, the copies being held on CuPy's stream ("copies")."""
    from concordia.restore import run as restore_run

    want = torch.randn(16 << 20, device="cuda").to(torch.bfloat16)   # 32 MiB
    with Session(shm_log, size=SIZE, segment_size=SEGMENT) as s:
        s.register("x", want, kind="kv", page_bytes=65536)
        s.checkpoint()
    if late == "copies":   # the copies queued behind a hold on CuPy's stream (the legacy default stream)
        real = restore_run.into_targets

        def held(*a, **kw):
            with torch.cuda.stream(torch.cuda.default_stream()):
                torch.cuda._sleep(HOLD_CYCLES)
            return real(*a, **kw)
        monkeypatch.setattr(restore_run, "into_targets", held)
    side = torch.cuda.Stream()
    x = torch.zeros_like(want)
    torch.cuda.synchronize()
    with Session(shm_log, create=False) as s:
        if registered:
            s.register("x", x, kind="kv", page_bytes=65536)
        with torch.cuda.stream(side):
            if late == "writes":
                torch.cuda._sleep(HOLD_CYCLES)
            x.fill_(7.0)   # queued on side before the call, not waited for
            s.recover(into="registered" if registered else {"x": x})
            got = x.view(torch.int16).clone()   # queued on side after the call
        side.synchronize()
    assert torch.equal(got, want.view(torch.int16)), "a read queued after the recovery ran before its copy"
    assert torch.equal(x.view(torch.int16), want.view(torch.int16)), "the write queued before it came after"


def test_a_recovery_waits_for_the_stream_of_a_device_whose_representative_moved(shm_log):
    """A recovery into the registered tensors orders its copies by the
    checkpoints' producer streams, one region standing for each device.  When
    that region's tensor has moved to the host since, the other tensors of
    its device still take their stream's order: the copy into `b` follows a
    write queued on the side stream before the call."""
    a = torch.zeros(1 << 20, dtype=torch.bfloat16, device="cuda")
    want = torch.randn(16 << 20, device="cuda").to(torch.bfloat16)   # 32 MiB
    b = want.clone()
    side = torch.cuda.Stream()
    with Session(shm_log, size=SIZE, segment_size=SEGMENT) as s:
        s.register("a", a, page_bytes=65536)   # first: cuda:0's representative
        s.register("b", b, kind="kv", page_bytes=65536)
        s.checkpoint()
        a.data = a.data.cpu()   # moved since
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(HOLD_CYCLES)
            b.fill_(7.0)   # queued on side before the call, not waited for
            s.recover(into="registered", regions=["b"])
            got = b.view(torch.int16).clone()   # queued on side after the call
        side.synchronize()
    assert torch.equal(got, want.view(torch.int16)), "the write queued before the recovery came after its copy"
