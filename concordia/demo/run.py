"""`concordia demo`: a decode loop killed with SIGKILL and recovered bit-exact.

Three runs of the reference workload (`concordia.demo.workload`):

1. reference: uninterrupted, to the last step;
2. worker: a child process that checkpoints into the log every few steps and
   is killed with SIGKILL after a chosen step (between two checkpoints, so the
   steps since the last commit are lost and must be recomputed);
3. recovery: a fresh child process that opens the log, restores the last
   committed epoch into fresh arrays, recomputes the lost steps and continues
   to the end, checkpointing into the same log.

The generated tokens and the final KV cache, adapter, scheduler tables and
counters of run 3 must equal run 1 bit for bit.  The worker runs in lock step
with this process (it waits for a go-ahead after every step), so the kill
lands exactly after the chosen step.  The log is left for `concordia-wal`.

The children are this module run as a program (`python -m concordia.demo
worker|resume ...`); they speak JSON lines on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from concordia.regions.errors import DemoError
from concordia.demo.workload import Workload, WorkloadConfig

DEFAULT_LOG = "file:./concordia-data/demo.log"
DEFAULT_STEPS = 160
DEFAULT_EVERY = 4
LOG_SIZE = 128 << 20
SEGMENT_SIZE = 16 << 20


# ---------------------------------------------------------------- helpers

def _n(count: int, noun: str) -> str:
    """'1 step', '2 steps'."""
    return f"{count} {noun}{'' if count == 1 else 's'}"

def array_module(device: str):
    """numpy or CuPy for device 'cpu' | 'gpu' | 'auto' (GPU when CuPy finds one)."""
    if device == "cpu":
        return np
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
    except Exception as exc:
        if device == "gpu":
            raise DemoError(f"no usable GPU: {type(exc).__name__}: {exc}", hint="use --device cpu") from None
    if device == "gpu":
        raise DemoError("no CUDA device found", hint="use --device cpu")
    return np


def register_workload(session, wl: Workload) -> None:
    """The five state arrays, each with the detector its kind calls for."""
    kvb = wl.kv_blocks()
    t = wl.tables
    session.register("kv", wl.kv, kind="kv", page_bytes=4096, block_tables=kvb["block_tables"],
                     seq_lens=kvb["seq_lens"], block_stamp=kvb["block_stamp"], seq_ids=t.slot_req)
    session.register("adapter", wl.adapter, kind="adapter", page_bytes=4096)
    session.register("sched", wl.sched, kind="scheduler", page_bytes=512)
    session.register("tokens", wl.tokens, kind="scheduler", page_bytes=1024)
    session.register("meta", wl.meta, kind="opaque", page_bytes=64)


def _emit(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _config(args) -> WorkloadConfig:
    return WorkloadConfig(seed=args.seed)


# ---------------------------------------------------------------- children
def worker_main(args) -> int:
    """Run from step 0 with checkpoints; after every step report and wait for 'go'."""
    from concordia.policy import Policy
    from concordia.session import Session

    xp = array_module(args.device)
    wl = Workload(_config(args), xp=xp)
    s = Session(args.log, overwrite=True, size=LOG_SIZE, segment_size=SEGMENT_SIZE,
                policy=Policy(every_steps=args.every))
    register_workload(s, wl)
    st = s.checkpoint(reason="start")
    _emit({"event": "checkpoint", "epoch": st.epoch, "step": 0, "bytes": st.bytes, "ms": st.total_ms})
    while wl.step_index < args.steps:
        wl.step()
        st = s.step()
        if st is not None:
            _emit({"event": "checkpoint", "epoch": st.epoch, "step": wl.step_index, "bytes": st.bytes,
                   "ms": st.total_ms})
        _emit({"event": "step", "step": wl.step_index})
        if sys.stdin.readline().strip() != "go":
            break
    s.close()
    _emit({"event": "done", "step": wl.step_index})
    return 0


def reference_main(args) -> int:
    """The uninterrupted run, in a process set up exactly like the others."""
    t0 = time.perf_counter()
    wl = Workload(_config(args), xp=array_module(args.device))
    wl.run(args.steps)
    np.savez(args.state_out, **wl.snapshot())
    _emit({"event": "reference", "seconds": time.perf_counter() - t0})
    return 0


def resume_main(args) -> int:
    """Recover from the log, recompute the lost steps, continue to the end."""
    t_start = time.perf_counter()
    from concordia.policy import Policy
    from concordia.session import Session

    xp = array_module(args.device)
    warm = _Warmup(_config(args), xp) if xp is not np else None
    wl = Workload(_config(args), xp=xp)
    t_ready = time.perf_counter()
    s = Session(args.log, create=False, policy=Policy(every_steps=args.every))
    t_open = time.perf_counter()
    uncommitted = sum(d.length for d in s.log.dropped if d.kind in ("uncommitted", "torn"))
    register_workload(s, wl)
    s.recover(into="registered")
    if xp is not np:
        xp.cuda.Device().synchronize()
    t_restored = time.perf_counter()
    rec = s.last_recovery
    warm_wait_ms = warm.join() if warm is not None else 0.0
    resumed_at = wl.step_index
    steps_ms = []  # (model step, checkpoint) per recomputed step, each synchronised
    while wl.step_index < max(args.lost_until, resumed_at):
        t0 = time.perf_counter()
        wl.step()
        if xp is not np:
            xp.cuda.Device().synchronize()
        t1 = time.perf_counter()
        st = s.step()
        if xp is not np:
            xp.cuda.Device().synchronize()
        steps_ms.append([round((t1 - t0) * 1e3, 3), round((time.perf_counter() - t1) * 1e3, 3),
                         st.to_json() if st is not None else None])
    if xp is not np:
        xp.cuda.Device().synchronize()
    t_caught_up = time.perf_counter()
    wl.run(args.steps, on_step=lambda _w, _i: s.step())
    final = s.checkpoint(reason="end")
    s.close()
    np.savez(args.state_out, **wl.snapshot())
    _emit({"event": "resumed", "epoch": rec.epoch, "resumed_at_step": resumed_at,
           "recomputed_steps": max(args.lost_until, resumed_at) - resumed_at,
           "uncommitted_bytes_dropped": uncommitted, "dropped": rec.dropped,
           "start_ms": (t_ready - t_start) * 1e3, "open_ms": (t_open - t_ready) * 1e3,
           "plan_ms": rec.plan_ms, "restore_ms": (t_restored - t_open) * 1e3 - rec.plan_ms,
           "restore_bytes": rec.bytes, "restore_pages": rec.pages, "region_bytes": rec.regions,
           "recompute_ms": (t_caught_up - t_restored) * 1e3, "final_epoch": final.epoch,
           "warm_ms": warm.ms if warm is not None else 0.0, "warm_wait_ms": warm_wait_ms,
           "warm_error": warm.error if warm is not None else None,
           "warm_steps": warm.steps if warm is not None else 0, "recompute_steps_ms": steps_ms,
           "checkpoint_bytes": s.checkpoint_totals.bytes})
    return 0


def warm_model(wl: Workload, max_steps: int = 64) -> int:
    """Step a scratch workload until a step has run the model (the first steps
    of the reference workload admit nobody, so one step loads none of the
    model's kernels); returns the steps taken."""
    for n in range(1, max_steps + 1):
        if wl.step()["running"]:
            return n
    raise DemoError(f"the workload ran no sequence in its first {max_steps} steps")


class _Warmup:
    """Loads every kernel the resumed run will launch (Concordia's, for each
    page size the workload registers, and the model's, by stepping a scratch
    copy of the workload until it has run the model) on a thread, while the
    log is opened and restored: the first recomputed step then finds them
    loaded.  join() returns the milliseconds the caller waited for it."""

    def __init__(self, cfg: WorkloadConfig, xp):
        import threading

        self.ms = 0.0
        self.steps = 0
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, args=(cfg, xp), name="warmup", daemon=True)
        self._thread.start()

    def _run(self, cfg, xp) -> None:
        t0 = time.perf_counter()
        try:
            from concordia.gpu_kernels import gpu, jit

            specs = []
            for pb in (4096, 512, 1024, 64):
                d = {"PAGE_BYTES": pb}
                specs += [("stage", d), ("crc32c", d), ("shadow_diff", d), ("scatter", d)]
            jit.precompile(specs + [("crc32c", {})])
            gpu.precompile_helpers()
            self.steps = warm_model(Workload(cfg, xp=xp))
            xp.cuda.get_current_stream().synchronize()
        except Exception as exc:  # a warm-up that fails only costs the time it saved
            self.error = f"{type(exc).__name__}: {exc}"
        self.ms = (time.perf_counter() - t0) * 1e3

    def join(self) -> float:
        t0 = time.perf_counter()
        self._thread.join()
        return (time.perf_counter() - t0) * 1e3


