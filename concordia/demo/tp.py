"""A tensor-parallel toy decode protected per rank, and one rank replaced mid-run.

    from concordia.demo import tp
    res = tp.run(world=2, steps=12, kill=(1, 5, "after_reduce"), workdir=d)
    res["identical"], res["timeline"]

Each rank holds a column shard of every layer's first weight and the matching
row shard of its second, and its own KV-like state (the first layer's hidden
shard of every step).  A step runs the layers; each layer all-gathers the ranks'
partial outputs and sums them in rank order (so the sum is the same bits on
every rank and in every run), and updates the state in place.  Each rank
checkpoints every step through a `GroupSession` (its own log; epoch = the
group's); the step counter and the tokens are regions too.

`run` starts `world` ranks and one standby process (torch imported, waiting),
lets the victim rank SIGKILL itself at (rank, step, phase), and recovers: the
survivors see their collective fail (gloo and NCCL raise when a peer's
connection closes; the process group's timeout is the backstop), abort and
destroy their process group, and meet the standby, which takes the dead rank,
on a new rendezvous: a fresh `torch.distributed.FileStore` in a new file (one
per generation; no port to agree on and no rank must outlive the others to
host it).  torch's gloo group has no abort or shrink (NCCL's has
`abort`/`ncclCommAbort`, used when the backend is nccl); destroy and a fresh
init is what it offers.  Then `GroupSession.rejoin`: the replacement restores
its regions from its rank's log at the group epoch, survivors keep theirs unless
ahead (then they roll back from their own log), and decoding continues from
the group epoch's step.  The final state and tokens of every rank are compared
with an uninterrupted run's.

phase: "compute" (before the step's first collective), "after_reduce" (the
state updated, not committed), "after_commit" (committed, before the group's
MIN).

`crash_state` and `_checkpoint_loop` are the coordination's crash test: ranks
that only checkpoint a state known from its step, SIGKILLed from outside.
"""

from __future__ import annotations

import datetime
import os
import signal
import time

PHASES = ("compute", "after_reduce", "after_commit")


def _shapes(world, hidden, ffn, layers, steps):
    if ffn % world:
        raise ValueError(f"ffn {ffn} does not split over {world} ranks")
    return ffn // world


def _weights(rank, world, hidden, ffn, layers, device):
    import torch

    g = torch.Generator().manual_seed(1234)
    f = ffn // world
    w1, w2 = [], []
    for _ in range(layers):  # the full matrices, the same on every rank, then the shard
        a = torch.randn(hidden, ffn, generator=g) / hidden ** 0.5
        b = torch.randn(ffn, hidden, generator=g) / ffn ** 0.5
        w1.append(a[:, rank * f:(rank + 1) * f].contiguous())
        w2.append(b[rank * f:(rank + 1) * f, :].contiguous())
    return torch.stack(w1).to(device), torch.stack(w2).to(device)


def _init_pg(backend, rdzv, gen, rank, world, timeout_s):
    import torch.distributed as dist

    store = dist.FileStore(os.path.join(rdzv, f"gen-{gen}"), world)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return dist.group.WORLD


