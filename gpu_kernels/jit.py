"""The one loader of Concordia's `.cu` sources: `-D` specialisation per region,
NVRTC through CuPy (`load`, which the executor's module and the benchmarks'
kernels use too), a module cache per device, and ahead-of-time compilation.

A *spec* is a module name (`shadow_diff`, `fingerprint`, `crc32c`, `stage`,
`scatter`, `kv_scan`, `table`) and a dict of `-D` constants (page size, KV layout).
`module(name, defines)` compiles on first use for the current device and keeps
the result; CuPy also caches the compiled binary on disk (`CUPY_CACHE_DIR`),
so a second process skips NVRTC.  `precompile(specs)` compiles and loads every
module a session needs before any persistent kernel is launched: loading a
module while a resident kernel runs can deadlock.

`nvcc_ptx(name, defines)` compiles the same source with `nvcc --ptx` for
sm_90; CI uses it on every specialisation the product uses (`CI_SPECS`).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import tempfile
import threading

from .errors import GpuUnavailableError, KernelCompileError, KernelInputError

SOURCE_DIR = pathlib.Path(__file__).resolve().parent
COMMON = "common.cuh"

# kernels each module defines (extern "C" names)
KERNELS = {
    "shadow_diff": ("shadow_diff",),
    "fingerprint": ("fingerprint",),
    "crc32c": ("crc32c_pages", "crc32c_words"),
    "stage": ("stage_alloc", "stage_payload", "stage_finalize", "stage_delta"),
    "scatter": ("scatter_pages", "expand_runs"),
    "kv_scan": ("kv_scan", "adapter_scan"),
    "table": ("table_fingerprint", "table_shadow", "table_mark", "table_plan", "table_stage", "table_finalize"),
    "copy": ("copy_spans",),
}

# -D constants each module needs
REQUIRED = {
    "shadow_diff": ("PAGE_BYTES",),
    "fingerprint": ("PAGE_BYTES",),
    "crc32c": (),
    "stage": ("PAGE_BYTES",),
    "scatter": ("PAGE_BYTES",),
    "kv_scan": (),
    "table": (),
    "copy": (),
}
# modules whose source lives outside SOURCE_DIR (`register`): the benchmarks' own kernels
_SOURCE_DIRS: dict[str, pathlib.Path] = {}
KV_DEFINES = ("PAGE_BYTES", "KV_BLOCK_SIZE", "KV_HEADS", "KV_HEAD_DIM", "KV_DTYPE_BYTES")

# kernels compiled only when a -D constant is given (#ifdef'd in the source)
KERNEL_NEEDS = {
    "crc32c_pages": "PAGE_BYTES",
    "kv_scan": "KV_BLOCK_SIZE",
    "table_fingerprint": "PAGE_BYTES",  # the table's detectors, one module per page size
    "table_shadow": "PAGE_BYTES",
}

# Concordia's own modules carry this define, and concordia.instrument leaves
# them as they are: its hooks would slow every checkpoint, and a closed pause
# gate would hold the checkpoint it paused the caller's work for.
OWN_KERNEL_OPTION = "-DCONCORDIA_OWN_KERNEL=1"
NVRTC_OPTIONS = ("-std=c++17", OWN_KERNEL_OPTION)


def kernels_in(name: str, defines: dict) -> tuple[str, ...]:
    """The kernels a module defines under `defines` (some are #ifdef'd out)."""
    return tuple(k for k in KERNELS[name] if KERNEL_NEEDS.get(k) is None or KERNEL_NEEDS[k] in defines)


def page_specs(page_bytes: int) -> list[tuple[str, dict]]:
    """Every module a region of `page_bytes` pages uses (detect, stage, scatter)."""
    d = {"PAGE_BYTES": int(page_bytes)}
    return [("shadow_diff", d), ("fingerprint", d), ("crc32c", d), ("stage", d), ("scatter", d), ("table", d)]


def kv_spec(*, page_bytes: int, block_size: int, kv_heads: int, head_dim: int, dtype_bytes: int):
    return ("kv_scan", {"PAGE_BYTES": int(page_bytes), "KV_BLOCK_SIZE": int(block_size),
                        "KV_HEADS": int(kv_heads), "KV_HEAD_DIM": int(head_dim),
                        "KV_DTYPE_BYTES": int(dtype_bytes)})


# The specialisations the product and its benchmark use; CI compiles each.
CI_SPECS = (
    page_specs(64) + page_specs(4096) + page_specs(65536)
    + [kv_spec(page_bytes=4096, block_size=16, kv_heads=8, head_dim=128, dtype_bytes=2),
       kv_spec(page_bytes=32768, block_size=16, kv_heads=4, head_dim=64, dtype_bytes=4),
       ("crc32c", {}), ("kv_scan", {}), ("table", {}), ("copy", {})]
)


def register(name: str, directory, kernels: tuple[str, ...], required: tuple[str, ...] = ()) -> None:
    """Make `directory/<name>.cu` a module of this loader (the benchmarks keep
    their own kernels beside them); it may include `common.cuh`."""
    KERNELS[name] = tuple(kernels)
    REQUIRED[name] = tuple(required)
    _SOURCE_DIRS[name] = pathlib.Path(directory).resolve()


def source_path(name: str) -> pathlib.Path:
    return _SOURCE_DIRS.get(name, SOURCE_DIR) / f"{name}.cu"


def _check(name: str, defines: dict) -> tuple[tuple[str, int], ...]:
    if name not in KERNELS:
        raise KernelInputError(f"no kernel module {name!r} (have {', '.join(KERNELS)})",
                               where="gpu_kernels.jit")
    for key in REQUIRED[name]:
        if key not in defines:
            raise KernelInputError(f"module {name} needs -D{key}", where="gpu_kernels.jit")
    pb = defines.get("PAGE_BYTES")
    if pb is not None and (int(pb) <= 0 or int(pb) % 64):
        raise KernelInputError(f"PAGE_BYTES {pb} is not a positive multiple of 64",
                               where="gpu_kernels.jit")
    return tuple(sorted((str(k), int(v)) for k, v in defines.items()))


def source(name: str) -> str:
    """The module's source with common.cuh inlined (NVRTC sees one text, and
    CuPy's disk cache keys on the whole of it)."""
    common = (SOURCE_DIR / COMMON).read_text().replace("#pragma once", "", 1)
    text = source_path(name).read_text()
    return text.replace(f'#include "{COMMON}"', common, 1)


def define_options(defines) -> tuple[str, ...]:
    return tuple(f"-D{k}={v}" for k, v in defines)


_lock = threading.Lock()
_modules: dict[tuple, object] = {}


def require_cupy():
    try:
        import cupy
    except Exception as exc:  # ImportError or a broken CUDA install
        raise GpuUnavailableError(f"CuPy is not importable ({type(exc).__name__}: {exc})",
                                  where="concordia.gpu_kernels",
                                  hint="GPU kernels need CuPy and a CUDA device") from None
    return cupy


def load(code: str, options, kernels, *, where: str):
    """The one place CUDA source becomes loaded kernels, for the product's
    modules, the executor's and the benchmarks': a `cupy.RawModule` of `code`
    compiled by NVRTC (CuPy's disk cache keys on the text and options) with
    each of `kernels` loaded on the current device now.  A compile error is one
    KernelCompileError line naming `where` (the whole NVRTC log in its `log`)."""
    cupy = require_cupy()
    mod = cupy.RawModule(code=code, options=tuple(options))
    try:
        for k in kernels:
            mod.get_function(k)  # compiles and loads on this device now
    except cupy.cuda.compiler.CompileException as exc:
        text = str(exc).strip()
        err = KernelCompileError(f"NVRTC: {text.splitlines()[0] if text else 'failed'}", where=where)
        err.log = text
        raise err from None
    return mod


def module(name: str, defines: dict | None = None, device: int | None = None):
    """The compiled, loaded `cupy.RawModule` of `name` specialised by `defines`
    on `device` (default: the current device), made once per device."""
    cupy = require_cupy()
    key_defs = _check(name, defines or {})
    dev = cupy.cuda.Device(device) if device is not None else cupy.cuda.Device()
    key = (dev.id, name, key_defs)
    mod = _modules.get(key)
    if mod is not None:
        return mod
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            with dev:
                mod = load(source(name), NVRTC_OPTIONS + define_options(key_defs), kernels_in(name, dict(key_defs)),
                           where=f"{name}.cu {key_defs}")
            _modules[key] = mod
    return mod


def function(name: str, kernel: str, defines: dict | None = None, device: int | None = None):
    """One kernel (`cupy.RawKernel`) of a specialised module."""
    return module(name, defines, device).get_function(kernel)


def precompile(specs, device: int | None = None) -> int:
    """Compile and load every (name, defines) in `specs` now; returns how many
    modules are loaded.  Call before launching any persistent kernel."""
    for name, defines in specs:
        module(name, defines, device)
    return len(_modules)


def loaded() -> list[tuple]:
    return sorted(_modules)


def is_loaded(name: str, defines: dict | None = None, device: int | None = None) -> bool:
    """Whether `module(name, defines, device)` is made already (a call would
    compile and load nothing)."""
    cupy = require_cupy()
    dev = device if device is not None else cupy.cuda.Device().id
    return (int(dev), name, _check(name, defines or {})) in _modules


def nvcc_ptx(name: str, defines: dict | None = None, *, arch: str = "sm_90", nvcc: str | None = None) -> str:
    """PTX of `name` specialised by `defines`, compiled by `nvcc --ptx` (CI's
    check that every source compiles for Hopper)."""
    key_defs = _check(name, defines or {})
    nvcc = nvcc or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not os.path.exists(nvcc) and not shutil.which(nvcc):
        raise KernelCompileError("nvcc not found", where=name, hint="install the CUDA toolkit")
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / f"{name}.ptx"
        cmd = [nvcc, "--ptx", f"-arch={arch}", "-std=c++17", f"-I{SOURCE_DIR}",
               *define_options(key_defs), str(source_path(name)), "-o", str(out)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            msg = " ".join((res.stderr or res.stdout).split())[:400]
            raise KernelCompileError(f"nvcc: {msg}", where=f"{name}.cu {key_defs}")
        return out.read_text()
