"""The CuPy interposition's control flow, run against a compiler module with
CuPy's call shape (CuPy is not installed in CI; the GPU tests run the real one)."""

from __future__ import annotations

import types

import pytest

from concordia import instrument
from concordia.instrument.rewriter import EPOCHS

PTX = (".version 8.0\n.target sm_90\n.address_size 64\n"
       ".visible .entry k(.param .u64 p)\n{\n\t.reg .b64 %rd<2>;\n"
       "\tld.param.u64 %rd1, [p];\n\tst.global.u32 [%rd1], 1;\n\tret;\n}\n")


class Module:
    def __init__(self):
        self.loaded = None

    def load(self, data):
        self.loaded = data


def fake_compiler():
    """The three functions of cupy.cuda.compiler the hook replaces, with the
    signatures CuPy 13/14 give them; `calls` records what reached them."""
    c = types.SimpleNamespace(calls=[])

    def _get_arch():
        return "90"

    def _get_arch_for_options_for_nvrtc(arch=None):
        return f"-arch=sm_{arch or '90'}", "cubin"

    def compile_using_nvrtc(source, options=(), arch=None, filename="kern.cu",
                            name_expressions=None, log_stream=None, cache_in_memory=False,
                            jitify=False):
        opt, method = c._get_arch_for_options_for_nvrtc(arch)
        c.calls.append(("nvrtc", opt, method, cache_in_memory))
        if method == "cubin":
            return b"\x7fELF....", None
        return source.encode(), {"k": "k"}

    def _compile_with_cache_cuda(source, options, arch, cache_dir, extra_source=None,
                                 backend="nvrtc", enable_cooperative_groups=False,
                                 name_expressions=None, log_stream=None, cache_in_memory=False,
                                 jitify=False):
        c.calls.append(("cache", backend, cache_in_memory))
        mod = Module()
        if backend == "nvrtc":
            mod.load(c.compile_using_nvrtc(source, options, arch, "x.cu", name_expressions,
                                           log_stream, cache_in_memory, jitify)[0])
        else:
            mod.load(b"\x7fELF-from-nvcc")
        return mod

    c._get_arch = _get_arch
    c._get_arch_for_options_for_nvrtc = _get_arch_for_options_for_nvrtc
    c.compile_using_nvrtc = compile_using_nvrtc
    c._compile_with_cache_cuda = _compile_with_cache_cuda
    return c


@pytest.fixture
def hooked(monkeypatch):
    import concordia.instrument.cupy_hook as ch

    attached = []
    monkeypatch.setattr(ch.runtime, "attach", lambda mod, res, gate, regions: attached.append(mod))
    c = fake_compiler()
    originals = {n: getattr(c, n) for n in ("compile_using_nvrtc", "_compile_with_cache_cuda",
                                             "_get_arch_for_options_for_nvrtc")}
    rep = instrument.enable(track_stores=True, compiler=c)
    yield c, rep, attached, originals
    instrument.disable()


def test_loaded_module_is_instrumented_ptx_compiled_in_memory(hooked):
    c, rep, attached, _ = hooked
    mod = c._compile_with_cache_cuda(PTX, (), None, "/nonexistent")
    assert EPOCHS.encode() in mod.loaded
    assert ("cache", "nvrtc", True) in c.calls          # never through the disk cache
    assert ("nvrtc", "-arch=compute_90", "ptx", True) in c.calls  # PTX, not a cubin
    assert rep.kernels == ["k"] and rep.stores_tracked == 1 and rep.hook_sites == 1
    assert rep.modules[0].handle is mod and attached == [mod]
    assert rep.find("k") is rep.modules[0]


def test_nvcc_backend_is_reported_as_skipped(hooked):
    c, rep, attached, _ = hooked
    mod = c._compile_with_cache_cuda(PTX, (), None, "/x", None, "nvcc")
    assert mod.loaded.startswith(b"\x7fELF")
    assert rep.skipped and "nvcc" in rep.skipped[0].reason
    assert rep.modules == [] and attached == []


def test_concordias_own_modules_are_left_as_they_are(hooked):
    # the define every Concordia module carries: its checkpoint kernels get no
    # hooks (a closed gate must not hold the checkpoint it paused work for)
    from concordia.gpu_kernels.jit import NVRTC_OPTIONS, OWN_KERNEL_OPTION

    c, rep, attached, _ = hooked
    assert OWN_KERNEL_OPTION in NVRTC_OPTIONS
    mod = c._compile_with_cache_cuda(PTX, NVRTC_OPTIONS, None, "/x")
    assert mod.loaded == PTX.encode() and EPOCHS.encode() not in mod.loaded
    assert rep.modules == [] and attached == []
    assert "Concordia's own module" in rep.skipped[0].reason
    # the next module of the caller's is instrumented as before
    assert EPOCHS.encode() in c._compile_with_cache_cuda(PTX, (), None, "/x").loaded


def test_unparseable_output_is_loaded_unchanged_and_reported(hooked):
    c, rep, _, _ = hooked
    mod = c._compile_with_cache_cuda("not ptx at all", (), None, "/x")
    assert mod.loaded == b"not ptx at all"
    assert "not a PTX module" in rep.skipped[0].reason


def test_disable_restores_cupy_and_enable_twice_is_refused(hooked):
    c, rep, _, originals = hooked
    with pytest.raises(instrument.InstrumentError, match="already enabled"):
        instrument.enable(compiler=c)
    instrument.disable()
    for name, fn in originals.items():
        assert getattr(c, name) is fn
    instrument.enable(compiler=c)  # the fixture's disable() pairs with this one


