"""What the GPU machine's CuPy does when `concordia.instrument` is enabled:
which compiler functions a RawModule compile reaches, whether the hook's
replacements are called, what the driver is handed, and how CuPy reaches the
driver (for the LD_PRELOAD shim).  Printed for the log of
scripts/gpu/instrument.sh; copies CuPy's compiler sources under $OUT/probe/.

    python3 tests/instrument/gpu_probe.py
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap
import traceback


def section(title: str) -> None:
    print(f"\n--- {title}", flush=True)


def copy_sources(out: pathlib.Path) -> None:
    import cupy
    from cupy.cuda import compiler

    out.mkdir(parents=True, exist_ok=True)
    root = pathlib.Path(cupy.__file__).parent
    print("cupy", cupy.__version__, "at", root)
    print("compiler module file:", getattr(compiler, "__file__", None))
    for rel in ("cuda/compiler.py", "cuda/_compiler_cache.py", "_core/raw.pyx", "_core/core.pyx",
                "_core/_kernel.pyx", "_util.pyx", "cuda/function.pyx"):
        p = root / rel
        if p.exists():
            shutil.copy(p, out / rel.replace("/", "__"))
            print("copied", rel)
        else:
            print("absent", rel)
    backends = pathlib.Path(cupy.__file__).parents[1] / "cupy_backends"
    for so in sorted(backends.glob("cuda/api/driver*.so")):
        print("driver extension:", so)
        for cmd in (["ldd", str(so)], ["nm", "-D", "--undefined-only", str(so)]):
            try:
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
                lines = [ln for ln in res.stdout.splitlines()
                         if "cuda" in ln.lower() or "dl" in ln or "cuModule" in ln]
                print(" ", " ".join(cmd[:1]), "->", lines[:30])
            except Exception as exc:
                print(" ", cmd[0], "failed:", exc)
    names = [n for n in dir(compiler) if "compile" in n or "arch" in n or "cache" in n.lower()
             or "NVRTC" in n]
    print("compiler names:", names)


def trace_compile() -> None:
    import cupy
    from cupy.cuda import compiler

    from concordia import instrument

    calls: list[str] = []

    def prof(frame, event, arg):
        if event == "call":
            co = frame.f_code
            if "cupy" in co.co_filename or "concordia" in co.co_filename:
                calls.append(f"{pathlib.Path(co.co_filename).name}:{co.co_name}")

    src = 'extern "C" __global__ void probe_k(float* y, int n)' \
          '{ int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = 2 * y[i] + 1; }'
    rep = instrument.enable()
    hook = instrument._hook
    print("patched:", {n: getattr(compiler, n) is not hook.saved.get(n) for n in hook.saved})
    sys.setprofile(prof)
    try:
        mod = cupy.RawModule(code=src)
        f = mod.get_function("probe_k")
        y = cupy.ones(256, dtype=cupy.float32)
        f((1,), (256,), (y, cupy.int32(256)))
        cupy.cuda.Device().synchronize()
    except Exception:
        traceback.print_exc()
    finally:
        sys.setprofile(None)
    seen, order = set(), []
    for c in calls:
        if c not in seen:
            seen.add(c)
            order.append(c)
    print("python calls during RawModule compile (first seen order):")
    print("  " + "\n  ".join(order[:120]))
    print("hook counters:", getattr(hook, "calls", None))
    print("report:", rep.summary())
    for s in rep.skipped:
        print("  skipped:", s.name, s.reason)
    try:
        print("get_global epochs:", mod.get_global("__concordia_epochs"))
    except Exception as exc:
        print("get_global epochs failed:", type(exc).__name__, exc)
    instrument.disable()
    backend = getattr(compiler, "_kernel_cache_backend", None)
    print("kernel cache backend:", type(backend).__name__ if backend is not None else None)
    cache = pathlib.Path(os.path.expanduser("~/.cupy/kernel_cache"))
    print("disk cache entries:", len(list(cache.iterdir())) if cache.is_dir() else "no dir")
    print("CUPY_CACHE_IN_MEMORY =", os.environ.get("CUPY_CACHE_IN_MEMORY"))
    print("cuda.bindings imported:", "cuda.bindings" in sys.modules,
          "cuda.core imported:", "cuda.core" in sys.modules)


CHILD = textwrap.dedent("""
    import json, sys, numpy as np, cupy
    from cupy.cuda import compiler
    print("arch fn before:", compiler._get_arch_for_options_for_nvrtc(), file=sys.stderr)
    compiler._get_arch_for_options_for_nvrtc = lambda arch=None, *a: (
        f"-arch=compute_{arch or compiler._get_arch()}", "ptx")
    src = 'extern "C" __global__ void shim_probe2(float* y, int n)' \\
          '{ int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = 2 * y[i] + 1; }'
    m = cupy.RawModule(code=src)
    f = m.get_function("shim_probe2")
    y = cupy.ones(1000, dtype=cupy.float32)
    f((4,), (256,), (y, np.int32(1000)))
    cupy.cuda.Device().synchronize()
    maps = open("/proc/self/maps").read()
    print("shim mapped:", "concordia_shim" in maps, file=sys.stderr)
    try:
        m.get_global("__concordia_epochs"); print("epochs global: found", file=sys.stderr)
    except Exception as e:
        print("epochs global:", e, file=sys.stderr)
    print(json.dumps({"y": float(y[5])}))
""")


def shim_child(tmp: pathlib.Path) -> None:
    from concordia.instrument import shim

    report = tmp / "probe-shim.jsonl"
    env = shim.preload_env(report)
    env["CUPY_CACHE_IN_MEMORY"] = "1"
    env["LD_DEBUG"] = ""
    script = tmp / "probe_child.py"
    script.write_text(CHILD)
    p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                       timeout=120)
    print("rc", p.returncode, "stdout", p.stdout.strip()[-500:])
    print("stderr", p.stderr.strip()[-3000:])
    for row in shim.read_report(report)[:20]:
        print("  report:", json.dumps(row)[:400])


def main() -> None:
    out = pathlib.Path(os.environ.get("OUT", tempfile.mkdtemp())) / "probe"
    for title, fn in (("sources", lambda: copy_sources(out)), ("compile trace", trace_compile),
                      ("shim child", lambda: shim_child(pathlib.Path(tempfile.mkdtemp())))):
        section(title)
        try:
            fn()
        except Exception:
            traceback.print_exc()


if __name__ == "__main__":
    main()
