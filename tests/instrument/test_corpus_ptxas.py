"""The rewritten PTX of every kernel in the corpus assembles with ptxas for sm_90:
the project's own CUDA sources, CuPy-shaped elementwise and reduction kernels,
RawKernel-style sources, a Triton-shaped module and hand-written edge cases."""

from __future__ import annotations

import pathlib
import subprocess

import pytest

from concordia.instrument.rewriter import Options, rewrite
from tests.instrument.conftest import CORPUS, REPO, nvcc_ptx, ptxas, tool

CU = sorted(CORPUS.glob("*.cu"))
PTX = sorted(CORPUS.glob("*.ptx"))
OWN = sorted((REPO / "gpu_kernels").glob("*.cu"))
MODES = {
    "hooks": Options(),
    "hooks+stores": Options(track_stores=True),
    "no-gate": Options(pause_gate=False),
    "stores-only": Options(exit_hooks=False, pause_gate=False, track_stores=True),
}


def _arch(text: str) -> str:
    return "sm_90a" if ".target sm_90a" in text else "sm_90"


def _check(text: str, tmp_path: pathlib.Path, *extra: str) -> None:
    base = ptxas(text, tmp_path, _arch(text), *extra)
    assert base.returncode == 0, f"corpus module itself does not assemble: {base.stderr}"
    for mode, opts in MODES.items():
        res = rewrite(text, opts)
        assert res.kernels, "no kernels found"
        if opts.exit_hooks:
            assert all(k.exit_sites >= 1 for k in res.kernels)
        p = ptxas(res.ptx, tmp_path, _arch(text), *extra)
        assert p.returncode == 0, f"{mode}: ptxas rejected the rewritten module:\n{p.stderr}"


@pytest.mark.parametrize("src", CU, ids=[p.name for p in CU])
@pytest.mark.parametrize("flags", [(), ("-lineinfo",)], ids=["O3", "lineinfo"])
def test_cuda_corpus(src, flags, tmp_path):
    text = nvcc_ptx(src, tmp_path, *flags).read_text()
    _check(text, tmp_path)


@pytest.mark.parametrize("src", PTX, ids=[p.name for p in PTX])
def test_ptx_corpus(src, tmp_path):
    _check(src.read_text(), tmp_path)


def test_stores_counted_in_corpus(tmp_path):
    text = nvcc_ptx(CORPUS / "raw_kernels.cu", tmp_path).read_text()
    res = rewrite(text, Options(track_stores=True))
    by = {k.name: k for k in res.kernels}
    assert by["scatter_vec"].stores_tracked >= 1
    assert by["bytes_and_halves"].stores_tracked == 3
    assert by["nothing_written"].stores_tracked == 0
    assert by["histogram"].stores_tracked == 1
    assert sum(f.stores_tracked for f in res.functions) >= 1  # put()


def _project_defines(name: str) -> list[str]:
    """-D options of the first specialisation the kernel loader compiles in CI for
    module `name` (none when the loader lists none)."""
    try:
        from concordia.gpu_kernels import jit
        for spec_name, defines in getattr(jit, "CI_SPECS", ()):
            if spec_name == name:
                return [f"-D{k}={v}" for k, v in sorted(defines.items())]
    except Exception:
        pass
    return []


@pytest.mark.parametrize("src", OWN, ids=[p.name for p in OWN])
def test_project_kernels(src, tmp_path):
    nvcc = tool("nvcc")
    out = tmp_path / (src.stem + ".ptx")
    p = subprocess.run([nvcc, "--ptx", "-arch=sm_90", "-std=c++17", f"-I{src.parent}",
                        *_project_defines(src.stem), str(src), "-o", str(out)],
                       capture_output=True, text=True)
    extra: tuple[str, ...] = ()
    if p.returncode != 0 and "separate compilation" in p.stderr:  # device-side launches
        extra = ("-c",)  # relocatable: the device runtime is linked later
        p = subprocess.run([nvcc, "--ptx", "-arch=sm_90", "-std=c++17", "-rdc=true",
                            f"-I{src.parent}", *_project_defines(src.stem), str(src), "-o", str(out)],
                           capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"{src.name} needs -D specialisation constants to compile on its own "
                    f"(its own tests compile every specialisation): {p.stderr.strip()[:120]}")
    text = out.read_text()
    if ".entry" not in text:
        pytest.skip(f"{src.name} defines no kernel entry on its own")
    _check(text, tmp_path, *extra)
