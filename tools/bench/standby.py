"""`concordia-wal bench standby`: from the SIGKILL of a primary to the first
decode step of a warm standby that took over, for a KV state of --gib GiB.

Three processes, all through public entry points:

* the primary: a `Session` on a hugetlb (or shm) log with one KV region of
  the size asked for (fp16 on the GPU, page 64 KiB), checkpointed whole, then
  a delta; it then holds the log as its writer;
* the standby: `concordia.standby.Standby` on the same log, warmed while the
  primary lives (mapping registered with CUDA, kernels compiled, one restore
  rehearsed); on the takeover its resume hook makes one decode step over the
  restored KV (the scores of one query against every cached key, a softmax,
  the weighted sum of the values: one read of the whole cache) and marks it;
* this process: starts both, SIGKILLs the primary once the standby watches,
  and reads the standby's report.

With --follow the primary checkpoints every step (one page changed a step)
until it is killed, and the run is a chain of takeovers on one log: a warm
standby takes over first (the baseline) and carries on as the primary,
checkpointing every step; then each of --trials hot standbys
(`Standby(follow=True)`: a mirror of the state kept while it waits, each
committed epoch applied as it is written, the takeover applying only what
was committed since its last look) follows the primary of the moment, takes
over when it is killed, and carries on as the next primary.  `standby` gives
the hot takeovers' median and max, `hot_vs_warm` the median over the warm
one, in the same run, on the GPU when there is one (the mirror's arrays on
the device), else on the host (a component figure for the protocol, not the
GPU's kill-to-decoding).

`kill_to_decoding_s` is CLOCK_MONOTONIC from just before the kill to the end
of that first decode step (both processes on one host read one clock);
`kill_to_detect_s` ends when the standby holds the lock, or, for a hot
standby that saw the primary exiting first, when it saw that (it then
decides the log while the primary's teardown holds the lock, and isolate
holds the wait for it); the phases (isolate, restore, reintegrate) are the
standby's own, `restore.last_poll` the phases of the mirror's last poll
before the takeover.  Beside them, pinned
host-to-device bandwidth measured in the same run, and the restore's rate
against it.  Without a GPU (`--quick` in CI) the same runs on the host.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import click
import numpy as np

from ..common import FiniteRange, check_outputs, guarded, report
from concordia.devmem.outfile import hold_interrupts

from ..entry import stopping
from .files import Scratch, force_option

GIB = 1 << 30
PAGE_BYTES = 64 << 10
HEADS, HEAD_DIM = 8, 128


# ---------------------------------------------------------------- the primary
def _primary(spec: str, nbytes: int, device: str, every_step: str = "0", log_ratio: str = "4") -> None:
    """Write the KV state, commit a base and a delta, say "ready", hold the log
    (every_step "1": go on checkpointing, one page changed a step, on a log of
    log_ratio times the state and 8 segments beside it, for retention)."""
    from concordia import Session

    nbytes = int(nbytes)
    xp = _xp(device)
    kv = xp.empty(nbytes // 2, xp.float16)
    flat = kv.view(xp.uint8)
    block = xp.asarray(np.random.default_rng(7).integers(0, 256, min(nbytes, 64 << 20), dtype=np.uint8))
    for i, off in enumerate(range(0, nbytes, block.size)):
        n = min(block.size, nbytes - off)
        flat[off:off + n] = block[:n] ^ np.uint8(i & 0xFF)   # every 64 MiB different
    seg = min(1 << 30, max(16 << 20, -(-(nbytes // 8) // (1 << 20)) * (1 << 20)))
    size = -(-(nbytes + nbytes // 16 + 4 * seg) // seg) * seg
    steps = every_step == "1"
    if steps:   # retention's bases and compaction beside the state
        size = -(-(int(float(log_ratio) * nbytes) + 8 * seg) // seg) * seg
    t0 = time.perf_counter()
    s = Session(spec, size=size, segment_size=seg)  # a new log in the run's own folder
    s.register("kv", kv, kind="kv", page_bytes=PAGE_BYTES)
    s.checkpoint()
    flat[:PAGE_BYTES * 8] ^= np.uint8(1)
    s.checkpoint()
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()
    print(json.dumps({"ready": os.getpid(), "write_s": time.perf_counter() - t0, "epoch": s.epoch,
                      "log_bytes": size}), flush=True)
    if steps:
        _every_step(s, flat)
    while True:
        time.sleep(3600)


def _every_step(s, flat) -> None:
    """Checkpoint every step until killed, one page changed a step."""
    pages = flat.size // PAGE_BYTES
    step = 0
    while True:
        flat[(step % pages) * PAGE_BYTES] ^= np.uint8(1)
        s.checkpoint()
        step += 1


# ---------------------------------------------------------------- the standby
def _decode_step(xp, kv):
    """One decode step's read of the KV cache: a query against every key, a
    softmax, the weighted sum of the values (half the cache keys, half values).
    On the GPU each of the two reads is one cuBLAS product over the cache as it
    lies (every head's query in one block-diagonal matrix, every head's sum in
    one product whose diagonal blocks are kept), so the step runs at memory
    speed as a serving kernel's would; numpy has no half-precision BLAS, and
    its einsum does the same sums faster there."""
    tokens = kv.size // (2 * HEADS * HEAD_DIM)
    kvv = kv[:2 * tokens * HEADS * HEAD_DIM].reshape(2, tokens, HEADS * HEAD_DIM)
    k, v = kvv[0], kvv[1]
    q = xp.ones((HEADS, HEAD_DIM), xp.float16)
    if xp is np:
        scores = np.einsum("thd,hd->ht", k.reshape(tokens, HEADS, HEAD_DIM), q)
    else:
        qm = (xp.eye(HEADS, dtype=xp.float16)[:, None, :] * q[:, :, None]).reshape(HEADS * HEAD_DIM, HEADS)
        scores = (k @ qm).T
    scores = scores.astype(xp.float32) / np.float32(HEAD_DIM ** 0.5)
    scores -= scores.max(axis=1, keepdims=True)
    w = xp.exp(scores)
    w /= w.sum(axis=1, keepdims=True)
    w = w.astype(xp.float16)
    if xp is np:
        out = np.einsum("ht,thd->hd", w, v.reshape(tokens, HEADS, HEAD_DIM))
    else:
        heads = xp.arange(HEADS)
        out = (w @ v).reshape(HEADS, HEADS, HEAD_DIM)[heads, heads]
        xp.cuda.get_current_stream().synchronize()
    return out


def _standby(spec: str, device: str, follow: str = "0", then: str = "stop") -> None:
    """A standby on `spec` (follow "1": hot) that takes over, decodes one step
    and reports; then "primary": it carries on as the primary, checkpointing
    every step, for the next standby to take over from."""
    from concordia.standby import Standby

    xp = _xp(device)

    def warm_decode(sb):   # the model hook: the decode step's kernels loaded, at its size, before the kill
        # a hot standby's mirror is read, as the step reads it: a second copy of the state
        # beside it would not fit on the GPU at 40 GiB with a primary there too
        held = sb.mirror.arrays.get("kv") if sb.mirror is not None else None
        _decode_step(xp, held if held is not None else xp.zeros(sb.regions["kv"].nbytes // 2, xp.float16))
        return "decode"

    def resume(tk):
        _decode_step(xp, tk.arrays["kv"])
        tk.resumed()
        return "decoded"

    sb = Standby(spec, device="gpu" if device == "gpu" else "cpu", load_model=warm_decode,
                 progress=lambda msg: print(f"standby: {msg}", file=sys.stderr, flush=True), follow=follow == "1")
    try:
        tk = sb.run(resume, timeout=120)
    finally:
        sb.close()
    print(json.dumps({"warm": sb.warm_report, **tk.to_json()}), flush=True)
    if then != "primary":
        tk.close()
        return
    s = tk.session()   # the log the takeover holds, carried on
    kv = tk.arrays["kv"]
    s.register("kv", kv, kind="kv", page_bytes=PAGE_BYTES)
    s.adopt(tk.epoch)   # the takeover's state is the log's latest epoch: deltas from it, not a whole image
    s.checkpoint()
    print(json.dumps({"primary": os.getpid(), "epoch": s.epoch}), flush=True)
    _every_step(s, kv.view(xp.uint8))


def _xp(device: str):
    if device == "gpu":
        import cupy

        return cupy
    return np


# ---------------------------------------------------------------- the run
def _child(*args):
    code = ("import sys; from concordia.tools.bench import standby as b; "
            f"b._{args[0]}(*sys.argv[1:])")
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args[1:])], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _drain(proc) -> None:
    """Read a child's output to its end from now on (a primary that goes on
    stepping must never block on a full pipe)."""
    for pipe in (proc.stdout, proc.stderr):
        threading.Thread(target=pipe.read, daemon=True).start()


def _line(proc, stream, what: str, within: float, who: str) -> str:
    """The first line of the child's stdout (stream "out") or stderr ("err")
    holding `what`.  A child that ends first is a RuntimeError naming it,
    how it ended (a signal: the OOM killer's SIGKILL says nothing itself)
    and the last thing it said."""
    deadline = time.monotonic() + within
    pipe = proc.stdout if stream == "out" else proc.stderr
    said = []
    while time.monotonic() < deadline:
        line = pipe.readline()
        if what in line:
            return line
        if not line:
            break
        said.append(line)
    try:
        code = proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        code = None
    if stream == "out" and code is not None:   # it has ended: its stderr is whole
        said += proc.stderr.read().splitlines()
    raise _ended(f"{who} gave no {what!r}", code, said)


def _ended(what: str, code: int | None, said: list) -> RuntimeError:
    """A child that stopped short: what it did not do, how it ended (exit
    status, signal, or still running), its last words and where it raised."""
    last = next((ln.strip() for ln in reversed(said) if ln.strip()), "no message")
    how = ("still running" if code is None else f"killed by signal {-code}" if code < 0
           else f"exit status {code}")
    where = _frames(said)
    return RuntimeError(f"{what} ({how}): {last}" + (f" [at {where}]" if where else ""))


_FRAME = re.compile(r'File "(?:.*/)?([^/"]+/[^/"]+\.pyx?)", line (\d+), in (\S+)')


def _frames(said: list, keep: int = 4) -> str:
    """The innermost `keep` frames of a traceback among a child's lines, as
    'folder/file.py:line in function' joined by ' < ' (innermost first): an
    exception's last line alone does not say which call raised it."""
    found = [m.groups() for m in map(_FRAME.search, said) if m]
    return " < ".join(f"{f}:{n} in {fn}" for f, n, fn in reversed(found[-keep:]))


def _spec(tier: str, scratch: Scratch) -> str:
    if tier == "hugetlb":
        from concordia.devmem import hugetlb

        where = hugetlb.default_mount()
        if where is None:
            raise click.UsageError("no hugetlbfs is mounted (scripts/hugepages.sh setup, as root), or use --tier shm")
        return scratch.log("standby", "hugetlb", where)
    return scratch.log("standby", "shm")


def run(nbytes: int, tier: str, device: str, scratch: Scratch, *, standbys=("warm",), steps: bool = False,
        steps_s: float = 1.0, log_ratio: float = 4.0, progress=None) -> list:
    """A primary and a chain of standbys (module doc), one figure dict per
    standby.  standbys: "warm" or "hot" (a following standby) each; every
    one but the last carries on as the primary the next one takes over from.
    steps: the primaries checkpoint every step, for steps_s seconds under the
    watching standby before each kill, on a log of log_ratio times the state.
    progress: called with one line a takeover as it ends (a chain cut short
    still shows what it measured)."""
    from .recover import _ceiling

    xp = _xp(device)
    base = {"device": device, "tier": tier, "bytes": nbytes, "GiB": nbytes / GIB, "page_bytes": PAGE_BYTES,
            "goals": {"kill_to_decoding_s": 0.5},
            "measured_through": {
                "kill_to_decoding_s kill_to_detect_s isolate_s restore_s first_decode_s":
                    "public entry points: a Session writing the log (the primary), "
                    "concordia.standby.Standby.run (the standby), CLOCK_MONOTONIC stamps of both",
                "restore": "component: restore.device.apply_plan_cupy's own stage seconds"}}
    base["ceiling"] = _ceiling(xp, min(nbytes, 2 * GIB))
    if xp is not np:
        xp.get_default_pinned_memory_pool().free_all_blocks()
        xp.get_default_memory_pool().free_all_blocks()
    spec = _spec(tier, scratch)
    procs, runs = [], []
    # a `timeout` around the bench sends SIGTERM: it unwinds, as the command line's stop
    # (`entry`), so that the children (which map the log) are killed and the log discarded,
    # not left behind; run without the entry point, the bench installs that stop itself
    on_term = (signal.signal(signal.SIGTERM, _stop)
               if threading.current_thread() is threading.main_thread()
               and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL else None)
    try:
        primary = _spawn(procs, "primary", spec, nbytes, device, "1" if steps else "0", log_ratio)
        ready = json.loads(_line(primary, "out", "ready", 600, "the primary"))
        base["primary"] = {"write_s": ready["write_s"], "epoch": ready["epoch"], "log_bytes": ready["log_bytes"],
                           "checkpoints_every_step": steps}
        _drain(primary)
        for i, kind in enumerate(standbys):
            last = i == len(standbys) - 1
            standby = _spawn(procs, "standby", spec, device, "1" if kind == "hot" else "0",
                                 "stop" if last else "primary")
            _line(standby, "err", "watching the primary", 600, f"standby {i + 1} ({kind})")
            if steps:
                time.sleep(steps_s)   # the primary's steps, followed (or not) by the standby
            t_kill = time.monotonic()
            os.kill(primary.pid, signal.SIGKILL)
            primary.wait()
            if last:
                out, err = standby.communicate(timeout=300)
                if standby.returncode != 0:
                    raise _ended(f"standby {i + 1} ({kind}) did not take over", standby.returncode,
                                 err.splitlines())
                rep = json.loads(out.strip().splitlines()[-1])
            else:
                rep = json.loads(_line(standby, "out", '"timeline"', 300, f"standby {i + 1} ({kind})"))
                _line(standby, "out", '"primary"', 300, f"standby {i + 1} ({kind}) as the primary")
                _drain(standby)
            runs.append(_figures(dict(base, standby=kind), rep, t_kill, nbytes))
            r = runs[-1]
            if progress is not None:
                progress(f"standby {i + 1} ({kind}): kill to decoding {r['kill_to_decoding_s']:.3f} s (detect "
                         f"{r['kill_to_detect_s']:.3f}, isolate {r['isolate_s']:.3f}, restore {r['restore_s']:.3f}, "
                         f"decode {r['first_decode_s']:.4f}), epoch {r['epoch']}"
                         + ("" if r["kill_to_confirmed_s"] is None else
                            f", confirmed {r['kill_to_confirmed_s']:.3f} s after the kill (lock "
                            f"{r['kill_to_locked_s']:.3f})")
                         + ("" if r["detect_in_poll_s"] is None else
                            f", {r['detect_in_poll_s']:.3f} s of detect in a poll")
                         + _poll_phases(r["restore"].get("last_poll")))
            primary = standby
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        scratch.discard(spec)
        if on_term is not None and signal.getsignal(signal.SIGTERM) is _stop:  # not once stopped by it
            signal.signal(signal.SIGTERM, on_term)
    return runs


def _stop(signum, frame):
    """SIGTERM as the command line's stop (`entry.stopping`: it unwinds, later
    signals are let go, and the command ends with `error: terminated`, exit 143)."""
    raise stopping(signum)


def _spawn(procs: list, *args):
    """A child started and listed with Ctrl-C and SIGTERM held back
    (`hold_interrupts`): a child forked but not yet in the list would be left
    running by the `finally` that kills them."""
    with hold_interrupts():
        procs.append(_child(*args))
    return procs[-1]


def _poll_phases(p: dict | None) -> str:
    """The phases of the mirror's last poll before the takeover (`Mirror.poll`)."""
    if not p:
        return ""
    return (f" (that poll: read {p['read_s']:.3f}, apply {p['apply_s']:.3f}, write {p['write_s']:.3f} s; "
            f"{p['items']} records, {p['epochs']} epochs{', resynced' if p.get('resynced') else ''})")


def _figures(res: dict, rep: dict, t_kill: float, nbytes: int) -> dict:
    """One takeover's figures from the standby's report and the kill's stamp."""
    st = rep["monotonic_s"]
    res.update({
        "kill_to_decoding_s": st["resumed"] - t_kill,
        "kill_to_restored_s": st["restored"] - t_kill,
        "kill_to_detect_s": st["detected"] - t_kill,
        "isolate_s": st["isolated"] - st["detected"],
        "restore_s": st["restored"] - st["isolated"],
        "first_decode_s": st["resumed"] - st["restored"],
        # of the detect phase, the time a poll of the mirror that ran at the kill went on after it
        "detect_in_poll_s": (max(0.0, st["last_poll_ended"] - max(t_kill, st["last_poll_started"]))
                             if "last_poll_ended" in st else None),
        "epoch": rep["epoch"], "cause": rep["cause"], "timeline": rep["timeline"],
        "restore": rep["restore"], "warm": rep["warm"],
        # an early takeover decodes before the writer lock comes free; the log is held, cut
        # and its epoch confirmed beside it, from the detection on (the first checkpoint waits)
        "early": "early" in rep["restore"],
        "kill_to_locked_s": st["locked"] - t_kill if "locked" in st else None,
        "kill_to_confirmed_s": st["confirmed"] - t_kill if "confirmed" in st else None,
    })
    if "mirror" in rep["restore"]:   # nothing read at the takeover: no rate to give
        res["restore_GBps"] = res["restore_ratio_to_ceiling"] = None
    else:
        res["restore_GBps"] = nbytes / res["restore_s"] / 1e9
        res["restore_ratio_to_ceiling"] = res["restore_GBps"] / res["ceiling"]["GBps"]
    return res


def _table(r: dict, standby: str = "warm") -> str:
    c = r["ceiling"]
    lines = [f"ceiling: {c['what']} {c['GBps']:.1f} GB/s (device: {r['device']})",
             f"{r['GiB']:.2f} GiB of KV on a {r['tier']} log, primary SIGKILLed, standby {standby} "
             f"(warm-up {r['warm']['warm_s']:.2f} s, not counted)",
             f"  kill -> detect     {r['kill_to_detect_s'] * 1e3:8.1f} ms",
             f"  isolate            {r['isolate_s'] * 1e3:8.1f} ms",
             f"  restore            {r['restore_s'] * 1e3:8.1f} ms  " +
             ("(held by the mirror)" if r["restore_GBps"] is None else
              f"{r['restore_GBps']:.1f} GB/s ({100 * r['restore_ratio_to_ceiling']:.0f}% of the ceiling)"),
             f"  first decode step  {r['first_decode_s'] * 1e3:8.1f} ms",
             f"  kill -> decoding   {r['kill_to_decoding_s'] * 1e3:8.1f} ms  (goal "
             f"{r['goals']['kill_to_decoding_s'] * 1e3:.0f} ms)"]
    if r.get("kill_to_confirmed_s") is not None:
        lines.append(f"  kill -> confirmed  {r['kill_to_confirmed_s'] * 1e3:8.1f} ms  (an early takeover: the "
                     f"writer lock {r['kill_to_locked_s'] * 1e3:.1f} ms, the log opened beside the decode)")
    return "\n".join(lines)


@click.command("standby")
@click.option("--gib", default=10.0, show_default=True, type=FiniteRange(min=0, min_open=True),
              help="KV state to protect and recover, in GiB.")
@click.option("--tier", type=click.Choice(["hugetlb", "shm"]), default="hugetlb", show_default=True,
              help="Where the log lives (hugetlb: $CONCORDIA_HUGETLB_DIR or the first hugetlbfs mounted).")
@click.option("--quick", is_flag=True, help="A small state on the host, shm log (CI smoke test).")
@click.option("--follow", is_flag=True,
              help="A primary checkpointing every step, and both standbys on it in one run: warm, and hot "
                   "(Standby(follow=True)); reports their ratio.")
@click.option("--steps-s", default=1.0, show_default=True, type=FiniteRange(min=0),
              help="With --follow: seconds the primary checkpoints under the standby before the kill.")
@click.option("--trials", default=1, show_default=True, type=click.IntRange(min=1),
              help="With --follow: hot standbys in the chain, each killed in turn once the next one follows it.")
@click.option("--log-ratio", default=4.0, show_default=True, type=FiniteRange(min=1.5),
              help="With --follow: the log's size over the state's (8 segments added), for retention.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of the table.")
@click.option("--out", type=click.Path(dir_okay=False), help="Also write the JSON here.")
@force_option("--out")
@guarded
def command(gib, tier, quick, follow, steps_s, trials, log_ratio, as_json, out, force):
    """SIGKILL a primary holding --gib GiB of KV state in a log and time a warm
    standby's takeover, from the kill to its first decode step.

    Example:

    \b
        concordia-wal bench standby --gib 10 --tier hugetlb --json --out standby.json
        concordia-wal bench standby --follow --gib 1 --tier shm
        concordia-wal bench standby --follow --trials 10 --gib 10 --tier hugetlb
    """
    check_outputs(force, out)  # before the run: a long benchmark is not refused at its end
    device = "gpu"
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            device = "cpu"
    except Exception:
        device = "cpu"
    if quick:
        gib, tier, device = 8 / 1024, "shm", "cpu"
    nbytes = max(PAGE_BYTES, int(gib * GIB) // PAGE_BYTES * PAGE_BYTES)
    with Scratch("standby") as scratch:  # its log goes, however the run ends
        if not follow:
            res = run(nbytes, tier, device, scratch)[0]
        else:
            runs = run(nbytes, tier, device, scratch, standbys=["warm"] + ["hot"] * trials, steps=True,
                       steps_s=steps_s, log_ratio=log_ratio,
                       progress=None if as_json else (lambda m: click.echo(m, err=True)))
            res = _follow_result(runs, device, tier, nbytes)
    report(res, as_json=as_json, out=out, table=_follow_table if follow else _table, force=force)


def _follow_result(runs: list, device: str, tier: str, nbytes: int) -> dict:
    """--follow's JSON: the warm standby (the baseline), the first hot one as
    `hot`, every hot one in `hot_trials`, and their kill-to-decoding spread."""
    warm, hots = runs[0], runs[1:]
    times = [h["kill_to_decoding_s"] for h in hots]
    restored = [h["kill_to_restored_s"] for h in hots]
    confirmed = [h["kill_to_confirmed_s"] for h in hots if h.get("kill_to_confirmed_s") is not None]
    return {"follow": True, "device": device, "tier": tier, "GiB": nbytes / GIB, "warm": warm, "hot": hots[0],
            "hot_trials": hots,
            "standby": {"trials": len(hots), "median_s": float(np.median(times)), "max_s": max(times),
                        "min_s": min(times), "kill_to_decoding_s": times,
                        "median_to_restored_s": float(np.median(restored)),
                        # early takeovers: when the log was held and its epoch confirmed (the
                        # first checkpoint's earliest moment), from the kill
                        "early": sum(bool(h.get("early")) for h in hots),
                        "median_to_confirmed_s": (float(np.median(confirmed)) if confirmed else None)},
            "hot_vs_warm": float(np.median(times)) / warm["kill_to_decoding_s"],
            "hot_vs_warm_to_restored": float(np.median(restored)) / warm["kill_to_restored_s"],
            "measured_through": {
                "warm hot": "one chain on one log: a primary checkpointing every step, SIGKILLed under a warm "
                            "standby, which carries on as the primary; then each hot standby in turn follows the "
                            "primary of the moment, takes over when it is SIGKILLed, and carries on as the next "
                            "primary",
                "standby": "the hot standbys' kill_to_decoding_s: median, max, min, each; an early takeover "
                           "(the default of a hot standby) decodes before the primary's writer lock comes "
                           "free, and median_to_confirmed_s is the median kill to the log held, cut and its "
                           "epoch confirmed, beside that decode",
                "hot_vs_warm": "the hot standbys' median kill_to_decoding_s over the warm one's, same run, "
                               "both on `device` (on the host: a component figure for the protocol)",
                "hot_vs_warm_to_restored": "the same to the end of the restore phase (the first "
                                           "decode step left out)"}}


def _follow_table(r: dict) -> str:
    out = [_table(r["warm"], "warm"), _table(r["hot"], "hot"), f"  {r['hot']['restore'].get('via', '')}"]
    sb = r["standby"]
    if sb["trials"] > 1:
        out.append(f"{sb['trials']} hot standbys in turn, kill -> decoding: median {sb['median_s'] * 1e3:.1f} ms, "
                   f"max {sb['max_s'] * 1e3:.1f} ms, min {sb['min_s'] * 1e3:.1f} ms")
    if sb.get("median_to_confirmed_s") is not None:
        out.append(f"{sb['early']} early takeover(s): kill -> the log held and its epoch confirmed, beside the "
                   f"decode: median {sb['median_to_confirmed_s'] * 1e3:.1f} ms")
    out.append(f"hot (median) / warm kill -> decoding: {r['hot_vs_warm']:.3f}; kill -> restored: "
               f"{r['hot_vs_warm_to_restored']:.3f}")
    return "\n".join(out)