# ---------------------------------------------------------------- parent
def _child(mode: str, argv: list[str], **popen):
    """Every run is a child with the same environment: one BLAS thread (the
    model is small; more threads only fight over the cores), so the three runs
    do exactly the same arithmetic."""
    env = dict(os.environ)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, "1")
    cmd = [sys.executable, "-m", "concordia.demo", mode, *argv]
    return subprocess.Popen(cmd, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, **popen)


@contextlib.contextmanager
def reaped(proc):
    """`proc` killed and waited for when the block is left by an exception
    (Ctrl-C or SIGTERM to this process alone): no child outlives the run,
    holding its log's memory mapped."""
    try:
        yield proc
    except BaseException:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        raise


def _run_child(mode: str, argv: list[str]) -> dict:
    with reaped(_child(mode, argv)) as proc:
        stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        raise DemoError(f"{mode} process failed (exit {proc.returncode}): {_last_line(stderr)}")
    return [json.loads(x) for x in stdout.splitlines() if x.startswith("{")][-1]


def _load(path: str) -> dict:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def _lines(proc):
    for line in proc.stdout:
        line = line.strip()
        if line.startswith("{"):
            yield json.loads(line)


def pick_kill_step(steps: int, every: int, rng: random.Random) -> int:
    """A step after the first post-start checkpoint that is not itself a
    checkpoint step, so committed state exists and uncommitted work is lost."""
    cands = [k for k in range(every + 1, steps) if k % every]
    if not cands:
        raise DemoError(f"--steps {steps} leaves no step to kill between checkpoints of every {every}",
                        hint="use more steps or checkpoint more often")
    return rng.choice(cands)


