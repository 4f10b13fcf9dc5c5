"""The Session API on every tier that runs here: checkpoint, recover, policy,
base-then-delta epochs, and the KV block-table scanner against the truth."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

from concordia import Session
from concordia.policy import Policy
from concordia.wal import format as fmt
from concordia.demo.workload import Workload, WorkloadConfig

from .state import LOG_SIZE, SEGMENT, assert_same, copy, make_state, mutate, register_all

ROOT = str(pathlib.Path(__file__).resolve().parents[2])


def new_session(log, **kw):
    return Session(log, size=LOG_SIZE, segment_size=SEGMENT, **kw)


def test_checkpoint_then_recover_in_a_new_session(persistent_log):
    state = make_state()
    with new_session(persistent_log) as s:
        register_all(s, state)
        first = s.checkpoint()
        at1 = copy(state)
        mutate(state, 1)
        second = s.checkpoint()
        at2 = copy(state)
        mutate(state, 2)  # never committed: must not come back
    assert first.epoch == 1 and second.epoch == 2
    with Session(persistent_log, create=False) as s:
        assert s.epoch == 2
        assert_same(s.recover(), at2)
        assert_same(s.recover(target=1), at1)


def test_memory_tier_recovers_within_the_session():
    from concordia.wal import Log

    log = Log.create("memory:", size=LOG_SIZE, segment_size=SEGMENT)
    state = make_state(3)
    s = Session(log)
    register_all(s, state)
    s.checkpoint()
    want = copy(state)
    mutate(state, 5)
    assert_same(s.recover(), want)
    s.close()
    log.close()


def test_first_checkpoint_is_a_base_and_later_ones_carry_only_changed_pages(file_log):
    state = make_state()
    with new_session(file_log) as s:
        register_all(s, state)
        first = s.checkpoint()
        assert sorted(first.base) == sorted(state)
        assert first.pages["kv"] == state["kv"].nbytes // 1024
        assert first.pages["blob"] == 8  # 1000 bytes in 128-byte pages, the last one short
        mutate(state, 1)
        second = s.checkpoint()
        assert second.base == []
        assert second.pages == {"kv": 1, "adapter": 1, "sched": 1, "blob": 1}
        third = s.checkpoint()
        assert sum(third.pages.values()) == 0 and third.epoch == 3
        pages = {}
        for rec in s.log.records():
            if rec.type == fmt.REC_PAGE_BATCH:
                assert rec.flags & fmt.FLAG_BASE == 0  # part of its epoch, not a catalogued base
                pages[rec.epoch] = pages.get(rec.epoch, 0) + rec.count
        assert pages == {1: sum(first.pages.values()), 2: 4}


def test_recover_into_registered_arrays_then_continue_with_deltas(file_log):
    state = make_state()
    with new_session(file_log) as s:
        register_all(s, state)
        s.checkpoint()
        mutate(state, 1)
        s.checkpoint()
    want = copy(state)
    fresh = {k: np.zeros_like(v) for k, v in state.items()}
    with Session(file_log, create=False) as s:
        register_all(s, fresh)
        s.recover(into="registered")
        assert_same(fresh, want)
        mutate(fresh, 7)
        st = s.checkpoint()
        assert st.base == [] and st.epoch == 3
        assert sum(st.pages.values()) == 4  # a delta, not a new base
        after = copy(fresh)
    with Session(file_log, create=False) as s:
        assert_same(s.recover(), after)


def test_an_uncommitted_epoch_of_a_killed_writer_never_comes_back(file_log, tmp_path):
    script = f"""
