"""The one recover entry: target checks, the plan, and the host or device applier.

    restore   plan `log` and apply the plan: new arrays of each region's layout,
              on the host (`wal.apply.apply_plan_numpy`) or the device pipeline
              (`restore.device.apply_plan_cupy`), or into checked targets.
              `recover` below, the standby and `concordia-wal bench recover`
              call it.
    recover   what `Session.recover` promises: every target checked before
              anything is written, each region handed back as what it was
              registered as (`regions.arrays.present`), and what it did
              (`RecoveryStats`).

A region with no state at the plan's epoch (registered after it: the
planner's `RegionPlan.absent`) is never restored as zeros: `absent="refuse"`
(the default) refuses the whole recovery before anything is written
(`wal.apply.check_present`, one line naming the region and the epoch; a
region whose descriptor no commit holds yet, a live writer's, likewise);
`absent="keep"` leaves its target as it is (a new array: leaves it out) and
lists it in `kept`.

Every target is written only once every page and digest checked out, so
damage leaves it as it was: host targets from arrays restored aside, device
targets by device-to-device copies from the pipeline's (or a read ahead's)
arrays (one a target, or one launch for many: `into_targets`), queued after
the work on each target's own stream and before the work queued there after
the call (`StreamOrder`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import numpy as np

from concordia.regions.arrays import adapt, dtype_name, numpy_dtype, present, torch_dtype, torch_module
from concordia.regions.errors import (NothingToRecoverError, RecoverMismatchError, SessionError, UnknownRegionError,
                                      UnsupportedArrayError)
from concordia.regions.streams import StreamOrder
from concordia.root_error import ConcordiaError
from concordia.wal import format as fmt
from concordia.wal.errors import CorruptionError

DEVICES = (None, "numpy", "cpu", "cupy", "cuda")
#: what a recovery does with a region that has no state at its epoch (module doc)
ABSENT = ("refuse", "keep")


@dataclasses.dataclass
class RecoveryStats:
    epoch: int
    plan_ms: float
    restore_ms: float
    bytes: int             # payload bytes read from the log
    pages: int
    regions: dict          # name -> bytes of the region
    dropped: list
    via: dict = dataclasses.field(default_factory=dict)  # name -> "device pipeline" | "host"
    kept: list = dataclasses.field(default_factory=list)  # absent="keep": regions with no state there, left alone
    #: name -> the epoch each restored region holds: the recovery's own, or an older one where
    #: skip_corrupt fell back for it (a region given up, or kept, is not here)
    epochs: dict = dataclasses.field(default_factory=dict)
    #: where the time went, in order: {phase: {"s": seconds, and "bytes", "GBps" where bytes flow}}
    #: (`phases_of`); "open" only in a session's first recovery after it opened the log
    phases: dict = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Restored:
    """What `restore` did: the restored arrays (layout dtype and shape, or the
    targets given), the plan and the seconds planning and applying it took,
    the path each region took, and the device pipeline's stage figures."""

    arrays: dict
    plan: object
    plan_s: float
    apply_s: float
    via: dict
    stats: dict
    kept: list = dataclasses.field(default_factory=list)  # regions with no state at the epoch, left alone


def on_device(device) -> bool:
    if device not in DEVICES:
        raise SessionError(f"unknown device {device!r} (use numpy or cupy)")
    return device in ("cupy", "cuda")


def check_absent(absent) -> None:
    if absent not in ABSENT:
        raise SessionError(f"unknown absent={absent!r} (use {' or '.join(map(repr, ABSENT))})",
                           hint="absent='keep' leaves a region with no state at the epoch as it is")


#: staged device copies at least this large are given back to the driver once
#: copied into their targets (`_restore`)
RELEASE_STAGED_BYTES = 256 << 20
#: after copies into targets out of memory of their own, CuPy's pool gives its free blocks back to the driver
#: when the restore added this many free bytes to it (a restore's page tables: 16 bytes a page); fewer stay
#: for the checkpoints that follow, since giving them back (cudaFree) waits for the device's work, the copies
#: included.  What the pool held free before the restore is not its doing and makes no one wait; once the
#: restore added enough, every free block goes (CuPy gives back all or none), those from before too.
RELEASE_POOL_BYTES = 64 << 20


