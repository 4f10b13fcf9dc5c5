"""The read-ahead probes (`concordia.prefetch`, issue 30), one question each;
diagnostic only: the figures a claim rests on come from `bench model --parts
recovery` (its fresh_read_ahead child).  Both write the Qwen3 0.6B shape's
state (batch 8, a StaticCache of CTX tokens prefilled, its LoRA) into an shm
log first (`_written`), then:

  profile      in this process, PLAIN_REPS times timed without a profiler,
               then REPS times under cProfile: a prefetch of the log onto
               the GPU, a fresh cache, protect() and restore() (the first
               rep is the process's first use of each path)
  fresh        FRESH_REPS fresh processes recover the log with a read ahead
               as the bench's fresh_read_ahead child does, its protect()
               and restore() under cProfile (the process's first use of
               each path, which the in-process profile does not see)
  stamps       FRESH_REPS fresh processes recover the log as `fresh`'s
               children do, with the functions of the recovery clocked
               instead of profiled (`read_ahead_stamps.py`: a microsecond a
               call, where cProfile doubles the times)
  contention   fresh processes recover the log as the bench's children do
               (`python -m concordia.demo.kills recover`): without a read
               ahead, with one, and with one under each shorter GIL switch
               interval of INTERVALS (seconds, comma-separated; CPython's
               default is 0.005), each printing its JSON line

    python3 scripts/gpu/read_ahead_probe.py profile|fresh|stamps|contention OUT_FILE
    (CTX, PLAIN_REPS, REPS, FRESH_REPS, INTERVALS from the environment; scripts/gpu/read_ahead_*_probe.sh)
"""

from __future__ import annotations

import cProfile
import gc
import io
import json
import os
import pstats
import signal
import subprocess
import sys
import time

import torch
from transformers import StaticCache

import concordia
from concordia.demo.model import allocated_cache, build, prompt
from concordia.integrations.transformers import protect, restore
from concordia.tools.bench.files import Scratch
from concordia.tools.bench.model import _prefill

BATCH, CHUNK = 8, 8192
WRAP = ("import runpy, sys; sys.setswitchinterval(float(sys.argv[1])); sys.argv = ['kills'] + sys.argv[2:]; "
        "runpy.run_module('concordia.demo.kills', run_name='__main__', alter_sys=True)")
# the child of `fresh`: concordia.demo.kills with its protect() and restore() profiled into argv[1]
PROFILED = """
import cProfile, gc, io, pstats, sys, time
import concordia.demo.kills as k
out, inner = sys.argv[1], k._protect_and_restore
def profiled(*a, **kw):
    pr = cProfile.Profile()
    pauses, began = [], {}
    def on_gc(phase, info):   # the cyclic collector's passes inside the clock: generation, seconds
        if phase == 'start':
            began['t'] = time.perf_counter()
        elif 't' in began:
            pauses.append((info['generation'], time.perf_counter() - began.pop('t')))
    gc.callbacks.append(on_gc)
    pr.enable()
    try:
        return inner(*a, **kw)
    finally:
        pr.disable()
        gc.callbacks.remove(on_gc)
        t = io.StringIO()
        t.write('collections (generation, ms): %s, %.3f ms in all\\n' % (
            [(g, round(s * 1e3, 3)) for g, s in pauses], sum(s for _, s in pauses) * 1e3))
        pstats.Stats(pr, stream=t).sort_stats('cumulative').print_stats(45)
        pstats.Stats(pr, stream=t).sort_stats('tottime').print_stats(30)
        open(out, 'w').write(t.getvalue())
k._protect_and_restore = profiled
sys.exit(k.main(sys.argv[2:]))
"""


def _written(log: str, cfg, model, ctx: int) -> str:
    """The state of `ctx` tokens prefilled (in CHUNK-token pieces, as `bench model` does) and checkpointed into
    `log`; a line saying so."""
    cache = StaticCache(config=cfg, max_cache_len=ctx + 8)
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2 * BATCH * ctx
    with concordia.Session(log, size=kv + kv // 4 + (2 << 30)) as s:
        g = protect(s, cache, model, batch_size=BATCH, max_tokens=ctx + 8)
        ids = prompt(BATCH, ctx, cfg.vocab_size, "cuda")
        t = time.perf_counter()
        _prefill(model, cache, ids, CHUNK)
        torch.cuda.synchronize()
        line = (f"ctx {ctx} x {BATCH}: prefill {time.perf_counter() - t:.3f} s, "
                f"checkpoint {s.checkpoint().total_ms:.0f} ms, {kv / 1e9:.1f} GB of KV")
    del g, cache, ids
    gc.collect()
    torch.cuda.empty_cache()
    return line


def profile(log: str, cfg, model, ctx: int, say, out) -> None:
    plain = int(os.environ.get("PLAIN_REPS", "3"))   # first these, timed without cProfile
    for rep in range(plain + int(os.environ.get("REPS", "3"))):
        p = concordia.prefetch(log, device="cupy", readonly=True)
        fresh = allocated_cache(cfg, model, BATCH, ctx + 8)   # as `bench model`'s children have it
        p.wait()
        s = p.session()
        pr = cProfile.Profile() if rep >= plain else None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if pr is not None:
            pr.enable()
        g = protect(s, fresh, model, batch_size=BATCH, max_tokens=ctx + 8)
        t1 = time.perf_counter()
        restore(s, g)
        torch.cuda.synchronize()
        if pr is not None:
            pr.disable()
        t2 = time.perf_counter()
        say(f"rep {rep}: protect {t1 - t0:.4f} s, restore {t2 - t1:.4f} s "
            f"({'under cProfile' if pr else 'not profiled'}), regions {len(s.regions)}, "
            f"read ahead used {s.last_recovery.phases['read_ahead']['used']}")
        if pr is None:
            s.close()
            del g, fresh
            torch.cuda.empty_cache()
            continue
        text = io.StringIO()
        pstats.Stats(pr, stream=text).sort_stats("cumulative").print_stats(40)
        pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(30)   # where the time is spent
        out.write(text.getvalue() + "\n")
        s.close()
        del g, fresh
        torch.cuda.empty_cache()


def _recover_args(log: str, ctx: int) -> list:
    """`concordia.demo.kills recover`'s arguments for the probe's log, as the bench's children get them."""
    return ["recover", "--log", log, "--plan", "[]", "--shape", "0.6b", "--device", "cuda", "--batch", str(BATCH),
            "--max-len", str(ctx + 8)]


def _child(name: str, cmd: list, say) -> dict | None:
    """Run a recovering child; its JSON line, or None once its failure is said."""
    r = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode or not lines:
        say(f"{name}: failed (exit {r.returncode}): {(r.stderr.strip().splitlines() or ['?'])[-1]}")
        return None
    return json.loads(lines[-1])


def fresh(log: str, cfg, model, ctx: int, say, out) -> None:
    for rep in range(int(os.environ.get("FRESH_REPS", "2"))):
        stats = f"{out.name}.rep{rep}"
        d = _child(f"fresh rep {rep}", [sys.executable, "-c", PROFILED, stats, *_recover_args(log, ctx), "--prefetch"],
                   say)
        if d is None:
            if os.path.exists(stats):
                os.remove(stats)
            continue
        say(f"fresh rep {rep} (under cProfile): recovery {d['recovery_s']:.4f} s, prefetch call "
            f"{d['prefetch_call_s']:.4f} s, protect {d['protect_s']:.4f} s, restore {d['restore_s']:.4f} s")
        with open(stats) as f:
            out.write(f.read() + "\n")
        os.remove(stats)


def stamps(log: str, cfg, model, ctx: int, say, out) -> None:
    child = os.path.join(os.path.dirname(os.path.abspath(__file__)), "read_ahead_stamps.py")
    for rep in range(int(os.environ.get("FRESH_REPS", "2"))):
        clocked = f"{out.name}.rep{rep}"
        d = _child(f"stamps rep {rep}", [sys.executable, child, clocked, *_recover_args(log, ctx), "--prefetch"], say)
        if d is not None:
            # (the collector's passes inside protect() and restore(): the child counts them, `gc`)
            say(f"stamps rep {rep}: recovery {d['recovery_s']:.4f} s, prefetch call {d['prefetch_call_s']:.4f} s, "
                f"protect {d['protect_s']:.4f} s, restore {d['restore_s']:.4f} s, collector {d.get('gc')}")
            say("  " + json.dumps({k: v for k, v in d["phases"].items() if k != "read_ahead"}))
        if os.path.exists(clocked):
            with open(clocked) as f:
                out.write(f.read() + "\n")
            os.remove(clocked)


def contention(log: str, cfg, model, ctx: int, say, out) -> None:
    intervals = [float(x) for x in os.environ.get("INTERVALS", "0.001,0.0002").split(",") if x]
    args = _recover_args(log, ctx)
    runs = [("plain", [sys.executable, "-m", "concordia.demo.kills", *args]),
            ("read ahead, interval 0.005", [sys.executable, "-m", "concordia.demo.kills", *args, "--prefetch"])]
    runs += [(f"read ahead, interval {i}", [sys.executable, "-c", WRAP, str(i), *args, "--prefetch"])
             for i in intervals]
    for name, cmd in runs:
        t = time.perf_counter()
        d = _child(name, cmd, say)
        if d is None:
            continue
        d.pop("imported", None)
        say(f"{name}: process {time.perf_counter() - t:.1f} s, build {d['build_s']:.3f} s, "
            f"recovery {d['recovery_s']:.3f} s, build + recovery {d['build_s'] + d['recovery_s']:.3f} s")
        say("  " + json.dumps(d.get("read_ahead") or d.get("phases")))


def main(what: str, path: str) -> None:
    # `timeout` sends SIGTERM: unwind, so that the scratch log (gigabytes in /dev/shm) is removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    probe = {"profile": profile, "fresh": fresh, "stamps": stamps, "contention": contention}[what]
    ctx = int(os.environ.get("CTX", "512"))
    cfg, model = build("0.6b", "cuda")
    with Scratch(f"read-ahead-{what}-probe") as scratch, open(path, "w") as out:
        def say(line):
            print(line, flush=True)
            out.write(line + "\n")

        log = scratch.log("probe", "shm")
        say(_written(log, cfg, model, ctx))
        if what in ("fresh", "stamps", "contention"):   # the children build their own; at 32k each needs 60 GB of the GPU
            del model
            gc.collect()
            torch.cuda.empty_cache()
            model = None
        probe(log, cfg, model, ctx, say, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