import os, signal, numpy as np
from concordia import Session
from tests.session.state import make_state, register_all, mutate
s = Session({file_log!r}, size={LOG_SIZE}, segment_size={SEGMENT})
st = make_state(); register_all(s, st); s.checkpoint()
np.savez({str(tmp_path / 'want.npz')!r}, **st)
mutate(st, 9)
# die after the page batches of epoch 2 are persisted, before its commit
s.log.appender.commit = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
s.checkpoint()
"""
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == -9, r.stderr
    with np.load(tmp_path / "want.npz") as z:
        want = {k: z[k] for k in z.files}
    with Session(file_log, create=False) as s:
        assert s.epoch == 1
        assert any(d.kind == "uncommitted" for d in s.log.dropped), s.log.dropped  # reported at open, cut away
        assert_same(s.recover(), want)
        again = copy(want)
        register_all(s, again)
        s.recover(into="registered")
        again["kv"][0, 0, 0, 0] = 42.0
        assert s.checkpoint().epoch == 2
        assert_same(s.recover(), again)


def test_pmem_tier_on_a_plain_file_with_forced_pmem(tmp_path):
    script = f"""
import numpy as np
from concordia import Session
from tests.session.state import make_state, register_all, mutate, copy, assert_same
log = "pmem:{tmp_path / 'pmem.log'}"
st = make_state(4)
with Session(log, size={LOG_SIZE}, segment_size={SEGMENT}) as s:
    assert s.log.backend.is_pmem, "libpmem did not take the forced-pmem path"
    register_all(s, st); s.checkpoint(); mutate(st, 2); s.checkpoint()
with Session(log, create=False) as s:
    assert_same(s.recover(), st)