def pool_free_bytes() -> int:
    """The free bytes CuPy's pool holds now (0 where CuPy is not loaded, or
    has no device to ask): a restore's baseline for `into_targets`' release."""
    import sys

    cp = sys.modules.get("cupy")
    if cp is None:
        return 0
    try:
        return int(cp.get_default_memory_pool().free_bytes())
    except Exception:   # CuPy without a usable device: a host restore has no pool to give back
        return 0


#: device targets from this many on are copied into by one launch (`into_targets`): a read ahead's 173
#: copies into a Qwen3's tensors, one driver call each, took 1.6 ms of the caller's time (H100)
BATCHED_COPIES = 8


def restore(log, target="latest", *, mode=None, regions=None, device: bool = False, into: dict | None = None,
            registration=None, read: str = "auto", stats: dict | None = None, plan=None,
            absent: str = "refuse", own_new: bool = False, order: StreamOrder | None = None,
            ring=None) -> Restored:
    """Plan `log` at `target` in `mode` (or take `plan`) and apply it to
    `regions` (None: every region of the plan).

    into: {name: (layout view, array module)} of checked targets (`check_target`).
    No target is written before every region asked for has checked out (its
    pages against their CRCs, its digest against its commit): device regions
    are restored by the device pipeline into new device arrays, then copied
    into their targets (`into_targets`: on CuPy's current stream, after the
    work queued on the targets' own streams, `order`, and before later work
    there, which `recover` orders; the new arrays are the size of the
    targets); host views get the bytes likewise.
    Damage found anywhere leaves every target as it was.  Regions asked for
    beyond `into` come back as new arrays, on the device when `device`.
    registration: the log mapping's live CUDA registration (a session's), read
    by the copy engine directly.  read and stats: as `apply_plan_cupy` takes them.
    absent: "refuse" or "keep" a region with no state at the epoch (module doc),
    decided before anything is written.  ring: where given (`ring_of`: a
    resident executor's), the device regions' pages are one RECOVER task of
    a persistent kernel (`restore.ring`) instead of the caller's pipeline,
    which a recovery that cannot take it takes (its stats say why:
    "ring_why").  own_new: the new device arrays get
    memory of their own from the driver (a read ahead's, `restore.ahead`,
    copied into targets later and dropped), not CuPy's pool.

    Pages are checked where the bytes flow (`_deferred`): the plan is made
    from the log's metadata, the appliers check every page they copy (on the
    device, or as the host copies it), and the pages of the records they do
    not copy whole are checked on the host's threads meanwhile, before any
    target is written.  Should either find damage, or the applier refuse, the
    recovery starts again from a plan made with every page checked
    (`wal.planner.plan`, FORMAT.md R-D5), so that what it restores or refuses
    is that plan's, as every other consumer of the log meets it."""
    check_absent(absent)
    st = {} if stats is None else stats
    # CuPy's free blocks before the restore (once: a second plan's restore follows the first's temporaries)
    args = dict(regions=regions, device=device, into=into or {}, registration=registration, read=read, st=st,
                absent=absent, own_new=own_new, order=order, pool_free=pool_free_bytes(), ring=ring)
    if plan is not None:
        return _restore(log, plan, 0.0, None, **args)
    from concordia.wal.planner import plan as make_plan, plan_unchecked

    t0 = time.perf_counter()
    unchecked, pages = plan_unchecked(log, target=target, mode=mode)
    try:
        return _restore(log, unchecked, time.perf_counter() - t0, pages, **args)
    except _Damaged as exc:
        why = str(exc)
    except ConcordiaError as exc:
        if not isinstance(exc, CorruptionError) and pages.run():
            raise  # no page damage anywhere: the checked plan is this one, and refuses alike
        why = f"{type(exc).__name__}: {exc}"
    st.clear()
    t0 = time.perf_counter()
    checked = make_plan(log, target=target, **({} if mode is None else {"mode": mode}))
    out = _restore(log, checked, time.perf_counter() - t0, None, **args)
    st["page_check"] = f"damage met while applying a plan made from metadata ({why}): planned again, every page checked"
    return out