def _teardown_pg():
    import torch.distributed as dist

    try:
        pg = dist.group.WORLD
        if dist.get_backend(pg) == "nccl" and hasattr(pg, "abort"):
            pg.abort()  # ncclCommAbort: the pending collectives end now
    except Exception:
        pass
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def _rank_main(cfg, rank, gen, replacement, q):
    """One rank: decode cfg['steps'] steps; on a failed collective re-form and go on."""
    import torch
    import torch.distributed as dist

    from concordia.group import GroupSession

    world, dev = cfg["world"], cfg["device"]
    if dev == "cuda":
        torch.cuda.set_device(rank)
        dev = f"cuda:{rank}"
    f = _shapes(world, cfg["hidden"], cfg["ffn"], cfg["layers"], cfg["steps"])
    events = {}
    pg = _init_pg(cfg["backend"], cfg["rdzv"], gen, rank, world, cfg["timeout_s"])
    if replacement:
        events["isolated"] = time.time()
    w1 = torch.zeros(cfg["layers"], cfg["hidden"], f, device=dev)
    w2 = torch.zeros(cfg["layers"], f, cfg["hidden"], device=dev)
    if not replacement:
        a, b = _weights(rank, world, cfg["hidden"], cfg["ffn"], cfg["layers"], dev)
        w1.copy_(a)
        w2.copy_(b)
    x = torch.zeros(cfg["hidden"], device=dev)
    kv = torch.zeros(cfg["steps"], f, device=dev)
    out = torch.zeros(cfg["steps"], dtype=torch.int64, device=dev)
    step = torch.zeros(1, dtype=torch.int64, device=dev)
    if not replacement:
        x[0] = 1.0
    log = f"file:{os.path.join(cfg['logdir'], f'rank{rank}.log')}"
    g = GroupSession(rank, world, log, comm=pg, size=cfg["log_bytes"], overwrite=not replacement)
    for name, arr in (("w1", w1), ("w2", w2), ("x", x), ("kv", kv), ("out", out), ("step", step)):
        g.register(name, arr, kind="kv" if name == "kv" else "opaque")
    if replacement:
        st = g.rejoin(pg, replacement=True)
        events["restored"] = time.time()
        events["rejoin"] = st.__dict__
    else:
        g.checkpoint()  # epoch of step 0: the weights and the initial state
    kill = cfg.get("kill")
    killed_here = kill is not None and kill[0] == rank and not replacement and gen == 0
    changed = False
    while int(step.item()) < cfg["steps"]:
        t = int(step.item())
        try:
            if killed_here and t == kill[1] and kill[2] == "compute":
                _die(cfg)
            for layer in range(cfg["layers"]):
                h = torch.tanh(x @ w1[layer])
                if layer == 0:
                    kv[t].copy_(h)
                p = h @ w2[layer]
                parts = [torch.empty_like(p) for _ in range(world)]
                dist.all_gather(parts, p, group=pg)
                total = parts[0].clone()
                for q_ in parts[1:]:
                    total += q_
                changed = True
                x.copy_(torch.tanh(x + total))
            out[t] = torch.argmax(x)
            step += 1
            if killed_here and t == kill[1] and kill[2] == "after_reduce":
                _die(cfg)
            if killed_here and t == kill[1] and kill[2] == "after_commit":
                g.commit_alone()
                _die(cfg)
            g.checkpoint()
            changed = False
            if "restored" in events and "decoding" not in events:
                events["decoding"] = time.time()  # the first step after the group came back
        except RuntimeError as exc:  # a peer died: the collective failed
            if "detected" in events:
                raise
            events["detected"] = time.time()
            events["error"] = str(exc).splitlines()[0][:200]
            _teardown_pg()
            gen += 1
            pg = _init_pg(cfg["backend"], cfg["rdzv"], gen, rank, world, cfg["timeout_s"])
            events["isolated"] = time.time()
            st = g.rejoin(pg, changed=changed)
            changed = False
            events["restored"] = time.time()
            events["rejoin"] = st.__dict__
            step_ = int(step.item())
            assert step_ == st.epoch - 1, (step_, st.epoch)  # epoch 1 is step 0's state
    if dev.startswith("cuda"):
        torch.cuda.synchronize()
    q.put((rank, {"x": x.cpu().numpy().tobytes(), "kv": kv.cpu().numpy().tobytes(),
                  "out": out.cpu().tolist(), "events": events}))
    g.close()
    _teardown_pg()


def _die(cfg):
    with open(os.path.join(cfg["logdir"], "killed"), "w") as fh:
        fh.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def _standby_main(cfg, q, take):
    import torch  # noqa: F401  imported before the failure, as a standby would be
    import torch.distributed  # noqa: F401

    import concordia.group  # noqa: F401
    import concordia.session  # noqa: F401

    got = take.get()
    if got is None:
        return
    rank, gen = got
    _rank_main(cfg, rank, gen, True, q)


def crash_state(rank, step, n=4096):
    """A rank's state after `step` steps of the crash test (numpy, int32)."""
    import numpy as np

    a = np.zeros(n, np.int32)
    for t in range(1, step + 1):
        lo = (t * 509) % n
        a[lo:lo + 300] = t * 16 + rank
    return a


