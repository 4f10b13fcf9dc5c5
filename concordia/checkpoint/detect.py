"""Every dirty-page detector, once: which pages of a region changed since the
last checkpoint, and how each detector is re-armed when the region equals the
committed state again.

    shadow        the region against a copy of itself (`shadow_diff`)
    fingerprint   a 64-bit fingerprint per page against the last one
    blocks        kv regions: new tokens of each sequence from the block tables
                  and sequence lengths, plus whole blocks whose write stamp rose
                  while no sequence held them
    versions      adapter regions: slots whose version counter moved
    stores        the pages the PTX store tracker marked (`concordia.instrument`),
                  cross-checked by fingerprints every `check_every` checkpoints
    positions     static KV caches [..., max_len, row]: the pages of the positions
                  added since the last checkpoint, from the caller's length, in
                  every (batch, head) row; optionally cross-checked as stores are
    all           every page

Every detector runs on the region's own device: the numpy twins in
`gpu_kernels.reference` for host arrays, the kernels of `gpu_kernels.gpu` for
CuPy arrays the page kernels can read (16-byte aligned), and the numpy twin on
a host copy for the rest.  The state a detector keeps lives on the `Region`.
"""

from __future__ import annotations

import functools

import numpy as np

from concordia.gpu_kernels import reference as ref
from concordia.regions.arrays import to_host
from concordia.regions.errors import SessionError
from concordia.regions.region import KvGeometry, PositionGeometry, Region, read_length, read_sequence


def _kernels(r: Region):
    """The CuPy launchers of the page kernels for `r`, or None: a host region,
    a device region the kernels cannot read (not 16-byte aligned), or kernels
    that do not load."""
    if not r.on_gpu or not r.device_aligned:
        return None
    try:
        from concordia.gpu_kernels import gpu
    except ImportError:
        return None
    return gpu


def _diff(r: Region, state: str, kernel: str, twin, *, update: bool) -> np.ndarray:
    """Sorted uint32 ids of the pages of `r` that differ from what the
    detector holds (`r.shadow` or `r.fps`, named by `state`); with `update` it
    takes them.  The kernel where it reads the region, else its numpy twin (on
    host copies of a device region, whose state then takes the twin's result)."""
    held = getattr(r, state)
    gpu = _kernels(r)
    if gpu is not None:
        return to_host(getattr(gpu, kernel)(r.flat, held, page_bytes=r.page_bytes, update=update))
    if not r.on_gpu:
        return twin(r.flat, held, page_bytes=r.page_bytes, update=update)
    host = to_host(held)
    found = twin(to_host(r.flat), host, page_bytes=r.page_bytes, update=update)
    if update and found.size:
        held[...] = r.xp.asarray(host)
    return found


def shadow_diff(r: Region, *, update: bool) -> np.ndarray:
    """The one shadow diff: pages of `r` that differ from its shadow copy."""
    return _diff(r, "shadow", "shadow_diff", ref.shadow_diff, update=update)


def fingerprint_diff(r: Region, *, update: bool) -> np.ndarray:
    """Pages of `r` whose 64-bit fingerprint differs from `r.fps`."""
    return _diff(r, "fps", "fingerprint_dirty", ref.fingerprint_dirty, update=update)


def fingerprints(r: Region):
    """The fingerprint of every page of `r`, on the region's device."""
    gpu = _kernels(r)
    if gpu is not None:
        return gpu.fingerprint_pages(r.flat, page_bytes=r.page_bytes)
    got = ref.fingerprint_pages(to_host(r.flat), page_bytes=r.page_bytes)
    return got if not r.on_gpu else r.xp.asarray(got)


def reset(r: Region, *, recovered: bool = False, fps=None) -> None:
    """The caller's array now equals the committed state: (re)arm the detector.
    recovered: the state was restored from the log, and state the caller keeps
    beside the region (a positions region's length) may be restored only after
    this call: the positions detector then takes no length as known, so its
    next checkpoint names every position up to the length then.
    fps: the fingerprints of the array's contents, when known already (a read
    ahead made them, `restore.ahead.Seeds`), for a detector that needs them."""
    def fingerprints_now():
        return fingerprints(r) if fps is None else fps

    if r.detect == "shadow":
        if r.shadow is None:
            r.shadow = r.xp.empty(r.nbytes, dtype=r.xp.uint8)
        r.shadow[...] = r.flat
    elif r.detect == "fingerprint":
        r.fps = fingerprints_now()
    elif r.detect == "blocks":
        r.kv_prev = _kv_now(r)
    elif r.detect == "versions":
        r.seen_versions = to_host(r.hints["slot_versions"]).copy()
    elif r.detect == "stores":
        r.tracked.clear()
        r.since_check = 0
        r.tracked_since_check = np.zeros(0, np.uint32)
        if r.check_every:
            r.fps = fingerprints_now()
    elif r.detect == "positions":
        _, now, r.seq_prev = _positions_span(r)
        r.length_prev = r.length_checked = 0 if recovered else now
        r.since_check = 0
        if r.check_every:
            r.fps = fingerprints_now()