class _Damaged(Exception):
    """The host's page checks beside an unchecked plan found a damaged page."""


def _deferred(plan, pages, names: list, st: dict):
    """Start R-D5's page checks of what the appliers of `names` will not copy
    (`PageCheck.run`: they check what they copy) on a thread; returns a
    function that waits for them and raises _Damaged when one failed."""
    from concurrent.futures import ThreadPoolExecutor

    read = [s for n in names for s in plan.regions[n].sources]
    whole = sum(s.rows.size == s.batch.page_ids.size for s in read)
    st["page_check"] = (f"deferred: {whole} record(s) checked page by page by the applier, "
                        f"the rest ({len(read) - whole} read in part) on the host meanwhile")

    def run():
        t = time.perf_counter()
        try:
            return pages.run(read)
        finally:
            st["page_check_s"] = time.perf_counter() - t

    one = ThreadPoolExecutor(1, thread_name_prefix="concordia-page-check")
    done = one.submit(run)
    one.shutdown(wait=False)   # the thread ends with the checks; wait() waits for them

    def wait():
        w = time.perf_counter()
        ok = done.result()   # raises what the checks raised
        st["page_check_wait_s"] = time.perf_counter() - w
        if not ok:
            raise _Damaged("the host's page checks found a damaged page")
    return wait


def absent_regions(plan, want: list, absent: str, *, where: str) -> list:
    """The regions of `want` with no state at `plan`'s epoch
    (`wal.apply.absent_names`), to be left as they are (absent="keep"), or
    the one-line refusal (`check_present`, "refuse"), before anything is
    written."""
    from concordia.wal.apply import absent_names, check_present

    if absent == "keep":
        return absent_names(plan, want)
    check_present(plan, want, where=where)
    return []


def _restore(log, plan, plan_s, pages, *, regions, device, into, registration, read, st, absent,
             own_new, order, pool_free, ring) -> Restored:
    """restore() with `plan`; `pages`: the page checks left from planning
    (`PageCheck`), or None when the plan was made with them; `pool_free`:
    CuPy's free bytes before the restore (`into_targets`)."""
    from concordia.wal.apply import apply_plan_numpy

    want = list(plan.regions) if regions is None else list(regions)
    kept = absent_regions(plan, want, absent, where=str(log.backend.where))  # before any write
    want = [n for n in want if n not in kept]
    # a region the plan gave up (skip_corrupt, damage the log's open met) has no sources to check
    wait = _deferred(plan, pages, [n for n in want if n in plan.regions], st) if pages is not None else (lambda: None)
    dev, host = split_targets(into, want)
    rest = [n for n in want if n not in dev and n not in host]
    arrays, via = {}, {}
    t1 = time.perf_counter()

    # one pass of each applier over every region it restores; the targets are written
    # only once everything checked out (`staged`, `host_got`: what goes into them)
    on_gpu = list(dev) + (rest if device else [])
    on_host = list(host) + ([] if device else rest)
    got, own = {}, False
    try:
        if on_gpu:
            from concordia.restore.device import apply_plan_cupy

            # staged copies of the device targets of at least RELEASE_STAGED_BYTES: memory of their own,
            # given back to the driver once copied (in CuPy's pool, the framework that owns the targets
            # could not use it: a cache of 30 GiB restored into torch tensors would leave 30 GiB there)
            own = sum(plan.regions[n].region.nbytes for n in dev if n in plan.regions) >= RELEASE_STAGED_BYTES
            own_memory = set(on_gpu) if own_new else set(dev) if own else ()
            got = None
            if ring is not None:   # a resident executor's persistent kernel, where it can take it
                from concordia.restore.ring import attempt

                got = attempt(ring, log, plan, st, regions=on_gpu, registration=registration, own_memory=own_memory)
            via.update(dict.fromkeys(got or (), "persistent kernel"))
            if got is None:
                got = apply_plan_cupy(log, plan, regions=on_gpu, stats=st, registration=registration, read=read,
                                      own_memory=own_memory)
                via.update(dict.fromkeys(got, "device pipeline"))
        if on_host:
            got_host = apply_plan_numpy(log, plan, regions=on_host)
            if not device and rest:
                st.setdefault("via", "numpy applier")
            via.update(dict.fromkeys(got_host, "host"))
            got.update(got_host)
    finally:
        wait()   # the page checks end before anything is written, or before an error leaves
    written = into_targets(dev, host, got, own, order, pool_free=pool_free)   # the decision is made
    arrays.update(got)
    arrays.update(written)
    return Restored(arrays, plan, plan_s, time.perf_counter() - t1, via, st, kept)


