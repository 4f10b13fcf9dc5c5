"""Fixtures for the instrumentation tests: the CUDA tools and the PTX corpus."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

CORPUS = pathlib.Path(__file__).parent / "corpus"
REPO = pathlib.Path(__file__).resolve().parents[2]


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not on PATH (the CUDA toolkit is needed for this test)")
    return path


def nvcc_ptx(src: pathlib.Path, out_dir: pathlib.Path, *flags: str) -> pathlib.Path:
    out = out_dir / (src.stem + ".ptx")
    subprocess.run([tool("nvcc"), "--ptx", "-arch=sm_90", *flags, str(src), "-o", str(out)],
                   check=True, capture_output=True, text=True)
    return out


def ptxas(ptx_text: str, tmp: pathlib.Path, arch: str = "sm_90", *extra: str) -> subprocess.CompletedProcess:
    f = tmp / "in.ptx"
    f.write_text(ptx_text)
    return subprocess.run([tool("ptxas"), f"-arch={arch}", *extra, str(f), "-o", str(tmp / "out.cubin")],
                          capture_output=True, text=True)