def dirty_pages(r: Region, *, advance: bool) -> np.ndarray:
    """Sorted uint32 ids of the pages of `r` changed since the last checkpoint
    (every page while it has no base).  With `advance` the detector takes the
    current state as its new baseline (only when the pages found are about to
    be logged)."""
    if r.crcs is None or r.detect == "all":
        return np.arange(r.pages, dtype=np.uint32)
    if r.detect == "shadow":
        # without `advance` the shadow is only compared, never copied: a
        # dirty-bytes policy measures at every step
        return shadow_diff(r, update=advance)
    if r.detect == "fingerprint":
        return fingerprint_diff(r, update=advance)
    if r.detect == "blocks":
        return _kv_dirty(r, advance)
    if r.detect == "positions":
        return _positions_dirty(r, advance)
    if r.detect == "stores":
        return _stores_dirty(r, advance)
    if r.detect == "versions":
        seen = r.seen_versions if advance else r.seen_versions.copy()
        return ref.adapter_dirty_pages(to_host(r.hints["slot_versions"]), seen,
                                       pages_per_slot=int(r.hints["pages_per_slot"]),
                                       num_pages=r.pages, advance=True)
    raise AssertionError(r.detect)


def launch(r: Region, kernels, flags, found=None) -> bool:
    """Queue the detector of `r` as a device kernel writing one flag byte per
    page into `flags`, advancing it as dirty_pages(advance=True) does (and
    listing the dirty pages into `found`, see gpu.launch_shadow_diff).  False
    (nothing queued) when there is no base yet or the detector scans
    host-side tables (block tables, slot versions): use dirty_pages then."""
    if r.crcs is None or not r.flags_detector:
        return False
    if r.detect == "shadow":
        kernels.launch_shadow_diff(r.flat, r.shadow, flags, page_bytes=r.page_bytes, update=True, found=found)
    else:
        kernels.launch_fingerprint(r.flat, r.fps, flags, page_bytes=r.page_bytes, update=True, found=found)
    return True


def _stores_dirty(r: Region, advance: bool) -> np.ndarray:
    """The pages the store tracker marked since the last checkpoint (the
    bitmap is cleared when advancing).  Every `check_every`-th advancing
    call also diffs the fingerprints taken at the previous cross-check:
    a page changed since then that the tracker never marked (a write by
    a kernel that is not instrumented, a copy, a kernel loaded before
    instrumentation) is added to this checkpoint and counted in
    `missed_pages`.  The bitmap is read, then cleared: like every detector,
    this assumes the caller's kernels that write the region have finished
    (a page marked in between would wait for the next cross-check)."""
    from concordia import instrument

    if not instrument.is_tracked(r.tracked):
        raise SessionError("the store tracker no longer tracks this region (instrumentation was disabled "
                           "or its regions replaced): its writes since then are not known",
                           where=f"region {r.name!r}",
                           hint="register the array again (a new region gets a base checkpoint)")
    ids = r.tracked.dirty_pages().astype(np.uint32)
    if not advance:
        return ids
    r.tracked.clear()
    if not r.check_every:
        return ids
    r.tracked_since_check = np.union1d(r.tracked_since_check, ids).astype(np.uint32)
    r.since_check += 1
    if r.since_check < r.check_every:
        return ids
    named = r.tracked_since_check
    r.tracked_since_check = np.zeros(0, np.uint32)
    return _cross_check(r, ids, named)


def _cross_check(r: Region, ids: np.ndarray, named: np.ndarray) -> np.ndarray:
    """The cross-check of a detector told where the caller writes (stores,
    positions): the fingerprints taken at the last check are diffed (and
    taken again), and every changed page the detector did not name since then
    (`named`, sorted) is added to this checkpoint's `ids` and counted in
    `missed_pages`."""
    changed = fingerprint_diff(r, update=True)
    missed = np.setdiff1d(changed, named, assume_unique=True).astype(np.uint32)
    r.missed_pages += int(missed.size)
    r.since_check = 0
    return np.union1d(ids, missed).astype(np.uint32) if missed.size else ids