def ring_of(holder, log):
    """What `restore` takes as `ring` for a session whose resident executor is
    `holder` (None: no ring): a callable giving (`restore.ring.RingRecovery`
    it keeps, or None, why not), asked only by a recovery onto the device."""
    if holder is None:
        return None

    def engine():
        from concordia.restore.ring import engine_for

        return engine_for(holder, log)
    return engine


def later_quietly(order: StreamOrder) -> None:
    """`order.before_later_work()` on a failing path: its own failure (a
    device in an error state) does not replace the error being raised."""
    try:
        order.before_later_work()
    except Exception:
        pass


@contextlib.contextmanager
def ordered_after(order: StreamOrder):
    """Run the block (reads of the targets just written), then
    `order.before_later_work()`: the streams' later work follows the copies
    whether the block ends or raises (then quietly, `later_quietly`)."""
    try:
        yield
    except BaseException:
        later_quietly(order)
        raise
    order.before_later_work()


def split_targets(views: dict, names) -> tuple[dict, dict]:
    """({name: device view}, {name: host view}) of the checked targets `views`
    ({name: (view, xp)}) among `names`."""
    names = set(names)
    dev = {n: v for n, (v, xp) in views.items() if xp is not np and n in names}
    host = {n: v for n, (v, xp) in views.items() if xp is np and n in names}
    return dev, host


def into_targets(dev: dict, host: dict, got: dict, own: bool, order: StreamOrder | None = None,
                 parts: dict | None = None, pool_free: int = 0) -> dict:
    """Copy what `got` holds for the device targets `dev` (one
    device-to-device copy each, or one batched copy for BATCHED_COPIES or more
    (`gpu_kernels.gpu.copy_checked_spans`), on CuPy's current stream, after the work
    queued on the targets' own streams, `order`: `recover` makes it and
    orders their later work after the copies) and the host views `host` into
    them, taking those arrays out of `got`; {name: target written}.  A region
    given up (skip_corrupt) is not in `got` and its target stays as it was.
    own: the staged copies have memory of their own (`restore.device.OwnBlock`),
    given back to the driver once dropped: in stream order behind the copies
    out of them, or, where it cannot be, after the host waited for the
    copies; the pool's free blocks go too once the restore added
    RELEASE_POOL_BYTES to the `pool_free` bytes they held before it
    (`pool_free_bytes`; giving them back waits for the device's work).
    parts: where given, the seconds of the device copies' queueing
    ("queue_s"), the host's wait for them ("wait_s", none when freed in
    stream order) and the pool's free blocks given back ("pool_free_s")."""
    out, t = {}, time.perf_counter()
    clock = parts if parts is not None else {}
    staged = {n: got.pop(n) for n in dev if n in got}
    host_got = {n: got.pop(n) for n in host if n in got}
    if dev:
        if order is not None:
            order.after_producers()
        from concordia.gpu_kernels import gpu
        from concordia.gpu_kernels.errors import KernelCompileError
        from concordia.gpu_kernels.jit import require_cupy

        cp = require_cupy()
        stream = cp.cuda.get_current_stream()
        pairs = [(a, dev[name]) for name, a in staged.items()]
        batched = len(pairs) >= BATCHED_COPIES   # one launch, not a driver call a region
        if batched:
            try:   # (checked already: each target against the log, each staged copy made to its size)
                gpu.copy_checked_spans(pairs)
            except KernelCompileError:   # (the kernel could not be built here: nothing was queued)
                batched = False
        if not batched:
            gpu.copy_engine(pairs)
        pairs = None   # (it holds the staged copies)
        out.update((name, dev[name]) for name in staged)
        clock["queue_s"], t = time.perf_counter() - t, time.perf_counter()
        if own:
            from concordia.restore.device import free_after

            if not free_after(staged.values(), stream):
                stream.synchronize()  # the copies out of them are done: dropped, they go back to the driver
        clock["wait_s"], t = time.perf_counter() - t, time.perf_counter()
        staged.clear()   # nothing here holds a staged copy now
        pool = cp.get_default_memory_pool()
        if own and pool.free_bytes() - pool_free >= RELEASE_POOL_BYTES:
            pool.free_all_blocks()   # and the pipeline's own temporaries (page tables) leave CuPy's pool too
        clock["pool_free_s"] = time.perf_counter() - t
    for name, a in host_got.items():
        host[name][...] = a
        out[name] = host[name]
    return out