print("ok")
"""
    env = dict(os.environ, PMEM_IS_PMEM_FORCE="1")
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, env=env)
    if "libpmem did not take" in r.stderr:
        pytest.skip("libpmem is not installed: the pmem tier falls back to msync")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_policy_every_n_steps(file_log):
    state = make_state()
    with new_session(file_log, policy=Policy(every_steps=3)) as s:
        register_all(s, state)
        s.checkpoint()
        taken = []
        for i in range(9):
            mutate(state, i)
            st = s.step()
            taken.append(st is not None)
        assert taken == [False, False, True] * 3
        assert s.epoch == 4


def test_policy_every_dirty_bytes(file_log):
    state = make_state()
    with new_session(file_log, policy=Policy(every_bytes=3 * 1024)) as s:
        register_all(s, state)
        s.checkpoint()
        state["kv"][0, 0, 0, 0] += 1  # one 1 KiB page
        assert s.dirty_bytes() == 1024
        assert s.step() is None
        state["kv"][0, 1, 0, 0] += 1
        state["kv"][0, 2, 0, 0] += 1
        st = s.step()
        assert st is not None and st.reason == "bytes" and st.pages["kv"] == 3


def test_policy_every_t_milliseconds(file_log, monkeypatch):
    """The policy's clock is faked (however slow the machine, a step 10 ms
    after the checkpoint is not due, one 50 ms after is)."""
    import types

    import concordia.policy

    now = [1000.0]
    monkeypatch.setattr(concordia.policy, "time", types.SimpleNamespace(monotonic=lambda: now[0]))  # its clock only
    state = make_state()
    with new_session(file_log, policy=Policy(every_ms=30)) as s:
        register_all(s, state)
        s.checkpoint()
        now[0] += 0.010
        assert s.step() is None
        now[0] += 0.040
        st = s.step()
        assert st is not None and st.reason == "time"


@pytest.mark.parametrize("scanner", ["blocks", "shadow"])
def test_kv_scanner_finds_every_write_of_the_workload(tmp_path, scanner):
    """Short requests that start and finish between checkpoints, blocks freed
    and handed on: every committed epoch must restore the exact live state."""
    cfg = WorkloadConfig(d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab=128, block_size=4,
                         num_blocks=24, max_slots=4, max_blocks_per_seq=8, n_requests=14,
                         prompt_len=(1, 3), new_tokens=(1, 6), arrival_gap=(0, 2))
    wl = Workload(cfg)
    log = f"file:{tmp_path / 'kv.log'}"
    with new_session(log, policy=Policy(every_steps=5)) as s:
        if scanner == "blocks":
            kvb = wl.kv_blocks()
            s.register("kv", wl.kv, kind="kv", page_bytes=256, block_tables=kvb["block_tables"],
                       seq_lens=kvb["seq_lens"], block_stamp=kvb["block_stamp"], seq_ids=wl.tables.slot_req)
        else:
            s.register("kv", wl.kv, kind="kv", page_bytes=256)
        assert s.regions["kv"].detect == scanner
        s.checkpoint()
        truth = {1: wl.kv.copy()}
        while wl.step_index < 45:
            wl.step()
            st = s.step()
            if st is not None:
                truth[st.epoch] = wl.kv.copy()
        for epoch, want in truth.items():
            got = s.recover(target=epoch)["kv"]
            assert got.tobytes() == want.tobytes(), f"epoch {epoch}"
        assert len(s.checkpoints) == s.checkpoint_totals.count  # fewer than kept: the whole run
        written = sum(c.pages["kv"] for c in list(s.checkpoints)[1:])
    if scanner == "blocks":  # the scanner writes far less than whole blocks of every layer
        assert written < len(truth) * wl.kv.nbytes // 256 // 4


def test_recovered_arrays_go_to_the_requested_targets(file_log):
    state = make_state()
    with new_session(file_log) as s:
        register_all(s, state)
        s.checkpoint()
        target = np.zeros_like(state["adapter"])
        out = s.recover(into={"adapter": target})
        assert out["adapter"] is target
        assert target.tobytes() == state["adapter"].tobytes()
        assert set(out) == {"adapter"}


def test_torch_cpu_tensors_through_dlpack(file_log):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed here")
    t = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    with new_session(file_log) as s:
        s.register("t", t, kind="adapter", page_bytes=1024)
        s.checkpoint()
        t[3, :] = -1.0  # in place: the registered memory is the tensor's own
        st = s.checkpoint()
        assert st.pages["t"] == 1
        got = s.recover()["t"]
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32  # registered as a tensor: one back
    assert got.numpy().tobytes() == t.numpy().tobytes()


def test_a_cpu_tensor_is_seen_in_its_own_memory_with_the_bytes_dlpack_gives():
    """A CPU tensor of every width is seen by its address in its layout: the same dtype, shape and bytes
    as a DLPack export gives, in the tensor's own memory (writes through it land in the tensor), kept
    alive by the view, and its storage can still be resized (numpy() would have forbidden it)."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed here")
    pytest.importorskip("ml_dtypes")
    from concordia.regions.arrays import _torch_layout, adapt

    g = torch.Generator().manual_seed(3)
    cases = [torch.randn(3, 4, dtype=torch.bfloat16, generator=g), torch.randn(5, generator=g).to(torch.float8_e4m3fn),
             torch.tensor([True, False, True]), torch.arange(6, dtype=torch.int8).reshape(2, 3),
             torch.randn(2, 2, generator=g), torch.randn(3, dtype=torch.complex64, generator=g),
             torch.randn(2, dtype=torch.complex128, generator=g), torch.tensor(3.5), torch.zeros(0, 4),
             torch.nn.Parameter(torch.ones(4)), torch.arange(10.0)[2:8], torch.arange(4, dtype=torch.uint8)]
    for t in cases:
        a, xp, owner = adapt(t, "t")
        layout = _torch_layout(t, "t", None)[2]
        exported = np.from_dlpack(t.detach().reshape(-1).view(torch.uint8)).view(layout).reshape(tuple(t.shape))
        assert xp is np and owner is t
        assert (a.dtype, a.shape, a.tobytes()) == (exported.dtype, exported.shape, exported.tobytes()), t.dtype
        if a.size:
            assert a.__array_interface__["data"][0] == t.data_ptr(), t.dtype
            before = exported.tobytes()
            a.reshape(-1)[:1].view(np.uint8)[0] ^= 0xFF   # a write through the view is the tensor's
            assert exported.tobytes() != before and exported.tobytes() == a.tobytes(), t.dtype
            assert t.untyped_storage().resizable(), t.dtype
    t = torch.arange(64, dtype=torch.float32)
    a, _, _ = adapt(t, "t")
    want = a.tobytes()
    del t
    import gc

    gc.collect()
    assert a.tobytes() == want   # the view holds the tensor's memory
    t = torch.zeros(4, 64, dtype=torch.bfloat16)
    adapt(t, "t")
    t.resize_(8, 64)   # a registered tensor may still be resized (the session names the change)
    t.untyped_storage().resize_(0)


