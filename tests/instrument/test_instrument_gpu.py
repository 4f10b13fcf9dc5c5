"""On the GPU: instrumented kernels compute what uninstrumented ones do, epoch
counters count launches, the store tracker's dirty pages equal a shadow diff
exactly, the pause gate holds and releases CuPy kernels and PyTorch stream work,
and the LD_PRELOAD shim catches modules loaded by CuPy, PyTorch and Triton."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from concordia import instrument
from concordia.instrument import shim
from concordia.regions.streams import foreign_stream

pytestmark = pytest.mark.gpu

SRC = r"""
extern "C" __global__ void axpy(const float* x, float* y, float a, long long n) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  y[i] = a * x[i] + y[i];
}
extern "C" __global__ void scatter4(const long long* idx, const float4* v, float4* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  long long j = idx[i];
  if (j < 0) return;
  out[j] = v[i];
}
extern "C" __global__ void bump_bytes(const long long* off, unsigned char* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) { unsigned char b = out[off[i]]; out[off[i]] = (unsigned char)(b + 1); }
}
extern "C" __global__ void fill3d(float* out, int n) {
  int t = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
  int i = blockIdx.x * (blockDim.x * blockDim.y * blockDim.z) + t;
  if (i >= n) return;
  out[i] = (float)i;
}
"""


@pytest.fixture
def cp():
    cupy = pytest.importorskip("cupy")
    instrument.disable()
    yield cupy
    instrument.disable()


@pytest.fixture
def gated(cp):
    """Instrumentation enabled with a gate attached: (report, gate); the gate
    is opened and freed afterwards."""
    rep = instrument.enable()
    gate = instrument.Gate()
    instrument.set_gate(gate)
    try:
        yield rep, gate
    finally:
        gate.open()
        instrument.disable()
        gate.free()


def _wait(cond, seconds=10.0):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.001)
    return False


def test_instrumented_kernels_compute_identical_results(cp):
    rng = np.random.default_rng(1)
    n = (1 << 20) + 37
    x = cp.asarray(rng.standard_normal(n, dtype=np.float32))
    y0 = cp.asarray(rng.standard_normal(n, dtype=np.float32))
    grid, block = ((n + 255) // 256,), (256,)
    plain = cp.RawModule(code=SRC).get_function("axpy")
    y_plain = y0.copy()
    plain(grid, block, (x, y_plain, np.float32(1.5), np.int64(n)))

    rep = instrument.enable()
    k = cp.RawModule(code=SRC).get_function("axpy")
    y_inst = y0.copy()
    for _ in range(5):
        k(grid, block, (x, y_inst, np.float32(1.5), np.int64(n)))
    y_ref = y0.copy()
    for _ in range(5):
        plain(grid, block, (x, y_ref, np.float32(1.5), np.int64(n)))
    cp.cuda.Device().synchronize()
    assert cp.array_equal(y_inst, y_ref)
    rec = rep.find("axpy")
    assert instrument.epochs(rec.handle, rec.result)["axpy"] == 5

    ew = cp.ElementwiseKernel("float32 a, float32 b", "float32 z", "z = a * 2 + b", "cc_ew")
    red = cp.ReductionKernel("float32 v", "float32 s", "v", "a + b", "s = a", "0", "cc_sum")
    z = ew(x, y0)
    s = red(x)
    assert cp.array_equal(z, x * 2 + y0) or np.array_equal(z.get(), x.get() * 2 + y0.get())
    np.testing.assert_allclose(float(s), float(x.get().astype(np.float64).sum()), rtol=1e-3, atol=1e-1)
    names = " ".join(rep.kernels)
    assert "cc_ew" in names and "cc_sum" in names and "axpy" in names
    assert rep.hook_sites >= 3 and not [sk for sk in rep.skipped if "cubin" in sk.reason]


@pytest.mark.parametrize("page_bytes", [4096, 3072, 64])
def test_store_tracked_dirty_set_equals_shadow_diff(cp, page_bytes):
    rng = np.random.default_rng(page_bytes)
    instrument.enable(track_stores=True)
    mod = cp.RawModule(code=SRC)
    scatter, bump = mod.get_function("scatter4"), mod.get_function("bump_bytes")
    nvec = 1 << 16                       # 1 MiB of float4
    out = cp.asarray(rng.standard_normal(nvec * 4, dtype=np.float32))
    region = instrument.track_array("out", out, page_bytes)
    other = cp.zeros(nvec * 4, dtype=np.float32)  # not registered: never marked
    instrument.set_regions([region])
    raw = out.view(cp.uint8)
    pages = -(-raw.size // page_bytes)
    for trial in range(6):
        shadow = raw.copy()
        region.clear()
        if trial % 2 == 0:
            m = int(rng.integers(1, 2000))
            idx = rng.choice(nvec, size=m, replace=False).astype(np.int64)
            idx[rng.random(m) < 0.1] = -1    # some threads take the early exit
            cur = out.reshape(nvec, 4)[cp.asarray(np.maximum(idx, 0))]
            vals = cur + 1.0
            scatter(((m + 127) // 128,), (128,), (cp.asarray(idx), vals, out, np.int32(m)))
            scatter(((m + 127) // 128,), (128,), (cp.asarray(idx), vals, other, np.int32(m)))
        else:
            m = int(rng.integers(1, 3000))
            off = rng.choice(raw.size, size=m, replace=False).astype(np.int64)
            bump(((m + 127) // 128,), (128,), (cp.asarray(off), raw, np.int32(m)))
        cp.cuda.Device().synchronize()
        diff = (raw != shadow).get()
        padded = np.zeros(pages * page_bytes, dtype=bool)
        padded[: diff.size] = diff
        expect = np.flatnonzero(padded.reshape(pages, page_bytes).any(axis=1))
        got = region.dirty_pages()
        assert np.array_equal(got, expect), f"trial {trial}: {len(got)} tracked vs {len(expect)} changed"
        assert len(expect) > 0


def test_pause_gate_holds_and_releases_cupy_kernels(cp, gated):
    _, gate = gated
    k = cp.RawModule(code=SRC).get_function("axpy")
    ew = cp.ElementwiseKernel("float32 a", "float32 z", "z = a + 1", "cc_gate_ew")
    n = 1 << 20
    x = cp.ones(n, dtype=cp.float32)
    y = cp.zeros(n, dtype=cp.float32)
    z = cp.empty(n, dtype=cp.float32)
    k(((n + 255) // 256,), (256,), (x, y, np.float32(2), np.int64(n)))   # load while open
    ew(x, z)
    cp.cuda.Device().synchronize()
    s = cp.cuda.Stream(non_blocking=True)
    for launch in (lambda: k(((n + 255) // 256,), (256,), (x, y, np.float32(2), np.int64(n))),
                   lambda: ew(x, z)):
        gate.close()
        with s:
            launch()
        assert _wait(lambda: gate.arrived), "no launch reached the closed gate"
        time.sleep(0.05)
        assert not s.done, "the stream finished while the gate was closed"
        gate.open()
        s.synchronize()
        assert s.done
    assert float(y[0]) == 4.0 and float(z[-1]) == 2.0


SLOW = r"""
extern "C" __global__ void slow_fill(float* out, int n, long long spin) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (blockIdx.x == 0) { if (i < n) out[i] = 1.0f; return; }
  long long t0 = clock64();
  while (clock64() - t0 < spin) { }
  if (i < n) out[i] = 1.0f + blockIdx.x;
}
"""


def test_gate_reports_arrival_only_after_every_block_has_finished(cp, gated):
    # Block 0 (which holds the launch) leaves at once; every other block spins
    # for milliseconds before it writes.  When the gate says "arrived", all of
    # the launch's writes must be there, and the held launch counts as complete.
    _, gate = gated
    rep = instrument.report()
    k = cp.RawModule(code=SLOW).get_function("slow_fill")
    blocks, threads = 3 * cp.cuda.Device().attributes["MultiProcessorCount"], 128
    n = blocks * threads - 5
    out = cp.zeros(n, dtype=cp.float32)
    k((blocks,), (threads,), (out, np.int32(n), np.int64(1000)))
    cp.cuda.Device().synchronize()
    rec = rep.find("slow_fill")
    assert instrument.epochs(rec.handle, rec.result)["slow_fill"] == 1
    out.fill(0)
    cp.cuda.Device().synchronize()
    expect = 1.0 + np.arange(n) // threads
    s, side = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    gate.close()
    with s:
        k((blocks,), (threads,), (out, np.int32(n), np.int64(20_000_000)))   # ~10 ms per block
    assert _wait(lambda: gate.arrived), "the launch never reached the closed gate"
    seen = out.get(stream=side)
    assert not s.done, "the stream finished while the gate was closed"
    assert np.array_equal(seen, expect), f"{int((seen != expect).sum())} elements unwritten at arrival"
    assert instrument.epochs(rec.handle, rec.result, stream=side)["slow_fill"] == 2
    gate.open()
    s.synchronize()
    assert instrument.epochs(rec.handle, rec.result)["slow_fill"] == 2


def test_epochs_count_launches_of_varying_grids_exactly(cp):
    rep = instrument.enable()
    mod = cp.RawModule(code=SRC)
    axpy, bump, fill3d = (mod.get_function(n) for n in ("axpy", "bump_bytes", "fill3d"))
    rng = np.random.default_rng(5)
    y = cp.zeros(1 << 20, dtype=cp.float32)
    x = cp.ones(1 << 20, dtype=cp.float32)
    raw = cp.zeros(1 << 16, dtype=cp.uint8)
    off = cp.asarray(rng.choice(raw.size, size=4000, replace=False).astype(np.int64))
    counts = {"axpy": 0, "bump_bytes": 0, "fill3d": 0}
    for _ in range(60):
        pick = rng.random()
        if pick < 0.4:
            m = int(rng.integers(1, y.size))
            axpy(((m + 255) // 256,), (int(rng.choice([32, 96, 256])),), (x, y, np.float32(1), np.int64(m)))
            counts["axpy"] += 1
        elif pick < 0.7:
            m = int(rng.integers(1, 4000))
            bump(((m + 63) // 64,), (64,), (off, raw, np.int32(m)))
            counts["bump_bytes"] += 1
        else:
            # blocks of 30 threads in three dimensions (no whole warp), the last one partly idle
            m = int(rng.integers(1, 5000))
            y.fill(-1)
            fill3d(((m + 29) // 30,), (5, 3, 2), (y, np.int32(m)))
            got = y[:m + 1].get()
            assert np.array_equal(got[:m], np.arange(m, dtype=np.float32)) and got[m] == -1
            counts["fill3d"] += 1
    cp.cuda.Device().synchronize()
    rec = rep.find("axpy")
    assert instrument.epochs(rec.handle, rec.result) == {**counts, "scatter4": 0}
    assert rec.result.options.pause_gate


def test_pause_gate_holds_pytorch_stream_work(cp, gated):
    torch = pytest.importorskip("torch")
    _, gate = gated
    k = cp.RawModule(code=SRC).get_function("axpy")
    n = 1 << 20
    tx = torch.ones(n, device="cuda")
    ty = torch.zeros(n, device="cuda")
    x, y = cp.from_dlpack(tx), cp.from_dlpack(ty)
    k(((n + 255) // 256,), (256,), (x, y, np.float32(1), np.int64(n)))
    torch.cuda.synchronize()
    ts = torch.cuda.Stream()
    gate.close()
    with torch.cuda.stream(ts), foreign_stream(cp, ts.cuda_stream, ts.device.index, ts):
        k(((n + 255) // 256,), (256,), (x, y, np.float32(1), np.int64(n)))
        ty.mul_(10)                    # a PyTorch kernel queued behind the held launch
    assert _wait(lambda: gate.arrived)
    time.sleep(0.05)
    assert not ts.query(), "PyTorch work ran past the closed gate"
    gate.open()
    ts.synchronize()
    assert float(ty[0]) == 20.0 and float(ty[-1]) == 20.0


CHILD_CUPY = textwrap.dedent("""
    import json, numpy as np, cupy
    from cupy.cuda import compiler
    compiler._get_arch_for_options_for_nvrtc = lambda arch=None, *a: (
        f"-arch=compute_{arch or compiler._get_arch()}", "ptx")
    src = 'extern "C" __global__ void shim_probe(float* y, int n)' \\
          '{ int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = 2 * y[i] + 1; }'
    m = cupy.RawModule(code=src)
    f = m.get_function("shim_probe")
    y = cupy.ones(1000, dtype=cupy.float32)
    f((4,), (256,), (y, np.int32(1000)))
    cupy.cuda.Device().synchronize()
    ep = cupy.ndarray((1,), cupy.uint64, memptr=m.get_global("__concordia_epochs"))
    print(json.dumps({"y": float(y[5]), "epochs": int(ep[0])}))
