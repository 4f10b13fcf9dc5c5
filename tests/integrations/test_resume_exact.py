"""generate() resumes exactly under transformers' defaults: a tiny Qwen3 with a
LoRA updated online on the CPU, SIGKILLed at random moments of generate(),
restored and continued in a fresh process; tokens, final cache and LoRA
weights equal an uninterrupted run's, greedy and sampled, with generate()'s
decode step compiled (`compile_config._compile_all_devices`, as it is on
CUDA by default) and without."""

from __future__ import annotations

import random

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the transformers integration needs torch")
pytest.importorskip("transformers", reason="the transformers integration needs transformers (test extra)")
pytest.importorskip("peft", reason="the LoRA part needs peft (test extra)")

from transformers import StaticCache  # noqa: E402

import concordia  # noqa: E402
from concordia.demo.kills import run_kills  # noqa: E402
from concordia.demo.model import build, lora_update, prompt  # noqa: E402
from concordia.errors import SessionError  # noqa: E402
from concordia.integrations.transformers import CheckpointEvery, protect, restore  # noqa: E402


@pytest.fixture
def shm_log_path():
    from tests.session.conftest import _fresh_shm_log

    yield from _fresh_shm_log()

PLAN = [{"seed": 11, "sample": False, "kill": True}, {"seed": 12, "sample": True, "kill": True},
        {"seed": 13, "sample": True, "kill": False}]


@pytest.mark.slow
@pytest.mark.parametrize("compile_", ["on", "off"])
def test_sigkills_at_random_moments_resume_identically(tmp_path, compile_):
    rep = run_kills(f"file:{tmp_path / 'k.log'}", PLAN, compile=compile_, steps=12, every=1,
                    rng=random.Random())
    assert rep["compile"] is (compile_ == "on")
    assert [k["gen"] for k in rep["kills"]] == [0, 1]           # each planned kill was a real SIGKILL
    assert [k["sampled"] for k in rep["kills"]] == [False, True]
    for k in rep["kills"]:
        assert k["restored_epoch"] >= 4 and k["resumed_at_step"] == k["restored_epoch"]  # every step commits
        assert k["tokens_identical"] and k["identical"], k
    assert rep["identical"]  # and the generation that was not killed, in the life after the last kill


@pytest.mark.slow
def test_sigkills_while_the_resident_trigger_takes_the_epochs_resume_identically():
    """The same kills with a resident session on shm: after each generate()'s
    first checkpoint the executor's trigger takes every step's epoch
    (`CheckpointEvery`'s default there: the step holds while the consumer
    writes it into the arena, as the persistent kernel holds the stream on
    a GPU), with compiled decode; every resumed generation is identical."""
    import glob
    import os

    from tests.conftest import SHM_DIR, shm_test_name

    name = shm_test_name("resident-kills")
    try:
        rep = run_kills(f"shm:{os.path.join(SHM_DIR, name)}", PLAN, compile="on", steps=12, every=1,
                        rng=random.Random(), executor="resident")
    finally:
        for path in glob.glob(os.path.join(SHM_DIR, name + "*")):
            os.unlink(path)
    assert rep["executor"] == "resident" and rep["compile"] is True
    assert [k["gen"] for k in rep["kills"]] == [0, 1]
    for k in rep["kills"]:
        # the signal comes after step 4's gate went: that epoch went through the consumer's snapshot and a
        # kill may come before its commit is in the arena (step_trigger.py), but the consumer commits each
        # epoch before it reads the next, so the one before it is durable whenever the kill falls
        assert k["signalled_at_step"] == 4 and k["restored_epoch"] >= k["signalled_at_step"] - 1, k
        assert k["resumed_at_step"] == k["restored_epoch"]  # every step commits
        assert k["tokens_identical"] and k["identical"], k
    assert rep["identical"]