def recover(log, target="latest", *, targets: dict | None = None, device=None, mode=None, regions=None,
            registration=None, absent: str = "refuse", ahead=None, adapted: dict | None = None,
            order: StreamOrder | None = None, ring=None) -> tuple[dict, RecoveryStats]:
    """({name: restored}, RecoveryStats): `Session.recover` on an open log.

    targets: {name: array or tensor} restored in place (each checked first:
    `check_target`); regions: the names to restore (None: the targets', or
    every region of the log's plan: a region whose descriptor follows the
    last commit, a live writer's, is not the log's yet).  New arrays come back as the regions were
    registered (`present`): tensors for tensors, else numpy arrays (ml_dtypes
    for bfloat16 and float8), on the GPU with device="cupy".  absent: a region
    with no state at the epoch refused ("refuse"), or left as it is and
    listed in `RecoveryStats.kept` ("keep"; a new array is left out).
    ahead: a read ahead of the log (`restore.ahead.ReadAhead`) to copy from
    where it holds what is asked for; else the log is read, as without it.
    adapted: {name: (layout view, xp, kind, logical dtype)} of targets whose
    views were made already (registered regions, `Region.unchanged_view`):
    checked as they are (`check_view`), not adapted again.
    order: the device targets' stream order (`StreamOrder.of`; default: each
    target's framework's current stream): the copies into them follow the
    work queued there before the call, and, when it is given, the caller
    orders the work queued there after (its own reads of the targets come
    first); else this call does.  ring: as `restore` takes it (`ring_of`)."""
    t_checks = time.perf_counter()
    gpu = on_device(device)
    check_absent(absent)
    where = str(log.backend.where)
    want = regions if regions is not None else (list(targets) if targets is not None else None)
    infos = log.regions   # a dict made afresh each time it is asked for: once here, not once a region
    if want is not None:
        missing = [n for n in want if n not in infos]
        if missing:
            raise UnknownRegionError(f"the log holds no region {missing[0]!r} (it holds {sorted(infos)})",
                                     where=where)
    views = {}
    if targets is not None:  # check every target before restoring anything
        targets = {n: a for n, a in targets.items() if want is None or n in want}
        adapted = adapted or {}
        for name, arr in targets.items():
            made = adapted.get(name)
            views[name] = (check_target(infos[name], name, arr, device) if made is None else
                           check_view(infos[name], name, made[0], made[1], made[2], device, logical=made[3]))
    for name in (want if want is not None else infos):
        if name not in views:
            check_presentable(infos[name], name, gpu)
    if not log.last_committed_epoch:
        raise NothingToRecoverError("the log holds no committed epoch", where=where)
    t0 = time.perf_counter()
    own_order = order is None
    if own_order:
        order = StreamOrder.of([(a, None) for a in (targets or {}).values()])
    try:
        got = None if ahead is None else ahead.take(log, target, mode, want, views, gpu, absent, order)
        if got is None:
            got = restore(log, target, mode=mode, regions=want, device=gpu, into=views, registration=registration,
                          absent=absent, order=order, ring=ring)
    except BaseException:
        later_quietly(order)   # copies may have been queued
        raise
    if own_order:
        order.before_later_work()
    out = {n: targets[n] for n in views}
    for name, a in got.arrays.items():
        if name not in views:
            out[name] = present(a, infos[name], device=gpu, where=f"region {name!r}")
    p = got.plan
    total_s = time.perf_counter() - t0
    read = [(rp.pages_read, rp.region.page_bytes) for rp in p.regions.values()]   # one pass over the sources
    stats = RecoveryStats(epoch=int(p.epoch), plan_ms=got.plan_s * 1e3,
                          restore_ms=(total_s - got.plan_s) * 1e3,
                          bytes=sum(n * pb for n, pb in read), pages=sum(n for n, _ in read),
                          regions={n: int(a.nbytes) for n, a in got.arrays.items()},
                          epochs={n: int(p.regions[n].epoch) for n in got.arrays if n in p.regions},
                          dropped=[d.to_json() for d in p.dropped], via=got.via, kept=got.kept,
                          phases={"targets": _phase(t0 - t_checks), **phases_of(got, total_s)})
    if ahead is not None and "read_ahead" not in stats.phases:  # passed over: why, beside the log's phases
        stats.phases["read_ahead"] = ahead.phase()
    return out, stats


