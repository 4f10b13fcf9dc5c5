"""`concordia-wal bench model`: a Hugging Face transformers model protected
through `concordia.integrations.transformers`, the product path a user takes.

A Qwen3 model (the 0.6B shape on a GPU, a tiny shape on the CPU), built from a
config with seeded random weights, a `StaticCache` and a PEFT LoRA adapter
(q and v projections, rank 8), batch 8 by default:

transformers' defaults throughout: sdpa attention, and generate()'s decode
step compiled where transformers compiles it (CUDA with a StaticCache); no
determinism switches.

* decode: tokens/s of `model.generate()` with no checkpoint, with a checkpoint
  every step and every 8 steps (`CheckpointEvery`, the stopping-criterion
  hook), and the checkpoint time per step (`CheckpointStats.total_ms`);
  `overhead_every_step` is the decode time per token lost to checkpointing
  every step, as a fraction of the step without; the same every step
  waiting for each checkpoint; and every step and every 8 steps on a
  resident session (`Session(executor="resident")`), whose CheckpointEvery
  hands each epoch after the first to the executor's trigger: the
  persistent kernel at the step's gate on a GPU (one launch a step from the
  host), the consumer thread on the CPU (`overhead_every_step_resident`,
  `overhead_every_8_resident`; the executor's engine is built by one
  checkpoint before the timed steps, as once a session); asked for by
  `--decode-rows`, `every_step_resident_held` is every step on a resident
  session whose engine takes no snapshot (each epoch staged straight into
  its arena while the gate holds the step: the snapshot's baseline, in the
  same run).  One cache serves every run (compiled code
  is reused), each measured run after an unmeasured one, the settings
  interleaved `--decode-reps` times (medians);
* kills: generations SIGKILLed at random moments of generate(), each restored
  and finished in a fresh process (`concordia.demo.kills`), greedy and
  sampled alternately; tokens, final cache and LoRA weights against an
  uninterrupted run;
* longrun: one session checkpointing every step of `--longrun-steps` steps
  (generations of `--longrun-gen` steps on one cache, the adapter learning
  across them) into a log of `--longrun-log-x` times the state: whether the
  log filled (a checkpoint coalesced or raised), and a fresh process's
  recovery time (open + protect + restore) at step 1,000 and at the end;
* recovery at each context length: the cache is prefilled with that many
  tokens and checkpointed (a base of every page), then recovered as a
  recovering program would: `Session(log, create=False)`, `protect` of a fresh
  cache, `restore` into it (open + restore, in this process), and again in a
  fresh process (`fresh`, `hf_restore_vs_reprefill`: issue 30's measure, the
  process's start-up and model build left out), and in a fresh process that
  calls `concordia.prefetch` first and builds its model while the log is
  opened and read ahead (`fresh_read_ahead`, `hf_restore_vs_reprefill_read_ahead`:
  the seconds the recovery kept its thread, the prefetch call and everything
  after the model's build, waits for the read included); beside it, the
  same tokens re-prefilled into an empty cache, and a cold restart (the weights
  loaded from safetensors, then re-prefill); and the KV bytes' time at pinned
  host-to-device bandwidth measured in the same run (the ceiling).  Every
  recovery and the re-prefill start from a cache whose tensors are allocated
  (`demo.model.allocated_cache`, outside their clocks), as a server's are.
  The read-ahead ratio's figures are medians (the upper middle of an even
  count): of --recovery-reps read-ahead children (their seconds in
  `fresh_read_ahead_runs`, their errors in `fresh_read_ahead_errors`) and of
  --recovery-reps re-prefills after one untimed (`reprefill_runs`), so that
  one slow sample (a GPU still at idle clocks after the children) moves
  neither side of it.  The in-process recovery and the plain fresh child
  run once; every ratio is over the same median re-prefill.  Each fresh
  child freezes its built model's objects (`gc.freeze()`, as the README's
  recipe does) and counts the collector's passes inside its protect() and
  restore() (`gc` in its figures; the read-ahead children's in
  `fresh_read_ahead_gc`).

Prefill runs in chunks (--chunk tokens), as a server would for long contexts.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
from unittest import mock

import click

from ..common import FiniteRange, check_outputs, guarded, report
from .files import Scratch, force_option


def _sync(torch, device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _h2d_GBps(torch, nbytes: int) -> float | None:
    """Pinned host-to-device copy bandwidth (the ceiling of a restore)."""
    if not torch.cuda.is_available():
        return None
    n = min(nbytes, 4 << 30)
    src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    best = None
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    del src, dst
    return n / best / 1e9


def _prefill(model, cache, ids, chunk: int):
    import torch

    with torch.no_grad():
        for s in range(0, ids.shape[1], chunk):
            part = ids[:, s:s + chunk]
            pos = torch.arange(s, s + part.shape[1], device=ids.device)
            model(input_ids=part, past_key_values=cache, cache_position=pos, use_cache=True)


def _decode(model, guard, ids, steps, every, wait=False):
    """generate() `steps` tokens on a cache prefilled with all of `ids` but the
    last token, after its base checkpoint; (seconds per token, checkpoint
    statistics, how many checkpoints were left pending, the median host
    seconds inside the stopping criterion per step, and the median host
    milliseconds of each phase's call: the adapter update, the epoch's run
    (its launch, when pending; inside it, the room check and the table
    pass's launch), the settle of a pending epoch, retention's hook and its
    copies at a launch; with each phase's host milliseconds
    over the run per step, and retention's counts and who wrote its bases).
    The time includes committing the last pending epoch."""
    import torch
    from transformers import StoppingCriteria

    from concordia.demo.model import lora_update
    from concordia.integrations.transformers import CheckpointEvery

    # every=0: the same online adapter update at every step, no checkpoint
    queued = []
    parts: dict = {}  # phase -> host seconds of each call (`_timing`)
    s = guard.session
    update = _timing(lora_update(model), "update", parts)
    hook = CheckpointEvery(guard, every or 1 << 40, on_step=update, wait=wait,
                           after=lambda step, st: queued.append(bool(st is not None and st.pending)))
    host = []  # the host's seconds inside the criterion at each step (the update and the checkpoint)
    # where the checkpoint's host time goes: the epoch's launch (or whole run), the settle of
    # the pending one, retention's hook after a commit and at a launch
    # (inside the run: its room check, and the table pass's launch when there is one)
    table = s.runner.table_pass(s.log)
    # and on every row the guard's capture and token copy at a due step; on a resident session
    # the trigger's step (`trigger_step`) and, inside it, the arena swap's check and swap
    route = getattr(s.resident, "route", None)
    owners = ((s.runner, "run"), (s.runner, "settle"), (s.runner, "room"), (s.retention, "after_commit"),
              (s.retention, "launched"), (guard, "capture"), (guard, "record_tokens")) + \
        (((table, "launch"),) if table is not None else ()) + (((route, "rotate"),) if route is not None else ())
    labels = {"after_commit": "retention", "launched": "retention_copies", "room": "run_room",
              "launch": "run_launch", "rotate": "trigger_rotate"}
    # inside an arena swap (DeviceEpochs.rotate): the kernel's pause, the arena taken on, the next opened
    # (inside that: the arena made, its descriptor built, the trigger armed on it)
    swap = ()
    if s.resident is not None:
        from concordia.checkpoint import device_epoch
        from concordia.checkpoint.arena import Arena

        swap = ((device_epoch.DeviceEpochs, "pause", "swap_pause"), (device_epoch.DeviceEpochs, "_open", "swap_open"),
                (Arena, "adopt", "swap_adopt"), (Arena, "__init__", "swap_open_arena"),
                (device_epoch, "describe", "swap_open_describe"), (device_epoch.DeviceEpochs, "_arm", "swap_open_arm"))

    class Timed(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            t = time.perf_counter()
            out = hook(input_ids, scores, **kwargs)
            host.append(time.perf_counter() - t)
            return out

    dev = str(ids.device)
    # every timer is put back when the run ends, however it ends (instance attributes removed,
    # the classes' and modules' own functions restored)
    with contextlib.ExitStack() as timers:
        for obj, name, label in [(obj, name, labels.get(name, name)) for obj, name in owners] + list(swap):
            timers.enter_context(mock.patch.object(obj, name, _timing(getattr(obj, name), label, parts)))
        if s.resident is not None:  # the trigger CheckpointEvery makes at its first epoch: its step() timed
            make = s.resident.step_trigger

            def step_trigger(every, *args, **kw):
                tr = make(every, *args, **kw)
                tr.step = _timing(tr.step, "trigger_step", parts)
                return tr

            timers.enter_context(mock.patch.object(s.resident, "step_trigger", step_trigger))
        _sync(torch, dev)
        t0 = time.perf_counter()
        model.generate(input_ids=ids, max_new_tokens=steps, do_sample=False, past_key_values=guard.cache,
                       stopping_criteria=[Timed()], min_new_tokens=steps)
        guard.session.settle()
        _sync(torch, dev)
    per_step = (time.perf_counter() - t0) / steps
    phases = {k: round(_median(v) * 1e3, 4) for k, v in parts.items() if v}
    # what each phase adds to a step on average: rare costly calls (a base job's copies,
    # a job written at once under log pressure) weigh here as they do in tokens/s
    per_step_ms = {k: round(sum(v) / steps * 1e3, 4) for k, v in parts.items() if v}
    kept = {"counts": dict(s.retention.counts), "base_staging": s.retention.base_staging}
    if hook.trigger is not None:  # the trigger's epochs: their statistics came with the settle
        # due: the trigger's share of the due steps (the first is the session's own epoch); skipped: due
        # steps with no epoch, the trigger's or the session's (uncovered, mended; a coalesced one is
        # skipped): a row with any measures fewer checkpoints than it says (below 0: a step took two)
        tr = hook.trigger
        due = steps // (every or 1 << 40) - 1
        kept["trigger"] = {"on_device": tr.on_device, "fired": len(hook.fired), "due": due,
                           "skipped": due - len(hook.fired) - tr.uncovered - tr.mended,
                           "uncovered": tr.uncovered, "coalesced": tr.coalesced, "mended": tr.mended,
                           "errors": list(tr.errors)[:4]}
        n, secs, gave_up = hook.trigger.held()  # how long the gate's epochs held the decode (stream or thread)
        kept["trigger"].update(held_steps=n, held_ms_mean=secs / n * 1e3 if n else None,
                               held_ms_per_step=secs / steps * 1e3, gave_up=gave_up)
        if hook.trigger.on_device:  # arena swaps, arms after the kernel left (idle: the stream drained); the
            # epochs its engine (the last, where a mend replaced one) staged through the snapshot
            kept["trigger"].update(rotations=hook.trigger.rotations, rearmed=hook.trigger.rearmed,
                                   snapshot_epochs=hook.trigger.engine.snapshot_epochs,
                                   snapshot_why=hook.trigger.engine.snapshot_why)
        else:  # the CPU twin's epochs whose gate went through its snapshot
            kept["trigger"].update(snapshot_epochs=hook.trigger.snapshot_epochs)
        hook.trigger.disarm()
        fired = {e for e, _ in hook.fired}
        stats = hook.stats + [st for st in s.checkpoints if st.epoch in fired]
    else:
        stats = hook.stats
    return per_step, stats, sum(queued), _median(host), (phases, per_step_ms, kept)


def _by_phase(runs: list, key: str) -> dict:
    """{phase: the median over `runs` of run[key][phase]}, over the phases any run has."""
    return {k: _median([r[key][k] for r in runs if k in r[key]]) for k in sorted({k for r in runs for k in r[key]})}


def _timing(fn, name: str, into: dict):
    """fn, with the host seconds of each call appended to into[name]."""
    def timed(*args, **kw):
        t = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            into.setdefault(name, []).append(time.perf_counter() - t)
    return timed


#: the decode settings measured: (checkpoint every, wait, the session's executor); (0, False, "host") is the
#: baseline.  On a resident session CheckpointEvery hands every epoch after the first to the executor's
#: trigger (the persistent kernel's on a GPU: one launch a step from the host)
#: --decode-rows: each setting by name (the baseline always runs)
#: "resident-held": the resident trigger with no snapshot (DeviceEpochs(snapshot_max=0)): each epoch staged
#: straight into its arena, the gate holding the step until its headers are written, as before the snapshot;
#: the snapshot's baseline
DECODE_ROWS = {"every_step": (1, False, "host"), "every_8": (8, False, "host"), "every_step_waiting": (1, True, "host"),
               "every_step_resident": (1, False, "resident"), "every_8_resident": (8, False, "resident"),
               "every_step_resident_held": (1, False, "resident-held")}
DECODE_SETTINGS = ((0, False, "host"),) + tuple(DECODE_ROWS.values())
#: the rows run unless --decode-rows names others (the snapshot's baseline only when asked for)
DEFAULT_DECODE_ROWS = tuple(r for r in DECODE_ROWS if r != "every_step_resident_held")


def _decode_part(model, cfg, batch, steps, prompt_len, reps, kv_per_token, log_spec, discard, device,
                 settings=DECODE_SETTINGS) -> dict:
    """Tokens/s with no checkpoint, every step and every 8 steps (as
    CheckpointEvery does by default: pending epochs), and every step waiting
    for each checkpoint, on one cache (compiled code reused), each setting's
    measured run after an unmeasured one, the settings interleaved `reps`
    times.  The cache is reset and prefilled before each run's base
    checkpoint, outside the timed decode."""
    import torch
    from transformers import StaticCache

    import concordia
    from concordia.demo.model import prompt
    from concordia.integrations.transformers import protect

    max_len = prompt_len + steps + 1
    cache = StaticCache(config=cfg, max_cache_len=max_len)
    ids = prompt(batch, prompt_len, cfg.vocab_size, device)
    runs = {k: [] for k in settings}
    for rep in range(reps + 1):
        for every, wait, executor in settings:
            log = log_spec("decode")
            with contextlib.ExitStack() as held:
                if executor == "resident-held":  # the engine the next checkpoint builds takes no snapshot
                    from concordia.checkpoint import device_epoch

                    held.enter_context(mock.patch.object(device_epoch, "SNAPSHOT_MAX_BYTES", 0))
                s = held.enter_context(concordia.Session(log, size=_log_size(kv_per_token * batch * max_len),
                                                         executor=executor.split("-")[0]))
                if executor == "resident-held":  # nor its CPU twin (a host session's trigger epochs)
                    s.resident.snapshot_max = 0
                guard = protect(s, cache, model, batch_size=batch, max_tokens=max_len)
                cache.reset()
                _prefill(model, cache, ids[:, :-1], ids.shape[1])  # generate() then starts at the last token
                s.checkpoint()  # the base
                if executor != "host":  # its next epoch builds the executor's engine, once a session, as a
                    s.checkpoint()          # user's first generate() would: outside the timed steps
                per_tok, stats, pending, host_s, (phases, per_step_ms, kept) = _decode(model, guard, ids, steps,
                                                                                        every, wait)
                if rep:  # the first round warms (compiles) every setting
                    # a trigger's epochs have no call to time (their stats say 0 ms): only the calls' own
                    runs[every, wait, executor].append({"s_per_step": per_tok,
                                                        "ckpt_ms": [st.total_ms for st in stats if st.total_ms],
                                              "hook_ms": host_s * 1e3, "phases": phases,
                                              "phases_per_step": per_step_ms, "retention": kept,
                                              "regions": len(guard.names), "pending": pending,
                                              "bytes_per_ckpt": _median([st.log_bytes for st in stats])})
            discard(log)
    del cache
    _empty(torch, device)
    rows = {}
    for (every, wait, executor), rs in runs.items():
        per = _median([r["s_per_step"] for r in rs])
        ck = [c for r in rs for c in r["ckpt_ms"]]
        rows[every, wait, executor] = {"every": every, "wait": wait, "executor": executor,
                             "s_per_step": per, "tokens_per_s": batch / per,
                             "s_per_step_runs": [r["s_per_step"] for r in rs], "ckpt_ms": ck,
                             "pending": sum(r["pending"] for r in rs), "regions": rs[0]["regions"],
                             "ckpt_ms_median": _median(ck),
                             "hook_ms_median": _median([r["hook_ms"] for r in rs]),
                             # per phase, the median over runs of each run's median call (host ms)
                             "host_phases_ms": _by_phase(rs, "phases"),
                             # per phase, the median over runs of its host ms summed over the run per step
                             "host_phases_ms_per_step": _by_phase(rs, "phases_per_step"),
                             "retention": rs[-1]["retention"],
                             "log_bytes_per_ckpt": _median([r["bytes_per_ckpt"] for r in rs if r["bytes_per_ckpt"]])}
    base = rows[0, False, "host"]["s_per_step"]
    for r in rows.values():
        r["overhead"] = r["s_per_step"] / base - 1.0
    # overhead_every_step_resident, overhead_every_8_resident: the same checkpoints by the resident
    # executor's trigger (CheckpointEvery on a resident session); a row --decode-rows left out has no key
    # how far apart the baseline's own runs are ((slowest - fastest) / median): an overhead below
    # this is not told apart from no checkpoint by this run
    spread = rows[0, False, "host"]["s_per_step_runs"]
    out = {"decode": list(rows.values()), "decode_reps": reps, "decode_steps": steps,
           "baseline_spread": (max(spread) - min(spread)) / base if len(spread) > 1 else None}
    out.update({f"overhead_{name}": rows[k]["overhead"] for name, k in DECODE_ROWS.items() if k in rows})
    if (1, False, "host") in rows:
        out["ckpt_ms_per_step"] = rows[1, False, "host"]["ckpt_ms_median"]
    return out


def _kills_part(shape, device, batch, kills, steps, prompt_len, log_spec, say) -> dict:
    """`kills` generations SIGKILLed at random moments (greedy and sampled in
    turn) and one more left to finish, each in its own log."""
    import random

    from concordia.demo.kills import run_kills
    from concordia.demo.model import SHAPES

    sh = SHAPES[shape]
    per_token = 2 * sh["num_hidden_layers"] * sh["num_key_value_heads"] * sh["head_dim"] * 2
    state = per_token * batch * (prompt_len + steps + 1) + (64 << 20)
    plan = [{"seed": 100 + i, "sample": bool(i % 2), "kill": i < kills} for i in range(kills + 1)]
    say(f"kills: {kills} SIGKILLs at random moments of generate(), {steps} steps each")
    t0 = time.perf_counter()
    rep = run_kills(log_spec("kills"), plan, shape=shape, device=device, steps=steps, every=1, batch=batch,
                    prompt_len=prompt_len, size=_log_size(state), segment=64 << 20, rng=random.Random())
    rep["wall_s"] = time.perf_counter() - t0
    return rep


def _recovery_child(log: str, shape: str, device: str, batch: int, max_len: int, prefetch: bool = False) -> dict:
    """A fresh process recovers the log (`python -m concordia.demo.kills
    recover`: read-only open, protect a fresh cache, restore); its times,
    without the process's start-up.  prefetch: the process calls
    `concordia.prefetch` first and builds its model meanwhile."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "concordia.demo.kills", "recover", "--log", log, "--plan", "[]",
                        "--shape", shape, "--device", device, "--batch", str(batch), "--max-len", str(max_len),
                        *(["--prefetch"] if prefetch else [])],
                       capture_output=True, text=True)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        err = [ln for ln in r.stderr.splitlines() if ln.strip()]
        return {"error": err[-1] if err else f"exit {r.returncode}"}
    return json.loads(lines[-1])