def test_checkpoint_every_on_a_resident_session_hands_its_epochs_to_the_trigger(shm_log_path):
    """CheckpointEvery on a resident session: the first checkpoint is the
    session's own, every later one is the trigger's (into the arena, on the
    CPU consumer), each recovering the state of its step exactly; protect()
    there registers every region for a pass with no host step (words)."""
    from concordia.checkpoint.table import DET_LISTED, detector_of

    cfg, model, cache = _make(False)
    ids = prompt(2, 8, cfg.vocab_size, "cpu", seed=3)
    with concordia.Session(shm_log_path, size=64 << 20, segment_size=8 << 20, executor="resident") as s:
        g = protect(s, cache, model, batch_size=2, max_tokens=32)
        assert DET_LISTED not in [detector_of(r) for r in s.region_set]
        with pytest.raises(SessionError, match="trigger must be True, False or None"):
            CheckpointEvery(g, 1, trigger="yes")
        states = {}
        hook = CheckpointEvery(g, 1, on_step=lora_update(model),
                               after=lambda step, st: states.__setitem__(step, _snapshot(g)))
        model.generate(ids, past_key_values=cache, max_new_tokens=6, stopping_criteria=[hook], do_sample=False)
        assert hook.trigger is not None and not hook.trigger.on_device and len(hook.stats) == 1
        assert [c for _, c in hook.fired] == [1, 2, 3, 4, 5] and not hook.trigger.errors
        s.settle()
        assert s.resident.info()["trigger"]["in_arena"] == 5
        assert s.log.verify()["corrupt"] == 0
        for epoch, count in hook.fired:
            got = s.recover(epoch)
            for name, want in states[count + 1].items():
                assert np.asarray(got[name]).tobytes() == want, (epoch, name)


def _snapshot(guard) -> dict:
    return {n: np.asarray(a.detach().cpu() if hasattr(a, "detach") else a).tobytes()
            for n, a in ((n, guard.session.region_set[n].owner) for n in guard.names)}


def _make(compile_):
    cfg, model = build("tiny", "cpu", compile=compile_)
    return cfg, model, StaticCache(config=cfg, max_cache_len=32)


def _gen(model, cache, guard, ids, n, *, mask, start=0, sample=False):
    hook = CheckpointEvery(guard, 1, on_step=lora_update(model), start=start, attention_mask=mask)
    kw = {"do_sample": True, "top_k": 0} if sample else {"do_sample": False}
    return model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=n,
                          stopping_criteria=[hook], **kw)


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_restore_hands_back_tokens_mask_steps_and_generator(tmp_path, sample):
    """A left-padded batch whose pad token is generated: the mask kept beside
    the tokens, the steps taken and the generator's state come back, and the
    continuation equals the uninterrupted run (in one process, no compile)."""
    cfg, model, cache = _make(False)
    ids = prompt(2, 8, cfg.vocab_size, "cpu", seed=3)
    ids[0, :3] = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    pad = int(ids[0, 0])
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    torch.manual_seed(5)
    with concordia.Session(f"file:{tmp_path / 'ref.log'}", size=64 << 20, segment_size=8 << 20) as s:
        g = protect(s, cache, model, batch_size=2, max_tokens=32)
        ref = _gen(model, cache, g, ids, 10, mask=mask, sample=sample)
    cfg, model, cache = _make(False)
    torch.manual_seed(5)
    with concordia.Session(f"file:{tmp_path / 'a.log'}", size=64 << 20, segment_size=8 << 20) as s:
        g = protect(s, cache, model, batch_size=2, max_tokens=32)
        _gen(model, cache, g, ids, 4, mask=mask, sample=sample)
    cfg, model, cache = _make(False)
    torch.manual_seed(999)  # the generator elsewhere: restore puts it back
    with concordia.Session(f"file:{tmp_path / 'a.log'}", create=False) as s:
        g = protect(s, cache, model, batch_size=2, max_tokens=32)
        state = restore(s, g)
        assert state.steps == 4 and state.tokens.shape == (2, 12)
        assert torch.equal(state.attention_mask[:, :8], mask) and bool(state.attention_mask[:, 8:].all())
        out = _gen(model, cache, g, state.tokens, 6, mask=state.attention_mask, start=state.steps, sample=sample)
    assert torch.equal(out, ref)
    assert int(ids[0, 0]) == pad