def _phase(s: float, nbytes: int | None = None) -> dict:
    out = {"s": float(s)}
    if nbytes is not None:
        out["bytes"] = int(nbytes)
        out["GBps"] = nbytes / s / 1e9 if s > 0 else None
    return out


def phases_of(got: Restored, total_s: float) -> dict:
    """A recovery's phases from what `restore` measured: plan (reads the log's
    metadata; with every page checked, R-D5, when the first try met damage),
    then on the host path one pass that reads each page from the log, checks
    its CRC and writes it in place ("check_copy"), or on the device pipeline
    the transfer layout ("layout"), staging and targets ("alloc"), the
    pipelined read, H2D, CRC check and scatter ("transfer_check_scatter", with
    the way the log reached the device: "via") and
    the digests ("verify"), the mapping's registration when the restore
    made its own ("register"), and what none of these names ("other"; the log
    pieces pinned ahead of the copy engine stay pinned with the log, see
    `devmem.cuda_host.keep_pinned`);
    "check_wait": the wait, once everything was
    applied, for the host's checks of the pages no applier copied (its
    "overlapped_s": how long those checks ran beside the appliers); "present"
    is what is left (handing the arrays over as the regions were registered).
    `recover` puts the checks of the targets before them ("targets")."""
    st = got.stats
    if "read_ahead" in st:   # read ahead (`restore.ahead`): its wait, then one copy a target
        # the host's seconds: the device copies run on after it (ordered before the targets' later work)
        copy = {"s": float(st["copy_s"]), "bytes": int(st["copy_bytes"])}
        if st.get("copy_parts"):   # queue, wait, pool_free, release: seconds each
            copy["parts"] = {k: float(v) for k, v in st["copy_parts"].items()}
        return {"read_ahead": st["read_ahead"], "copy": copy,
                "present": _phase(max(0.0, total_s - got.apply_s))}
    nbytes = int(got.plan.bytes_to_read)   # (a pass over every source: not for a read ahead's copy)
    out = {"plan": _phase(got.plan_s)}
    if "scatter_s" in st:   # the device pipeline
        out["layout"] = _phase(st.get("layout_s", 0.0))
        out["alloc"] = _phase(st.get("alloc_s", 0.0))
        if st.get("alloc_parts"):   # staging, regions (zeroed), page_tables, kernels: seconds each
            out["alloc"]["parts"] = {k: float(v) for k, v in st["alloc_parts"].items()}
        out["transfer_check_scatter"] = _phase(max(0.0, st["scatter_s"] - st.get("alloc_s", 0.0)),
                                               st.get("bytes_copied", nbytes))
        if st.get("via"):   # the way the log reached the device (`apply_plan_cupy`'s or the ring's stats)
            out["transfer_check_scatter"]["via"] = st["via"]
        if st.get("ring_why"):   # a resident executor's recovery that could not take its persistent kernel
            out["transfer_check_scatter"]["ring_why"] = st["ring_why"]
        out["verify"] = _phase(st.get("verify_s", 0.0))
        if st.get("register_s"):
            out["register"] = _phase(st["register_s"])
    else:
        out["check_copy"] = _phase(max(0.0, got.apply_s - st.get("page_check_wait_s", 0.0)), nbytes)
    if "page_check_wait_s" in st:
        out["check_wait"] = {**_phase(st["page_check_wait_s"]), "overlapped_s": float(st.get("page_check_s", 0.0))}
    if "scatter_s" in st:   # the device pipeline's time no phase above names (the targets' copy, the rest)
        out["other"] = _phase(max(0.0, got.apply_s - sum(out[k]["s"] for k in out if k != "plan")))
    out["present"] = _phase(max(0.0, total_s - got.plan_s - got.apply_s))
    return out


