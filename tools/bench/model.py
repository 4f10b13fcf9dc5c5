"""`concordia-wal bench model`: a Hugging Face transformers model protected
through `concordia.integrations.transformers`, the product path a user takes.

A Qwen3 model (the 0.6B shape on a GPU, a tiny shape on the CPU), built from a
config with seeded random weights, a `StaticCache` and a PEFT LoRA adapter
(q and v projections, rank 8), batch 8 by default:

* decode: tokens/s of `model.generate()` with no checkpoint, with a checkpoint
  every step and every 8 steps (`CheckpointEvery`, the stopping-criterion
  hook), and the checkpoint time per step (`CheckpointStats.total_ms`);
  `overhead_every_step` is the decode time per token lost to checkpointing
  every step, as a fraction of the step without;
* recovery at each context length: the cache is prefilled with that many
  tokens and checkpointed (a base of every page), then recovered as a
  recovering program would: `Session(log, create=False)`, `protect` of a fresh
  cache, `restore` into it (open + restore, in this process); beside it, the
  same tokens re-prefilled into an empty cache, and a cold restart (the weights
  loaded from safetensors, then re-prefill); and the KV bytes' time at pinned
  host-to-device bandwidth measured in the same run (the ceiling).

Prefill runs in chunks (--chunk tokens), as a server would for long contexts.
"""

from __future__ import annotations

import os
import time

import click

from ..common import check_outputs, guarded, report
from .files import Scratch, force_option

PAPER_CKPT_MS = 18.9  # per checkpoint, Qwen3-0.6B, in the paper this project follows


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


def _decode(model, cfg, cache, guard, ids, steps, every):
    """generate() `steps` tokens after a prefilled prompt; (seconds per token,
    checkpoint ms of each checkpoint)."""
    import torch

    from concordia.demo.model import lora_update
    from concordia.integrations.transformers import CheckpointEvery

    # every=0: the same online adapter update at every step, no checkpoint
    hook = CheckpointEvery(guard, every or 1 << 40, on_step=lora_update(model))
    _prefill(model, cache, ids[:, :-1], ids.shape[1])  # generate() then starts at the last prompt token
    dev = str(ids.device)
    _sync(torch, dev)
    t0 = time.perf_counter()
    model.generate(input_ids=ids, max_new_tokens=steps, do_sample=False, past_key_values=cache,
                   stopping_criteria=[hook], min_new_tokens=steps)
    _sync(torch, dev)
    dt = time.perf_counter() - t0
    return dt / steps, [st.total_ms for st in hook.stats]


def run(shape: str, device: str, batch: int, contexts: list[int], decode_steps: int, decode_prompt: int,
        chunk: int, workdir: str, log_spec, progress=None, discard=lambda spec: None) -> dict:
    """Measure.  `workdir` (a folder of the run's own) takes the saved weights;
    `log_spec(name)` names a new log of the run, `discard(spec)` removes it."""
    import torch
    import transformers
    from transformers import Qwen3ForCausalLM, StaticCache

    import concordia
    from concordia.demo.model import build, prompt
    from concordia.integrations.transformers import protect, restore

    say = progress or (lambda m: None)
    transformers.logging.set_verbosity_error()
    torch.use_deterministic_algorithms(True)
    cfg, model = build(shape, device)
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * \
        next(model.parameters()).element_size()
    res = {"bench": "model", "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
           "shape": shape, "batch": batch, "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
           "paper_ckpt_ms": PAPER_CKPT_MS}

    # ---- decode with and without checkpoints
    say(f"decode: batch {batch}, {decode_steps} tokens after a {decode_prompt}-token prompt")
    rows = {}
    for every in (0, 1, 8):
        log = log_spec("decode")
        cache = StaticCache(config=cfg, max_cache_len=decode_prompt + decode_steps + 1)
        with concordia.Session(log, size=_log_size(kv_per_token * batch * (decode_prompt + decode_steps))) as s:
            guard = protect(s, cache, model, batch_size=batch, max_tokens=decode_prompt + decode_steps + 1)
            ids = prompt(batch, decode_prompt, cfg.vocab_size, device)
            s.checkpoint()  # the base, outside the timed decode
            per_tok, ckpt_ms = _decode(model, cfg, cache, guard, ids, decode_steps, every)
            rows[every] = {"every": every, "s_per_step": per_tok, "tokens_per_s": batch / per_tok,
                           "ckpt_ms": ckpt_ms, "regions": len(guard.names),
                           "ckpt_ms_median": _median(ckpt_ms)}
        discard(log)
        del cache
    base = rows[0]["s_per_step"]
    for r in rows.values():
        r["overhead"] = r["s_per_step"] / base - 1.0
    res["decode"] = list(rows.values())
    res["overhead_every_step"] = rows[1]["overhead"]
    res["overhead_every_8"] = rows[8]["overhead"]
    res["ckpt_ms_per_step"] = rows[1]["ckpt_ms_median"]

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
            guard = protect(s, cache, model, batch_size=batch)
            _sync(torch, device)
            t0 = time.perf_counter()
            _prefill(model, cache, ids, chunk)
            _sync(torch, device)
            row["prefill_s"] = time.perf_counter() - t0
            st = s.checkpoint()
            row["base_ckpt_ms"] = st.total_ms
        want = [layer.keys.clone() for layer in cache.layers[:2]]
        del cache
        _empty(torch, device)
        # recovery: open, protect a fresh cache, restore into it
        fresh = StaticCache(config=cfg, max_cache_len=ctx + 8)
        _sync(torch, device)
        t0 = time.perf_counter()
        with concordia.Session(log, create=False) as s:
            guard = protect(s, fresh, model, batch_size=batch)
            t1 = time.perf_counter()
            restore(s, guard)
            _sync(torch, device)
            t2 = time.perf_counter()
        row.update(open_s=t1 - t0, restore_s=t2 - t1, recovery_s=t2 - t0,
                   identical=all(torch.equal(a, b.keys) for a, b in zip(want, fresh.layers[:2])))
        del fresh, want
        _empty(torch, device)
        # re-prefill the same tokens into an empty cache
        cache = StaticCache(config=cfg, max_cache_len=ctx + 8)
        cache.early_initialization(batch_size=batch, num_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                                   dtype=next(model.parameters()).dtype, device=torch.device(device))
        _sync(torch, device)
        t0 = time.perf_counter()
        _prefill(model, cache, ids, chunk)
        _sync(torch, device)
        row["reprefill_s"] = time.perf_counter() - t0
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
        row["recovery_vs_cold"] = row["cold_restart_s"] / row["recovery_s"]
        if h2d:
            row["h2d_s"] = kv_bytes / (h2d * 1e9)
            row["recovery_to_h2d"] = row["recovery_s"] / row["h2d_s"]
        res["recovery"].append(row)
        key = f"recovery_vs_reprefill_{ctx // 1024}k" if ctx % 1024 == 0 else f"recovery_vs_reprefill_{ctx}"
        res[key] = row["recovery_vs_reprefill"]
    return res