def _longrun_part(model, cfg, shape, device, batch, steps, gen, prompt_len, log_x, kv_per_token, log_spec,
                  discard, say) -> dict:
    """One session, a checkpoint at every step of `steps` decode steps (in
    generations of `gen` steps on one cache), into a log of `log_x` times the
    protected state; recovery in a fresh process at step 1,000 and at the end.
    The log is full when a checkpoint coalesced for want of room (or, were
    that ever to happen, raised LogFullError)."""
    import warnings

    import torch
    from transformers import StaticCache

    import concordia
    from concordia.demo.model import lora_update, prompt
    from concordia.regions.errors import LogPressureWarning
    from concordia.integrations.transformers import CheckpointEvery, protect

    max_len = prompt_len + gen + 1
    cache = StaticCache(config=cfg, max_cache_len=max_len)
    seg = 64 << 20 if device.startswith("cuda") else 1 << 20
    say(f"longrun: {steps} steps, a checkpoint at each, generations of {gen}")
    # the probe's log must take two images of the state, as any log protect() registers into
    guess = kv_per_token * batch * max_len + sum(p.nbytes for n, p in model.named_parameters() if "lora_" in n)
    with concordia.Session("memory:", size=_log_size(guess), segment_size=64 << 20) as probe:  # what protect() registers
        protect(probe, cache, model, batch_size=batch, max_tokens=max_len)
        state = sum(int(r.array.nbytes) for r in probe.regions.values())
    size = max(8, int(state * log_x) // seg) * seg
    log = log_spec("longrun")
    out = {"steps": 0, "gen_steps": gen, "generations": 0, "state_bytes": state, "log_bytes": size,
           "log_to_state": size / state, "segment_bytes": seg, "coalesced": 0, "log_full_error": None}
    stats = []
    t_start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught, concordia.Session(log, size=size, segment_size=seg) as s:
        warnings.simplefilter("always", LogPressureWarning)
        guard = protect(s, cache, model, batch_size=batch, max_tokens=max_len)
        update = lora_update(model)
        while out["steps"] < steps:
            n = min(gen, steps - out["steps"])
            cache.reset()
            ids = prompt(batch, prompt_len, cfg.vocab_size, device, seed=out["generations"])
            hook = CheckpointEvery(guard, 1, on_step=update, start=out["steps"],
                                   after=lambda step, st: stats.append(st))
            try:
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, past_key_values=cache,
                               stopping_criteria=[hook])
            except concordia.LogFullError as exc:
                out["log_full_error"] = str(exc)
                break
            out["steps"] += n
            out["generations"] += 1
            if out["steps"] >= 1000 and "recovery_at_1000" not in out:
                out["recovery_at_1000"] = {**_recovery_child(log, shape, device, batch, max_len),
                                           "at_step": out["steps"]}
        out["retention"] = s.retention.to_json()
    out["wall_s"] = time.perf_counter() - t_start
    out["coalesced"] = sum(1 for st in stats if st.coalesced)
    out["log_full"] = out["coalesced"] > 0 or out["log_full_error"] is not None
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, LogPressureWarning)][:5]
    out["bytes_written"] = sum(int(st.log_bytes) for st in stats)
    out["ckpt_ms_median"] = _median([st.total_ms for st in stats])
    out["recovery_at_end"] = {**_recovery_child(log, shape, device, batch, max_len), "at_step": out["steps"]}
    out["recovery_s_at_1000"] = out.get("recovery_at_1000", {}).get("recovery_s")
    out["recovery_s_at_end"] = out["recovery_at_end"].get("recovery_s")
    if out["recovery_s_at_1000"] and out["recovery_s_at_end"]:
        out["end_to_1000"] = out["recovery_s_at_end"] / out["recovery_s_at_1000"]
    discard(log)
    del cache
    _empty(torch, device)
    return out