def test_a_mask_that_does_not_cover_the_tokens_is_refused(tmp_path):
    cfg, model, cache = _make(False)
    with concordia.Session(f"file:{tmp_path / 'm.log'}", size=64 << 20, segment_size=8 << 20) as s:
        g = protect(s, cache, model, batch_size=2, max_tokens=32)
        with pytest.raises(SessionError) as e:
            g.record_tokens(torch.zeros((2, 5), dtype=torch.int64), torch.ones((2, 6), dtype=torch.int64))
    assert "\n" not in str(e.value) and "hf.mask" in str(e.value)


def test_protect_without_rng_registers_no_generator_region(tmp_path):
    cfg, model, cache = _make(False)
    with concordia.Session(f"file:{tmp_path / 'r.log'}", size=64 << 20, segment_size=8 << 20) as s:
        g = protect(s, cache, model, batch_size=2, rng=False)
        assert "hf.rng" not in s.regions and g.rng is None
        g2_names = set(s.regions)
    assert g2_names == set(g.names)


@pytest.mark.gpu
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_the_persistent_kernels_trigger_takes_generates_epochs_and_a_resume_is_identical(sample):
    """A tiny Qwen3 on CUDA (generate()'s decode step compiled, its default)
    with a LoRA updated online, on a resident session over shm: after
    CheckpointEvery's first checkpoint the persistent kernel takes every
    step's epoch at the step's gate (one launch a step from the host).  A
    restore of the last epoch into fresh objects, continued, gives the tokens,
    cache and LoRA weights of an uninterrupted run on a host session."""
    import os

    from concordia.demo.model import digest
    from tests.conftest import SHM_DIR, shm_test_name

    def make():
        cfg, model = build("tiny", "cuda")
        return cfg, model, StaticCache(config=cfg, max_cache_len=32)

    def gen(model, cache, guard, ids, n, start=0, mask=None):
        hook = CheckpointEvery(guard, 1, on_step=lora_update(model), start=start)
        kw = {"do_sample": True, "top_k": 0} if sample else {"do_sample": False}
        return model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=n,
                              stopping_criteria=[hook], **kw), hook

    names = [shm_test_name("hf-ref"), shm_test_name("hf-res")]
    try:
        cfg, model, cache = make()
        ids = prompt(2, 8, cfg.vocab_size, "cuda", seed=3)
        torch.manual_seed(5)
        with concordia.Session(f"shm:{names[0]}", size=64 << 20, segment_size=8 << 20) as s:
            g = protect(s, cache, model, batch_size=2, max_tokens=32)
            ref, _ = gen(model, cache, g, ids, 12)
            torch.cuda.synchronize()
            want = digest(g)
        cfg, model, cache = make()
        torch.manual_seed(5)
        with concordia.Session(f"shm:{names[1]}", size=64 << 20, segment_size=8 << 20, executor="resident") as s:
            g = protect(s, cache, model, batch_size=2, max_tokens=32)
            _, hook = gen(model, cache, g, ids, 7)
            torch.cuda.synchronize()
            assert hook.trigger is not None and hook.trigger.on_device, s.resident.info()["route"]
            assert len(hook.fired) == 6 and not hook.trigger.errors, (hook.fired, hook.trigger.errors)
        cfg, model, cache = make()
        torch.manual_seed(999)  # the generator elsewhere: restore puts it back
        with concordia.Session(f"shm:{names[1]}", create=False, executor="resident") as s:
            g = protect(s, cache, model, batch_size=2, max_tokens=32)
            state = restore(s, g)
            assert state.steps == 7
            out, _ = gen(model, cache, g, state.tokens, 12 - state.steps, start=state.steps,
                         mask=state.attention_mask)
            torch.cuda.synchronize()
            assert torch.equal(out, ref) and digest(g) == want
    finally:
        for name in names:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass
