"""`concordia-wal bench executor-session`: the resident executor driving a
Session, against the host path, through the public entry points.

  stall     (on a GPU, `"stall"` is `device_steps`: 300 decode steps queued on
            the device and counted there, `DeviceStepCounter`, while the caller
            busy-loops in pure Python for 200 ms; the rows below also run)
            a producer ("the device") runs decode steps inside the pause gate
            and counts them; the session's trigger checkpoints every N steps
            from the consumer; the caller's thread stalls for 200 ms.  Epochs
            committed during the stall, and whether every one of them
            recovers to exactly the state of the step it records.  The stall
            kinds: time.sleep (releases the GIL) and a pure-Python busy loop
            (holds the GIL between the interpreter's switch intervals, which
            hands it to the consumer thread only every `sys.getswitchinterval()`).
            On the CPU the consumer is a Python thread; with no host thread the
            persistent kernel is the H200's case.
  ckpt_ms   `Session.checkpoint()` of 1 and 1,024 regions, one dirty page each:
            executor="host" (the default staging), "host" with staging="mapped"
            (the same region-table pipeline the resident path takes), and
            executor="resident" (its epochs after the first are arena
            epochs, checkpoint/arena_route.py: on a GPU, EPOCH tasks of the
            persistent kernel; on the CPU, the consumer thread's twin), and
            executor="auto", the default, on the path it decided on after its
            first epoch (`ckpt_detail` names the path each took); medians in milliseconds, means beside them (the resident
            rows' include taking a full arena on, once per arena).
  residency (GPU only) slowdown of an fp16 GEMM, a GEMV and a streaming add
            while a persistent kernel is resident and idle beside a Session
            that has committed (`bench executor`'s measurement, with the
            Session open): a component figure, since the session's epochs run
            on the thread consumer until the device epoch handler exists.

  device    (GPU only) the persistent kernel's EPOCH handler
            (checkpoint/device_epoch.py), through a resident Session:
            `epoch_on_device` from the completion of the EPOCH task behind one
            `checkpoint()`; the device trigger's stall (300 steps queued, each
            followed by `s.resident.step_trigger(8).step()`, the step gate on
            the caller's stream; the caller in a pure-Python loop for
            GIL_HELD_S; every epoch checked in a fresh process), which becomes
            `"stall"`; `latency_ms`: `Session.checkpoint()` with
            executor="resident" (the product path, the ckpt_ms row) against
            executor="host" for each region count, and the default
            executor="auto" (`auto_took`: the path it decided on; a goal
            says whether that was the faster one), with one EPOCH task of
            `DeviceEpochs` beside them (`epoch_task`, a component figure)
            and, in `latency_phases_us`, that task's phases as the device
            stamped them; `idle_slowdown`: the residency rows' with the SM
            target, as fractions.
  recover   (GPU only) a resident session's recovery onto the device, one
            RECOVER task of a persistent kernel (restore/ring.py), against
            the host path's pipeline, both `Session.recover(into=)` of CuPy
            targets at 64 MiB and 1 GiB (`run_recover`); `recover_on_device`
            says whether every resident recovery took the kernel.

`--parts` names which of these run (all by default).

Without a GPU, or with `--cpu`, the numpy session and the CPU executor run;
the JSON says which executor and which device ran.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time

import click
import numpy as np

from concordia.executor.errors import ExecutorError

from ..common import check_outputs, guarded, report, require_cupy
from .files import Scratch, force_option

MiB = 1 << 20
#: what a run measures (`--parts`): the stalls, the checkpoint rows, residency, the device's EPOCH handler,
#: the device's RECOVER handler
PARTS = ("stall", "ckpt", "residency", "device", "recover")
STALL_S = 0.2
#: how long the caller holds the GIL in the device stall (the issue asks for at least 2 s)
GIL_HELD_S = 2.5


def _state_at(count: int, rows: int = 32, cols: int = 1024) -> np.ndarray:
    a = np.zeros((rows, cols), np.uint32)
    for k in range(1, count + 1):
        a[(k * 7) % rows, k % cols] = k
    return a


def _stall(kind: str, seconds: float) -> None:
    """The caller's thread stalls for `seconds`."""
    if kind == "time.sleep":
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:  # pure Python: holds the GIL but for the switch interval
        x += 1


def run_stall(kind: str, every: int, log: str) -> dict:
    """Epochs the trigger commits while the caller stalls for STALL_S (host arrays)."""
    from concordia import Session
    from concordia.executor.resident import PauseGate, StepCounter

    a = np.zeros((32, 1024), np.uint32)
    step = np.zeros(1, np.uint64)
    with Session(log, overwrite=True, size=64 * MiB, segment_size=4 * MiB, executor="resident") as s:
        s.register("a", a)
        s.register("step", step, page_bytes=64)
        s.checkpoint()
        counter, gate = StepCounter(), PauseGate()
        tr = s.resident.trigger(every=every, counter=counter, gate=gate)
        stop = threading.Event()

        def device():
            k = 0
            while not stop.is_set():
                with gate.step():
                    k += 1
                    a[(k * 7) % 32, k % 1024] = k
                    step[0] = k
                    counter.add(1)
                time.sleep(2e-4)   # the step's device time

        dev = threading.Thread(target=device, daemon=True)
        dev.start()
        while counter.read() < 2 * every:  # running before the stall starts
            time.sleep(1e-3)
        before, steps0 = len(tr.fired), counter.read()
        t0 = time.perf_counter()
        _stall(kind, STALL_S)
        stalled_s = time.perf_counter() - t0
        during, steps = len(tr.fired) - before, counter.read() - steps0
        stop.set()
        dev.join(5)
        s.resident.disarm()
        fired = list(tr.fired)
        identical = bool(fired) and all(
            np.array_equal(s.recover(epoch)["a"], _state_at(count)) and int(s.recover(epoch)["step"][0]) == count
            for epoch, count in fired[-3:])
        return {"stall": kind, "stall_s": round(stalled_s, 4), "every_steps": every,
                "epochs_committed": during, "steps_during_stall": steps,
                "expected_epochs_at_trigger_rate": steps // every, "recovered_identical": identical,
                "recovered_checked": len(fired[-3:]), "errors": tr.errors,
                "commit_by": s.resident.commit_by}


def _queued_stall(a, x, mark, fired, seconds: float) -> tuple[float, float, int]:
    """300 steps queued on the device (a write of `a`, the GEMM `x @ x`, then
    `mark()`: the step counted), then the caller's thread in a pure-Python
    loop for `seconds`: (seconds queueing, seconds stalled, the trigger's
    epochs, `fired()`, committed during the stall)."""
    t0 = time.perf_counter()
    for k in range(1, 301):  # queued: the device runs them during the stall
        a[(k * 7) % 32, k % 1024] = k
        x @ x
        mark()
    queued_s = time.perf_counter() - t0
    before = len(fired())
    t1 = time.perf_counter()
    _stall("python_busy_loop", seconds)
    return queued_s, time.perf_counter() - t1, len(fired()) - before


def run_stall_device(cp, every: int, log: str, quick: bool) -> dict:
    """The GPU's stall: decode steps queued on the device and counted there
    (`DeviceStepCounter`, registered beside the state), the caller's thread in
    a 200 ms pure-Python busy loop; epochs the trigger committed during it,
    each recovered and compared with the state of the step it holds."""
    from concordia import Session
    from concordia.executor.resident import DeviceStepCounter

    counter = DeviceStepCounter()
    a = cp.zeros((32, 1024), cp.uint32)
    n = 4096 if quick else 8192
    x = cp.ones((n, n), cp.float16)
    x @ x
    cp.cuda.get_current_stream().synchronize()
    with Session(log, overwrite=True, size=64 * MiB, segment_size=4 * MiB, executor="resident") as s:
        s.register("a", a)
        s.register("steps", counter.word, page_bytes=64)
        s.checkpoint()
        tr = s.resident.trigger(every=every, counter=counter)
        queued_s, stalled_s, during = _queued_stall(a, x, counter.add, lambda: tr.fired, STALL_S)
        steps_at_end = counter.read()
        cp.cuda.get_current_stream().synchronize()
        time.sleep(0.05)
        s.resident.disarm()
        fired = list(tr.fired)
        identical = True
        for epoch, _ in fired[-3:]:
            got = s.recover(epoch)
            k = int(np.asarray(got["steps"])[0])
            a_got = np.asarray(got["a"])
            # one point of the caller's stream (the holds): the steps counted, and
            # perhaps the next one's write, queued before its count
            identical &= bool(np.array_equal(a_got, _state_at(k)) or np.array_equal(a_got, _state_at(k + 1)))
        return {"stall": "python_busy_loop", "stall_s": round(stalled_s, 4), "every_steps": every,
                "point": "one point of the caller's stream (regions.streams.Holds): the steps counted, "
                         "perhaps the next one's write (a step boundary needs a gate)",
                "producer": f"300 steps queued on the device ({n}^3 fp16 GEMM each), counted there",
                "queued_s": round(queued_s, 4), "epochs_committed": during, "steps_by_stall_end": steps_at_end,
                "recovered_identical": bool(identical and fired), "recovered_checked": len(fired[-3:]),
                "errors": tr.errors, "commit_by": s.resident.commit_by}


#: what a fresh process runs to check a device stall's epochs: argv = log, then epoch:count pairs
_FRESH_CHECK = """
import json, sys
import numpy as np
from concordia import Session
from concordia.tools.bench.executor_session import _state_at as state
out = {}
with Session(sys.argv[1], create=False) as s:
    for pair in sys.argv[2:]:
        epoch, count = (int(x) for x in pair.split(":"))
        got = s.recover(epoch)["a"]
        got = got.get() if hasattr(got, "get") else np.asarray(got)
        out[epoch] = bool(np.asarray(got).tobytes() == state(count).tobytes())
print(json.dumps(out))
"""


def run_device_epochs(cp, counts: list[int], log: str, quick: bool, scratch: Scratch) -> dict:
    """The persistent kernel's EPOCH handler (checkpoint/device_epoch.py)
    behind a resident Session: the completion of the EPOCH task one
    `checkpoint()` ran (`epoch_on_device`), the session's step trigger while
    the caller spins in pure Python for GIL_HELD_S (`stall`, each epoch
    checked in a fresh process), and the latency of `Session.checkpoint()`
    resident against host for each region count."""
    import subprocess

    from concordia import Session
    from concordia.policy import Policy

    out: dict = {}
    a = cp.zeros((32, 1024), cp.uint32)
    n = 4096 if quick else 8192
    x = cp.ones((n, n), cp.float16)
    x @ x
    a[1, 1] = 1
    a[1, 1] = 0
    cp.cuda.get_current_stream().synchronize()
    with Session(log, overwrite=True, size=256 * MiB, segment_size=32 * MiB, policy=Policy(retain=False),
                 executor="resident") as s:
        s.register("a", a, detect="shadow", page_bytes=4096)
        s.checkpoint()  # the base, on the consumer
        a[3, 3] = 3
        st = s.checkpoint()  # an EPOCH task of the persistent kernel (the resident route)
        engine = s.resident.route.engine
        c = getattr(engine, "last", None)
        out["epoch_on_device"] = bool(c is not None and c.op == 7 and c.status == 0 and c.lsn_last > c.lsn_first > 0
                                      and set(st.via.values()) == {"device-epoch"})
        out["device_epoch"] = None if c is None else {
            "op": int(c.op), "status": c.status.name, "pages": int(c.pages), "record_bytes": int(c.bytes),
            "lsn_first": int(c.lsn_first), "lsn_commit": int(c.lsn_last), "executor_id": int(c.executor_id),
            "via": sorted(set(st.via.values())), "route": s.resident.info()["route"]}
        a[3, 3] = 0
        s.checkpoint()
        cp.cuda.get_current_stream().synchronize()
        tr = s.resident.step_trigger(8)  # the product path: the persistent kernel's trigger at each step's gate
        queued_s, held_s, during = _queued_stall(a, x, tr.step, lambda: tr.fired, GIL_HELD_S)
        fired = tr.fired
        status = tr.engine.trigger_status if tr.on_device else None
        on_device = tr.on_device
        cp.cuda.get_current_stream().synchronize()
        tr.disarm()
        s.settle()
        epoch_now = s.epoch
    check = subprocess.run([sys.executable, "-c", _FRESH_CHECK, log, *(f"{e}:{k}" for e, k in fired)],
                           capture_output=True, text=True, timeout=600)
    try:
        same = json.loads(check.stdout.strip().splitlines()[-1]) if check.returncode == 0 else {}
    except (ValueError, IndexError):
        same = {}
    out["stall"] = {"gil_held_s": round(held_s, 3), "epochs_committed": during,
                    "recovered_identical": bool(fired) and len(same) == len(fired) and all(same.values()),
                    "recovered_checked": len(same), "checked_in": "a fresh process",
                    "every_steps": 8, "fired": fired[:64], "trigger_status": status, "last_epoch": epoch_now,
                    "trigger_on_device": on_device,
                    "producer": f"300 steps queued on the device ({n}^3 fp16 GEMM each), each followed by "
                                "s.resident.step_trigger(8).step(): cx_step_gate on the caller's stream",
                    "point": "a step boundary: the producer held at its gate while the epoch ran",
                    "queued_s": round(queued_s, 4),
                    "fresh_check_error": None if check.returncode == 0 else check.stderr.strip()[-400:]}
    scratch.discard(log)
    out["latency_ms"] = {}
    reps = 5 if quick else 30
    try:
        for count in counts:
            seg = _arena_segment(count)  # the same log shape for both: one the device's arena fits
            resident = _checkpoint_ms(scratch, log, count, reps, cp, "resident", "auto", segment_size=seg)
            host = _checkpoint_ms(scratch, log, count, reps, cp, "host", "auto", segment_size=seg)
            auto = _checkpoint_ms(scratch, log, count, reps, cp, "auto", "auto", segment_size=seg)
            out["latency_ms"][str(count)] = {
                "resident": resident["ckpt_ms"], "host": host["ckpt_ms"],
                "resident_via": resident["via"], "resident_mean": resident["ckpt_ms_mean"],
                # the default session: the path it decided on after its first epoch, and what that cost
                "auto": auto["ckpt_ms"], "auto_took": auto["executor"], "auto_via": auto["via"],
                "host_mean": host["ckpt_ms_mean"], "auto_mean": auto["ckpt_ms_mean"],
                # each timed call, and the arenas each session opened: where a median sits between two modes
                "runs_ms": {"resident": resident["ckpt_ms_runs"], "host": host["ckpt_ms_runs"],
                            "auto": auto["ckpt_ms_runs"]},
                "arenas": {"resident": resident["arenas"], "auto": auto["arenas"]},
                "epoch_task": _device_epoch_ms(cp, log, count, reps, scratch)}
        out["latency_phases_us"] = {str(count): _device_epoch_ms(cp, log, count, reps, scratch, stamps=True)
                                    for count in counts}
    except Exception as exc:  # recorded; the epoch and the stall above stand
        out["latency_error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return out


def _device_epoch_ms(cp, log: str, n: int, reps: int, scratch: Scratch, *, stamps: bool = False,
                     small_pages: int | None = None):
    """Median of one EPOCH task on the persistent kernel (its round trip: the
    table pass and the commit on the device) over the regions `_per_step`
    makes: `DeviceEpochs(session).epoch()` where the host path's row times
    `Session.checkpoint()`.  stamps: instead, each phase's median µs (the
    kernel's stamps, device_epoch.STAMPS; each stamp adds a one-thread launch)
    with the round trip's median as the host saw it.  small_pages: the
    largest table run as one block (device_epoch.SMALL_PAGES when None)."""
    from concordia.checkpoint.device_epoch import SMALL_PAGES, STAMPS, DeviceEpochs
    from concordia.policy import Policy

    seg = _arena_segment(n)
    made, seen = [], []

    def step(s):
        if not made:  # after the base, CuPy's kernels loaded by the first dirtying
            made.append(DeviceEpochs(s, stamps=stamps, small_pages=SMALL_PAGES if small_pages is None else small_pages))
        t0 = time.perf_counter()
        c = made[0].epoch()
        if c.status != 0 or c.pages != n:
            raise ExecutorError(f"EPOCH task: status {c.status.name}, {c.pages} pages of {n}",
                                where="bench executor-session")
        if stamps:
            seen.append({**made[0].phases(), "round_trip": round((time.perf_counter() - t0) * 1e6, 2)})
        return c

    try:
        ms = _per_step(scratch, log, n, reps, cp, step, segment_size=seg, policy=Policy(retain=False),
                       warm_up=True)[0]
    finally:
        if made:
            made[0].close()
    if not stamps:
        return ms
    seen = seen[3:]  # as _per_step leaves out its first steps
    return {"path": made[0].path, **{k: round(statistics.median(p[k] for p in seen), 2)
                                     for k in (*STAMPS[1:], "round_trip")}}


REGION_PAGES, PAGE = 16, 4096


def _arena_segment(n: int) -> int:
    """Segment bytes for `n` regions' epochs on the device: an arena holds the
    most one epoch writes (every page), and takes at most half a segment."""
    seg = 16 * MiB
    while seg < 2 * (n * (REGION_PAGES * PAGE + 3 * 64) + MiB):
        seg *= 2
    return seg


def _per_step(scratch: Scratch, log: str, n: int, reps: int, xp, step, *, segment_size: int = 16 * MiB,
              warm_up: bool = False, seen: dict | None = None, **session_kw) -> tuple:
    """(median ms, what the last step returned, least ms, mean ms): `step(session)` timed alone,
    reps + 2 times (the first two left out), over `n` regions of REGION_PAGES
    pages (shadow detector), one page of each dirtied before each step.
    warm_up: a first step taken untimed (its first use of anything).  seen:
    filled with each timed step's ms (`runs_ms`) and the arenas the session
    opened in all (`arenas`: a swap costs a step more than its epoch)."""
    from concordia import Session

    size = PAGE * REGION_PAGES
    big = xp.zeros(n * size, xp.uint8)
    need = max(64 * MiB, 3 * segment_size, n * size * 4 + (reps + 4) * (n * (PAGE + 256) + MiB) + 16 * MiB)
    need = -(-need // segment_size) * segment_size
    try:
        with Session(log, overwrite=True, size=need, segment_size=segment_size, **session_kw) as s:
            for i in range(n):
                s.register(f"r{i:04d}", big[i * size:(i + 1) * size], page_bytes=PAGE, detect="shadow")
            s.checkpoint()
            times, last = [], None
            for i in range(reps + 2 + int(warm_up)):
                at = xp.arange(n) * size + ((i * 5) % REGION_PAGES) * PAGE + 7
                big[at] += 1
                if xp is not np:
                    xp.cuda.Device().synchronize()
                t0 = time.perf_counter()
                last = step(s)
                times.append(time.perf_counter() - t0)
            times = times[2 + int(warm_up):]
            if seen is not None:
                seen.update(runs_ms=[round(t * 1e3, 4) for t in times], arenas=s.runner.arenas)
            return (round(statistics.median(times) * 1e3, 4), last, round(min(times) * 1e3, 4),
                    round(statistics.fmean(times) * 1e3, 4))
    finally:
        scratch.discard(log)


def _checkpoint_ms(scratch: Scratch, log: str, n: int, reps: int, xp, executor: str, staging: str,
                   segment_size: int = 16 * MiB) -> dict:
    """Median `Session.checkpoint()` over the regions `_per_step` makes."""
    seen: dict = {}
    ms, last, least, mean = _per_step(scratch, log, n, reps, xp, lambda s: s.checkpoint(), executor=executor,
                                      staging=staging, segment_size=segment_size, seen=seen)
    return {"ckpt_ms": ms, "ckpt_ms_min": least, "ckpt_ms_mean": mean, "ckpt_ms_runs": seen["runs_ms"],
            "arenas": seen["arenas"], "dirty_pages": sum(last.pages.values()),
            "table_pass": last.table_pass, "via": sorted(set(last.via.values())), "executor": last.executor}


RECOVER_REGIONS = 8


def run_recover(cp, log: str, quick: bool, scratch: Scratch) -> dict:
    """A resident session's recovery onto the device, one RECOVER task of a
    persistent kernel (restore/ring.py), against the host path's
    (executor="host": the caller's pipeline), both through
    `Session.recover(into=)` of CuPy targets: for each state size, a log
    written by a resident session (a base and two deltas), then blocks of
    recoveries by a fresh session of each kind, alternated; medians of the
    recover call's seconds, with the way each took (`via`) and whether
    every target equals the state written.  `live`: a recovery inside the
    writing session, whose device epochs' kernel takes the task."""
    from concordia import Session

    sizes = [16 * MiB] if quick else [64 * MiB, 1024 * MiB]
    reps = 3 if quick else 7
    out = {"measure": ("Session(log, create=False, executor=...).recover(into={name: CuPy array}) of "
                       f"{RECOVER_REGIONS} float32 regions, synchronized; two blocks a path, alternated, each a "
                       f"fresh session's first recovery (`first_s`: its module load and the pinning of the pieces "
                       f"it reads) and {reps} more; the median of those {2 * reps}"),
           "sizes": {}}
    for size in sizes:
        n = size // RECOVER_REGIONS // 4
        rng = np.random.default_rng(size)
        state = [cp.asarray(rng.standard_normal(n, dtype=np.float32)) for _ in range(RECOVER_REGIONS)]
        seg = 64 * MiB
        need = -(-(size * 3 + 8 * seg) // seg) * seg
        row = {"bytes": size}
        try:
            with Session(log, overwrite=True, size=need, segment_size=seg, executor="resident") as s:
                for i, a in enumerate(state):
                    s.register(f"w{i}", a, kind="adapter")
                s.checkpoint()
                for k in range(2):
                    for a in state:
                        a[k * 4099::65_537] += 1
                    s.checkpoint()
                cp.cuda.Device().synchronize()
                targets = {f"w{i}": cp.empty_like(a) for i, a in enumerate(state)}
                t = time.perf_counter()
                s.recover(into=targets)
                cp.cuda.Device().synchronize()
                row["live"] = {"s": round(time.perf_counter() - t, 6),
                               "via": sorted(set(s.last_recovery.via.values())),
                               "kernel": ("the session's device epochs'" if s.resident.epoch_kernel() is not None
                                          else "the recovery's own"),
                               "identical": all(bool(cp.array_equal(targets[f"w{i}"], a)) for i, a in enumerate(state))}
            times = {"resident": [], "host": []}
            first = {"resident": [], "host": []}
            via = {"resident": set(), "host": set()}
            how = {"resident": set(), "host": set()}
            same = {"resident": True, "host": True}
            for block in range(2):
                for executor in ("resident", "host") if block == 0 else ("host", "resident"):
                    with Session(log, create=False, executor=executor) as s:
                        targets = {f"w{i}": cp.empty_like(a) for i, a in enumerate(state)}
                        for r in range(reps + 1):
                            for t_ in targets.values():
                                t_.fill(0)
                            cp.cuda.Device().synchronize()
                            t0 = time.perf_counter()
                            s.recover(into=targets)
                            cp.cuda.Device().synchronize()
                            (times[executor] if r else first[executor]).append(time.perf_counter() - t0)
                            via[executor].update(s.last_recovery.via.values())
                            phase = s.last_recovery.phases.get("transfer_check_scatter", {})
                            how[executor].add((phase.get("via", ""), phase.get("ring_why", "")))
                            same[executor] = same[executor] and all(
                                bool(cp.array_equal(targets[f"w{i}"], a)) for i, a in enumerate(state))
        finally:
            scratch.discard(log)
        ring, host = statistics.median(times["resident"]), statistics.median(times["host"])
        row.update(resident_s=round(ring, 6), host_s=round(host, 6), host_over_resident=round(host / ring, 3),
                   resident_GBps=round(size / ring / 1e9, 2), host_GBps=round(size / host / 1e9, 2),
                   first_s={k: [round(t, 6) for t in v] for k, v in first.items()},
                   via={k: sorted(v) for k, v in via.items()},
                   how={k: [list(h) for h in sorted(v)] for k, v in how.items()}, identical=same)
        out["sizes"][f"{size // MiB}MiB"] = row
    rows = out["sizes"].values()
    out["recover_on_device"] = all(r["via"]["resident"] == ["persistent kernel"]
                                   and r["live"]["via"] == ["persistent kernel"] for r in rows)
    out["identical"] = all(all(r["identical"].values()) and r["live"]["identical"] for r in rows)
    return out


def run(on_gpu: bool, quick: bool, counts: list[int], scratch: Scratch, parts: tuple = PARTS) -> dict:
    """Measure `parts` (PARTS; the GPU's only where one runs); the log is the
    run's own (`scratch`), formatted afresh by each step (overwrite=True)
    and removed after it."""
    xp, device = np, "cpu"
    if on_gpu:
        xp = require_cupy(ExecutorError, where="bench executor-session", hint="use --cpu for the numpy session")
        device = xp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    log = scratch.log("session", "shm" if os.path.isdir("/dev/shm") else "memory")
    doc = {"benchmark": "executor-session", "device": device, "quick": quick, "parts": list(parts),
           "executor": {"resident": ("concordia.executor.resident: epochs after the first into the session's arena "
                                        "(checkpoint/arena_route.py): a CuPy session's by the persistent kernel, "
                                        "a host session's by its CPU thread"),
                        "device_epoch_handler": False},
           "regions_xp": "cupy" if xp is not np else "numpy", "log_tier": log.split(":")[0],
           "python_switch_interval_s": sys.getswitchinterval()}
    every = 8
    if "stall" in parts:
        try:
            stalls = {k: run_stall(k, every, log) for k in ("time.sleep", "python_busy_loop")}
        finally:
            scratch.discard(log)
        if on_gpu:
            try:
                stalls["device_steps"] = run_stall_device(xp, every, log, quick)
            finally:
                scratch.discard(log)
        doc["stall"] = stalls["device_steps" if on_gpu else "python_busy_loop"]
        doc["stall_variants"] = stalls
    if "ckpt" in parts:
        reps = 5 if quick else 30
        doc["ckpt_ms"], doc["ckpt_detail"] = {}, {}
        for label, executor, staging in (("host", "host", "auto"), ("host_mapped", "host", "mapped"),
                                         ("resident", "resident", "auto"), ("auto", "auto", "auto")):
            doc["ckpt_ms"][label], doc["ckpt_detail"][label] = {}, {}
            for n in counts:
                got = _checkpoint_ms(scratch, log, n, reps, xp, executor, staging)
                doc["ckpt_ms"][label][str(n)] = got["ckpt_ms"]
                doc["ckpt_detail"][label][str(n)] = got
        doc["ckpt_reps"] = reps
    if on_gpu and "residency" in parts:
        doc["residency"] = _residency_in_session(xp, quick, log, scratch)
        work = doc["residency"].get("workloads", {})
        doc["idle_slowdown"] = {key: round(v["executor_resident_idle_sm_target_pct"] / 100.0, 4)
                                for name, v in work.items() for key in ("gemm", "gemv", "stream") if key in name}
    if on_gpu and "device" in parts:
        try:
            device = run_device_epochs(xp, counts, log, quick, scratch)
        except Exception as exc:  # recorded; the rest of the run stands
            device = {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
                      "epoch_on_device": False}
        finally:
            scratch.discard(log)
        doc["epoch_on_device"] = device.get("epoch_on_device", False)
        doc["executor"]["device_epoch_handler"] = True
        if "stall" in device:
            doc.setdefault("stall_variants", {})["device_epoch_trigger"] = device["stall"]
            doc["stall"] = device["stall"]
        for k in ("device_epoch", "latency_ms", "latency_phases_us", "error", "latency_error"):
            if k in device:
                doc[k] = device[k]
    if on_gpu and "recover" in parts:
        try:
            doc["recover"] = run_recover(xp, log, quick, scratch)
        except Exception as exc:  # recorded; the rest of the run stands
            doc["recover"] = {"error": f"{type(exc).__name__}: "
                                       f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
                              "recover_on_device": False, "identical": False}
        doc["recover_on_device"] = doc["recover"]["recover_on_device"]
    doc["goals"] = _goals(doc, on_gpu, counts)
    return doc


def _goals(doc: dict, on_gpu: bool, counts: list[int]) -> dict:
    """Each measured part's goals: met or not."""
    goals = {}
    if "stall" in doc:
        goals["stall_epochs_committed>0"] = doc["stall"]["epochs_committed"] > 0
        goals["stall_recovered_identical"] = doc["stall"]["recovered_identical"]
        if on_gpu:
            goals["stall_gil_held_s>=2"] = doc["stall"].get("gil_held_s", 0) >= 2
    if on_gpu and "epoch_on_device" in doc:
        goals["epoch_on_device"] = bool(doc.get("epoch_on_device"))
        for n, row in doc.get("latency_ms", {}).items():
            goals[f"latency_resident<=host_{n}"] = row["resident"] <= row["host"]
            goals[f"latency_resident_on_device_{n}"] = "device-epoch" in row.get("resident_via", [])
            if "auto_took" in row:  # the default takes the path that won (resident where it did)
                won = "resident" if row["resident"] <= row["host"] else "host"
                goals[f"latency_auto_took_{won}_{n}"] = row["auto_took"] == won
    for k, v in doc.get("idle_slowdown", {}).items():
        goals[f"idle_slowdown_{k}<=0.02"] = v <= 0.02
    if "ckpt_ms" in doc:
        for n in counts:
            goals[f"resident_ckpt<=host_{n}"] = doc["ckpt_ms"]["resident"][str(n)] <= doc["ckpt_ms"]["host"][str(n)]
    if "residency" in doc and "workloads" in doc["residency"]:
        # the GpuExecutor's default: cuBLAS told to leave its one SM free (sm_carveout=1)
        goals["resident_idle_slowdown_with_sm_target<=2%"] = all(
            v["executor_resident_idle_sm_target_pct"] <= 2.0 for v in doc["residency"]["workloads"].values())
    if "recover" in doc:
        goals["recover_on_device"] = bool(doc["recover"]["recover_on_device"])
        goals["recover_identical"] = bool(doc["recover"]["identical"])
    return goals


def _residency_in_session(cp, quick: bool, log: str, scratch: Scratch) -> dict:
    """`bench executor`'s idle-residency measurement with a resident Session open
    on a committed state beside it (component: see the module docstring)."""
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    from concordia import Session
    from concordia.executor import persistent as gpu
    from concordia.executor.host import Submitter

    from . import executor as bx
    from . import kernels

    child = gpu.ExecutorModule(child=True).load()
    bench = kernels.load_bench_kernels()
    ws = cp.cuda.Stream(non_blocking=True)
    workloads = bx.workloads(cp, ws, quick)
    for w in workloads.values():
        w()
    ws.synchronize()
    state = cp.zeros(64 * MiB, cp.uint8)
    gring = gpu.GpuRing(1024)
    flag = gpu.MappedHostBuffer(8)
    sub = Submitter(gring.ring, gpu.GpuExecutor(gring, child, idle_s=30.0, lifetime_s=120.0, sm_carveout=0),
                    stall_deadline_s=30.0)
    try:
        with Session(log, overwrite=True, size=512 * MiB, segment_size=64 * MiB, executor="resident") as s:
            s.register("state", state)
            s.checkpoint()
            state[123] = 1
            s.checkpoint()
            got = bx.residency(cp, gpu, bench, ws, workloads, gring, sub, flag, quick)
            got["session"] = {"epoch": s.epoch, "executor": s.executor_info}
            return got
    except Exception as exc:  # recorded; the rest of the run stands
        return {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"}
    finally:
        flag.array.view(np.uint64)[0] = 1
        if not gring.ring.stop_sent:
            try:
                sub.stop(timeout=30)
            except Exception:
                pass
        sub.consumer.join(30)
        gring.close()
        flag.close()
        scratch.discard(log)


def _table(doc: dict) -> str:
    lines = [f"executor-session on {doc['device']} ({doc['regions_xp']} regions, {doc['log_tier']} log; "
             f"resident = {doc['executor']['resident']})"]
    for k, st in doc.get("stall_variants", {}).items():
        ran = (f"{st['steps_during_stall']} steps ran" if "steps_during_stall" in st
               else f"{st['steps_by_stall_end']} device steps by its end" if "steps_by_stall_end" in st
               else f"the device trigger, {len(st['fired'])} epochs in all, checked in {st['checked_in']}")
        held = st.get("stall_s", st.get("gil_held_s", 0.0))
        lines.append(f"stall {k:<17} {held * 1e3:6.0f} ms: {st['epochs_committed']:3d} epochs committed "
                     f"(every {st['every_steps']} steps; {ran}), recovered identical: {st['recovered_identical']}")
    if "ckpt_ms" in doc:
        counts = list(doc["ckpt_ms"]["host"])
        lines.append(f"{'checkpoint ms (median)':<24}" + "".join(f"{n + ' regions':>14}" for n in counts))
        for label, row in doc["ckpt_ms"].items():
            lines.append(f"  {label:<22}" + "".join(f"{row[n]:>14.3f}" for n in counts))
    if "epoch_on_device" in doc:
        lines.append(f"epoch on device: {doc['epoch_on_device']}"
                     + (f" ({doc['device_epoch']})" if "device_epoch" in doc else f" ({doc.get('error')})"))
    for n, row in doc.get("latency_ms", {}).items():
        lines.append(f"  {n:>5} regions: resident checkpoint {row['resident']:.3f} ms (via {row['resident_via']}), "
                     f"host checkpoint {row['host']:.3f} ms; one EPOCH task {row['epoch_task']:.3f} ms (component)"
                     + (f"; auto took {row['auto_took']}: {row['auto']:.3f} ms" if "auto_took" in row else "")
                     + ("; means: " + ", ".join(f"{k} {row[k + '_mean']:.3f}" for k in ("resident", "host", "auto")
                                                if k + "_mean" in row) if "auto_mean" in row else "")
                     + ("; arenas: " + ", ".join(f"{k} {v}" for k, v in row["arenas"].items()) if "arenas" in row
                        else ""))
    for n, row in doc.get("latency_phases_us", {}).items():
        lines.append(f"  {n:>5} regions, stamped phases µs ({row['path']}): "
                     + ", ".join(f"{k} {v:.1f}" for k, v in row.items() if k != "path"))
    res = doc.get("residency")
    if res and "workloads" in res:
        lines.append(f"{'residency slowdown % (persistent kernel idle beside the session)':<66}"
                     f"{'idle':>8}{'+sm target':>11}{'released':>10}")
        for name, v in res["workloads"].items():
            lines.append(f"  {name:<64}{v['executor_resident_idle_pct']:>8.2f}"
                         f"{v['executor_resident_idle_sm_target_pct']:>11.2f}{v['executor_released_pct']:>10.2f}")
    elif res:
        lines.append(f"residency: {res.get('error')}")
    rec = doc.get("recover")
    if rec and "sizes" in rec:
        lines.append("recovery onto the device (Session.recover into CuPy targets; median s)")
        for label, r in rec["sizes"].items():
            lines.append(f"  {label:>8}: resident {r['resident_s']:.4f} s ({r['resident_GBps']} GB/s, via "
                         f"{'/'.join(r['via']['resident'])}), host {r['host_s']:.4f} s ({r['host_GBps']} GB/s, "
                         f"via {'/'.join(r['via']['host'])}); host/resident {r['host_over_resident']}; live "
                         f"{r['live']['s']:.4f} s via {'/'.join(r['live']['via'])}; identical {r['identical']}")
    elif rec:
        lines.append(f"recovery onto the device: {rec.get('error')}")
    lines.append("goals  " + "  ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in doc["goals"].items()))
    return "\n".join(lines)


@click.command("executor-session")
@click.option("--cpu", "on_cpu", is_flag=True, help="numpy session and the CPU executor (the default without a GPU)")
@click.option("--quick", is_flag=True, help="few repetitions (CI smoke run)")
@click.option("--regions", default="1,1024", show_default=True, help="region counts of the checkpoint rows")
@click.option("--parts", default=",".join(PARTS), show_default=True,
              help="what to measure: stall, ckpt, residency, device, recover (the last three on a GPU only)")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of the table")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="also write JSON here")
@force_option("--out")
@guarded
def command(on_cpu, quick, regions, parts, as_json, out, force):
    """The resident executor driving a Session: epochs committed by its trigger
    while the caller stalls, checkpoint latency against the host path for 1
    and 1,024 regions, and (on a GPU) idle residency inside a Session.

    Example:

    \b
        concordia-wal bench executor-session --cpu --out executor-session.json
        concordia-wal bench executor-session --json      # on the GPU machine
    """
    check_outputs(force, out)  # before the run: a long benchmark is not refused at its end
    try:
        counts = [int(x) for x in regions.split(",") if x.strip()]
        if not counts or min(counts) < 1:
            raise ValueError
    except ValueError:
        raise click.BadParameter(f"{regions!r} is not a list of region counts such as 1,1024",
                                 param_hint="--regions") from None
    chosen = tuple(p.strip() for p in parts.split(",") if p.strip())
    unknown = [p for p in chosen if p not in PARTS]
    if unknown or not chosen:
        raise click.BadParameter(f"{parts!r}: {'unknown part ' + repr(unknown[0]) if unknown else 'no part'} "
                                 f"(use {', '.join(PARTS)})", param_hint="--parts")
    on_gpu = False
    if not on_cpu:
        try:
            import cupy

            on_gpu = cupy.cuda.runtime.getDeviceCount() > 0
        except Exception:
            on_gpu = False
    with Scratch("executor-session") as scratch:  # its log goes, however the run ends
        doc = run(on_gpu, quick, counts, scratch, chosen)
    report(doc, as_json=as_json, out=out, table=_table, force=force)