def cupy14_compiler():
    """CuPy 14.2's shape: `_compile_with_cache_cuda` (no cache_dir, a `to_ltoir`
    flag) calls `_compile_using_nvrtc_no_warning`, of which the public
    `compile_using_nvrtc` is a wrapper."""
    c = types.SimpleNamespace(calls=[])
    c._get_arch = lambda: "90"
    c._get_arch_for_options_for_nvrtc = lambda arch=None: (f"-arch=sm_{arch or '90'}", "cubin")

    def _compile_using_nvrtc_no_warning(source, options=(), arch=None, filename="kern.cu",
                                        name_expressions=None, log_stream=None,
                                        cache_in_memory=False, jitify=None, method=None):
        opt, m = (f"-arch=compute_{arch}", "lto") if method else c._get_arch_for_options_for_nvrtc(arch)
        c.calls.append(("nvrtc", opt, m, options))
        if m == "cubin":
            return b"\x7fELF....", None
        return (b"LTOIR" if m == "lto" else source.encode()), None

    def compile_using_nvrtc(*args, **kwargs):
        return c._compile_using_nvrtc_no_warning(*args, **kwargs)

    def _compile_with_cache_cuda(source, options, arch, extra_source=None, backend="nvrtc",
                                 enable_cooperative_groups=False, name_expressions=None,
                                 log_stream=None, cache_in_memory=False, jitify=False,
                                 to_ltoir=False):
        out, _ = c._compile_using_nvrtc_no_warning(source, options, arch, "", name_expressions,
                                                   log_stream, cache_in_memory, jitify,
                                                   "lto" if to_ltoir else None)
        if to_ltoir:
            return out
        mod = Module()
        mod.load(out)
        return mod

    c._compile_using_nvrtc_no_warning = _compile_using_nvrtc_no_warning
    c.compile_using_nvrtc = compile_using_nvrtc
    c._compile_with_cache_cuda = _compile_with_cache_cuda
    return c


def test_cupy14_inner_nvrtc_entry_is_hooked_once_with_its_own_cache_key(monkeypatch):
    import concordia.instrument.cupy_hook as ch

    monkeypatch.setattr(ch.runtime, "attach", lambda *a: None)
    c = cupy14_compiler()
    public = c.compile_using_nvrtc
    rep = instrument.enable(compiler=c)
    try:
        assert c.compile_using_nvrtc is public      # only the inner entry point is replaced
        mod = c._compile_with_cache_cuda(PTX, ("-DX",), None)
        assert mod.loaded.count(EPOCHS.encode()) >= 1 and rep.kernels == ["k"]
        (_, opt, method, options), = c.calls
        assert (opt, method) == ("-arch=compute_90", "ptx")
        salt = [o for o in options if o.startswith("-DCONCORDIA_INSTRUMENT=")]
        assert len(salt) == 1 and "-DX" in options
        # a direct call of the public wrapper is rewritten exactly once
        out, _ = c.compile_using_nvrtc(PTX)
        assert rep.modules[-1].handle is None and len(rep.modules) == 2
        from concordia.instrument.rewriter import rewrite
        with pytest.raises(instrument.InstrumentError):
            rewrite(out, rep.modules[-1].result.options)   # already instrumented: refused
        assert c._compile_with_cache_cuda(PTX, (), None, to_ltoir=True) == b"LTOIR"
        assert "LTO IR" in rep.skipped[-1].reason and len(rep.modules) == 2
    finally:
        instrument.disable()
    assert c._compile_using_nvrtc_no_warning.__name__ == "_compile_using_nvrtc_no_warning"
    instrument.enable(compiler=c)
    try:
        c._compile_with_cache_cuda(PTX, (), None)
        later = [o for o in c.calls[-1][3] if o.startswith("-DCONCORDIA_INSTRUMENT=")]
        assert later and later != salt                # a new enable() gets a new cache key
    finally:
        instrument.disable()


def test_the_package_exports_the_rewrite_function_beside_the_rewriter_module():
    from concordia.instrument import rewrite as R
    from concordia.instrument import runtime

    assert callable(R)                            # the package's re-exported function
    table = runtime.region_table([], 4)           # reads the layout constants
    from concordia.instrument.rewriter import REGION_WORDS
    assert table.size == 4 * REGION_WORDS and not table.any()


def test_disable_detaches_loaded_modules_from_gate_and_regions(monkeypatch):
    import concordia.instrument.cupy_hook as ch

    calls = []
    monkeypatch.setattr(ch.runtime, "attach", lambda mod, res, gate, regions: calls.append(
        (mod, gate, list(regions))))
    c = fake_compiler()
    gate, region = object(), object()
    instrument.enable(track_stores=True, compiler=c, gate=gate)
    try:
        mod = c._compile_with_cache_cuda(PTX, (), None, "/x")
        instrument.set_regions([region])
        assert calls[-1] == (mod, gate, [region])
    finally:
        instrument.disable()
    assert calls[-1] == (mod, None, [])       # no stale gate or bitmap after disable()



def test_too_many_regions_are_refused_before_anything_changes(hooked):
    c, rep, attached, _ = hooked
    c._compile_with_cache_cuda(PTX, (), None, "/x")
    before = list(attached)
    with pytest.raises(instrument.InstrumentError, match="9 tracked regions, at most 8") as info:
        instrument.set_regions([object()] * 9)
    assert "\n" not in info.value.one_line() and "set_regions" in info.value.one_line()
    assert instrument._hook.regions == [] and attached == before
    assert EPOCHS.encode() in c._compile_with_cache_cuda(PTX, (), None, "/x").loaded   # the hook still works
