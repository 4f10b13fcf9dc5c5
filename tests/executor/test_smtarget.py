"""SM-count targets lowered while an executor is resident (smtarget.py): the
counting across holders and the putting back, over plain settings here (cuBLAS
itself runs only on a GPU: test_gpu_executor.py checks the real handle), and
finding the loaded cuBLAS among a process's mappings; and how GpuExecutor's
default carve-out falls back where an explicit one raises (its constructor needs
no device)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from concordia.executor.errors import ExecutorError
from concordia.executor.ring import Ring
from concordia.executor.smtarget import Knob, SmTarget, mapped_cublas_paths

pytestmark = pytest.mark.timeout(30)


class Setting:
    """A value with a write log, standing for one handle's SM-count target."""

    def __init__(self, value):
        self.value, self.writes = value, []

    def knob(self, key, lowered):
        def write(v):
            self.writes.append(v)
            self.value = v
        return Knob(key, lambda: self.value, write, lowered)


def test_apply_lowers_and_restore_puts_back():
    s = Setting(0)
    t = SmTarget(1, knobs=[s.knob(("h", 1), 131)])
    with t:
        assert s.value == 131 and t.active
        t.apply()                      # idempotent per instance
        assert s.writes == [131]
    assert s.value == 0 and not t.active
    t.restore()
    assert s.writes == [131, 0]


def test_holders_are_counted_per_knob_and_the_last_puts_back():
    s, other = Setting(0), Setting(None)
    a = SmTarget(1, knobs=[s.knob(("h", 7), 131)])
    b = SmTarget(2, knobs=[s.knob(("h", 7), 130), other.knob(("torch", "carveout"), 2)])
    a.apply()
    b.apply()                           # the handle is already held: its value stays a's
    assert s.value == 131 and other.value == 2
    a.restore()
    assert s.value == 131               # b still holds it
    b.restore()
    assert s.value == 0 and other.value is None
    assert s.writes == [131, 0] and other.writes == [2, None]


def test_a_failing_knob_leaves_nothing_held():
    s = Setting(0)

    def broken(_):
        raise ExecutorError("set refused", where="test")

    t = SmTarget(1, knobs=[s.knob(("h", 1), 131), Knob(("h", 2), lambda: 0, broken, 131)])
    with pytest.raises(ExecutorError, match="set refused"):
        t.apply()
    assert s.value == 0 and not t.active
    again = SmTarget(1, knobs=[s.knob(("h", 1), 120)])
    with again:
        assert s.value == 120           # nothing left counted for handle 1


@pytest.mark.parametrize("bad", [-1, 1.5, "1"])
def test_bad_carveout_is_one_line(bad):
    with pytest.raises(ExecutorError, match="non-negative integer") as e:
        SmTarget(bad, knobs=[])
    assert "\n" not in str(e.value)


def test_zero_carveout_touches_nothing():
    t = SmTarget(0)
    with t:
        assert t.knobs == []


def test_mapped_cublas_paths_skip_cublaslt_and_repeats():
    maps = "\n".join([
        "7f00-7f10 r--p 00000000 00:2a 11 /opt/x/nvidia/cu13/lib/libcublasLt.so.13",
        "7f10-7f20 r-xp 00001000 00:2a 12 /opt/x/nvidia/cu13/lib/libcublas.so.13",
        "7f20-7f30 r--p 00002000 00:2a 12 /opt/x/nvidia/cu13/lib/libcublas.so.13",
        "7f30-7f40 rw-p 00000000 00:00 0 ",
        "7f40-7f50 r-xp 00000000 00:2a 13 /usr/local/cuda/lib64/libcublas.so.13.1.0.3",
    ])
    assert mapped_cublas_paths(maps) == ["/opt/x/nvidia/cu13/lib/libcublas.so.13",
                                         "/usr/local/cuda/lib64/libcublas.so.13.1.0.3"]
    assert mapped_cublas_paths("") == []


class _Refused:
    """An SmTarget that cannot be made here (as with no cuBLAS that has the call)."""

    made: list = []

    def __init__(self, carveout, **kw):
        _Refused.made.append(carveout)
        raise ExecutorError("no loaded cuBLAS library has cublasSetSmCountTarget", where="cublas sm target")


@pytest.fixture
def refused(monkeypatch):
    from concordia.executor import persistent as gpu

    monkeypatch.setattr(gpu, "SmTarget", _Refused)
    _Refused.made = []
    ring = Ring.allocate(16)
    # the constructor touches neither the device nor the module: a ring holder is enough
    return lambda **kw: gpu.GpuExecutor(SimpleNamespace(ring=ring), module=None, **kw)


def test_default_carveout_falls_back_and_says_why(refused):
    from concordia.executor.persistent import DEFAULT_SM_CARVEOUT

    ex = refused()
    assert _Refused.made == [DEFAULT_SM_CARVEOUT]
    assert ex.sm_target is None and "cublasSetSmCountTarget" in ex.sm_target_skipped


def test_explicit_carveout_that_cannot_apply_raises(refused):
    with pytest.raises(ExecutorError, match="cublasSetSmCountTarget"):
        refused(sm_carveout=2)
    assert _Refused.made == [2]


def test_zero_carveout_or_a_given_target_makes_none(refused):
    ex = refused(sm_carveout=0)
    assert ex.sm_target is None and ex.sm_target_skipped is None
    given = SmTarget(0)
    ex = refused(sm_target=given)
    assert ex.sm_target is given and ex.sm_target_skipped is None
    assert _Refused.made == []