def check_target(info, name, arr, device=None):
    """(layout view, xp) of a recover target, or a one-line RecoverMismatchError
    naming the region: another logical dtype, shape or device, or a view that
    is not C-contiguous.  Nothing is written here."""
    where = f"region {name!r}"
    kind = "tensor" if type(arr).__module__.split(".")[0] == "torch" else "array"
    got = dtype_name(arr) if hasattr(arr, "dtype") else None
    if got is not None and got != info.logical_dtype:
        raise RecoverMismatchError(f"cannot recover {info.logical_dtype} data into a {got} {kind}", where=where)
    shape = tuple(int(n) for n in arr.shape) if hasattr(arr, "shape") else None
    if shape is not None and shape != tuple(info.shape):
        raise RecoverMismatchError(f"cannot recover shape {list(info.shape)} into shape {list(shape)}", where=where)
    contiguous = (arr.is_contiguous() if kind == "tensor" else
                  getattr(getattr(arr, "flags", None), "c_contiguous", True))
    if not contiguous:
        raise RecoverMismatchError(f"the target {kind} is not C-contiguous (a view?)", where=where,
                                   hint="recover into the contiguous base, or into a new array and copy")
    a, xp, _ = adapt(arr, where, info.logical_dtype)
    return check_view(info, name, a, xp, kind, device)


def check_view(info, name, a, xp, kind: str = "array", device=None, logical: str | None = None):
    """`check_target` of a target's layout view `a` (array module `xp`) made
    already (`regions.arrays.adapt`: a registered region's, unchanged since),
    holding logical dtype `logical` when given; (a, xp)."""
    where = f"region {name!r}"
    if logical is not None and logical != info.logical_dtype:
        raise RecoverMismatchError(f"cannot recover {info.logical_dtype} data into a {logical} {kind}", where=where)
    if a.dtype != fmt.layout_dtype(info.dtype) or tuple(a.shape) != tuple(info.shape):
        raise RecoverMismatchError(f"cannot recover {info.dtype}{list(info.shape)} bytes into "
                                   f"{a.dtype}{list(a.shape)}", where=where)
    if not a.flags.c_contiguous:
        raise RecoverMismatchError(f"the target {kind} is not C-contiguous", where=where)
    on_gpu = xp is not np
    if device is not None and on_gpu != (device in ("cupy", "cuda")):
        raise RecoverMismatchError(f"the target {kind} is on {'a GPU' if on_gpu else 'the host'}, device={device!r} "
                                   f"was asked for", where=where)
    if on_gpu:
        here = xp.cuda.runtime.getDevice()
        if a.device.id != here:
            raise RecoverMismatchError(f"the target {kind} is on cuda:{a.device.id}, the restore runs on cuda:{here}",
                                       where=where, hint="call recover inside cupy.cuda.Device(n) of the targets")
    return a, xp


def check_presentable(info, name, gpu: bool) -> None:
    """Refuse, before anything is restored, a region whose logical dtype this
    build cannot hand back (one line naming the region)."""
    where = f"region {name!r}"
    size = np.dtype(info.dtype).itemsize
    if info.framework == "torch" and torch_module() is not None:
        torch_dtype(info.logical_dtype, where, size)
        return
    if not info.logical:  # the layout is the logical dtype
        return
    numpy_dtype(info.logical_dtype, where, size)
    if gpu:
        raise UnsupportedArrayError(f"CuPy has no {info.logical_dtype} arrays: restore it as a PyTorch tensor or "
                                    "on the host", where=where)
