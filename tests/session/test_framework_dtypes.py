"""Every fixed-size dtype of PyTorch and numpy (ml_dtypes included) round-trips
through a checkpoint: `recover()` in a fresh process hands back the same
framework type and dtype, `recover(into=...)` fills tensors of the real dtype,
and `concordia-wal restore` writes the same bytes, all byte-identical.  Bad
targets and unrepresentable dtypes are one-line errors naming the region,
with nothing written."""

from __future__ import annotations

import json
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner

from concordia import Session
from concordia.errors import RecoverMismatchError, ShapeChangedError, UnsupportedArrayError
from concordia.regions.arrays import numpy_dtype
from concordia.tools.wal_cli import main as wal_main

torch = pytest.importorskip("torch", reason="PyTorch is not installed here")

SIZE, SEGMENT = 32 << 20, 4 << 20
SHAPE = (3, 5, 7)  # odd sizes: last pages are short


def _torch_dtypes():
    """(name, dtype) of every torch dtype, each once, as torch names them."""
    seen = {}
    for name in dir(torch):
        d = getattr(torch, name)
        if isinstance(d, torch.dtype):
            seen.setdefault(str(d).split(".", 1)[1], d)
    return sorted(seen.items())


def _supported(name, itemsize):
    try:
        numpy_dtype(name, "test", itemsize)
        return True
    except UnsupportedArrayError:
        return False


TORCH = [(n, d) for n, d in _torch_dtypes() if _supported(n, d.itemsize)]
TORCH_REFUSED = [(n, d) for n, d in _torch_dtypes() if not _supported(n, d.itemsize)]
NUMPY = sorted({np.dtype(c).name for c in np.typecodes["AllInteger"] + np.typecodes["AllFloat"] + "?"}
               | {n for n in dir(ml_dtypes) if isinstance(getattr(ml_dtypes, n), type)
                  and _supported(n, np.dtype(getattr(ml_dtypes, n)).itemsize)})


def test_the_dtypes_that_matter_are_supported():
    names = {n for n, _ in TORCH}
    assert {"bfloat16", "float8_e4m3fn", "float8_e5m2", "bool", "complex64", "complex128", "float16", "float32",
            "float64", "int8", "int16", "int32", "int64", "uint8"} <= names
    assert {"bfloat16", "float8_e4m3fn", "float8_e5m2", "bool", "complex64", "float64",
            "int4"} <= set(NUMPY)


def _bytes_of(dtype_size, n, seed, is_bool=False):
    rng = np.random.default_rng(seed)
    if is_bool:
        return rng.integers(0, 2, n * dtype_size, dtype=np.uint8)
    return rng.integers(0, 256, n * dtype_size, dtype=np.uint8)


def _torch_tensor(name, d, seed):
    n = int(np.prod(SHAPE))
    raw = _bytes_of(d.itemsize, n, seed, is_bool=(name == "bool"))
    return torch.from_numpy(raw).view(d).reshape(SHAPE)  # views only: torch's sub-byte dtypes have no kernels


def _numpy_array(name, seed):
    dt = numpy_dtype(name, "test")
    n = int(np.prod(SHAPE))
    raw = _bytes_of(dt.itemsize, n, seed, is_bool=(name == "bool"))
    return raw.view(dt).reshape(SHAPE).copy()


def _raw(x) -> bytes:
    if isinstance(x, torch.Tensor):
        return x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8).tobytes()


FRESH = r"""
import json, sys
import numpy as np
import torch
from concordia import Session
out = {}
with Session(sys.argv[1], create=False) as s:
    for name, a in s.recover().items():
        raw = a.reshape(-1).view(torch.uint8).numpy() if isinstance(a, torch.Tensor) else a.reshape(-1).view(np.uint8)
        out[name] = [type(a).__module__.split(".")[0] + "." + type(a).__name__, str(a.dtype), list(a.shape),
                     bytes(raw).hex()]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A log holding one region per supported torch dtype ("t:<name>") and
    numpy dtype ("n:<name>"), two epochs, the second changing every region."""
    log = f"file:{tmp_path_factory.mktemp('dtypes') / 'dtypes.log'}"
    state = {}
    with Session(log, size=SIZE, segment_size=SEGMENT) as s:
        for i, (name, d) in enumerate(TORCH):
            state[f"t:{name}"] = _torch_tensor(name, d, i)
        for i, name in enumerate(NUMPY):
            state[f"n:{name}"] = _numpy_array(name, 1000 + i)
        state["n:bigendian"] = np.arange(105, dtype=">f4").reshape(SHAPE)
        for key, a in state.items():
            s.register(key, a, page_bytes=64)
        s.checkpoint()
        for key, a in state.items():  # change the first element in place, keep the framework
            if isinstance(a, torch.Tensor):
                a.reshape(-1).view(torch.uint8)[0] ^= 1
            else:
                a.reshape(-1).view(np.uint8)[0] ^= 1
        s.checkpoint()
    return log, state