def run_demo(*, log: str = DEFAULT_LOG, steps: int = DEFAULT_STEPS, kill_at="random", seed: int = 0,
             every: int = DEFAULT_EVERY, device: str = "auto", progress=None, force: bool = False) -> dict:
    """The whole demo; returns the report (see `format_report`).  The log is
    formatted afresh: a target holding a Concordia log is replaced, one holding
    anything else is refused and left unchanged unless `force`."""
    say = progress or (lambda _msg: None)
    if steps < 2:
        raise DemoError(f"--steps must be at least 2, not {steps}", where="demo")
    if every < 1:
        raise DemoError(f"--every must be at least 1, not {every}", where="demo")
    if kill_at == "random":
        kill = pick_kill_step(steps, every, random.Random())
    else:
        kill = int(kill_at)
        if not 1 <= kill < steps:
            raise DemoError(f"--kill-at {kill} must lie in [1, {steps - 1}]", where="demo")
    from concordia.wal.volume import check_format_target

    # the worker formats the log (Session(overwrite=True)): the same check as every create path first
    check_format_target(log, overwrite=force, allow_log=True, hint="pass --force to overwrite it")
    xp = array_module(device)   # a device it cannot use is refused before any folder is made
    _prepare_log_dir(log)
    dev = "gpu" if xp is not np else "cpu"
    cfg = WorkloadConfig(seed=seed)
    common = ["--log", log, "--steps", str(steps), "--seed", str(seed), "--every", str(every), "--device", dev]

    tmp = tempfile.TemporaryDirectory(prefix="concordia-demo-")
    try:
        return _run(log, steps, kill, seed, every, dev, cfg, common, tmp.name, say)
    finally:
        tmp.cleanup()


