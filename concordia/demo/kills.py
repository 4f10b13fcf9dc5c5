"""SIGKILLs at random moments of `generate()`, each followed by a restore and
a continuation in a fresh process, compared bit for bit with an uninterrupted
run: tokens, the final cache and the final LoRA weights.

A plan is a list of generations (each its own log, prompt and seed, greedy or
sampled, `steps` new tokens, a checkpoint every `every` steps).  One process
per life, so the start-up (imports, model build, compile) is paid once per
kill, not once per generation:

    reference   runs every generation uninterrupted, one after another
    recover     recovers one log into a fresh cache and times it (bench model);
                with --prefetch the log is opened and read ahead on a thread
                (`concordia.prefetch`) while the model is built
    life        restores the generation the last life was killed in (if any),
                finishes it, then starts the next ones; once a generation it
                was told to die in has taken `min_steps` steps, it says so
                (a line on stdout with its measured step time) and the parent
                SIGKILLs it after a random delay of up to `window` steps: in a
                forward, a LoRA update, a checkpoint, wherever it falls

The model is built once per process (the Qwen3 shapes of `concordia.demo.model`,
transformers' defaults: sdpa attention, and generate()'s compiled decode step
where transformers compiles it), with one StaticCache reset between
generations and the LoRA weights put back to their initial values, so that
compiled code is reused.  Every role prints JSON lines; the parent
(`run_kills`) returns the comparison.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import signal
import subprocess
import sys
import time

from concordia.regions.errors import DemoError

from .model import allocated_cache, build, digest, lora_update, prompt
from .run import reaped


def _model(args):
    import torch
    from transformers import StaticCache

    if not args.device.startswith("cuda"):
        torch.set_num_threads(1)
    compile_ = {"default": None, "on": True, "off": False}[args.compile]
    cfg, model = build(args.shape, args.device, seed=args.seed, compile=compile_)
    cache = StaticCache(config=cfg, max_cache_len=args.prompt + args.steps + 1)
    lora0 = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    return cfg, model, cache, lora0


def _fresh(model, cache, lora0) -> None:
    """A new generation on the same objects: an empty cache, the adapter as built."""
    import torch

    cache.reset()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in lora0:
                p.copy_(lora0[n])


def compiled(model, cache) -> bool:
    """Whether generate() compiles its decode step for this model and cache:
    transformers' own criterion, as generate() asks it."""
    gen = model.get_base_model() if hasattr(model, "get_base_model") else model
    return bool(gen._valid_auto_compile_criteria({"past_key_values": cache}, gen.generation_config))


def _protect(args, session, cache, model):
    from concordia.integrations.transformers import protect

    return protect(session, cache, model, batch_size=args.batch, max_tokens=args.prompt + args.steps + 1)


def _generate(args, g: dict, model, cfg, cache, session, *, guard=None, start=0, ids=None, mask=None,
              on_ckpt=None):
    import torch

    from concordia.integrations.transformers import CheckpointEvery

    guard = guard or _protect(args, session, cache, model)
    if ids is None:
        ids = prompt(args.batch, args.prompt, cfg.vocab_size, args.device, g["seed"])
        torch.manual_seed(g["seed"])  # the sampling generator, as a user seeds it
    update = lora_update(model)
    hook = CheckpointEvery(guard, args.every, on_step=update, start=start,
                           after=(lambda step, st: on_ckpt(step)) if on_ckpt else None)
    kw = {"do_sample": True, "top_k": 0} if g["sample"] else {"do_sample": False}
    out = model.generate(ids, attention_mask=mask, max_new_tokens=args.steps - start, past_key_values=cache,
                         stopping_criteria=[hook], **kw)
    return out, guard


def _result(gen: int, out, guard) -> dict:
    return {"gen": gen, "tokens": out.cpu().tolist(), "digest": digest(guard)}


def _log(args, gen: int) -> str:
    return f"{args.log}.{gen}"


def _session(args, gen: int, **kw):
    from concordia.session import Session

    return Session(_log(args, gen), size=args.size, segment_size=args.segment, executor=args.executor, **kw)


def _say(doc: dict) -> None:
    print(json.dumps(doc), flush=True)