""")

CHILD_TORCH = textwrap.dedent("""
    import json, torch
    x = torch.arange(1 << 16, device="cuda", dtype=torch.float32)
    out = {"torch_sum": float((x * 2).sum().item()),
           "cudart_shared": any("libcudart.so" in ln for ln in open("/proc/self/maps"))}
    try:
        import triton, triton.language as tl

        @triton.jit
        def shim_triton_double(x_ptr, n, BLOCK: tl.constexpr):
            i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)

        shim_triton_double[(64,)](x, x.numel(), BLOCK=1024)
        torch.cuda.synchronize()
        out["triton"] = float(x[3].item())
    except ImportError:
        out["triton"] = None
    print(json.dumps(out))
""")


def _run_child(code, tmp_path, **kw):
    # A file, not `python -c`: Triton reads a @jit function's source from its file.
    report = tmp_path / "shim.jsonl"
    script = tmp_path / "child.py"
    script.write_text(code)
    env = shim.preload_env(report, **kw)
    env["CUPY_CACHE_IN_MEMORY"] = "1"
    p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                       timeout=100)
    rows = shim.read_report(report)
    if os.environ.get("OUT"):  # keep what the shim saw for the results page
        regs = [r for r in rows if r.get("via") == "__cudaRegisterFatBinary"]
        kept = [r for r in rows if r.get("via") != "__cudaRegisterFatBinary"]
        if regs:  # one line for the runtime's registrations (a library registers thousands)
            kept.append({"via": "__cudaRegisterFatBinary", "fatbins": len(regs),
                         "named": sum(bool(r.get("kernels")) for r in regs),
                         "kernels": sum(len(r["kernels"].split(",")) for r in regs if r.get("kernels")),
                         "sample": [{k: str(v)[:200] for k, v in r.items()} for r in regs[:3]]})
        with open(os.path.join(os.environ["OUT"], "instrument-shim.jsonl"), "a") as f:
            for row in kept:
                f.write(json.dumps({"child": tmp_path.name, **row}) + "\n")
    assert p.returncode == 0, (p.stderr[-2000:], rows[:10])
    return json.loads(p.stdout.strip().splitlines()[-1]), rows


def test_shim_instruments_ptx_loaded_through_the_driver(cp, tmp_path):
    out, rep = _run_child(CHILD_CUPY, tmp_path)
    assert out["y"] == 3.0
    assert out["epochs"] == 1, rep  # the loaded module carries the shim's hooks
    assert any(r.get("action") == "instrumented" for r in rep)
    assert any("shim_probe" in [k["name"] for k in r.get("kernels", []) if isinstance(k, dict)]
               for r in rep)


def test_shim_catches_pytorch_and_triton_modules(cp, tmp_path):
    pytest.importorskip("torch")
    # PyTorch's own fatbins are reported by name, not rewritten: rewriting and
    # JIT-compiling every PTX member of libtorch would take many minutes.
    out, rep = _run_child(CHILD_TORCH, tmp_path, fatbin=False)
    assert out["torch_sum"] == float(sum(range(1 << 16)) * 2)
    # libtorch registers its fatbins with the CUDA runtime as it loads; with a
    # shared libcudart the shim sees each registration and names its kernels
    # (a runtime linked into libtorch itself binds the call where LD_PRELOAD
    # cannot reach it)
    regs = [r for r in rep if r.get("via") == "__cudaRegisterFatBinary"]
    if out["cudart_shared"]:
        assert regs and any(r.get("kernels") for r in regs), rep[:5]
    if out["triton"] is None:
        pytest.skip("triton is not installed next to torch")
    assert out["triton"] == 6.0
    names = ",".join(r.get("kernels", "") for r in rep if isinstance(r.get("kernels"), str))
    assert "shim_triton_double" in names, rep  # Triton loads a cubin: reported as SASS only, by name


def test_threads_count_only_while_the_gate_is_closed(cp):
    # with no gate, or an open one, only launches are counted; closing the
    # gate clears the slots, and the held launch's threads are all counted in
    # its own slot; attaching and detaching need no device synchronisation
    from concordia.instrument.rewriter import HOLD_SLOTS, SLOTS
    from concordia.instrument.runtime import module_global

    rep = instrument.enable()
    k = cp.RawModule(code=SRC).get_function("axpy")
    n = 1 << 20
    x, y = cp.ones(n, dtype=cp.float32), cp.zeros(n, dtype=cp.float32)
    grid, block = ((n + 255) // 256,), (256,)

    def launch():
        k(grid, block, (x, y, np.float32(1), np.int64(n)))

    for _ in range(3):
        launch()
    cp.cuda.Device().synchronize()
    rec = rep.find("axpy")
    side = cp.cuda.Stream(non_blocking=True)

    def counted():
        slots = module_global(rec.handle, SLOTS, 2 * HOLD_SLOTS, np.uint64).get(stream=side)
        return int(slots[0::2].sum())

    assert instrument.epochs(rec.handle, rec.result)["axpy"] == 3 and counted() == 0
    gate = instrument.Gate()
    try:
        instrument.set_gate(gate)
        launch()
        cp.cuda.Device().synchronize()
        assert counted() == 0
        gate.close()
        first = gate.stamp
        assert first > 0 and counted() == 0
        s = cp.cuda.Stream(non_blocking=True)
        with s:
            launch()
        assert _wait(lambda: gate.arrived), "the launch never reached the closed gate"
        assert counted() == n and not s.done
        gate.open()
        s.synchronize()
        launch()
        cp.cuda.Device().synchronize()
        assert counted() == n
        gate.close()
        assert gate.stamp > first and counted() == 0
        gate.open()
        instrument.set_gate(None)
        launch()
        cp.cuda.Device().synchronize()
        assert counted() == 0
        assert instrument.epochs(rec.handle, rec.result)["axpy"] == 7 and float(y[0]) == 7.0
    finally:
        gate.open()
        instrument.disable()
        gate.free()


def test_a_launch_submitted_before_the_gate_closed_is_not_held(cp, gated):
    # K2 is queued behind a slow K1 before the gate closes and starts after
    # it closed: every thread of it reads "closed", but its grid id is below
    # the gate's stamp, so it is not held; the next launch is
    rep, gate = gated
    slow = cp.RawModule(code=SLOW).get_function("slow_fill")
    axpy = cp.RawModule(code=SRC).get_function("axpy")
    blocks, threads = 2 * cp.cuda.Device().attributes["MultiProcessorCount"], 128
    out = cp.zeros(blocks * threads, dtype=cp.float32)
    n = 1 << 16
    x, y = cp.ones(n, dtype=cp.float32), cp.zeros(n, dtype=cp.float32)
    slow((1,), (32,), (out, np.int32(1), np.int64(1000)))              # both loaded while open
    axpy((n // 256,), (256,), (x, y, np.float32(1), np.int64(n)))
    cp.cuda.Device().synchronize()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        slow((blocks,), (threads,), (out, np.int32(out.size), np.int64(200_000_000)))   # ~0.1 s
        axpy((n // 256,), (256,), (x, y, np.float32(1), np.int64(n)))
    gate.close()
    assert not s.done, "K1 finished before the gate closed; the test proves nothing"
    assert _wait(lambda: s.done), "a launch submitted before close() was held"
    assert not gate.arrived and float(y[0]) == 2.0
    rec = rep.find("axpy")
    assert instrument.epochs(rec.handle, rec.result)["axpy"] == 2
    with s:
        axpy((n // 256,), (256,), (x, y, np.float32(1), np.int64(n)))
    assert _wait(lambda: gate.arrived), "the launch after close() was not held"
    assert not s.done
    gate.open()
    s.synchronize()
    assert float(y[0]) == 3.0


def test_a_slot_that_does_not_add_up_never_reports_arrival(cp, gated):
    # counts in the held launch's slot that are not its own (here: every slot
    # poisoned after close) keep its holder waiting; opening the gate lets it
    # leave without arrival, and the launch's results are whole
    from concordia.instrument.rewriter import HOLD_SLOTS, SLOTS
    from concordia.instrument.runtime import module_global

    rep, gate = gated
    k = cp.RawModule(code=SRC).get_function("axpy")
    n = 1 << 20
    x, y = cp.ones(n, dtype=cp.float32), cp.zeros(n, dtype=cp.float32)
    k((n // 256,), (256,), (x, y, np.float32(1), np.int64(n)))
    cp.cuda.Device().synchronize()
    rec = rep.find("axpy")
    gate.close()
    module_global(rec.handle, SLOTS, 2 * HOLD_SLOTS, np.uint64).set(np.full(2 * HOLD_SLOTS, 12345, np.uint64))
    cp.cuda.Device().synchronize()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        k((n // 256,), (256,), (x, y, np.float32(1), np.int64(n)))
    time.sleep(0.2)
    assert not gate.arrived and not s.done, "the holder should still be waiting for its slot"
    gate.open()
    assert _wait(lambda: s.done), "opening the gate did not release the holder"
    assert not gate.arrived and float(y[0]) == 2.0 and float(y[-1]) == 2.0