def probe_decode(rows: tuple, steps: int) -> dict:
    """`run`'s decode part alone on the decode `rows` (DECODE_ROWS names),
    one measured round of `steps` steps after a warm one, in a scratch
    folder with shm logs: the Qwen3-0.6B shape, batch 8, a 512-token prompt
    on CUDA, the tiny shape, batch 2, 16 tokens on the CPU.  The run the
    trigger probes watch (scripts/trigger_*_probe.py)."""
    import torch

    gpu = torch.cuda.is_available()
    with Scratch("model") as scratch:
        return run("0.6b" if gpu else "tiny", "cuda" if gpu else "cpu", 8 if gpu else 2, [64], steps,
                   512 if gpu else 16, 8192, scratch.folder(None), lambda name: scratch.log(name, "shm", None),
                   progress=None, discard=scratch.discard, parts={"decode"}, decode_reps=1, kills=1, kill_steps=12,
                   longrun_steps=10, longrun_gen=10, longrun_log_x=4.0, decode_rows=tuple(rows))


def run(shape: str, device: str, batch: int, contexts: list[int], decode_steps: int, decode_prompt: int,
        chunk: int, workdir: str, log_spec, progress=None, discard=lambda spec: None, *,
        parts=("decode", "kills", "longrun", "recovery"), decode_reps: int = 3, kills: int = 6,
        kill_steps: int = 32, longrun_steps: int = 10000, longrun_gen: int = 1000, longrun_log_x: float = 4.0,
        decode_rows=DEFAULT_DECODE_ROWS, recovery_reps: int = 3) -> dict:
    """Measure.  `workdir` (a folder of the run's own) takes the saved weights;
    `log_spec(name)` names a new log of the run, `discard(spec)` removes it."""
    import torch
    import transformers
    from transformers import Qwen3ForCausalLM, StaticCache

    import concordia
    from concordia.demo.model import allocated_cache, build, prompt
    from concordia.demo.kills import compiled
    from concordia.integrations.transformers import protect, restore

    say = progress or (lambda m: None)
    transformers.logging.set_verbosity_error()
    cfg, model = build(shape, device)
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * \
        next(model.parameters()).element_size()
    res = {"bench": "model", "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
           "shape": shape, "batch": batch, "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
           "compile": compiled(model, StaticCache(config=cfg, max_cache_len=8)), "attn": model.config._attn_implementation,
           "parts": list(parts)}

    if "decode" in parts:
        say(f"decode: batch {batch}, {decode_steps} tokens after a {decode_prompt}-token prompt, "
            f"{decode_reps} rounds")
        settings = tuple(k for k in DECODE_SETTINGS if not k[0] or k in {DECODE_ROWS[r] for r in decode_rows})
        res.update(_decode_part(model, cfg, batch, decode_steps, decode_prompt, decode_reps, kv_per_token, log_spec, discard,
                                device, settings))
    if "longrun" in parts:
        res["longrun"] = _longrun_part(model, cfg, shape, device, batch, longrun_steps, longrun_gen, decode_prompt,
                                       longrun_log_x, kv_per_token, log_spec, discard, say)
    if "kills" in parts:
        run_ = _kills_part(shape, device, batch, kills, kill_steps, min(decode_prompt, 64), log_spec, say)
        res["kills"] = run_.pop("kills")
        res["kills_run"] = run_
    if "recovery" not in parts:
        return res

    # ---- recovery against re-prefill and a cold restart
    h2d = _h2d_GBps(torch, 4 << 30)
    res["h2d_GBps"] = h2d
    weights, adapter = os.path.join(workdir, "weights"), os.path.join(workdir, "adapter")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the bench's own progress lines are the only ones on stderr
    model.get_base_model().save_pretrained(weights, safe_serialization=True)
    model.save_pretrained(adapter, safe_serialization=True)
    res["recovery"] = []
    for ctx in contexts:
        say(f"recovery at {ctx} tokens x {batch}")
        kv_bytes = kv_per_token * batch * ctx
        log = log_spec(f"ctx{ctx}")
        ids = prompt(batch, ctx, cfg.vocab_size, device)
        cache = StaticCache(config=cfg, max_cache_len=ctx + 8)
        row = {"context": ctx, "kv_bytes": kv_bytes}
        with concordia.Session(log, size=_log_size(kv_bytes)) as s:
            # the tokens region too (max_tokens), as a generating program protects it
            guard = protect(s, cache, model, batch_size=batch, max_tokens=ctx + 8)
            _sync(torch, device)
            t0 = time.perf_counter()
            _prefill(model, cache, ids, chunk)
            _sync(torch, device)
            row["prefill_s"] = time.perf_counter() - t0
            st = s.checkpoint()
            row["base_ckpt_ms"] = st.total_ms
        want = [layer.keys.clone() for layer in cache.layers[:2]]
        # what dropping them gives back by reference counting alone (no collection between), the closed
        # session `s` still in scope: all of the cache, where the session, its hooks and the cache hold no cycle
        cuda, was = device.startswith("cuda"), gc.isenabled()
        gc.disable()
        try:
            held = torch.cuda.memory_allocated() if cuda else None
            del cache, guard  # the guard holds the cache's tensors: 30 GB at 32k tokens, kept beside two more
            row["freed_on_drop_bytes"] = held - torch.cuda.memory_allocated() if cuda else None
        finally:
            if was:
                gc.enable()
        _empty(torch, device)
        # recovery: open, protect a fresh cache (allocated, as the re-prefill's is), restore into it
        fresh = allocated_cache(cfg, model, batch, ctx + 8)
        _sync(torch, device)
        t0 = time.perf_counter()
        with concordia.Session(log, create=False) as s:
            ta = time.perf_counter()
            guard = protect(s, fresh, model, batch_size=batch, max_tokens=ctx + 8)
            t1 = time.perf_counter()
            restore(s, guard)
            _sync(torch, device)
            t2 = time.perf_counter()
            row["phases"] = s.last_recovery.phases   # the recovery's, from the session's open on
        row.update(open_s=t1 - t0, restore_s=t2 - t1, recovery_s=t2 - t0, session_s=ta - t0, protect_s=t1 - ta,
                   identical=all(torch.equal(a, b.keys) for a, b in zip(want, fresh.layers[:2])))
        del fresh, want, guard  # (the guard holds the fresh cache: the children need the memory)
        _empty(torch, device)
        # the same recovery in a fresh process, as after a crash: its CUDA start-up, imports
        # and model build left out, its first touches of everything else counted
        row["fresh"] = _recovery_child(log, shape, device, batch, ctx + 8)
        # ... and one that knows it recovers: the log opened and read ahead while its model is built
        # (the median child of several: `fresh_read_ahead_runs` has each one's seconds)
        aheads = [_recovery_child(log, shape, device, batch, ctx + 8, prefetch=True) for _ in range(recovery_reps)]
        done = [a for a in aheads if a.get("recovery_s") is not None]
        row["fresh_read_ahead"] = _median(done, key=lambda a: a["recovery_s"]) or aheads[-1]
        row["fresh_read_ahead_runs"] = [a.get("recovery_s") for a in aheads]
        row["fresh_read_ahead_errors"] = [a["error"] for a in aheads if a.get("error")]
        row["fresh_read_ahead_gc"] = [a.get("gc") for a in aheads]   # the collector's passes in each one's clock
        # re-prefill the same tokens into an empty cache: one untimed (the GPU back at its clocks after the
        # children), then the median of several
        cache = allocated_cache(cfg, model, batch, ctx + 8)
        runs = []
        for i in range(recovery_reps + 1):
            if i:
                cache.reset()   # each re-prefill into an empty cache, as the first
            _sync(torch, device)
            t0 = time.perf_counter()
            _prefill(model, cache, ids, chunk)
            _sync(torch, device)
            if i:
                runs.append(time.perf_counter() - t0)
        row["reprefill_s"], row["reprefill_runs"] = _median(runs), runs
        del cache
        _empty(torch, device)
        # cold restart: weights from safetensors, then re-prefill
        t0 = time.perf_counter()
        from peft import PeftModel

        cold = Qwen3ForCausalLM.from_pretrained(weights, dtype=next(model.parameters()).dtype).to(device)
        cold = PeftModel.from_pretrained(cold, adapter).eval()
        _sync(torch, device)
        t1 = time.perf_counter()
        cache = StaticCache(config=cfg, max_cache_len=ctx + 8)
        _prefill(cold, cache, ids, chunk)
        _sync(torch, device)
        row.update(cold_load_s=t1 - t0, cold_restart_s=time.perf_counter() - t0)
        del cache, cold
        _empty(torch, device)
        discard(log)
        row["recovery_vs_reprefill"] = row["reprefill_s"] / row["recovery_s"]
        fresh_s = row["fresh"].get("recovery_s")
        row["fresh_recovery_vs_reprefill"] = row["reprefill_s"] / fresh_s if fresh_s else None
        # every read ahead restored what the plain recovery did, tensor for tensor (None: not hashed, a large
        # state, or a child that failed: `fresh_read_ahead_errors`)
        dg = [row["fresh"].get("digest")] + [a.get("digest") for a in aheads]
        row["read_ahead_identical"] = None if None in dg else len(set(dg)) == 1
        # from before the model's build to restored, each child: what the read ahead saves the process,
        # its cost to the build (the read beside it) counted
        for who in ("fresh", "fresh_read_ahead"):
            if row[who].get("recovery_s") is not None:
                row[who]["total_s"] = row[who]["build_s"] + row[who]["recovery_s"]
        if "total_s" in row["fresh"] and "total_s" in row["fresh_read_ahead"]:
            row["read_ahead_saved_s"] = row["fresh"]["total_s"] - row["fresh_read_ahead"]["total_s"]
        ahead_s = row["fresh_read_ahead"].get("recovery_s")
        row["fresh_read_ahead_vs_reprefill"] = row["reprefill_s"] / ahead_s if ahead_s else None
        row["recovery_vs_cold"] = row["cold_restart_s"] / row["recovery_s"]
        if h2d:
            row["h2d_s"] = kv_bytes / (h2d * 1e9)
            row["recovery_to_h2d"] = row["recovery_s"] / row["h2d_s"]
        res["recovery"].append(row)
        name = f"{ctx // 1024}k" if ctx % 1024 == 0 else f"{ctx}"
        res[f"recovery_vs_reprefill_{name}"] = row["recovery_vs_reprefill"]
        # issue 30's measure: restore(session, guard) in a fresh process against re-prefilling
        res.setdefault("hf_restore_vs_reprefill", {})[f"ctx_{name}"] = row["fresh_recovery_vs_reprefill"]
        # the same with `concordia.prefetch` called at the process's start (kills.py: _recover_read_ahead)
        res.setdefault("hf_restore_vs_reprefill_read_ahead", {})[f"ctx_{name}"] = row["fresh_read_ahead_vs_reprefill"]
    return res