def _checkpoint_loop(rank, world, logdir, rdzv, steps):
    """Checkpoint crash_state step by step through a GroupSession until killed."""
    import numpy as np
    import torch.distributed as dist

    from concordia.group import GroupSession

    pg = _init_pg("gloo", rdzv, 0, rank, world, 30.0)
    a = np.zeros(4096, np.int32)
    step = np.zeros(1, np.int64)
    g = GroupSession(rank, world, f"file:{os.path.join(logdir, f'rank{rank}.log')}", comm=pg, size=16 << 20,
                     overwrite=True)
    g.register("a", a, page_bytes=1024)
    g.register("step", step)
    for t in range(1, steps + 1):
        a[...] = crash_state(rank, t, a.size)
        step[0] = t
        g.checkpoint()
    dist.destroy_process_group()


def run(*, world=2, steps=12, hidden=64, ffn=256, layers=2, kill=None, workdir, backend="gloo",
        device="cpu", timeout_s=20.0, log_bytes=64 << 20, deadline_s=120.0) -> dict:
    """Decode with `world` ranks; kill=(rank, step, phase) or None.  Returns
    {"ranks": {rank: {"x", "kv", "out", "events"}}, "timeline": [...] or None}."""
    import torch.multiprocessing as mp

    for sub in ("logs", "rdzv"):
        os.makedirs(os.path.join(workdir, sub), exist_ok=True)
    cfg = dict(world=world, steps=steps, hidden=hidden, ffn=ffn, layers=layers, kill=kill, backend=backend,
               device=device, timeout_s=timeout_s, log_bytes=log_bytes,
               logdir=os.path.join(workdir, "logs"), rdzv=os.path.join(workdir, "rdzv"))
    ctx = mp.get_context("spawn")
    q, take = ctx.Queue(), ctx.Queue()
    procs = {r: ctx.Process(target=_rank_main, args=(cfg, r, 0, False, q), daemon=True) for r in range(world)}
    standby = ctx.Process(target=_standby_main, args=(cfg, q, take), daemon=True) if kill else None
    for p in procs.values():
        p.start()
    if standby is not None:
        standby.start()
    results, t_end = {}, time.time() + deadline_s
    replaced = False
    try:
        while len(results) < world:
            if time.time() > t_end:
                raise TimeoutError(f"the decode did not finish in {deadline_s} s")
            try:
                rank, res = q.get(timeout=0.05)
                results[rank] = res
                continue
            except Exception:
                pass
            for r, p in list(procs.items()):
                if not replaced and p.exitcode is not None and p.exitcode != 0 and kill and r == kill[0]:
                    take.put((r, 1))  # the replacement joins generation 1
                    procs[r] = standby
                    replaced = True
                elif p.exitcode not in (None, 0) and p is not standby or (p is standby and p.exitcode not in (None, 0)):
                    raise RuntimeError(f"rank {r} exited with {p.exitcode}")
    finally:
        if standby is not None and not replaced:
            take.put(None)
        for p in [*procs.values(), standby]:
            if p is not None:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    timeline = None
    if kill:
        t_kill = float(open(os.path.join(cfg["logdir"], "killed")).read())
        ev = [results[r]["events"] for r in range(world)]
        surv = [e for r, e in enumerate(ev) if r != kill[0]]
        detect = min(e["detected"] for e in surv)
        isolated = max(e["isolated"] for e in ev)
        restored = max(e["restored"] for e in ev)
        decoding = max(e["decoding"] for e in ev)
        timeline = [{"phase": "detect", "ms": (detect - t_kill) * 1e3},
                    {"phase": "isolate", "ms": (isolated - detect) * 1e3},
                    {"phase": "restore", "ms": (restored - isolated) * 1e3},
                    {"phase": "reintegrate", "ms": (decoding - restored) * 1e3}]
        for p in timeline:
            print(f"{p['phase']:>12}: {p['ms']:9.1f} ms")
        print(f"kill to decoding: {decoding - t_kill:.3f} s")
        timeline_total = decoding - t_kill
    return {"ranks": results, "timeline": timeline,
            "kill_to_decoding_s": timeline_total if kill else None}