def run_reference(args) -> None:
    plan = json.loads(args.plan)
    cfg, model, cache, lora0 = _model(args)
    _say({"compiled": compiled(model, cache)})
    for i, g in enumerate(plan):
        _fresh(model, cache, lora0)
        with _session(args, i, overwrite=True) as s:
            out, guard = _generate(args, g, model, cfg, cache, s)
            _say(_result(i, out, guard))


def run_life(args) -> None:
    import torch

    plan = json.loads(args.plan)
    die_in = {int(x) for x in args.die_in.split(",") if x != ""}
    cfg, model, cache, lora0 = _model(args)
    first = args.resume
    if args.resume >= 0:
        from concordia.integrations.transformers import restore

        _fresh(model, cache, lora0)  # the restore must put everything back, not find it there
        with _session(args, args.resume, create=False) as s:
            guard = _protect(args, s, cache, model)
            state = restore(s, guard)
            if torch.cuda.is_available() and args.device.startswith("cuda"):
                torch.cuda.synchronize()
            _say({"restored": args.resume, "epoch": state.epoch, "steps": state.steps})
            if state.steps >= args.steps:  # the kill came after the last step's checkpoint: nothing to take
                out = state.tokens
            else:
                out, guard = _generate(args, plan[args.resume], model, cfg, cache, s, guard=guard,
                                       start=state.steps, ids=state.tokens, mask=state.attention_mask)
            _say({**_result(args.resume, out, guard), "resumed_at_step": state.steps, "epoch": state.epoch})
        first = args.resume + 1
    else:
        first = 0
    for i in range(first, len(plan)):
        _fresh(model, cache, lora0)
        marks = []

        def at(step, i=i, marks=marks):
            marks.append((step, time.perf_counter()))
            if i in die_in and step >= args.min_steps and len(marks) > 1 and marks[-2][0] < args.min_steps:
                (s0, t0), (s1, t1) = marks[-2], marks[-1]
                _say({"kill_me": i, "step": step, "step_s": (t1 - t0) / (s1 - s0)})
        with _session(args, i, overwrite=True) as s:
            out, guard = _generate(args, plan[i], model, cfg, cache, s, on_ckpt=at)
            _say(_result(i, out, guard))
        if i in die_in:  # the kill has not come yet: wait for it outside generate()
            _say({"finished_before_kill": i})
            time.sleep(3600)


def run_recover(args) -> None:
    """A fresh process recovers `--log` read-only into a fresh cache (protect,
    restore) and says how long that took, without its start-up."""
    from concordia.session import Session

    sync = _sync(args)
    tb = time.perf_counter()
    model, cache = _model_and_cache(args, sync)
    gc.freeze()   # as the read-ahead child (and the README's recipe): the built model out of the collector's walks
    build_s = time.perf_counter() - tb
    loaded = set(sys.modules)
    t0 = time.perf_counter()
    with Session(args.log, create=False, readonly=True) as s:
        ta = time.perf_counter()
        got = _protect_and_restore(s, args, model, cache, sync)
    # where the time went: the open of the Session and protect(), then the recovery's phases
    _say({"open_s": ta - t0 + got["protect_s"], "recovery_s": ta - t0 + got["protect_s"] + got["restore_s"],
          "session_s": ta - t0, "build_s": build_s, **got, "imported": _imported(loaded)})


def _recover_read_ahead(args) -> None:
    """run_recover as a process that knows it recovers: `concordia.prefetch`
    first, the model built meanwhile, then protect and restore.  recovery_s
    is what the recovery kept the caller's thread: the prefetch call, then
    from the model's end on (waiting for the open and the read included);
    build_s is the model's build beside the read, the read's own times are
    in `read_ahead`; `gc` counts the collector's passes inside protect()
    and restore(), after `gc.freeze()` (README: recovery in a fresh
    process)."""
    import torch

    from concordia.prefetching import prefetch

    cuda = args.device.startswith("cuda")
    sync = _sync(args)
    if cuda:  # CUDA's start-up is not the recovery's, as in run_recover (whose build pays it before its clock)
        torch.zeros(1, device=args.device)
        sync()
    loaded = set(sys.modules)
    t0 = time.perf_counter()
    p = prefetch(args.log, device="cupy" if cuda else None, readonly=True)
    ta = time.perf_counter()
    model, cache = _model_and_cache(args, sync)
    # the built model's objects out of the collector's reach, as a serving process does once its model is
    # loaded: a full pass over them (about 250 ms on an H100's host) fell inside protect() in one child in four
    gc.freeze()
    tb = time.perf_counter()
    with p.session() as s:
        tc = time.perf_counter()
        got = _protect_and_restore(s, args, model, cache, sync)
    waited = tc - tb + got["protect_s"] + got["restore_s"]   # everything after the build
    _say({"open_s": ta - t0 + tc - tb + got["protect_s"], "recovery_s": ta - t0 + waited, "prefetch_call_s": ta - t0,
          "build_s": tb - ta, "session_s": tc - tb, **got, "read_ahead": got["phases"].get("read_ahead"),
          "imported": _imported(loaded)})