def _empty(torch, device):
    """Free what PyTorch's and CuPy's pools keep between the bench's phases
    (and what only a collection frees)."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        if "cupy" in sys.modules:
            sys.modules["cupy"].get_default_memory_pool().free_all_blocks()


def _median(xs, key=None):
    """The middle of `xs` (the upper one of an even count), by `key`; None when empty."""
    xs = sorted(xs, key=key)
    return xs[len(xs) // 2] if xs else None


def _log_size(state_bytes: int) -> int:
    # room for retention's base images beside the deltas, in whole 64 MiB segments
    seg = 64 << 20
    return max(8 * seg, (int(state_bytes * 3) // seg + 8) * seg)


def _table(res: dict) -> str:
    out = [f"{res['device']}: Qwen3 {res['shape']} shape ({res['dtype']}, {res['attn']} attention, decode "
           f"{'compiled' if res['compile'] else 'eager'}), batch {res['batch']}, through "
           f"concordia.integrations.transformers"]
    if "decode" in res:
        out.append(f"{'checkpoint':>16} {'tokens/s':>10} {'s/step':>9} {'overhead':>9} {'ckpt ms':>9} {'log KB':>8}")
        for r in res["decode"]:
            trig = {"resident": ", trigger", "resident-held": ", held"}.get(r.get("executor"), "")
            name = "none" if not r["every"] else f"every {r['every']}{trig}"
            ck = "-" if r["ckpt_ms_median"] is None or r.get("executor") != "host" else \
                f"{r['ckpt_ms_median']:.2f}"
            kb = "-" if not r.get("log_bytes_per_ckpt") else f"{r['log_bytes_per_ckpt'] / 1024:.0f}"
            out.append(f"{name:>16} {r['tokens_per_s']:>10.1f} {r['s_per_step']:>9.4f} {r['overhead']:>9.3f} "
                       f"{ck:>9} {kb:>8}")
            tr = (r.get("retention") or {}).get("trigger") or {}
            if tr.get("skipped", 0) > 0:
                out.append(f"{'':>16} NOT every due step checkpointed: {tr['skipped']} of {tr['due']} skipped")
            elif tr.get("skipped", 0) < 0:
                out.append(f"{'':>16} {-tr['skipped']} due steps took two epochs")
        if res.get("baseline_spread") is not None:
            out.append(f"  the baseline's runs are {res['baseline_spread']:.3f} apart (of a step, {res['decode_steps']} "
                       "steps a run): an overhead below that is within this run's noise")
        if res.get("ckpt_ms_per_step") is not None:
            out.append(f"checkpoint per step {res['ckpt_ms_per_step']:.2f} ms")
    if "kills" in res:
        ks = res["kills"]
        out.append(f"kills: {len(ks)} SIGKILLs at random moments, {sum(k['sampled'] for k in ks)} sampled, "
                   f"{sum(k['identical'] for k in ks)} identical (tokens, cache, LoRA); every generation "
                   f"{'identical' if res['kills_run']['identical'] else 'NOT identical'}")
    if "longrun" in res:
        lr = res["longrun"]
        r1 = lr.get("recovery_s_at_1000")
        r2 = lr.get("recovery_s_at_end")
        exhausted = (lr.get("retention") or {}).get("pacing", {}).get("exhausted")
        full = f"{lr['log_full']} ({lr['coalesced']} coalesced{', retention had nothing left to free' if exhausted else ''})"
        out.append(f"longrun: {lr['steps']} steps, a checkpoint at each, log {lr['log_to_state']:.2f}x the state, "
                   f"log full: {full}, recovery at 1,000 "
                   f"{'-' if r1 is None else f'{r1:.3f} s'}, at the end {'-' if r2 is None else f'{r2:.3f} s'}")
    if res.get("recovery"):
        out.append(f"{'context':>8} {'KV GB':>7} {'recover s':>10} {'fresh s':>8} {'re-prefill s':>13} "
                   f"{'cold s':>8} {'vs re-prefill':>14} {'fresh vs':>9} {'vs cold':>8} {'x H2D time':>11}")
        for r in res["recovery"]:
            h = f"{r['recovery_to_h2d']:.2f}" if "recovery_to_h2d" in r else "-"
            fs = r["fresh"].get("recovery_s")
            fresh = ("-", "-") if fs is None else (f"{fs:.3f}", f"{r['fresh_recovery_vs_reprefill']:.1f}x")
            out.append(f"{r['context']:>8} {r['kv_bytes'] / 1e9:>7.2f} {r['recovery_s']:>10.3f} {fresh[0]:>8} "
                       f"{r['reprefill_s']:>13.3f} {r['cold_restart_s']:>8.2f} {r['recovery_vs_reprefill']:>13.1f}x "
                       f"{fresh[1]:>9} {r['recovery_vs_cold']:>7.1f}x {h:>11}")
            if fs is None:
                out.append(f"{'':>8} fresh process: {r['fresh'].get('error')}")
            ra = r.get("fresh_read_ahead") or {}
            if ra.get("recovery_s") is None:
                out.append(f"{'':>8} fresh process, read ahead: {ra.get('error')}")
            else:
                rd = ra.get("read_ahead") or {}
                out.append(f"{'':>8} fresh process, read ahead (concordia.prefetch, then the model built): "
                           f"{ra['recovery_s']:.4f} s of the caller's, {r['fresh_read_ahead_vs_reprefill']:.1f}x "
                           f"re-prefill; build {ra['build_s']:.3f} s (without it {r['fresh'].get('build_s', 0):.3f}), "
                           f"the read's open {rd.get('open_s', 0):.3f} s and read {rd.get('read_s', 0):.3f} s, "
                           f"waited {rd.get('s', 0):.4f} s, used {rd.get('used')}"
                           + (f" ({rd.get('why_not')})" if rd.get("why_not") else ""))
                passes = [g for g in r.get("fresh_read_ahead_gc") or [] if g]
                if passes:
                    out.append(f"{'':>8} the collector inside the read-ahead children's clocks: "
                               + ", ".join(f"{g['passes']} passes ({g['full']} full) {g['s'] * 1e3:.1f} ms"
                                           for g in passes))
            for who, got in (("in process", r), ("fresh", r["fresh"]), ("fresh, read ahead", ra)):
                if got.get("phases"):
                    out.append(f"{'':>8} {who}: session {got['session_s']:.3f} s, protect {got['protect_s']:.3f} s; "
                               + _phase_line(got["phases"])
                               + (f"; imported meanwhile: {', '.join(got['imported'])}" if got.get("imported") else ""))
    return "\n".join(out)


def _phase_line(phases: dict) -> str:
    """A recovery's phases (`RecoveryStats.phases`) in seconds, on one line."""
    return ", ".join(f"{k} {v['s']:.3f}" for k, v in phases.items() if isinstance(v, dict) and "s" in v)


