"""Build and use the LD_PRELOAD shim (`shim.c`), and read fatbins in Python.

The shim is compiled with the system C compiler on first use into
`$XDG_CACHE_HOME/concordia` (default `~/.cache/concordia`), named by the hash of
its source, so an edited source is rebuilt and concurrent builders never see a
half-written library (write to a temporary name, then rename).

Fatbin layout (as nvcc 13 writes it; little-endian): a 16-byte header
`u32 magic 0xBA55ED50, u16 version, u16 header_size, u64 members_size`, then
members, each `u16 kind (1 PTX, 2 ELF), u16 version, u32 header_size,
u64 payload_size, ..., u32 arch @28, u32 flags @40 (0x2000 LZ4, 0x8000 zstd),
u64 inflated_size @56`, followed by the payload.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import pathlib
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from concordia.instrument.errors import InstrumentError

SOURCE = pathlib.Path(__file__).with_name("shim.c")
FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_ELF = 1, 2
FLAG_LZ4, FLAG_ZSTD = 0x2000, 0x8000


def cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "concordia"


def build(cc: str | None = None, force: bool = False) -> pathlib.Path:
    """Path of the compiled shim, building it if needed."""
    src = SOURCE.read_bytes()
    tag = hashlib.sha256(src).hexdigest()[:16]
    out = cache_dir() / f"libconcordia_shim-{tag}.so"
    if out.exists() and not force:
        return out
    cc = cc or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise InstrumentError("no C compiler found to build the shim", where=str(SOURCE),
                              hint="install gcc or set CC")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so")
    os.close(fd)
    cmd = [cc, "-shared", "-fPIC", "-O2", "-Wall", "-o", tmp, str(SOURCE), "-ldl", "-lpthread"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        os.unlink(tmp)
        msg = " ".join((res.stderr or res.stdout).split())[:300]
        raise InstrumentError(f"building the shim failed: {msg}", where=str(SOURCE))
    from concordia.devmem.dirsync import publish

    publish(tmp, out)  # synced and renamed whole: never a torn shim under the cached name
    return out


def preload_env(report: str | os.PathLike, *, track_stores: bool = False, fatbin: bool = True,
                python: str | None = None, base: dict | None = None) -> dict:
    """Environment for a child process that runs under the shim."""
    env = dict(os.environ if base is None else base)
    lib = str(build())
    env["LD_PRELOAD"] = (lib + " " + env["LD_PRELOAD"]) if env.get("LD_PRELOAD") else lib
    env["CONCORDIA_SHIM_REPORT"] = str(report)
    env["CONCORDIA_SHIM_PYTHON"] = python or sys.executable
    env["CONCORDIA_SHIM_ARGS"] = "--track-stores" if track_stores else ""
    env["CONCORDIA_SHIM_FATBIN"] = "1" if fatbin else "0"
    root = str(pathlib.Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), root) if p)
    return env


def read_report(path: str | os.PathLike) -> list[dict]:
    """The shim's and the rewriter's JSON lines, in order."""
    p = pathlib.Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def classify(image: bytes) -> str:
    """The shim's own verdict on an image (see `concordia_shim_classify`)."""
    lib = ctypes.CDLL(str(build()))
    fn = lib.concordia_shim_classify
    fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    fn.restype = ctypes.c_int
    out = ctypes.create_string_buffer(4096)
    fn(bytes(image) + b"\0" * 8, out, len(out))
    return out.value.decode()


@dataclass
class Member:
    kind: int
    arch: int
    flags: int
    payload: bytes
    inflated_size: int

    @property
    def compressed(self) -> bool:
        return bool(self.flags & (FLAG_LZ4 | FLAG_ZSTD))


def fatbin_members(data: bytes) -> list[Member]:
    if len(data) < 16:
        raise InstrumentError(f"{len(data)} bytes is too short for a fatbin")
    magic, _ver, hsize, fsize = struct.unpack_from("<IHHQ", data, 0)
    if magic != FATBIN_MAGIC:
        raise InstrumentError(f"not a fatbin (magic 0x{magic:08x}, expected 0x{FATBIN_MAGIC:08x})")
    out, off, end = [], hsize, min(len(data), hsize + fsize)
    while off + 64 <= end:
        kind, _v, ehs, psz = struct.unpack_from("<HHIQ", data, off)
        if ehs < 64 or psz == 0:
            break
        arch, = struct.unpack_from("<I", data, off + 28)
        flags, = struct.unpack_from("<I", data, off + 40)
        raw, = struct.unpack_from("<Q", data, off + 56)
        out.append(Member(kind, arch, flags, data[off + ehs: off + ehs + psz], raw))
        off += ehs + psz
    return out