def test_a_cpu_hint_tensor_is_read_in_its_own_memory_and_stays_resizable(tmp_path):
    """A hint read on the host (`to_host`: a length, a sequence id, slot versions) from a CPU tensor is
    its values in its own dtype, strided or not, and leaves the caller's storage resizable: numpy()
    would have marked it never to be resized, and a caller's block table or length may be.  Through the
    product path: a positions region whose length= and seq_ids= are CPU tensors, checkpointed, then
    the hint tensors resized."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed here")
    from concordia.regions.arrays import to_host
    from concordia.regions.region import position_page_bytes

    base = torch.arange(24, dtype=torch.int32).reshape(4, 6)
    cases = [base, base[:, 1::2], base.t(), torch.tensor(7), torch.tensor([True, False]),
             torch.arange(3, dtype=torch.int64).expand(2, 3), torch.zeros(0, 3, dtype=torch.int64),
             torch.nn.Parameter(torch.ones(3), requires_grad=False), torch.tensor([2.5, -1.0], dtype=torch.float64)]
    for t in cases:
        got = to_host(t)
        want = t.detach().clone().numpy()
        assert (got.dtype, got.shape) == (want.dtype, want.shape) and np.array_equal(got, want), t
        if t.numel():
            assert got.__array_interface__["data"][0] == t.data_ptr()
        assert t.untyped_storage().resizable(), t
    raw = to_host(torch.ones(2, dtype=torch.bfloat16))   # no numpy type of its own: raw bytes, no ml_dtypes
    assert raw.dtype == np.dtype("V2") and raw.shape == (2,)
    kv = np.zeros((2, 2, 16, 32), np.float16)
    length, seq = torch.tensor([0], dtype=torch.int64), torch.tensor([1], dtype=torch.int64)
    with Session(f"file:{tmp_path / 'hints.log'}", size=16 << 20) as s:
        s.register("kv", kv, kind="kv", detect="positions", page_bytes=position_page_bytes(64),
                   length=length, seq_ids=seq)
        for n in (3, 7):
            kv[..., length.item():n, :] = n
            length.fill_(n)
            s.checkpoint()
        assert length.untyped_storage().resizable() and seq.untyped_storage().resizable()
        length.resize_(4)   # the caller's tensors are still its own to resize
        seq.untyped_storage().resize_(64)
    with Session(f"file:{tmp_path / 'hints.log'}", create=False) as r:
        assert r.recover()["kv"].tobytes() == kv.tobytes()


def test_device_dax_tier_through_an_emulated_device(tmp_path):
    """dax: logs go through DevDaxBackend; where no /dev/dax exists, a file
    stands in for the device (whole-device mapping, sysfs geometry replaced by
    the file's length and an explicit alignment)."""
    from concordia.devmem import DevDaxBackend
    from concordia.wal import Log

    dev = tmp_path / "dax0.0"
    with open(dev, "wb") as f:
        f.truncate(LOG_SIZE)
    os.chmod(dev, 0o600)
    state = make_state()
    log = Log.create(DevDaxBackend.emulate(str(dev)), size=LOG_SIZE, segment_size=SEGMENT)
    with Session(log) as s:
        assert s.log.backend.kind == "devdax"
        register_all(s, state)
        s.checkpoint()
        mutate(state, 1)
        s.checkpoint()
        want = copy(state)
        mutate(state, 2)  # never committed
    log.close()
    log = Log.open(DevDaxBackend.emulate(str(dev)), writable=True)
    with Session(log) as s:
        assert s.epoch == 2
        assert_same(s.recover(), want)
    log.close()
