"""The LD_PRELOAD shim builds with the system compiler, and its image
classification agrees with nvcc-produced fatbins and cubins (no GPU needed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from concordia.instrument import shim
from concordia.instrument.errors import InstrumentError
from tests.instrument.conftest import CORPUS, tool


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(cache))
    path = shim.build()
    yield path
    mp.undo()


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    nvcc = tool("nvcc")
    d = tmp_path_factory.mktemp("img")
    src = CORPUS / "raw_kernels.cu"
    out = {}
    for name, args in {
        "sass_only": ["-fatbin", "-gencode", "arch=compute_90,code=sm_90"],
        "sass_compressed": ["-fatbin", "-gencode", "arch=compute_90,code=sm_90", "-Xfatbin", "-compress-all"],
        "both": ["-fatbin", "-gencode", "arch=compute_90,code=[sm_90,compute_90]"],
        "ptx_plain": ["-fatbin", "-gencode", "arch=compute_90,code=compute_90",
                      "-Xfatbin", "-compress-mode=none"],
        "cubin": ["-cubin", "-arch=sm_90"],
        "ptx": ["--ptx", "-arch=sm_90"],
    }.items():
        f = d / name
        subprocess.run([nvcc, *args, str(src), "-o", str(f)], check=True, capture_output=True)
        out[name] = f.read_bytes()
    return out


def test_shim_builds_into_the_user_cache(built):
    assert built.exists() and built.parent.name == "concordia"
    assert shim.build() == built  # cached by source hash, not rebuilt


def test_shim_exports_the_driver_entry_points(built):
    nm = subprocess.run(["nm", "-D", "--defined-only", str(built)], capture_output=True, text=True)
    if nm.returncode != 0:
        pytest.skip("nm not available")
    for sym in ("cuModuleLoadData", "cuModuleLoadDataEx", "cuLibraryLoadData", "cuGetProcAddress",
                "cuGetProcAddress_v2", "__cudaRegisterFatBinary", "concordia_shim_classify"):
        assert sym in nm.stdout


KERNELS = {"scatter_vec", "histogram", "bytes_and_halves", "nothing_written"}


def test_sass_only_fatbin_is_detected_with_kernel_names(built, images):
    verdict = shim.classify(images["sass_only"])
    assert verdict.startswith("fatbin:ptx=0,compressed=0,elf=1:")
    assert KERNELS <= set(verdict.split(":", 2)[2].split(","))


def test_fatbin_with_ptx_is_seen_and_matches_the_python_reader(built, images):
    verdict = shim.classify(images["both"])
    assert verdict.startswith("fatbin:ptx=1,") and ",elf=1:" in verdict
    members = shim.fatbin_members(images["both"])
    assert sorted(m.kind for m in members) == [shim.KIND_PTX, shim.KIND_ELF]
    plain = [m for m in shim.fatbin_members(images["ptx_plain"]) if m.kind == shim.KIND_PTX][0]
    assert not plain.compressed
    assert b".entry scatter_vec" in plain.payload
    assert shim.classify(images["ptx_plain"]).startswith("fatbin:ptx=1,compressed=0,elf=0")


def test_cubin_and_ptx_and_garbage(built, images):
    elf = shim.classify(images["cubin"])
    assert elf.startswith("elf:") and KERNELS <= set(elf[4:].split(","))
    assert shim.classify(images["ptx"]) == "ptx"
    assert shim.classify(b"hello world, not an image") == "unknown"
    with pytest.raises(InstrumentError, match="not a fatbin"):
        shim.fatbin_members(b"\0" * 32)


def test_preload_env_names_the_shim_and_the_interpreter(built, tmp_path):
    env = shim.preload_env(tmp_path / "r.jsonl", track_stores=True, base={})
    assert env["LD_PRELOAD"] == str(built)
    assert env["CONCORDIA_SHIM_ARGS"] == "--track-stores"
    assert shim.read_report(tmp_path / "r.jsonl") == []


def test_preloaded_into_a_process_without_cuda_is_harmless(built):
    # The shim resolves libcuda lazily, so a process that never touches CUDA runs normally.
    p = subprocess.run(["/bin/sh", "-c", "echo ok"], env={"LD_PRELOAD": str(built), "PATH": "/usr/bin:/bin"},
                       capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.strip() == "ok" and "error" not in p.stderr


REGISTER = """
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
data = open(sys.argv[2], "rb").read()
buf = ctypes.create_string_buffer(data, len(data))

class Wrapper(ctypes.Structure):   # __fatBinC_Wrapper_t, as nvcc emits it
    _fields_ = [("magic", ctypes.c_int), ("version", ctypes.c_int),
                ("data", ctypes.c_void_p), ("filename", ctypes.c_void_p)]

w = Wrapper(0x466243B1, 1, ctypes.addressof(buf), None)
lib.__cudaRegisterFatBinary.restype = ctypes.c_void_p
print(lib.__cudaRegisterFatBinary(ctypes.byref(w)))
"""


@pytest.mark.parametrize("image", ["sass_only", "sass_compressed"])
def test_runtime_registrations_are_reported_by_kernel_name(built, images, image, tmp_path):
    # What libtorch's static constructors do for each embedded fatbin.  With no
    # CUDA runtime in this process there is nothing to pass the call on to.
    fat = tmp_path / "image.fatbin"
    fat.write_bytes(images[image])
    report = tmp_path / "r.jsonl"
    script = tmp_path / "register.py"
    script.write_text(REGISTER)
    p = subprocess.run([sys.executable, str(script), str(built), str(fat)], capture_output=True, text=True,
                       env={"CONCORDIA_SHIM_REPORT": str(report), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "None"
    rows = shim.read_report(report)
    assert len(rows) == 1 and rows[0]["via"] == "__cudaRegisterFatBinary"
    assert rows[0]["action"] == "registered" and rows[0]["detail"].startswith("fatbin:ptx=0,")
    assert KERNELS <= set(rows[0]["kernels"].split(","))
