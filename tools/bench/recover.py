"""`concordia-wal bench recover`: restore KV state from a log onto the GPU,
beside the ceilings and the alternatives, all measured in the same run.

For each size and tier (shm, file, hugetlb) a log is written by a `Session` checkpoint
of a device KV region of that size, then recovered as a fresh reader would:
open the log, plan, and restore straight into device memory
(`restore.device.apply_plan_cupy`: host threads read the log into pinned
buffers with preadv while the copy engine and the scatter kernel move and
apply the previous chunks; a restore of at most 1 GiB pins the pieces of the
mapping it reads instead), every page CRC and the region digest checked on
the device.  For shm logs up to --registered-max-gib the same log is also
restored from a registered mapping (the copy engine reads the log itself, as
for a live session that keeps its log registered; registering is timed apart),
hugetlb logs (a file on a hugetlbfs mount: $CONCORDIA_HUGETLB_DIR or the
first one mounted, `scripts/hugepages.sh setup`) restore the way
`read="auto"` takes them, pinning the log in pieces ahead of the copy engine
(huge pages pin ~3.5x faster than 4 KiB ones), and once more copied by host
threads (`copy_*`); and every log once more the way a program recovers it:
`Session(log, create=False).recover()` (the read-only open, no writer lock
and no cut, that checks the last commit's pages, then the same restore), as `session_*` in each row.
Beside it:

* ceiling: pinned host-to-device copy bandwidth (cupy, pinned buffer);
* re-prefill: the reference model rebuilding the same number of tokens' KV
  from scratch (measured on a batch, scaled by tokens);
* torch: `torch.save` / `torch.load(map_location="cuda")` of the same bytes
  as one tensor, in the same directory as the log (when PyTorch is present,
  up to --torch-max-gib).

Without a GPU (`--quick` in CI) the same steps run on the host: numpy
applier, memcpy as the ceiling, the model on numpy.
"""

from __future__ import annotations

import math
import os
import time

import click
import numpy as np

from ..common import FiniteRange, check_outputs, emit_json, guarded, write_output
from .files import SHM_DIR, Scratch, force_option, save_figure

GIB = 1 << 30


def _gpu():
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
    except Exception:
        return None
    return None


def _sync(xp):
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


def _ceiling(xp, nbytes: int) -> dict:
    """Pinned host->device bandwidth (GPU) or host memcpy (CPU), best of 5."""
    nbytes = max(1 << 20, min(nbytes, 2 * GIB))
    if xp is np:
        src = np.ones(nbytes, np.uint8)
        dst = np.empty_like(src)
        best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(5))
        return {"what": "host memcpy", "bytes": nbytes, "GBps": nbytes / best / 1e9}
    mem = xp.cuda.alloc_pinned_memory(nbytes)
    host = np.frombuffer(mem, np.uint8, nbytes)
    host[:] = 1
    dev = xp.empty(nbytes, xp.uint8)
    dev.set(host)
    _sync(xp)

    def one():
        dev.set(host)
        _sync(xp)

    best = min(_timed(one) for _ in range(5))
    return {"what": "pinned host-to-device copy", "bytes": nbytes, "GBps": nbytes / best / 1e9}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _spec(tier: str, scratch: Scratch, workdir: str | None) -> str:
    """A new log of the run on `tier` (file logs in `workdir`, default the
    temporary folder)."""
    if tier == "hugetlb":
        from concordia.devmem import hugetlb

        where = hugetlb.default_mount()
        if where is None:
            raise RuntimeError("no hugetlbfs is mounted (scripts/hugepages.sh setup, as root)")
        return scratch.log("recover", "hugetlb", where)
    return scratch.log("recover", tier, workdir)