@click.command("model")
@click.option("--contexts", default="1024,8192,32768", show_default=True,
              help="Context lengths (tokens per sequence) at which recovery is measured.")
@click.option("--batch", default=8, show_default=True, type=click.IntRange(1, None), help="Sequences.")
@click.option("--decode-steps", default=256, show_default=True, type=click.IntRange(8, None),
              help="Tokens generated in each decode timing (64 steps of a 6 ms step left the baseline's runs "
                   "12% apart: more than the goals' 3%).")
@click.option("--decode-prompt", default=512, show_default=True, type=click.IntRange(1, None),
              help="Prompt tokens before the decode timing.")
@click.option("--chunk", default=8192, show_default=True, type=click.IntRange(1, None),
              help="Prefill chunk in tokens.")
@click.option("--recovery-reps", default=3, show_default=True, type=click.IntRange(1, None),
              help="Read-ahead recovery children and re-prefills a context (each figure their median).")
@click.option("--decode-reps", default=3, show_default=True, type=click.IntRange(1, None),
              help="Measured rounds of the decode settings (after one unmeasured round).")
@click.option("--kills", "n_kills", default=6, show_default=True, type=click.IntRange(1, None),
              help="Generations SIGKILLed at random moments (greedy and sampled in turn).")
@click.option("--kill-steps", default=32, show_default=True, type=click.IntRange(6, None),
              help="Steps of each generation of the kills part.")