def _positions_span(r: Region) -> tuple[int | None, int, object]:
    """(start, now, sequence id now) of a positions region: positions
    [start, now) of every row were written since the last checkpoint; start
    is None when the region is named whole: the length went down, or the
    sequence id changed (the cache started over: a reset and a new prompt)."""
    h = r.hints
    now = read_length(h["length"], h["positions"].max_len, f"region {r.name!r}")
    seq = None if h.get("seq_ids") is None else read_sequence(h["seq_ids"], f"region {r.name!r}")
    start = r.length_prev
    if now < start or (seq is not None and not (seq == r.seq_prev if type(seq) is int
                                                 else np.array_equal(seq, r.seq_prev))):
        start = None
    return start, now, seq


def _positions_dirty(r: Region, advance: bool) -> np.ndarray:
    """The pages of the positions [length at the last checkpoint, length now)
    of every row, from the caller's length alone (the region is not read: the
    cost follows the new tokens); every page when the length went down or the
    sequence id changed (a cache reset, a new prompt: anything may have been
    rewritten).  Every `check_every`-th advancing call also cross-checks by
    fingerprints: since the last check the pages of [length then, length
    now) were named, or the whole region when it was named whole in between.

    Writes at positions the length does not cover (a cache restarted and
    refilled past the old length between two checkpoints with no sequence
    id to say so, a rollback that rewrites a position) are not seen until a
    cross-check: a caller that may do so passes seq_ids, sets check_every, or
    registers with detect="fingerprint"."""
    start, now, seq = _positions_span(r)
    if not advance:
        return _positions_named(r, start, now)
    return _positions_found(r, start, now, _positions_take(r, start, now, seq))


def most_pages(r: Region) -> int:
    """At least as many pages as the next checkpoint of `r` takes, known
    without reading the region or the device: the positions a positions
    region names since its last checkpoint (every page when it is named whole
    or its cross-check is due), every page for any other detector."""
    if r.crcs is None or r.detect != "positions" or (r.check_every and r.since_check + 1 >= r.check_every):
        return int(r.pages)
    start, now, _ = _positions_span(r)
    return int(r.pages) if start is None else _position_count(r.hints["positions"], start, now)


@functools.lru_cache(maxsize=256)
def _position_count(g, lo: int, hi: int) -> int:
    """How many pages `position_pages(g, lo, hi)` lists (the layers of a
    cache share one geometry and span: counted once)."""
    return int(position_pages(g, lo, hi).size)


def _positions_take(r: Region, start: int | None, now: int, seq) -> bool:
    """Move a positions region's detector to length `now` (and sequence id
    `seq`); True when its cross-check is due with this checkpoint."""
    if start is None:
        r.length_checked = None  # the whole region is named
    r.length_prev, r.seq_prev = now, seq
    if not r.check_every:
        return False
    r.since_check += 1
    return r.since_check >= r.check_every


def _positions_named(r: Region, start: int | None, now: int) -> np.ndarray:
    if start is None:
        return np.arange(r.pages, dtype=np.uint32)
    return position_pages(r.hints["positions"], start, now)


def _positions_found(r: Region, start: int | None, now: int, due: bool) -> np.ndarray:
    """The pages a checkpoint takes from a positions region named from
    `start` to `now`, with its cross-check when `due`."""
    ids = _positions_named(r, start, now)
    if not due:
        return ids
    checked, r.length_checked = r.length_checked, now
    return _cross_check(r, ids, _positions_named(r, checked, now))


def listed_pages(regions, first) -> np.ndarray:
    """dirty_pages(advance=True) of every region in `regions` (detectors that
    list their pages on the host: block tables, slot versions, the store
    tracker, positions), each offset by its `first` page in a table's page
    space, as one uint64 array (region after region, except as below): what a
    table pass flags for its listed rows.  Positions regions whose length
    grew alike over one geometry (the keys and values of every layer of a
    cache) share one computation, so a decode step costs a few numpy calls
    however many layers there are."""
    out, shared = [], {}
    for r, f in zip(regions, np.asarray(first, np.uint64).tolist()):
        if r.detect == "positions" and r.crcs is not None:
            start, now, seq = _positions_span(r)
            due = _positions_take(r, start, now, seq)
            if start is not None and not due:
                shared.setdefault((r.hints["positions"], start, now), []).append(f)
                continue
            ids = _positions_found(r, start, now, due)
        else:
            ids = dirty_pages(r, advance=True)
        out.append(ids.astype(np.uint64) + np.uint64(f))
    for (g, lo, hi), firsts in shared.items():
        ids = position_pages(g, lo, hi)
        if ids.size:
            out.append((np.array(firsts, np.uint64)[:, None] + ids).reshape(-1))
    return np.concatenate(out) if out else np.zeros(0, np.uint64)