def _write_log(xp, spec: str, nbytes: int, page_bytes: int) -> dict:
    """A log whose one committed epoch holds a KV region of `nbytes`."""
    from concordia.session import Session

    kv = xp.empty(nbytes // 2, xp.float16)
    flat = kv.view(xp.uint8)
    rng = np.random.default_rng(7)
    block = xp.asarray(rng.integers(0, 256, size=min(nbytes, 64 << 20), dtype=np.uint8))
    for i, off in enumerate(range(0, nbytes, block.size)):
        n = min(block.size, nbytes - off)
        flat[off:off + n] = block[:n] ^ np.uint8(i & 0xFF)
    mib = 1 << 20
    seg = min(1 << 30, max(16 * mib, -(-(nbytes // 8) // mib) * mib))  # records are at most 8 MiB
    log_size = -(-(nbytes + nbytes // 16 + 4 * seg) // seg) * seg
    t0 = time.perf_counter()
    with Session(spec, size=log_size, segment_size=seg) as s:  # a new log of the run's own
        s.register("kv", kv, kind="kv", page_bytes=page_bytes)
        s.checkpoint()
    secs = time.perf_counter() - t0
    digest = _digest(xp, kv, page_bytes)
    del kv, flat, block
    return {"write_s": secs, "digest": digest}


def _digest(xp, arr, page_bytes):
    from concordia.gpu_kernels import reference as ref

    if xp is np:
        return ref.region_digest(ref.crc32c_pages(arr, page_bytes=page_bytes))
    from concordia.gpu_kernels import gpu

    return gpu.region_digest(gpu.crc32c_pages(arr, page_bytes=page_bytes))


def _restore(xp, spec: str, registered: bool = False, read: str = "auto", repeat: int = 3) -> dict:
    """The median of `repeat` recoveries of the log (fresh open, plan and
    restore each time; see _restore_once); every run's seconds in
    runs_total_s / runs_restore_s."""
    runs = []
    for _ in range(repeat):
        _release(xp)
        runs.append(_restore_once(xp, spec, registered, read))
    runs_sorted = sorted(runs, key=lambda r: r["total_s"])
    med = dict(runs_sorted[len(runs) // 2])
    med["runs_total_s"] = [r["total_s"] for r in runs]
    med["runs_restore_s"] = [r["restore_s"] for r in runs]
    return med


def _restore_once(xp, spec: str, registered: bool = False, read: str = "auto") -> dict:
    """Open, plan and restore the log's KV region onto the device (or host).
    registered: open the log writable and register its mapping with CUDA
    first (timed as register_s, outside the restore), as a live session that
    keeps its log registered would hold it; the copy engine then reads the
    mapping itself."""
    from concordia.restore.run import restore
    from concordia.wal import Log

    t0 = time.perf_counter()
    log = Log.open(spec, writable=registered, check_pages=False)  # pages are checked where they land
    t1 = time.perf_counter()
    st: dict = {}
    reg, register_s = None, 0.0
    try:
        if registered and xp is not np:
            from concordia.devmem import cuda_host

            t = time.perf_counter()
            reg = cuda_host.register(log.backend)
            register_s = time.perf_counter() - t
        got = restore(log, device=xp is not np, registration=reg, read=read, stats=st)
        out = got.arrays
        if xp is not np:
            _sync(xp)
        t4 = time.perf_counter()
        nbytes = int(out["kv"].nbytes)
        del out
    finally:
        if reg is not None:
            reg.unregister()
        log.close()
    plan_s = got.plan_s
    restore_s = t4 - t1 - register_s - plan_s  # the plan applied: from the plan's end to the bytes in place
    return {"open_s": t1 - t0, "plan_s": plan_s, "restore_s": restore_s, "total_s": (t1 - t0) + plan_s + restore_s,
            "register_s": register_s, "layout_s": st.get("layout_s", 0.0),
            "staging_alloc_s": st.get("staging_alloc_s", 0.0), "scatter_s": st.get("scatter_s", restore_s),
            "verify_s": st.get("verify_s", 0.0), "via": st.get("via"), "chunks": st.get("chunks"),
            "fill_wait_s": st.get("fill_wait_s"), "copy_wait_s": st.get("copy_wait_s"),
            "register_wait_s": st.get("register_wait_s"), "pin_stop_s": st.get("pin_stop_s"),
            "pins_kept": st.get("pins_kept"),
            "pin_refused": st.get("pin_refused"), "alloc_s": st.get("alloc_s"),
            "bytes": nbytes, "GBps": nbytes / restore_s / 1e9}


def _session_once(xp, spec: str) -> dict:
    """A program's recovery of the log: Session(create=False) (read-only until
    the program's first write) and recover() into new arrays on the device
    (or the host)."""
    from concordia import Session

    t0 = time.perf_counter()
    s = Session(spec, create=False)
    try:
        t1 = time.perf_counter()
        out = s.recover(device="cupy" if xp is not np else None)
        _sync(xp)
        t2 = time.perf_counter()
        nbytes = int(out["kv"].nbytes)
        phases = s.last_recovery.phases   # the session's own: open, plan, the check-and-copy pass...
        del out
    finally:
        s.close()
    return {"session_open_s": t1 - t0, "session_recover_s": t2 - t1, "session_total_s": t2 - t0,
            "session_GBps": nbytes / (t2 - t1) / 1e9, "session_phases": phases}


def _host_read(xp, spec: str, nbytes: int, threads=(None,)) -> dict:
    """The host side alone: the restore's reader threads filling pinned
    buffers with nbytes of the log (preadv, as the restore reads it), for each
    thread count in `threads` (None: the restore's own count)."""
    from concordia.restore import device as rd
    from concordia.wal import Log

    log = Log.open(spec, writable=False, check_pages=False)
    fd, arr, owned = rd._source_of(log)
    chunk = rd.DEFAULT_CHUNK_BYTES
    bufs = ([np.frombuffer(xp.cuda.alloc_pinned_memory(chunk), np.uint8, chunk) for _ in range(2)]
            if xp is not np else [np.empty(chunk, np.uint8) for _ in range(2)])
    out = {}
    try:
        for t in threads:
            n_threads = t or rd.COPY_THREADS
            t0 = time.perf_counter()
            pending = []
            for k, lo in enumerate(range(0, nbytes, chunk)):
                n = min(chunk, nbytes - lo)
                rd._wait(pending)
                pending = rd._fill(fd, arr, bufs[k % 2], np.array([[lo, n, 0]], np.int64), threads=n_threads)
            rd._wait(pending)
            out[n_threads] = nbytes / (time.perf_counter() - t0) / 1e9
    finally:
        if owned:
            os.close(fd)
        log.close()
    return {"GBps": out.get(rd.COPY_THREADS, max(out.values())), "threads": rd.COPY_THREADS,
            "by_threads": out, "how": "preadv" if fd is not None else "memory copies"}


def _warm_up(xp, page_bytes: int, scratch: Scratch) -> float:
    """Seconds of a first, small restore in this process (kernel load, pinned
    staging buffers): paid once by a recovering process, kept out of the rows."""
    spec = scratch.log("warm-up")
    try:
        _write_log(xp, spec, 64 * page_bytes, page_bytes)
        t0 = time.perf_counter()
        _restore_once(xp, spec)
        return time.perf_counter() - t0
    finally:
        scratch.discard(spec)


def _prefill(xp, nbytes: int, quick: bool) -> dict:
    """Seconds for the reference model to rebuild nbytes of KV from tokens."""
    from concordia.demo.workload import Workload, WorkloadConfig

    wl = Workload(WorkloadConfig(), xp=xp)
    T = wl.cfg.max_len
    batch = 4 if quick else 256
    toks = np.random.default_rng(0).integers(0, wl.cfg.vocab, (batch, T)).astype(np.int32)
    wl.prefill(toks[:1])  # warm up (kernels, allocator)
    _sync(xp)
    t0 = time.perf_counter()
    wl.prefill(toks)
    _sync(xp)
    secs = time.perf_counter() - t0
    tps = batch * T / secs
    tokens = nbytes / wl.kv_bytes_per_token
    return {"tokens": int(tokens), "tokens_per_s": tps, "seconds": tokens / tps,
            "measured_tokens": batch * T, "kv_bytes_per_token": wl.kv_bytes_per_token}


def _torch(xp, nbytes: int, path: str) -> dict | None:
    try:
        import torch
    except Exception:
        return None
    dev = "cuda" if xp is not np and torch.cuda.is_available() else "cpu"
    t = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    try:
        t0 = time.perf_counter()
        torch.save(t, path)
        t1 = time.perf_counter()
        del t
        if dev == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        back = torch.load(path, map_location=dev)
        if dev == "cuda":
            torch.cuda.synchronize()
        t3 = time.perf_counter()
        del back
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return {"save_s": t1 - t0, "load_s": t3 - t2, "device": dev}


def _release(xp) -> None:
    """Hand cached device memory back between steps (CuPy's pool and torch's
    cache would otherwise hold several copies of the largest size)."""
    if xp is np:
        return
    xp.get_default_memory_pool().free_all_blocks()
    xp.get_default_pinned_memory_pool().free_all_blocks()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:
        pass


def run(sizes_bytes, tiers, quick: bool, page_bytes: int, scratch: Scratch, on_row=None, with_torch: bool = True,
        torch_max_bytes: int | None = None, registered_max_bytes: int = 10 * GIB) -> dict:
    """Every (size, tier) row; `on_row(result so far)` after each one, so a
    run cut short keeps what it measured.  A step that fails (a tier too large
    for the machine's disk, say) leaves a row with its error and the run goes on."""
    gpu = _gpu()
    xp = gpu if gpu is not None else np
    work = os.environ.get("CONCORDIA_BENCH_DIR")  # where file logs go (in a folder of the run's own)
    rows = []
    res = {"device": "gpu" if gpu is not None else "cpu", "page_bytes": page_bytes,
           "goals": {"ratio_to_ceiling": 0.8, "total_s_at_10GiB": 1.0,
                     "hugetlb_ratio_to_ceiling_at_10GiB": 0.85}, "rows": rows,
           "measured_through": MEASURED_THROUGH}
    res["ceiling"] = ceiling = _ceiling(xp, max(sizes_bytes))
    _release(xp)
    res["first_restore_s"] = _warm_up(xp, page_bytes, scratch)
    pre = _prefill(xp, max(sizes_bytes), quick)  # tokens per second, scaled to each size below
    res["reprefill"] = {k: pre[k] for k in ("tokens_per_s", "measured_tokens", "kv_bytes_per_token")}
    for nbytes in sizes_bytes:
        tokens = nbytes / pre["kv_bytes_per_token"]
        reprefill_s = tokens / pre["tokens_per_s"]
        for tier in tiers:
            row = {"tier": tier, "bytes": nbytes, "GiB": nbytes / GIB, "reprefill_s": reprefill_s,
                   "reprefill_tokens": int(tokens)}
            spec = None
            try:
                spec = _spec(tier, scratch, work)
                w = _write_log(xp, spec, nbytes, page_bytes)
                _release(xp)
                r = _restore(xp, spec)
                if tier == "shm" and xp is not np:  # the same log, pieces pinned ahead of the copy engine
                    _release(xp)
                    c = _restore(xp, spec, read="pin")
                    row.update({f"pin_{k}": c[k] for k in ("total_s", "restore_s", "GBps", "via", "register_wait_s",
                                                           "pin_stop_s", "pins_kept", "pin_refused")})
                    row["pin_ratio_to_ceiling"] = c["GBps"] / ceiling["GBps"]
                if tier == "hugetlb" and xp is not np:  # the same log copied by host threads instead
                    _release(xp)
                    c = _restore(xp, spec, read="copy", repeat=1)
                    row.update({f"copy_{k}": c[k] for k in ("total_s", "restore_s", "GBps", "via")})
                    row["copy_ratio_to_ceiling"] = c["GBps"] / ceiling["GBps"]
                sweep = quick or tier == "hugetlb"   # the thread sweep is the shm/file question
                hr = _host_read(xp, spec, nbytes, threads=(None,) if sweep else (None, 4, 8, 16))
                row.update({"host_read_GBps": hr["GBps"], "host_read_threads": hr["threads"],
                            "host_read_GBps_by_threads": hr["by_threads"]})
                if tier in ("shm", "hugetlb") and xp is not np and nbytes <= registered_max_bytes:
                    _release(xp)  # the same log read by the copy engine from a registered mapping
                    g = _restore(xp, spec, registered=True, repeat=1)
                    row.update({f"registered_{k}": g[k] for k in ("total_s", "restore_s", "register_s",
                                                                    "GBps", "via")})
                    row["registered_ratio_to_ceiling"] = g["GBps"] / ceiling["GBps"]
                _release(xp)  # last: a writable open of the log, as a program recovering it makes
                row.update(_session_once(xp, spec))
                row.update({"write_s": w["write_s"], **{k: v for k, v in r.items() if k != "bytes"},
                            "ratio_to_ceiling": r["GBps"] / ceiling["GBps"],
                            "speedup_vs_reprefill": reprefill_s / r["total_s"]})
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"
            finally:
                if spec is not None:
                    scratch.discard(spec)
                _release(xp)
            # torch.save writes with write(2), which hugetlbfs has not: memory beside memory
            directory = SHM_DIR if tier in ("shm", "hugetlb") else work
            try:
                tr = (_torch(xp, nbytes, scratch.path("torch.pt", directory))
                      if with_torch and (torch_max_bytes is None or nbytes <= torch_max_bytes) else None)
            except Exception as exc:
                tr = None
                row["torch_error"] = f"{type(exc).__name__}: {exc}"
            _release(xp)
            row.update({"torch_save_s": tr and tr["save_s"], "torch_load_s": tr and tr["load_s"],
                        "speedup_vs_torch_load": (tr["load_s"] / row["total_s"]) if tr and "total_s" in row
                        else None})
            rows.append(row)
            if on_row is not None:
                on_row(res)
    return res


# which entry point each figure of a row measures: the product's or a component
MEASURED_THROUGH = {
    "open_s plan_s restore_s total_s GBps ratio_to_ceiling pin_* copy_* registered_*":
        "component: Log.open + restore.run.restore (wal.planner.plan, then restore.device.apply_plan_cupy; "
        "apply_plan_numpy on the host), the read-only pipeline Session.recover runs",
    "session_*": "public entry point: Session(log, create=False).recover()",
    "host_read_*": "component: the restore's reader threads alone (restore.device internals)",
}


def _table(res: dict) -> str:
    c = res["ceiling"]
    lines = [f"ceiling: {c['what']} {c['GBps']:.1f} GB/s (device: {res['device']})",
             "open/plan/restore/total: component figures (Log.open, restore.run.restore: plan, apply_plan_cupy); "
             "Session.recover: the public entry point",
             f"{'tier':<7} {'GiB':>6} {'open':>7} {'plan':>7} {'restore':>8} {'total':>8} {'GB/s':>7} "
             f"{'ceil%':>6} {'re-prefill':>11} {'torch.load':>11}  via"]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"{r['tier']:<7} {r['GiB']:>6.2f} failed: {r['error']}")
            continue
        tl = f"{r['torch_load_s']:.3f}s" if r["torch_load_s"] is not None else "-"
        lines.append(f"{r['tier']:<7} {r['GiB']:>6.2f} {r['open_s']:>6.3f}s {r['plan_s']:>6.3f}s "
                     f"{r['restore_s']:>7.3f}s {r['total_s']:>7.3f}s {r['GBps']:>7.1f} "
                     f"{100 * r['ratio_to_ceiling']:>5.0f}% {r['reprefill_s']:>10.2f}s {tl:>11}  {r['via']}")
        if "session_total_s" in r:
            lines.append(f"{'':<7} {'':>6} {'Session.recover:':>16} {r['session_open_s']:>6.3f}s (open) "
                         f"{r['session_recover_s']:>7.3f}s (plan + restore) {r['session_total_s']:>7.3f}s")
        if "copy_restore_s" in r:
            lines.append(f"{'':<7} {'':>6} {'copied by threads:':>16} {r['copy_restore_s']:>7.3f}s "
                         f"{r['copy_total_s']:>7.3f}s {r['copy_GBps']:>7.1f} "
                         f"{100 * r['copy_ratio_to_ceiling']:>5.0f}%")
        if "registered_restore_s" in r:
            lines.append(f"{'':<7} {'':>6} {'registered mapping:':>16} {r['registered_restore_s']:>7.3f}s "
                         f"{r['registered_total_s']:>7.3f}s {r['registered_GBps']:>7.1f} "
                         f"{100 * r['registered_ratio_to_ceiling']:>5.0f}%  (registering "
                         f"{r['registered_register_s']:.3f}s, not counted)")
    return "\n".join(lines)


def _plot(res: dict, path: str, *, replace: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    done = [r for r in res["rows"] if "total_s" in r]
    for tier in sorted({r["tier"] for r in done}):
        rs = [r for r in done if r["tier"] == tier]
        ax.plot([r["GiB"] for r in rs], [r["total_s"] for r in rs], "o-", label=f"Concordia restore ({tier} log)")
        tl = [(r["GiB"], r["torch_load_s"]) for r in rs if r["torch_load_s"] is not None]
        if tl:
            ax.plot(*zip(*tl), "s--", label=f"torch.load ({tier})")
    rs = sorted({(r["GiB"], r["reprefill_s"]) for r in res["rows"]})
    ax.plot([a for a, _ in rs], [b for _, b in rs], "^:", label="re-prefill (model)")
    gib = sorted({r["GiB"] for r in res["rows"]})
    ax.plot(gib, [g * GIB / (res["ceiling"]["GBps"] * 1e9) for g in gib], "k-", lw=0.8,
            label=f"ceiling: {res['ceiling']['what']}")
    ax.set_xlabel("KV state restored (GiB)")
    ax.set_ylabel("seconds")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title(f"Recovery of KV state ({res['device'].upper()})")
    fig.tight_layout()
    save_figure(fig, path, replace=replace, dpi=120)  # complete or absent, like the JSON


@click.command("recover")
@click.option("--sizes", default="1,10,40", show_default=True,
              help="KV sizes in GiB, comma-separated (fractions allowed).")
@click.option("--tiers", default="shm,file", show_default=True,
              help="Log tiers: shm, file, hugetlb (a hugetlbfs mount: $CONCORDIA_HUGETLB_DIR or the first one).")
@click.option("--page-bytes", default=65536, show_default=True, type=int, help="Page size of the KV region.")
@click.option("--torch/--no-torch", "with_torch", default=True, show_default=True,
              help="Time torch.save/torch.load of the same bytes.")
@click.option("--torch-max-gib", default=10.0, show_default=True, type=FiniteRange(min=0),
              help="Largest size at which torch.save/torch.load are timed (they take ~2.5 s per GiB).")
@click.option("--registered-max-gib", default=10.0, show_default=True, type=FiniteRange(min=0),
              help="Largest shm size also restored from a registered mapping (registering takes ~0.25 s/GiB).")
@click.option("--quick", is_flag=True, help="Small sizes (CI smoke test; runs on the CPU).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of the table.")
@click.option("--out", type=click.Path(dir_okay=False), help="Also write the JSON here.")
@click.option("--plot", is_flag=True, help="Draw seconds per size to a PNG (beside --out, or ./bench-recover.png).")
@force_option("--out", "the --plot PNG")
@guarded
def command(sizes, tiers, page_bytes, with_torch, torch_max_gib, registered_max_gib, quick, as_json, out, plot,
            force):
    """Restore KV state from shm, file and hugetlb logs onto the GPU, beside pinned
    host-to-device bandwidth, re-prefill with the model and torch.load.

    Example:

    \b
        concordia-wal bench recover --sizes 1,10,40 --json --plot --out recover.json
    """
    plot_path = ((os.path.splitext(out)[0] + ".png") if out else "bench-recover.png") if plot else None
    check_outputs(force, out, plot_path)  # before the run: a long benchmark is not refused at its end
    try:
        gib = [float(x) for x in sizes.split(",") if x.strip()]
    except ValueError:
        gib = []
    if not gib or not all(math.isfinite(g) and g > 0 for g in gib):   # nan, inf, 0, negatives, nothing
        raise click.BadParameter(f"not a list of sizes in GiB above 0: {sizes!r}", param_hint="--sizes")
    tier_list = [t.strip() for t in tiers.split(",") if t.strip()]
    bad = [t for t in tier_list if t not in ("shm", "file", "hugetlb")]
    if bad or not tier_list:
        raise click.BadParameter(f"unknown tier {bad[0] if bad else tiers!r} (use shm, file, hugetlb)",
                                 param_hint="--tiers")
    if quick:
        gib = [4 / 1024, 16 / 1024]
    sizes_bytes = [max(page_bytes, int(g * GIB) // page_bytes * page_bytes) for g in gib]
    written = []

    def save(result):
        if out:
            import json

            # complete or not at all: the file a row before is kept until this one is whole;
            # an existing --out is replaced only with --force, the run's own from a row before always
            write_output(out, json.dumps(result, indent=2).encode(), replace=force or bool(written))
            written.append(out)

    with Scratch("recover") as scratch:  # its logs and torch files go, however the run ends
        res = run(sizes_bytes, tier_list, quick, page_bytes, scratch, on_row=save, with_torch=with_torch,
                  torch_max_bytes=int(torch_max_gib * GIB), registered_max_bytes=int(registered_max_gib * GIB))
    save(res)
    if plot_path:
        _plot(res, plot_path, replace=force)
        res["plot"] = plot_path
    if as_json:
        emit_json(res)
    else:
        click.echo(_table(res))