def _sync(args):
    import torch

    return torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)


def _model_and_cache(args, sync) -> tuple:
    """The model of `--shape` and an empty StaticCache of `--max-len` for
    `--batch` rows, its tensors allocated (`allocated_cache`: as `bench
    model`'s re-prefill baseline finds them), built and synchronised."""
    cfg, model = build(args.shape, args.device, seed=args.seed)
    cache = allocated_cache(cfg, model, args.batch, args.max_len)
    sync()
    return model, cache


def _protect_and_restore(s, args, model, cache, sync) -> dict:
    """protect() a fresh cache in session `s` and restore() into it: the
    seconds of each, the epoch and steps restored, the recovery's phases and
    a digest of what it restored (taken after the clock)."""
    from concordia.integrations.transformers import protect, restore

    passes = _CollectorPasses()
    gc.callbacks.append(passes)
    try:
        t0 = time.perf_counter()
        guard = protect(s, cache, model, batch_size=args.batch, max_tokens=args.max_len)
        t1 = time.perf_counter()
        state = restore(s, guard)
        sync()
        t2 = time.perf_counter()
    finally:
        gc.callbacks.remove(passes)
    return {"protect_s": t1 - t0, "restore_s": t2 - t1, "epoch": state.epoch, "steps": state.steps,
            "phases": s.last_recovery.phases, "gc": passes.said(), "digest": _digest(guard)}


class _CollectorPasses:
    """The cyclic collector's passes while protect() and restore() run (a
    `gc.callbacks` entry): a full pass over a built model's objects took about
    250 ms in one fresh child in four on an H100's host, inside protect()."""

    def __init__(self):
        self.passes, self.began = [], None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.began = time.perf_counter()
        elif self.began is not None:
            self.passes.append((info.get("generation"), time.perf_counter() - self.began))
            self.began = None

    def said(self) -> dict:
        """{"passes": how many, "s": their seconds, "full": how many were of the oldest generation}"""
        return {"passes": len(self.passes), "s": sum(t for _, t in self.passes),
                "full": sum(1 for g, _ in self.passes if g == 2)}


def _imported(loaded: set) -> list:
    """The packages first imported since `loaded` (inside the timed recovery: their import is in it)."""
    return sorted({m.partition(".")[0] for m in set(sys.modules) - loaded})


#: a recovering child hashes what it restored (`digest`) up to this many bytes (sha256 on the host: about 1 GB/s)
DIGEST_MAX_BYTES = 2 << 30


def _digest(guard) -> str | None:
    """One sha256 over the digests of every protected tensor, after the timed
    recovery; None for a state above DIGEST_MAX_BYTES."""
    import hashlib

    from .model import _tensors

    if sum(t.nbytes for t in _tensors(guard).values()) > DIGEST_MAX_BYTES:
        return None
    return hashlib.sha256(json.dumps(digest(guard), sort_keys=True).encode()).hexdigest()


def _spawn(role: str, args: dict):
    argv = [sys.executable, "-m", "concordia.demo.kills", role]
    for k, v in args.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _lines(proc):
    for line in proc.stdout:
        if line.startswith("{"):
            yield json.loads(line)


def _tail(proc) -> str:
    err = proc.stderr.read() if proc.stderr else ""
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "no message"