def _run(log, steps, kill, seed, every, dev, cfg, common, tmp, say) -> dict:
    say(f"reference run: {steps} steps uninterrupted")
    ref_npz = os.path.join(tmp, "reference.npz")
    ref_s = _run_child("reference", common + ["--state-out", ref_npz])["seconds"]
    ref_state = _load(ref_npz)
    ref_out = _outputs_of(cfg, ref_state)

    say(f"worker: checkpoint every {every} steps into {log}; SIGKILL after step {kill}")
    w = _child("worker", common, stdin=subprocess.PIPE)
    checkpoints, last_commit_step, killed_at = [], 0, None
    t_kill = t_dead = None
    try:
        for ev in _lines(w):
            if ev["event"] == "checkpoint":
                checkpoints.append(ev)
                last_commit_step = ev["step"]
            elif ev["event"] == "step":
                if ev["step"] >= kill:
                    killed_at = ev["step"]
                    t_kill = time.perf_counter()
                    os.kill(w.pid, signal.SIGKILL)
                    w.wait()
                    t_dead = time.perf_counter()
                    break
                w.stdin.write("go\n")
                w.stdin.flush()
    finally:
        if w.poll() is None:
            w.kill()
            w.wait()
    if killed_at is None:
        raise DemoError(f"worker ended before step {kill} (exit {w.returncode}): "
                        + _last_line(w.stderr.read()))
    w.stderr.close()
    w.stdout.close()
    w.stdin.close()

    say(f"recovery: fresh process restores the last commit (step {last_commit_step}) and continues")
    out_npz = os.path.join(tmp, "final.npz")
    t_spawn = time.perf_counter()
    res = _run_child("resume", common + ["--lost-until", str(killed_at), "--state-out", out_npz])
    got = _load(out_npz)

    compare = {}
    for name, arr in ref_state.items():
        compare[name] = bool(arr.dtype == got[name].dtype and arr.shape == got[name].shape
                             and arr.tobytes() == got[name].tobytes())
    tokens_ok = _outputs_of(cfg, got) == ref_out
    identical = all(compare.values()) and tokens_ok

    spawn_to_open_ms = res["start_ms"] + res["open_ms"]
    timeline = [
        {"phase": "detect", "ms": (t_dead - t_kill) * 1e3,
         "what": "worker death seen (SIGKILL sent, exit status reaped)"},
        {"phase": "isolate", "ms": (t_spawn - t_dead) * 1e3 + spawn_to_open_ms,
         "what": "fresh process started, log opened at the last commit (epoch "
                 f"{res['epoch']}); " + (f"{_kib(res['uncommitted_bytes_dropped'])} of uncommitted records cut away"
                                         if res["uncommitted_bytes_dropped"] else
                                         "nothing uncommitted on media: the lost steps died with the worker")},
        {"phase": "restore", "ms": res["plan_ms"] + res["restore_ms"],
         "what": f"epoch {res['epoch']} planned ({res['plan_ms']:.1f} ms) and applied, "
                 f"{_mib(res['restore_bytes'])} read, digests verified"},
        {"phase": "reintegrate", "ms": res["recompute_ms"],
         "what": f"{_n(res['recomputed_steps'], 'lost step')} recomputed (steps {res['resumed_at_step']}"
                 f"..{killed_at}); decoding resumed"},
    ]
    return {
        "identical": identical,
        "device": dev,
        "log": log,
        "workload": {"layers": cfg.n_layers, "d_model": cfg.d_model, "slots": cfg.max_slots,
                     "requests": cfg.n_requests, "steps": steps, "seed": seed,
                     "state_bytes": {k: int(v.nbytes) for k, v in ref_state.items()}},
        "reference_s": ref_s,
        "checkpoint_every": every,
        "worker": {"killed_after_step": killed_at, "last_commit_step": last_commit_step,
                   "last_commit_epoch": checkpoints[-1]["epoch"] if checkpoints else 0,
                   "checkpoints": len(checkpoints),
                   "checkpoint_bytes": int(sum(c["bytes"] for c in checkpoints)),
                   "base_bytes": int(checkpoints[0]["bytes"]) if checkpoints else 0,
                   "checkpoint_ms_mean": float(np.mean([c["ms"] for c in checkpoints[1:]]))
                   if len(checkpoints) > 1 else 0.0},
        "recovery": res,
        "timeline": timeline,
        "total_recovery_ms": sum(p["ms"] for p in timeline),
        "compared": {**compare, "generated_tokens": tokens_ok},
    }