_NONE = np.zeros(0, np.uint32)


def position_pages(g: PositionGeometry, lo: int, hi: int) -> np.ndarray:
    """Sorted unique uint32 ids of the pages holding positions [lo, hi) of
    every row of a positions region: rows x the pages one row's positions
    cover (rows x (hi - lo) for row-sized pages), computed, never scanned."""
    if hi <= lo:
        return _NONE
    rb, pb = g.row_bytes, g.page_bytes
    span = g.span_pages
    if span is not None:  # every row's run starts on a page: one range, repeated per row
        first, last = lo * rb // pb, (hi * rb - 1) // pb
        return (g.row_first_pages + np.arange(first, last + 1, dtype=np.uint32)).reshape(-1)
    # pages hold the end of one row's run and the start of the next: per-row ranges, merged
    start = np.arange(g.rows, dtype=np.int64) * (g.max_len * rb)
    first, last = (start + lo * rb) // pb, (start + hi * rb - 1) // pb
    return np.unique(ref.expand_ranges(first, last - first + 1)).astype(np.uint32)


def _kv_now(r: Region) -> dict:
    h = r.hints
    now = {"tables": to_host(h["block_tables"]).astype(np.int64),
           "lens": to_host(h["seq_lens"]).astype(np.int64)}
    if h.get("block_stamp") is not None:
        now["stamp"] = to_host(h["block_stamp"]).astype(np.int64)
    if h.get("seq_ids") is not None:
        now["ids"] = to_host(h["seq_ids"]).astype(np.int64)
    return now


def _kv_dirty(r: Region, advance: bool) -> np.ndarray:
    """New tokens of every sequence (kv_dirty_blocks), plus whole blocks
    whose write stamp rose while no sequence held them across the interval
    (blocks freed, or freed and handed on, since the last checkpoint)."""
    g: KvGeometry = r.hints["geometry"]
    prev, now = r.kv_prev, _kv_now(r)
    same = (now["ids"] == prev["ids"]) if "ids" in now else (now["lens"] >= prev["lens"])
    ckpt_lens = np.where(same, prev["lens"], 0).astype(np.int32)
    ids = ref.kv_dirty_blocks(now["tables"].astype(np.int32), now["lens"].astype(np.int32), ckpt_lens,
                              block_size=g.block_size, kv_heads=g.kv_heads, head_dim=g.head_dim,
                              dtype_bytes=g.dtype_bytes, page_bytes=r.page_bytes,
                              num_blocks=g.num_blocks, num_layers=g.num_layers, advance=False)
    if "stamp" in now:
        rose = now["stamp"] > prev["stamp"]
        # blocks one sequence held from the last checkpoint until now: only it wrote them
        held = np.zeros(g.num_blocks, bool)
        t_prev, t_now = prev["tables"], now["tables"]
        nblk = -(-np.asarray(prev["lens"], np.int64) // g.block_size)   # blocks held at the last checkpoint
        in_use = np.arange(t_now.shape[1])[None, :] < nblk[:, None]
        keep = np.asarray(same)[:, None] & in_use & (t_prev == t_now) & (t_now >= 0)
        held[t_now[keep]] = True
        whole = np.flatnonzero(rose & ~held)
        if whole.size:
            ids = np.union1d(ids, _kv_block_pages(g, whole, r.page_bytes)).astype(np.uint32)
    if advance:
        r.kv_prev = now
    return ids


def _kv_block_pages(g: KvGeometry, blocks: np.ndarray, pb: int) -> np.ndarray:
    """Every page of the given blocks, K and V, in every layer."""
    geo = ref.kv_layout(block_size=g.block_size, kv_heads=g.kv_heads, head_dim=g.head_dim,
                        dtype_bytes=g.dtype_bytes, num_blocks=g.num_blocks)
    lo = (np.arange(g.num_layers, dtype=np.int64)[:, None] * geo["layer"]
          + blocks.astype(np.int64)[None, :] * geo["block"]).ravel()
    first = lo // pb
    return np.unique(ref.expand_ranges(first, (lo + geo["block"] - 1) // pb - first + 1))
