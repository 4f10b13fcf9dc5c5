"""The kill-and-resume demo on a Hugging Face transformers model.

A Qwen3 model built from a config with seeded random weights (no download: the
0.6B shape on a GPU, a tiny shape on the CPU), a `StaticCache`, and a PEFT LoRA
adapter updated online at every step, generate tokens with
`concordia.integrations.transformers` checkpointing from inside `generate()`.
A worker process is SIGKILLed at a chosen step; a fresh process rebuilds the
model from its seed, restores cache, counters, adapter and tokens from the log,
and generates the rest.  Its tokens, cache and adapter are compared, bit for
bit, with an uninterrupted run.

Each role runs in its own process (`python -m concordia.demo.model ROLE ...`,
one JSON line on stdout), so the kill is a real SIGKILL and the recovery a real
fresh process.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

from concordia.regions.errors import DemoError

SHAPES = {
    # the Qwen3-0.6B shape (28 layers, 8 KV heads of 128, 151,936-token vocabulary)
    "0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 tie_word_embeddings=True),
    # a few layers small enough for a CPU test
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512),
}


def build(shape: str, device: str, *, lora: bool = True, seed: int = 0, attn: str | None = None,
          compile: bool | None = None):
    """(config, model): Qwen3 of `shape` with weights drawn from `seed`, on
    `device` (bf16 on a GPU, fp32 on the CPU), with a LoRA adapter on q and v.
    `attn`: the attention implementation (None: transformers' default, sdpa).
    `compile`: None leaves generate()'s default (its decode step compiled on
    CUDA with a StaticCache, eager on the CPU); True compiles it on the CPU as
    well (`compile_config._compile_all_devices`); False turns it off
    (`generation_config.disable_compile`)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(**SHAPES[shape], **({"attn_implementation": attn} if attn else {}))
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    # made where it runs: drawing 0.6B weights on the host first takes seconds
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(dtype=dtype).eval()
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(seed + 1)
        model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"],
                                                 init_lora_weights=False)).eval()
    if compile is True:
        from transformers.generation.configuration_utils import CompileConfig

        cc = CompileConfig()
        cc._compile_all_devices = True
        model.generation_config.compile_config = cc
    elif compile is False:
        model.generation_config.disable_compile = True
    return cfg, model


def lora_update(model):
    """An online adapter update, the same function of the step in every process:
    the B matrices decay a little and move by a step-dependent amount."""
    import torch

    params = [p for n, p in model.named_parameters() if "lora_B" in n]

    def on_step(step, input_ids):
        with torch.no_grad():
            for p in params:
                p.mul_(0.99).add_(1e-2 * (step % 7))
    return on_step


def allocated_cache(cfg, model, batch: int, max_len: int):
    """A StaticCache of `max_len` tokens for `batch` rows with its tensors
    allocated where the model is (transformers allocates them at the first
    forward otherwise): what a server holds from its start, and what both a
    recovery and a re-prefill begin from in `bench model`."""
    import torch
    from transformers import StaticCache

    p = next(model.parameters())
    cache = StaticCache(config=cfg, max_cache_len=max_len)
    cache.early_initialization(batch_size=batch, num_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                               dtype=p.dtype, device=torch.device(p.device))
    return cache