def run_kills(log: str, plan: list[dict], *, shape: str = "tiny", device: str = "cpu", steps: int = 12,
              every: int = 1, batch: int = 2, prompt_len: int = 8, compile: str = "default",
              size: int = 64 << 20, segment: int = 8 << 20, seed: int = 0, window: float = 3.0,
              rng: random.Random | None = None, executor: str = "host") -> dict:
    """Kill each generation of `plan` whose "kill" is true at a random moment
    of its generate() (after `min_steps` = a third of `steps`, within `window`
    step times), restore it in a fresh process and finish it; compare every
    generation with the reference.  executor: the sessions' (`Session(executor=...)`;
    "resident": the executor's trigger takes every epoch after the first).
    {"kills": [...], "identical": bool, ...}."""
    rng = rng or random.Random()
    common = dict(shape=shape, device=device, steps=steps, every=every, batch=batch, prompt=prompt_len,
                  compile=compile, size=size, segment=segment, seed=seed, plan=json.dumps(plan),
                  min_steps=max(2, steps // 3), executor=executor)
    refs, compiled = {}, None
    with reaped(_spawn("reference", dict(common, log=log + ".ref"))) as ref:
        for doc in _lines(ref):
            if "compiled" in doc:
                compiled = doc["compiled"]
            else:
                refs[doc["gen"]] = doc
        ref.wait()
    if ref.returncode != 0 or len(refs) != len(plan):
        raise DemoError(f"the reference run failed (exit {ref.returncode}): {_tail(ref)}", where="kills")
    die = [i for i, g in enumerate(plan) if g.get("kill")]
    results, kills, resume = {}, [], -1
    while True:
        killed = None
        with reaped(_spawn("life", dict(common, log=log, resume=resume,
                                         die_in=",".join(str(i) for i in die)))) as life:
            for doc in _lines(life):
                if "kill_me" in doc:
                    per = doc["step_s"] or 0.01
                    delay = rng.uniform(0, window * per)
                    time.sleep(delay)
                    life.send_signal(signal.SIGKILL)
                    killed = {"gen": doc["kill_me"], "signalled_at_step": doc["step"], "delay_s": delay}
                elif "finished_before_kill" in doc:
                    pass  # known below: its result came before the kill
                elif "restored" in doc:
                    kills[-1].update(restored_epoch=doc["epoch"], resumed_at_step=doc["steps"])
                elif "gen" in doc:
                    results[doc["gen"]] = doc
            rc = life.wait()
        if killed is None:
            if rc != 0:
                raise DemoError(f"a life ended with exit {rc}: {_tail(life)}", where="kills")
            break
        if rc != -signal.SIGKILL:
            raise DemoError(f"a life was not killed (exit {rc}): {_tail(life)}", where="kills")
        # the kill fell outside generate() only if that generation's result came first
        killed["during_generate"] = killed["gen"] not in results
        kills.append(killed)
        die = [i for i in die if i > killed["gen"]]
        resume = killed["gen"]
    out = []
    for k in kills:
        i = k["gen"]
        same = {n: results[i]["digest"].get(n) == h for n, h in refs[i]["digest"].items()}
        out.append({**k, "sampled": bool(plan[i]["sample"]), "compile": compiled,
                    "tokens_identical": results[i]["tokens"] == refs[i]["tokens"],
                    "identical": results[i]["tokens"] == refs[i]["tokens"] and all(same.values()),
                    "differs": sorted(n for n, v in same.items() if not v)})
    whole = all(results.get(i, {}).get("tokens") == refs[i]["tokens"] for i in range(len(plan)))
    return {"kills": out, "identical": bool(out) and all(k["identical"] for k in out) and whole,
            "compile": compiled, "generations": len(plan),
            "model": {"shape": shape, "device": device, "batch": batch, "prompt": prompt_len, "steps": steps,
                      "every": every}, "executor": executor}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m concordia.demo.kills")
    ap.add_argument("role", choices=["reference", "life", "recover"])
    ap.add_argument("--log", required=True)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--compile", default="default", choices=["default", "on", "off"])
    ap.add_argument("--size", type=int, default=64 << 20)
    ap.add_argument("--segment", type=int, default=8 << 20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-steps", type=int, default=2)
    ap.add_argument("--resume", type=int, default=-1)
    ap.add_argument("--die-in", default="")
    ap.add_argument("--max-len", type=int, default=0)
    ap.add_argument("--executor", default="host", choices=["host", "resident"])
    ap.add_argument("--prefetch", action="store_true")
    args = ap.parse_args(argv)
    recover = _recover_read_ahead if args.prefetch else run_recover
    {"reference": run_reference, "life": run_life, "recover": recover}[args.role](args)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