@click.option("--longrun-steps", default=10000, show_default=True, type=click.IntRange(1, None),
              help="Steps of the long run, a checkpoint at each.")
@click.option("--longrun-gen", default=1000, show_default=True, type=click.IntRange(1, None),
              help="Steps of each generation of the long run (one cache, reset between).")
@click.option("--longrun-log-x", default=4.0, show_default=True, type=FiniteRange(1.0, None),
              help="The long run's log size as a multiple of the protected state.")
@click.option("--parts", default="decode,kills,longrun,recovery", show_default=True,
              help="Which parts run: decode, kills, longrun, recovery.")
@click.option("--decode-rows", default=",".join(DEFAULT_DECODE_ROWS), show_default=True,
              help="Which checkpoint settings the decode part measures against no checkpoint.")
@click.option("--tier", type=click.Choice(["shm", "file"]), default="shm", show_default=True,
              help="Where the log lives.")
@click.option("--dir", "workdir", type=click.Path(file_okay=False), default=None,
              help="Where file logs and the saved weights go, in a folder of the run's own "
                   "(default: the temporary folder).")
@click.option("--quick", is_flag=True, help="A tiny model on the CPU, short contexts (CI smoke test).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of the table.")
@click.option("--out", type=click.Path(dir_okay=False), help="Also write the JSON here.")
@force_option("--out")
@guarded
def command(contexts, batch, decode_steps, decode_prompt, chunk, recovery_reps, decode_reps, n_kills, kill_steps,
            longrun_steps, longrun_gen, longrun_log_x, decode_rows, parts, tier, workdir, quick, as_json, out, force):
    """Decode tokens/s of a transformers model with no checkpoint, a checkpoint
    every step and every 8 steps; SIGKILLs at random moments of generate()
    resumed in fresh processes; a long run checkpointing every step; and
    recovery (open + restore into the cache) against re-prefilling the same
    tokens and a cold restart, at several context lengths.

    Example:

    \b
        concordia-wal bench model --contexts 1024,8192,32768 --json --out model.json
        concordia-wal bench model --quick
    """
    check_outputs(force, out)  # before the run: a long benchmark is not refused at its end
    if workdir is not None and not os.path.isdir(workdir):
        raise click.BadParameter(f"{workdir}: no such folder", param_hint="--dir")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built here; nothing is fetched
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as exc:
        from concordia.root_error import MissingDependencyError

        raise MissingDependencyError(exc.name or "transformers", needed_by="concordia-wal bench model") from None
    try:
        ctx = [int(x) for x in contexts.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"not a list of token counts: {contexts!r}", param_hint="--contexts") from None
    if not ctx or min(ctx) < 1:
        raise click.BadParameter(f"not a list of token counts: {contexts!r}", param_hint="--contexts")
    want = [p.strip() for p in parts.split(",") if p.strip()]
    bad = [p for p in want if p not in ("decode", "kills", "longrun", "recovery")]
    if bad or not want:
        raise click.BadParameter(f"unknown part {bad[0] if bad else parts!r} (use decode, kills, longrun, recovery)",
                                 param_hint="--parts")
    rows = [r.strip() for r in decode_rows.split(",") if r.strip()]
    if any(r not in DECODE_ROWS for r in rows):
        raise click.BadParameter(f"unknown row {next(r for r in rows if r not in DECODE_ROWS)!r} "
                                 f"(use {', '.join(DECODE_ROWS)})", param_hint="--decode-rows")
    gpu = torch.cuda.is_available() and not quick
    if quick:
        ctx, batch, decode_steps, decode_prompt, chunk = [64, 256], 2, 8, 16, 128
        decode_reps, n_kills, kill_steps, longrun_steps, longrun_gen, recovery_reps = 1, 2, 12, 300, 100, 1
    with Scratch("model") as scratch:  # its logs, weights and adapter go, however the run ends
        res = run("0.6b" if gpu else "tiny", "cuda" if gpu else "cpu", batch, ctx, decode_steps, decode_prompt,
                  chunk, scratch.folder(workdir), lambda name: scratch.log(name, tier, workdir),
                  progress=None if as_json else (lambda m: click.echo(m, err=True)), discard=scratch.discard,
                  parts=want, decode_reps=decode_reps, kills=n_kills, kill_steps=kill_steps,
                  longrun_steps=longrun_steps, longrun_gen=longrun_gen, longrun_log_x=longrun_log_x,
                  decode_rows=tuple(rows), recovery_reps=recovery_reps)
    res["tier"] = tier
    report(res, as_json=as_json, out=out, table=_table, force=force)  # --out complete or absent