def prompt(batch: int, length: int, vocab: int, device: str, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(1234 + seed)
    return torch.randint(0, vocab, (batch, length), generator=g).to(device)


def fingerprints(guard) -> dict:
    """A cheap 64-bit sum per protected tensor, computed where it lives (the
    state as of each checkpoint is recorded with it, to tell a restore that
    differs from what was checkpointed from a continuation that differs)."""
    import torch

    out = {}
    for name, t in _tensors(guard).items():
        w = t.detach().contiguous().view(torch.uint8).reshape(-1).to(torch.int64)
        idx = torch.arange(w.numel(), device=w.device, dtype=torch.int64) % 65521 + 1
        out[name] = int((w * idx).sum().item())
    out["counters"] = guard.counters.cpu().tolist()
    return out


def digest(guard) -> dict:
    """sha256 of every protected tensor's bytes (cache, counters, adapter)."""
    import torch

    out = {}
    for name, t in _tensors(guard).items():
        b = t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()
        out[name] = hashlib.sha256(b).hexdigest()
    return out


def _tensors(guard) -> dict:
    out = {}
    for i, k, v in guard.kv:
        layer = guard.cache.layers[i]
        out[k], out[v] = layer.keys, layer.values
    out.update(guard.lora)
    return out


def _setup(args, session):
    import torch
    from transformers import StaticCache

    from concordia.integrations.transformers import protect

    torch.use_deterministic_algorithms(True)
    if not args.device.startswith("cuda"):
        torch.set_num_threads(1)
    cfg, model = build(args.shape, args.device, seed=args.seed)
    max_len = args.prompt + args.steps + 1
    cache = StaticCache(config=cfg, max_cache_len=max_len)
    guard = protect(session, cache, model, batch_size=args.batch, max_tokens=max_len)
    return cfg, model, cache, guard


def run_reference(args) -> dict:
    """An uninterrupted run of `steps` tokens (its checkpoints go to a log too,
    so both runs do the same work)."""
    from concordia.integrations.transformers import CheckpointEvery
    from concordia.session import Session

    with Session(args.log, size=args.size, segment_size=args.segment, overwrite=True) as s:
        cfg, model, cache, guard = _setup(args, s)
        ids = prompt(args.batch, args.prompt, cfg.vocab_size, args.device, args.seed)
        marks = {}
        hook = CheckpointEvery(guard, args.every, on_step=lora_update(model),
                               after=lambda step, st: marks.__setitem__(str(step), fingerprints(guard)))
        out = model.generate(input_ids=ids, max_new_tokens=args.steps, do_sample=False,
                             past_key_values=cache, stopping_criteria=[hook])
        return {"tokens": out.cpu().tolist(), "digest": digest(guard), "epoch": s.epoch, "marks": marks}


def run_worker(args) -> dict:
    """The protected run, SIGKILLed by itself at step `kill_at` (before that
    step's checkpoint, so the work since the last one is lost)."""
    from concordia.integrations.transformers import CheckpointEvery
    from concordia.session import Session

    s = Session(args.log, size=args.size, segment_size=args.segment, overwrite=True)
    cfg, model, cache, guard = _setup(args, s)
    ids = prompt(args.batch, args.prompt, cfg.vocab_size, args.device, args.seed)
    update = lora_update(model)

    def on_step(step, input_ids):
        if step == args.kill_at:
            print(json.dumps({"killed_after_step": step - 1, "last_commit_epoch": s.epoch,
                              "t_kill": time.time()}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        update(step, input_ids)

    marks_path = args.log.split(":", 1)[-1] + ".marks.json"

    def after(step, st):  # the state each checkpoint committed, for the resume to compare
        marks[str(step)] = fingerprints(guard)
        with open(marks_path, "w") as f:
            json.dump(marks, f)

    marks = {}
    hook = CheckpointEvery(guard, args.every, on_step=on_step, after=after)
    model.generate(input_ids=ids, max_new_tokens=args.steps, do_sample=False, past_key_values=cache,
                   stopping_criteria=[hook])
    return {"error": "the worker was not killed"}


def run_resume(args) -> dict:
    """A fresh process: rebuild the model from its seed, restore everything the
    log holds, and generate the rest of the tokens."""
    import torch

    from concordia.integrations.transformers import CheckpointEvery, restore
    from concordia.session import Session

    t0 = time.perf_counter()
    s = Session(args.log, create=False)
    cfg, model, cache, guard = _setup(args, s)
    t1 = time.perf_counter()
    state = restore(s, guard)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    done = state.tokens.shape[1] - args.prompt
    restored = fingerprints(guard)
    hook = CheckpointEvery(guard, args.every, on_step=lora_update(model), start=done)
    t_resumed = time.time()
    out = model.generate(input_ids=state.tokens, max_new_tokens=args.steps - done, do_sample=False,
                         past_key_values=cache, stopping_criteria=[hook])
    s.close()
    return {"tokens": out.cpu().tolist(), "digest": digest(guard), "resumed_at_step": done,
            "epoch": state.epoch, "setup_s": t1 - t0, "restore_s": t2 - t1, "t_resumed": t_resumed,
            "regions": len(guard.names), "restored": restored}


def child(role: str, **kw) -> tuple[int, dict | None, str]:
    """Run one role in a fresh process; (returncode, its JSON line or None, stderr)."""
    argv = [sys.executable, "-m", "concordia.demo.model", role]
    env = dict(os.environ)
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, set before CUDA starts
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    r = subprocess.run(argv, capture_output=True, text=True, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    return r.returncode, (json.loads(lines[-1]) if lines else None), r.stderr


def run_demo(log: str, *, shape: str = "tiny", device: str = "cpu", steps: int = 24, every: int = 4,
             kill_at=11, batch: int = 2, prompt_len: int = 8, size: int = 64 << 20,
             segment: int = 8 << 20, seed: int = 0) -> dict:
    """Reference, worker killed at `kill_at`, resume: the comparison as a dict.
    `kill_at` may be a list of steps: one reference run, then a kill and a
    resume for each, reported under "runs" ("identical" only if all are)."""
    common = dict(shape=shape, device=device, steps=steps, every=every, batch=batch, prompt=prompt_len,
                  size=size, segment=segment, seed=seed)
    rc, ref, err = child("reference", log=log + ".ref", **common)
    if rc != 0 or ref is None:
        raise DemoError(f"reference run failed (exit {rc}): {_last(err)}", where="demo")
    points = kill_at if isinstance(kill_at, (list, tuple)) else [kill_at]
    runs = [_kill_and_resume(log, ref, k, common) for k in points]
    if not isinstance(kill_at, (list, tuple)):
        return runs[0]
    return {"identical": all(r["identical"] for r in runs), "runs": runs, "model": runs[0]["model"]}


def _last(err: str) -> str:
    lines = err.strip().splitlines()
    return lines[-1] if lines else "no message"


def _kill_and_resume(log: str, ref: dict, kill_at: int, common: dict) -> dict:
    rc, worker, err = child("worker", log=log, kill_at=kill_at, **common)
    if rc != -signal.SIGKILL or worker is None:
        raise DemoError(f"worker was not killed (exit {rc}): {_last(err)}", where="demo")
    t_kill = worker.pop("t_kill")
    rc, res, err = child("resume", log=log, **common)
    if rc != 0 or res is None:
        raise DemoError(f"resume failed (exit {rc}): {_last(err)}", where="demo")
    same = {k: res["digest"].get(k) == v for k, v in ref["digest"].items()}
    marks_path = log.split(":", 1)[-1] + ".marks.json"
    try:
        with open(marks_path) as f:
            committed = json.load(f).get(str(res["resumed_at_step"]))
        os.unlink(marks_path)
    except OSError:
        committed = None
    want = ref["marks"].get(str(res["resumed_at_step"]))
    diag = {"restored_equals_checkpointed": None if committed is None else
            [k for k in committed if committed[k] != res["restored"].get(k)],
            "checkpointed_equals_reference": None if committed is None or want is None else
            [k for k in want if want[k] != committed.get(k)]}
    return {"identical": res["tokens"] == ref["tokens"] and all(same.values()),
            "tokens_identical": res["tokens"] == ref["tokens"], "compared": same, "worker": worker,
            "kill_at": kill_at, "differs": diag, "resumed_at_step": res["resumed_at_step"], "recovered_epoch": res["epoch"],
            "restore_s": res["restore_s"], "setup_s": res["setup_s"],
            "kill_to_resumed_s": res["t_resumed"] - t_kill,
            "model": {"shape": common["shape"], "device": common["device"], "batch": common["batch"],
                      "prompt": common["prompt"], "steps": common["steps"], "every": common["every"],
                      "regions": res["regions"]}}


def pick_kill_at(steps: int, every: int, rng) -> int:
    """A step between two checkpoints, after the first one (so there is
    something to recover and something to recompute)."""
    choices = [k for k in range(every + 2, steps + 1) if (k - 1) % every]
    return rng.choice(choices) if choices else steps


def format_report(rep: dict) -> str:
    m = rep["model"]
    lines = [f"model: Qwen3 {m['shape']} shape, random weights, {m['device']}, batch {m['batch']}, "
             f"{m['regions']} regions (StaticCache layers, counters, LoRA adapter, tokens)",
             f"worker SIGKILLed after step {rep['worker']['killed_after_step']}; "
             f"recovered epoch {rep['recovered_epoch']}, resumed at step {rep['resumed_at_step']}",
             f"restore into the cache {rep['restore_s'] * 1e3:.1f} ms; kill to resumed decoding "
             f"{rep['kill_to_resumed_s']:.2f} s (fresh process: imports, model rebuilt from its seed)",
             "tokens, cache and adapter: " + ("BIT-IDENTICAL to an uninterrupted run" if rep["identical"]
                                              else "DIFFERENT from an uninterrupted run: " +
                                              ", ".join(k for k, v in rep["compared"].items() if not v))]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m concordia.demo.model")
    ap.add_argument("role", choices=["reference", "worker", "resume"])
    ap.add_argument("--log", required=True)
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--kill-at", type=int, default=0)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--size", type=int, default=64 << 20)
    ap.add_argument("--segment", type=int, default=8 << 20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    fn = {"reference": run_reference, "worker": run_worker, "resume": run_resume}[args.role]
    print(json.dumps(fn(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