def _outputs_of(cfg: WorkloadConfig, state: dict) -> dict:
    wl = Workload(cfg, xp=np)
    wl.load_state(state)
    return wl.outputs()


def _prepare_log_dir(log: str) -> None:
    kind, _, path = log.partition(":")
    if kind in ("file", "pmem") and path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    elif ":" not in log:
        os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)


def _last_line(text: str) -> str:
    lines = [x for x in (text or "").strip().splitlines() if x.strip()]
    return lines[-1] if lines else "no message"


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


def format_report(rep: dict) -> str:
    w, r = rep["workload"], rep["worker"]
    lines = [
        f"workload   {w['layers']} layers x {w['d_model']} wide, {w['slots']} slots, {w['requests']} requests, "
        f"{w['steps']} steps on the {rep['device'].upper()}; state "
        f"{_mib(sum(w['state_bytes'].values()))} (kv {_mib(w['state_bytes']['kv'])})",
        f"log        {rep['log']}",
        f"reference  uninterrupted run: {rep['reference_s'] * 1e3:.0f} ms",
        f"worker     checkpoint every {rep['checkpoint_every']} steps: {r['checkpoints']} epochs, "
        f"{_mib(r['checkpoint_bytes'])} written (base {_mib(r['base_bytes'])}, "
        f"{r['checkpoint_ms_mean']:.1f} ms per delta checkpoint)",
        f"crash      SIGKILL after step {r['killed_after_step']}; last commit: epoch {r['last_commit_epoch']} "
        f"at step {r['last_commit_step']} ({_n(r['killed_after_step'] - r['last_commit_step'], 'step')} lost)",
        "recovery timeline",
    ]
    for p in rep["timeline"]:
        lines.append(f"  {p['phase']:<12}{p['ms']:9.1f} ms  {p['what']}")
    lines.append(f"  {'total':<12}{rep['total_recovery_ms']:9.1f} ms")
    res = rep["recovery"]
    lines.append(f"bytes      restore read {_mib(res['restore_bytes'])} from the log; the recovered run "
                 f"wrote {_mib(res['checkpoint_bytes'])} more (last epoch {res['final_epoch']})")
    cmp = rep["compared"]
    detail = ", ".join(f"{k} {'=' if ok else 'DIFFERS'}" for k, ok in cmp.items())
    verdict = "BIT-IDENTICAL to the uninterrupted run" if rep["identical"] else "MISMATCH"
    lines.append(f"result     {verdict} ({detail})")
    lines.append(f"inspect    concordia-wal info {rep['log']}")
    return "\n".join(lines)


# ---------------------------------------------------------------- entry
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m concordia.demo")
    p.add_argument("mode", choices=["reference", "worker", "resume"])
    p.add_argument("--log", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--every", type=int, default=DEFAULT_EVERY)
    p.add_argument("--device", default="cpu")
    p.add_argument("--lost-until", type=int, default=0)
    p.add_argument("--state-out")
    args = p.parse_args(argv)
    from concordia.root_error import ConcordiaError

    try:
        return {"reference": reference_main, "worker": worker_main, "resume": resume_main}[args.mode](args)
    except ConcordiaError as exc:
        sys.stderr.write(f"error: {exc.one_line()}\n")
        return 2  # the parent reports any failure of a child as a DemoError