def restart(*, world=2, steps=12, kill_step=6, hidden=64, ffn=256, layers=2, workdir, backend="gloo",
            device="cpu", timeout_s=20.0) -> float:
    """The baseline: every rank started again (communicator, weights, re-prefill:
    the steps before `kill_step` decoded again, no log).  Returns seconds from
    the start of the new processes to the first step after `kill_step`."""
    import torch.multiprocessing as mp

    os.makedirs(os.path.join(workdir, "rdzv"), exist_ok=True)
    cfg = dict(world=world, steps=steps, hidden=hidden, ffn=ffn, layers=layers, kill=None, backend=backend,
               device=device, timeout_s=timeout_s, rdzv=os.path.join(workdir, "rdzv"), kill_step=kill_step)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    t0 = time.time()
    procs = [ctx.Process(target=_restart_main, args=(cfg, r, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    done = [q.get(timeout=600) for _ in range(world)]
    for p in procs:
        p.join(timeout=10)
    return max(done) - t0


def _restart_main(cfg, rank, q):
    import torch
    import torch.distributed as dist

    world, dev = cfg["world"], cfg["device"]
    if dev == "cuda":
        torch.cuda.set_device(rank)
        dev = f"cuda:{rank}"
    pg = _init_pg(cfg["backend"], cfg["rdzv"], 0, rank, world, cfg["timeout_s"])
    w1, w2 = _weights(rank, world, cfg["hidden"], cfg["ffn"], cfg["layers"], dev)
    x = torch.zeros(cfg["hidden"], device=dev)
    x[0] = 1.0
    for t in range(cfg["kill_step"] + 1):
        for layer in range(cfg["layers"]):
            h = torch.tanh(x @ w1[layer])
            p = h @ w2[layer]
            parts = [torch.empty_like(p) for _ in range(world)]
            dist.all_gather(parts, p, group=pg)
            total = parts[0].clone()
            for q_ in parts[1:]:
                total += q_
            x.copy_(torch.tanh(x + total))
    if dev.startswith("cuda"):
        torch.cuda.synchronize()
    q.put(time.time())
    _teardown_pg()


def main(argv=None) -> int:
    """python -m concordia.demo.tp --json OUT [--device cuda --backend nccl] ...: one
    rank killed and replaced, and a restart, in the same run."""
    import argparse
    import json
    import tempfile

    ap = argparse.ArgumentParser(prog="python -m concordia.demo.tp")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kill-step", type=int, default=6)
    ap.add_argument("--phase", choices=PHASES, default="after_reduce")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--log-bytes", type=int, default=64 << 20)
    ap.add_argument("--timeout-s", type=float, default=20.0, help="the process group's timeout")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    shape = dict(world=a.world, steps=a.steps, hidden=a.hidden, ffn=a.ffn, layers=a.layers, backend=a.backend,
                 device=a.device, timeout_s=a.timeout_s)
    with tempfile.TemporaryDirectory(dir=a.workdir) as d:
        base = run(workdir=os.path.join(d, "base"), log_bytes=a.log_bytes, **shape)
        got = run(workdir=os.path.join(d, "kill"), kill=(a.world - 1, a.kill_step, a.phase), log_bytes=a.log_bytes,
                  **shape)
        rs = restart(workdir=os.path.join(d, "restart"), kill_step=a.kill_step, **shape)
    identical = all(got["ranks"][r][k] == base["ranks"][r][k] for r in range(a.world) for k in ("x", "kv", "out"))
    doc = {"identical": identical, "kill_to_decoding_s": got["kill_to_decoding_s"], "timeline": got["timeline"],
           "restart_s": rs, "restart_what": "new processes, communicator init, weights rebuilt, steps re-decoded",
           "rejoin": {r: got["ranks"][r]["events"]["rejoin"] for r in range(a.world)},
           "detected_by": got["ranks"][0]["events"].get("error"), **shape, "kill_step": a.kill_step,
           "phase": a.phase}
    tmp = a.json + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(doc, fh, indent=1)
    os.replace(tmp, a.json)
    print(f"identical: {identical}  kill to decoding: {got['kill_to_decoding_s']:.3f} s  restart: {rs:.3f} s")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