def test_recover_in_a_fresh_process_returns_the_framework_and_dtype(written):
    log, state = written
    p = subprocess.run([sys.executable, "-c", FRESH, log], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    assert set(got) == set(state)
    for key, a in state.items():
        kind, dtype, shape, hexed = got[key]
        if isinstance(a, torch.Tensor):
            assert (kind, dtype) == ("torch.Tensor", str(a.dtype)), key
        else:
            assert (kind, dtype) == ("numpy.ndarray", str(a.dtype)), key
        assert tuple(shape) == SHAPE, key
        assert bytes.fromhex(hexed) == _raw(a), key


def test_recover_into_tensors_of_the_real_dtype(written):
    log, state = written
    targets = {k: (torch.from_numpy(np.zeros(a.numel() * a.itemsize, np.uint8)).view(a.dtype).reshape(a.shape)
                   if isinstance(a, torch.Tensor) else np.zeros_like(a))
               for k, a in state.items()}
    with Session(log, create=False) as s:
        out = s.recover(into=targets)
    for key, a in state.items():
        assert out[key] is targets[key]
        assert targets[key].dtype == a.dtype
        assert _raw(targets[key]) == _raw(a), key


def test_restore_command_writes_the_bytes_and_says_how_to_read_them(written, tmp_path):
    log, state = written
    runner = CliRunner()
    for key in state:  # every region: each torch and numpy dtype
        out = tmp_path / f"{key.replace(':', '_')}.npy"
        r = runner.invoke(wal_main, ["restore", log, "--region", key, "--out", str(out)])
        assert r.exit_code == 0, r.output
        a = state[key]
        name = str(a.dtype).split(".", 1)[1] if isinstance(a, torch.Tensor) else np.dtype(a.dtype).name
        got = np.load(out)
        assert got.shape == SHAPE
        if got.dtype.name != name:
            assert f"holds the {name} data in its byte layout {got.dtype.str}" in r.output
            got = got.view(numpy_dtype(name, key))  # ml_dtypes' type of that name
        assert got.dtype.name == name
        assert got.tobytes() == _raw(a), key


def test_info_and_dump_show_the_logical_dtype(written):
    log, _ = written
    runner = CliRunner()
    r = runner.invoke(wal_main, ["info", log, "--json"])
    assert r.exit_code == 0, r.output
    regs = {x["name"]: x for x in json.loads(r.output)["regions"]}
    assert regs["t:bfloat16"]["logical_dtype"] == "bfloat16" and regs["t:bfloat16"]["dtype"] == "<u2"
    assert regs["t:bfloat16"]["framework"] == "torch"
    assert regs["n:float8_e4m3fn"]["dtype"] == "|u1" and regs["n:float8_e4m3fn"]["framework"] == "array"
    assert regs["n:float32"]["logical"] == "" and regs["n:float32"]["logical_dtype"] == "float32"
    r = runner.invoke(wal_main, ["info", log])
    assert "bfloat16[3, 5, 7] as <u2 (torch)" in r.output
    r = runner.invoke(wal_main, ["dump", log])
    assert r.exit_code == 0, r.output
    assert "define t:bfloat16 bfloat16[3,5,7] layout=<u2 framework=torch" in r.output
    r = runner.invoke(wal_main, ["verify", log])
    assert r.exit_code == 0, r.output  # a log with the LOGICAL_DTYPE feature verifies clean


def test_torch_dtypes_without_a_host_type_are_refused_naming_the_region(tmp_path):
    assert TORCH_REFUSED, "every torch dtype has a host type: nothing left to refuse"
    with Session(f"file:{tmp_path / 'r.log'}", size=SIZE, segment_size=SEGMENT) as s:
        for name, d in TORCH_REFUSED:
            try:
                t = torch.zeros(8, dtype=d)
            except Exception:  # some (quantized, bits) cannot even be made so
                continue
            for again in ("", ":again"):   # a refusal is not kept: each region is named in its own
                with pytest.raises(UnsupportedArrayError,
                                   match=rf"region 'x:{name}{again}': logical dtype '{name}' cannot"):
                    s.register(f"x:{name}{again}", t)
        assert s.log.regions == {}  # nothing written


# ----------------------------------------------------------------- bad input
@pytest.fixture
def bf16_log(tmp_path):
    log = f"file:{tmp_path / 'bf16.log'}"
    kv = torch.randn(4, 64, dtype=torch.float32).to(torch.bfloat16)
    with Session(log, size=SIZE, segment_size=SEGMENT) as s:
        s.register("kv", kv, kind="kv", page_bytes=128)
        s.checkpoint()
    return log, kv


_FRESH = """
import sys, torch
from concordia import Session
log, new = sys.argv[1], sys.argv[2] == "new"
kv = torch.zeros(4, 64, dtype=torch.bfloat16)
with Session(log, create=False) as s:
    s.register("kv", kv, kind="kv", page_bytes=128)
    if new:   # a region the log does not hold: its dtype is checked as when it was first written
        s.register("more", torch.zeros(4, 64, dtype=torch.float8_e4m3fn), page_bytes=128)
    else:
        s.recover(into={"kv": kv})
print(kv.view(torch.int16).sum().item(), "ml_dtypes" in sys.modules)
"""


def test_a_fresh_process_recovering_bfloat16_tensors_does_not_load_ml_dtypes(bf16_log):
    # its import took a fresh recovering process 1.8-2.7 s on a CI-like host, inside protect()
    log, kv = bf16_log
    want = str(kv.view(torch.int16).sum().item())
    got = subprocess.run([sys.executable, "-c", _FRESH, log, "recover"], capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == [want, "False"]
    got = subprocess.run([sys.executable, "-c", _FRESH, log, "new"], capture_output=True, text=True)
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["0", "True"]


@pytest.mark.parametrize("make,diag", [
    (lambda: torch.zeros(4, 64, dtype=torch.float16), "cannot recover bfloat16 data into a float16 tensor"),
    (lambda: torch.zeros(4, 64, dtype=torch.int16), "cannot recover bfloat16 data into a int16 tensor"),
    (lambda: torch.zeros(4, 32, dtype=torch.bfloat16), r"cannot recover shape \[4, 64\] into shape \[4, 32\]"),
    (lambda: torch.zeros(64, 4, dtype=torch.bfloat16).t(), "the target tensor is not C-contiguous"),
    (lambda: torch.zeros(4, 128, dtype=torch.bfloat16)[:, ::2], "the target tensor is not C-contiguous"),
    (lambda: np.zeros((4, 64), ml_dtypes.float8_e4m3fn), "cannot recover bfloat16 data into a float8_e4m3fn array"),
], ids=["float16", "int16", "shape", "transposed", "strided", "numpy-fp8"])
def test_bad_targets_are_refused_before_anything_is_written(bf16_log, make, diag):
    log, kv = bf16_log
    with Session(log, create=False) as s:
        bad = make()
        before = _raw(bad)
        with pytest.raises(RecoverMismatchError, match=rf"^region 'kv': {diag}") as e:
            s.recover(into={"kv": bad})
        assert "\n" not in str(e.value)
        assert _raw(bad) == before


def test_a_host_target_with_device_cupy_is_refused(bf16_log):
    log, _ = bf16_log
    with Session(log, create=False) as s:
        t = torch.zeros(4, 64, dtype=torch.bfloat16)
        with pytest.raises(RecoverMismatchError, match=r"region 'kv': the target tensor is on the host, "
                                                       r"device='cupy' was asked for"):
            s.recover(into={"kv": t}, device="cupy")
        assert not t.any()


def test_an_unrepresentable_logical_dtype_is_named(tmp_path):
    from concordia.wal import Log

    p = tmp_path / "odd.log"
    log = Log.create(f"file:{p}", size=SIZE, segment_size=SEGMENT)
    rid = log.define_region("odd", "|u1", (64,), 64, "opaque", logical="float7_e9m9")
    assert log.volume.superblock.incompat == 1  # the feature went in before the descriptor
    log.appender.append_page_batch(1, rid, np.array([0], np.uint32), np.arange(64, dtype=np.uint8).reshape(1, 64))
    log.appender.commit(1)
    log.close()
    with Session(f"file:{p}", create=False) as s:
        with pytest.raises(UnsupportedArrayError, match=r"^region 'odd': logical dtype 'float7_e9m9' cannot be "
                                                        r"represented by this build"):
            s.recover()
        out = np.zeros(64, np.uint8)
        with pytest.raises(RecoverMismatchError, match="cannot recover float7_e9m9 data into a uint8 array"):
            s.recover(into={"odd": out})
    # the bytes are still the log's: the command line writes them in their layout and says so
    r = CliRunner().invoke(wal_main, ["restore", f"file:{p}", "--region", "odd", "--out", str(tmp_path / "o.npy")])
    assert r.exit_code == 0, r.output
    assert "holds the float7_e9m9 data in its byte layout |u1" in r.output
    assert np.load(tmp_path / "o.npy").tobytes() == bytes(range(64))


@pytest.mark.parametrize("change,diag", [
    (lambda t: t.resize_(8, 64), "changed since registration"),
    (lambda t: t.untyped_storage().resize_(0), "storage was freed or shrunk"),
    (lambda t: setattr(t, "data", t.data.clone()), "changed since registration"),
], ids=["resized", "freed", "reallocated"])
@pytest.mark.parametrize("call", ["checkpoint", "dirty_bytes"])
def test_a_tensor_changed_after_register_is_refused(tmp_path, change, diag, call):
    """Nothing reads a registered tensor's memory once it changed: a checkpoint
    and the dirty-bytes measure (which a dirty-bytes policy takes before each
    checkpoint) refuse it alike, naming the region."""
    t = torch.zeros(4, 64, dtype=torch.bfloat16)
    with Session(f"file:{tmp_path / 'c.log'}", size=SIZE, segment_size=SEGMENT) as s:
        s.register("kv", t, page_bytes=128)
        s.checkpoint()
        change(t)
        with pytest.raises(ShapeChangedError, match=rf"^region 'kv': the registered array cannot be read: .*{diag}"):
            getattr(s, call)()
        assert s.epoch == 1  # nothing committed


def test_a_changed_tensor_is_named_by_its_dtype_and_shape_before_and_after(tmp_path):
    """The refusal's words name the tensor as PyTorch does (dtype and device
    are held as PyTorch's objects, not their names: `storage_of`)."""
    t = torch.zeros(4, 64, dtype=torch.bfloat16)
    with Session(f"file:{tmp_path / 'c.log'}", size=SIZE, segment_size=SEGMENT) as s:
        s.register("kv", t, page_bytes=128)
        s.checkpoint()
        t.resize_(8, 64)
        with pytest.raises(ShapeChangedError, match=r"^region 'kv': the registered array cannot be read: it "
                                                    r"changed since registration: was torch\.bfloat16\[4, 64\] "
                                                    r"at 0x[0-9a-f]+, now torch\.bfloat16\[8, 64\] at 0x[0-9a-f]+ \(register a new"):
            s.checkpoint()


def test_bf16_into_an_old_log_sets_the_feature_and_old_regions_still_read(tmp_path):
    import gzip
    import pathlib

    golden = pathlib.Path(__file__).parents[1] / "wal" / "golden"
    p = tmp_path / "old.log"
    p.write_bytes(gzip.decompress((golden / "v1_0_log.bin.gz").read_bytes()))
    want = np.load(golden / "v1_0_arrays.npz")
    kv = torch.ones(8, 32, dtype=torch.bfloat16)
    with Session(f"file:{p}", create=False) as s:
        assert s.log.volume.superblock.incompat == 0
        s.register("bf", kv, page_bytes=64)
        assert s.log.volume.superblock.incompat == 1
        s.checkpoint()
    with Session(f"file:{p}", create=False) as s:
        got = s.recover()
    assert got["bf"].dtype == torch.bfloat16 and _raw(got["bf"]) == _raw(kv)
    for name in want.files:
        assert got[name].dtype == want[name].dtype and got[name].tobytes() == want[name].tobytes()


def test_the_transfer_twin_restores_into_the_callers_memory(bf16_log):
    """apply_transfer_numpy(into=...), the numpy twin of the device pipeline's
    `into`, fills the caller's tensor byte for byte as a new array would be."""
    from concordia.restore.device import apply_transfer_numpy, transfer_plan
    from concordia.wal import Log
    from concordia.wal.planner import plan

    log_name, kv = bf16_log
    log = Log.open(log_name, writable=False, check_pages=False)
    try:
        p = plan(log)
        fresh = apply_transfer_numpy(log, transfer_plan(log, p, chunk_bytes=4096))
        target = torch.full((4, 64), 3.0, dtype=torch.bfloat16)
        view = target.reshape(-1).view(torch.uint8).numpy().view("<u2").reshape(4, 64)
        got = apply_transfer_numpy(log, transfer_plan(log, p, chunk_bytes=4096), into={"kv": view})
    finally:
        log.close()
    assert got["kv"] is view
    assert fresh["kv"].tobytes() == view.tobytes() == _raw(kv)


def test_recover_into_registered_tensors_then_deltas_go_on(tmp_path):
    log = f"file:{tmp_path / 'reg.log'}"
    kv = torch.randn(8, 256).to(torch.bfloat16)
    tables = torch.zeros(2, 4, dtype=torch.int32)  # a torch block table is read as the framework keeps it
    with Session(log, size=SIZE, segment_size=SEGMENT) as s:
        s.register("kv", kv, kind="kv", page_bytes=512)
        s.register("tables", tables, kind="scheduler", page_bytes=64)
        s.checkpoint()
        want = kv.clone()
        kv.fill_(0)
        out = s.recover(into="registered")
        assert out["kv"] is kv and torch.equal(kv.view(torch.int16), want.view(torch.int16))
        kv[0, 0] = 2.0
        st = s.checkpoint()
        assert st.pages["kv"] == 1 and st.pages["tables"] == 0


def test_regions_beyond_the_targets_come_back_as_new_tensors(tmp_path):
    log = f"file:{tmp_path / 'some.log'}"
    a = torch.randn(300).to(torch.bfloat16)
    b = torch.randn(200).to(torch.float8_e5m2)
    with Session(log, size=SIZE, segment_size=SEGMENT) as s:
        s.register("a", a, page_bytes=128)
        s.register("b", b, page_bytes=128)
        s.checkpoint()
        target = torch.zeros_like(a)
        out = s.recover(into={"a": target}, regions=["a", "b"])
    assert out["a"] is target and _raw(target) == _raw(a)
    assert out["b"].dtype == torch.float8_e5m2 and _raw(out["b"]) == _raw(b)


def test_compaction_keeps_the_logical_dtype_and_framework(tmp_path):
    from concordia.wal import Log
    from concordia.wal import compact

    log_name = f"file:{tmp_path / 'c.log'}"
    kv = torch.zeros(1 << 17, dtype=torch.bfloat16)  # 256 KiB
    with Session(log_name, size=16 << 20, segment_size=1 << 20) as s:
        s.register("kv", kv, page_bytes=4096)
        for step in range(12):  # every page each time: the first segments fill and can be freed
            kv.fill_(float(step))
            s.checkpoint()
    log = Log.open(log_name, writable=True)
    try:
        rep = compact(log, keep_bases=1, keep_epochs=1)
        assert rep.segments_freed, "nothing was reclaimed: the first descriptor is still there"
    finally:
        log.close()
    log = Log.open(log_name)
    try:
        info = log.regions["kv"]
        assert (info.dtype, info.logical, info.framework) == ("<u2", "bfloat16", "torch")
    finally:
        log.close()
    with Session(log_name, create=False) as s:
        got = s.recover()["kv"]
    assert got.dtype == torch.bfloat16 and bool((got == 11.0).all())