def _empty(torch, device):
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def _log_size(state_bytes: int) -> int:
    # room for retention's base images beside the deltas, in whole 64 MiB segments
    seg = 64 << 20
    return max(8 * seg, (int(state_bytes * 3) // seg + 8) * seg)


def _table(res: dict) -> str:
    out = [f"{res['device']}: Qwen3 {res['shape']} shape ({res['dtype']}), batch {res['batch']}, "
           f"{res['decode'][0]['regions']} regions through concordia.integrations.transformers"]
    out.append(f"{'checkpoint':>14} {'tokens/s':>10} {'s/step':>9} {'overhead':>9} {'ckpt ms':>9}")
    for r in res["decode"]:
        name = "none" if not r["every"] else f"every {r['every']}"
        ck = "-" if r["ckpt_ms_median"] is None else f"{r['ckpt_ms_median']:.2f}"
        out.append(f"{name:>14} {r['tokens_per_s']:>10.1f} {r['s_per_step']:>9.4f} {r['overhead']:>9.3f} {ck:>9}")
    out.append(f"checkpoint per step {res['ckpt_ms_per_step']:.2f} ms (the paper: {res['paper_ckpt_ms']} ms "
               f"on Qwen3-0.6B)")
    out.append(f"{'context':>8} {'KV GB':>7} {'recover s':>10} {'re-prefill s':>13} {'cold s':>8} "
               f"{'vs re-prefill':>14} {'vs cold':>8} {'x H2D time':>11}")
    for r in res["recovery"]:
        h = f"{r['recovery_to_h2d']:.2f}" if "recovery_to_h2d" in r else "-"
        out.append(f"{r['context']:>8} {r['kv_bytes'] / 1e9:>7.2f} {r['recovery_s']:>10.3f} "
                   f"{r['reprefill_s']:>13.3f} {r['cold_restart_s']:>8.2f} {r['recovery_vs_reprefill']:>13.1f}x "
                   f"{r['recovery_vs_cold']:>7.1f}x {h:>11}")
    return "\n".join(out)


@click.command("model")
@click.option("--contexts", default="1024,8192,32768", show_default=True,
              help="Context lengths (tokens per sequence) at which recovery is measured.")
@click.option("--batch", default=8, show_default=True, type=click.IntRange(1, None), help="Sequences.")
@click.option("--decode-steps", default=64, show_default=True, type=click.IntRange(8, None),
              help="Tokens generated in each decode timing.")
@click.option("--decode-prompt", default=512, show_default=True, type=click.IntRange(1, None),
              help="Prompt tokens before the decode timing.")
@click.option("--chunk", default=8192, show_default=True, type=click.IntRange(1, None),
              help="Prefill chunk in tokens.")
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
def command(contexts, batch, decode_steps, decode_prompt, chunk, tier, workdir, quick, as_json, out, force):
    """Decode tokens/s of a transformers model with no checkpoint, a checkpoint
    every step and every 8 steps, and recovery (open + restore into the cache)
    against re-prefilling the same tokens and a cold restart, at several
    context lengths.

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
    gpu = torch.cuda.is_available() and not quick
    if quick:
        ctx, batch, decode_steps, decode_prompt, chunk = [64, 256], 2, 8, 16, 128
    with Scratch("model") as scratch:  # its logs, weights and adapter go, however the run ends
        res = run("0.6b" if gpu else "tiny", "cuda" if gpu else "cpu", batch, ctx, decode_steps, decode_prompt,
                  chunk, scratch.folder(workdir), lambda name: scratch.log(name, tier, workdir),
                  progress=None if as_json else (lambda m: click.echo(m, err=True)), discard=scratch.discard)
    res["tier"] = tier
    report(res, as_json=as_json, out=out, table=_table, force=force)  # --out complete or absent
