"""Retention: what keeps a long session's log bounded and its recovery flat.

A `Session` calls `Retention.after_commit` once after every checkpoint has
committed.  Under the session's `Policy` it

  * starts a base job when a region's delta chain (payload logged since its
    newest base, or since the newest epoch that wrote it whole: an adapter
    updated at every step is an image at every checkpoint, never due) would
    pass `base_every_bytes`
    before a base started now is in force (so that the chain a recovery reads
    stays within the bound): a `wal.compaction.Compaction` at the epoch just
    committed, for the regions due (one with no catalogued base yet gets one
    when the log needs the space its first write holds: `stale`, below),
    taking the images from host copies made now (a region of at most
    LIVE_COPY_BYTES; the copy is the state of the committed epoch because
    nothing ran since the commit) or else folding them from the log;
  * writes that job's BASE records, about `slice_bytes` after each
    checkpoint, so that no checkpoint waits for a whole base;
  * switches when the bases are written (`Compaction.prepare`: the new
    catalog, then at a later hook `Compaction.switch`: one superblock write), freeing every segment below what the
    kept window still needs, and switches once more (with no new base) when
    the window has moved past the newest bases, so the floor follows them;
    the host copies, each slice, the new catalog and the superblock write that
    makes it current each take a hook of their own;
  * under log pressure (free space below a full base of every region plus a
    few segments) bases every region at once (as many as the free space
    takes, oldest base first; with none, a switch keeping only the newest
    epoch frees what older epochs hold) and keeps only the newest epoch:
    the checkpoint the caller relies on must not fail for want of space.

Image entries.  A region an epoch wrote whole (an adapter updated at every
step, a cache rewritten after a reset, any first write) needs no BASE record
to be based at that epoch: its own records are an image of it, and the
catalog lists them as its base (FORMAT.md §12.2, `wal.snapshot.image_entries`:
one walk of that epoch's record headers).  A job at such an epoch writes
nothing for those regions, takes no host copy of them, and counts no bytes
for them (`_cost`); a checkpoint whose pages write a region whole leaves room
for the base of the others only (`room`'s `whole`).  So checkpoints that
rewrite the whole state keep a log of about three states from filling: each
is the base the switch after it keeps.

Pacing by the write rate.  The log is written in order and freed only from
its oldest end, so a region whose newest base is old (a LoRA adapter that
never changes has no chain and is never due) holds every byte written since,
and a kept window (`keep_epochs`) holds every byte written within it, bases
included.  What the checkpoints write is measured (`rate`: an average of the
record bytes per checkpoint that weighs the newest by RATE_WEIGHT; `peak`: the
largest lately), and from it and the free space:

  * `need(image)`: the free bytes a base job of `image` bytes uses up before
    its switch can free anything: the image, a checkpoint at the measured rate
    for each hook it takes (its copies, its slices, its catalog, its switch),
    and `headroom` (a segment, two of the largest checkpoints lately, the
    catalog and descriptors a switch appends);
  * the log is *short* while the free space is below `need` of the whole
    state: a switch then moves the floor up to its new bases however young
    they are (the window shrinks: the log wins), and a switch waiting for the
    window to pass the newest bases is made at once;
  * while the free space is below twice that, a job also takes the *stale*
    regions (`_stale`): taken oldest base first, a base of the first k lets a
    switch free the log up to where the next one's base starts, and the k
    that frees the most beyond the images it writes is taken;
  * each slice is at least what is left of the job times the rate over the
    room left once the job, two checkpoints and the headroom are taken from
    the free space, so the job switches before the log fills (the whole rest
    at once when even that does not fit);
  * no job starts that the free space cannot finish (`_affordable`).

A checkpoint that coalesced (`Session.checkpoint(on_full="coalesce")`, the log
too full for its epoch) comes here too (`after_commit` sees
`stats.coalesced`): the first of a run of them issues one LogPressureWarning,
and each pushes retention as pressure does: the job under way is written and
switched at once keeping the newest epoch; with none, once for each committed
epoch, a switch keeping only it and a base of every region at it, folded
from the log (the arrays have moved on since the commit, so no host copy is
its state), switched at once; a coalesced checkpoint after that, with nothing
left to free, issues a second LogPressureWarning naming the log size such
checkpoints need (`exhausted`).  A checkpoint that may coalesce leaves the room
that base needs, counting what the switch before it frees (`room`), so the
log never fills past the point where retention can free it.  (A base at an
epoch keeps that epoch's records too: a log of less than about four images
of the state can be held by bursts that rewrite it whole, every checkpoint
coalescing until the writes that remain fit.)

After a table pass the hook costs no Python per region: the state's size,
the free space and every region's chain are kept between checkpoints (the
pass's page counts are added in one array operation, a per-region
checkpoint's one region at a time) and counted afresh only after a register.

A kill at any point is safe: until the superblock write of a switch nothing a
reader sees has changed (the BASE records are unlisted and ignored), and after
it the new catalog is whole (FORMAT.md §3.4, §12).

The kept window: the newest `keep_epochs` epochs and every epoch committed
within the last `keep_seconds` (epochs committed before this session opened
count as old as the session).  The oldest restorable epoch is the newest base
at or before the window's start; a recovery of an older one is refused by the
planner in one line naming it.
"""

from __future__ import annotations

import collections
import itertools
import time
import warnings
from typing import NamedTuple

import numpy as np

from concordia.regions.errors import LogPressureWarning, SessionError
from concordia.wal.compaction import record_bytes, retention_reserve  # the log's rules; record_bytes re-exported

#: regions up to this size are based from a host copy taken after the commit;
#: larger ones are folded from the log (no copy of the region is held)
LIVE_COPY_BYTES = 256 << 20
#: BASE bytes written after a checkpoint at the least (Policy.slice_bytes=None)
MIN_SLICE = 64 << 10
#: host copies up to this many bytes in all are kept from one job to the next,
#: so that a job's start copies into memory already in place (a fresh buffer
#: costs page faults and zeroing on top of the copy; a device region's kept
#: buffer is pinned, so its copy runs at the bus's speed)
KEPT_COPY_BYTES = 1 << 30
#: a device region's kept copy is pinned from this size up (pinning costs
#: milliseconds a buffer whatever its size; a small copy is quick either way)
PIN_COPY_BYTES = 4 << 20
#: a job written at once (under pressure) takes BASE records of this share
#: of a segment (MIN_SLICE at the least): few records, since each costs the
#: same fixed work whatever its size (in records of MIN_SLICE a base of the
#: state cost about four times its bytes' copy and hash), yet small enough
#: that the end of a segment a record does not fit wastes little of a log
#: short of space (the forecasts count that waste: `_base_record`)
PRESSURE_RECORD_SHARE = 64
#: weight of the newest checkpoint in the measured rate (`Retention.rate`)
RATE_WEIGHT = 1 / 8
#: a region's chain may reach this share of a segment before it is due, however
#: small the region (`Retention.bound`): a switch frees whole segments, so a
#: base of a shorter chain frees nothing, and a few pages rewritten at every
#: step (a decoder's token buffer and mask) would take a job, a catalog and a
#: superblock write every few steps
CHAIN_FLOOR_SHARE = 64


def _pinned(nbytes: int) -> tuple:
    """(host view, device view) of a pinned host buffer of `nbytes`, or a
    pageable one and None where pinning fails."""
    try:
        from concordia.gpu_kernels import gpu

        return gpu.pinned_buffer(nbytes)
    except Exception:
        return np.empty(nbytes, np.uint8), None


class _Starting(NamedTuple):
    """A job decided at one hook and made at the next (`Retention._begin`)."""

    epoch: int      # the committed epoch its bases are of
    names: list     # the regions it bases
    live: dict      # name -> host copy of the region at the epoch (taken when decided)
    pressure: bool  # written and switched at once
    imaged: set     # the names the epoch wrote whole (their base is an image entry)


class Retention:
    """The automatic bases and compaction of one session (see the module doc)."""

    def __init__(self, session, regions, policy):
        """session: its `log` and `checkpoints` are read (the log is replaced when
        a read-only session first writes); regions: its `RegionSet`."""
        self.session = session
        self.regions = regions
        self.policy = policy
        self.job = None            # the Compaction being written, or None
        self.job_pressure = False
        self.job_ready = False     # its bases are written: the next hook switches
        self._starting: _Starting | None = None  # a job to make at the next hook (`_begin`)
        self.based: set | None = None  # names with a catalogued base (read at the first hook)
        self.times: collections.deque = collections.deque()  # (epoch, monotonic time) of commits
        self.opened = time.monotonic()
        self.pending_floor = 0     # epoch of the newest bases, until the floor reaches them
        #: what the last hook did: "start" (a job's host copies), "base" (a slice of BASE
        #: records), "catalog" (a switch's catalog appended), "switch" (its superblock
        #: write), or None
        self.last: str | None = None
        self.reports: collections.deque = collections.deque(maxlen=64)  # CompactReport of switches
        self.counts: collections.Counter = collections.Counter()
        #: record bytes per checkpoint, measured (RATE_WEIGHT on the newest), and the
        #: largest lately (each checkpoint lowers it by RATE_WEIGHT until one is larger)
        self.rate = 0.0
        self.peak = 0.0
        self.last_bytes = 0        # record bytes of the last checkpoint that committed
        self.coalescing = 0        # checkpoints coalesced since the last one that committed
        self.short = False         # the last hook found the log short (module doc)
        self._pushed = 0           # the epoch coalesced checkpoints last freed space for
        #: coalesced checkpoints found nothing more to free: every region is based at
        #: the newest committed epoch and only it is kept (until the next commit)
        self.exhausted = False
        self.error: str | None = None  # the last failure (the job is dropped and retried later)
        from concordia.wal.compaction import Known

        #: the epochs this session committed, so that a switch needs no scan of the log
        self.known = Known()
        # no record of the next epoch lies below this LSN (a read-only log has no writer)
        self._mark = session.log.appender.write_lsn if getattr(session.log, "writable", True) else 0
        # What the hook needs of every region, kept so that a checkpoint costs no
        # Python per region here (see `_sync`): one slot per registered region,
        # in registration order.
        self._key: tuple | None = None  # (regions, base_every_bytes) the slots describe
        self._names: list = []
        self._slot: dict = {}           # name -> slot
        self._chain = np.zeros(0, np.int64)   # delta payload bytes since the region's newest base
        self._since = np.zeros(0, np.int64)   # the epoch its chain restarted at
        self._pin = np.zeros(0, np.int64)     # LSN its newest catalogued base starts at (0: none, the log's start)
        self._whole = np.zeros(0, np.int64)   # the newest epoch that wrote it whole (0: none known)
        self._bounds = np.zeros(0, np.int64)  # bound() of each region
        self._pbytes = np.zeros(0, np.int64)  # page bytes of each region
        self._image = np.zeros(0, np.int64)   # log bytes of a full image of each region
        self._npages = np.zeros(0, np.int64)  # pages of each region
        self._state = 0                 # state_bytes() of the registered regions
        self._tally = (0, 0)            # (regions, their image bytes) counted by `check_capacity`
        self._table: tuple | None = None  # (names of a table pass, their slots)
        self._free: tuple = (None, 0)   # (superblock, bytes of its free segments)
        self._copies: dict = {}         # name -> host buffer kept for its next job's copy
        self._images: dict = {}         # name -> the device's view of its pinned kept buffer
        #: writes a job's BASE records from the device's view of its copies
        #: (`checkpoint.bases.BaseStager`); made for a session whose log the
        #: device writes (`EpochRunner.base_stager`), or set by a caller
        self.base_stager = None
        self._copy_next: tuple | None = None  # (names, pressure) of a job whose copies `launched` takes

    # ------------------------------------------------------- the bookkeeping
    def _sync(self) -> None:
        """Make the per-region slots describe the registered regions, only after
        a register: regions are only ever added (register refuses a second
        region of a name), so their count says whether the slots still hold,
        and the slots of regions added since are appended (O(new regions));
        a changed policy rebuilds them all.  A region's chain survives."""
        regions = self.regions
        key = (len(regions), self.policy.base_every_bytes)
        if key == self._key:
            return
        names = regions.names
        k = len(self._names)
        if self._key is not None and key[1] == self._key[1] and names[:k] == self._names:
            # regions registered since (one a call while a model is protected): only theirs are
            # worked out, so that registering n regions costs O(n), not O(n^2)
            rs = list(regions)[k:]
            zeros = np.zeros(len(rs), np.int64)
            self._chain, self._since, self._pin, self._whole = (np.concatenate([a, zeros]) for a in
                                                                (self._chain, self._since, self._pin, self._whole))
        else:
            old = dict(zip(self._names, zip(self._chain.tolist(), self._since.tolist(), self._pin.tolist(),
                                            self._whole.tolist())))
            rs, k = list(regions), 0
            self._chain = np.array([old.get(n, (0, 0, 0, 0))[0] for n in names], np.int64)
            self._since = np.array([old.get(n, (0, 0, 0, 0))[1] for n in names], np.int64)
            self._pin = np.array([old.get(n, (0, 0, 0, 0))[2] for n in names], np.int64)
            self._whole = np.array([old.get(n, (0, 0, 0, 0))[3] for n in names], np.int64)
            self._bounds = self._pbytes = self._image = self._npages = np.zeros(0, np.int64)
            self._slot = {}
        self._names = names
        self._slot.update((n, i) for i, n in enumerate(names[k:], k))
        self._bounds = np.concatenate([self._bounds[:k], np.array([self.bound(r) for r in rs], np.int64)])
        self._pbytes = np.concatenate([self._pbytes[:k], np.array([r.page_bytes for r in rs], np.int64)])
        self._image = np.concatenate([self._image[:k], np.array([record_bytes(r.array.nbytes, r.page_bytes)
                                                                  for r in rs], np.int64)])
        self._npages = np.concatenate([self._npages[:k], np.array([-(-r.array.nbytes // r.page_bytes)
                                                                    for r in rs], np.int64)])
        self._state = int(self._image.sum())
        self._table = None
        self._key = key

    @property
    def chain(self) -> dict:
        """{region name: delta payload bytes logged since its newest base (or its
        first full write)}, a copy."""
        self._sync()
        return dict(zip(self._names, self._chain.tolist()))

    def _add_chain(self, stats) -> None:
        """Add the pages of `stats` to the chains: a table pass's counts in one
        array operation, a per-region checkpoint's dict over the regions it wrote."""
        counts = stats.page_counts() if hasattr(stats, "page_counts") else None
        if counts is not None:
            names, n = counts
            t = self._table
            if t is None or t[0] is not names:  # the table's names list is kept while the table is
                slots = np.array([self._slot[x] for x in names], np.intp)
                # (names, their slots or None when they are every slot in order, their page bytes)
                same = np.array_equal(slots, np.arange(len(self._names)))
                t = self._table = (names, None if same else slots, self._pbytes[slots])
            add = np.multiply(n, t[2], dtype=np.int64)
            # a region the epoch wrote whole (an adapter updated every step): its delta is an
            # image of it, which bounds the chain as a base does (a recovery reads nothing
            # before it); without this such a region was due for a base at every checkpoint
            if t[1] is None:
                self._chain += add
                whole = np.flatnonzero(np.asarray(n) >= self._npages)
            else:
                self._chain[t[1]] += add
                whole = t[1][np.asarray(n) >= self._npages[t[1]]]
            self._chain[whole] = 0
            self._since[whole] = stats.epoch
            self._whole[whole] = stats.epoch
        else:
            slot, chain, pb, npages = self._slot, self._chain, self._pbytes, self._npages
            for name, k in stats.pages.items():
                if k:
                    i = slot[name]
                    chain[i] += int(k) * int(pb[i])
                    if k >= npages[i]:   # written whole: an image of the region (above)
                        chain[i] = 0
                        self._since[i] = stats.epoch
                        self._whole[i] = stats.epoch
        for name in stats.base:  # a first full write bounds the chain as a base does
            self._chain[self._slot[name]] = 0
            self._since[self._slot[name]] = stats.epoch
            self._whole[self._slot[name]] = stats.epoch

    # ---------------------------------------------------------------- sizes
    def capacity(self) -> int:
        vol = self.session.log.volume
        return int(vol.superblock.segment_count) * int(vol.segment_bytes)

    def state_bytes(self, extra: tuple = ()) -> int:
        """Log bytes one full image of the registered regions (and of `extra`
        (nbytes, page_bytes) pairs) takes."""
        self._sync()
        return self._state + sum(record_bytes(n, pb) for n, pb in extra)

    def check_capacity(self, regions: list) -> None:
        """Refuse, before anything is written, regions `regions` ([(name, nbytes,
        page_bytes)], being registered together) with which one image of the state
        no longer fits the log (their first checkpoint writes every page); the error
        names the first region that does not fit."""
        seg = int(self.session.log.volume.segment_bytes)
        # the registered regions' images, counted on from the last call: not `_sync`'s slots, which a
        # register would rebuild for each region of a model (170 of them: 16 ms of a fresh process's protect)
        k, total = self._tally   # regions are only ever added: those since the last call are counted on
        total += sum(record_bytes(r.array.nbytes, r.page_bytes) for r in itertools.islice(self.regions, k, None))
        self._tally = (len(self.regions), total)
        have = self.capacity()
        need = total + seg
        for name, nbytes, page_bytes in regions:
            need += record_bytes(nbytes, page_bytes)
            if need > have:
                raise SessionError(f"the log holds {have} bytes ({_mib(have)}) of segments, and one image of the "
                                   f"registered state with this region needs {need} bytes ({_mib(need)})",
                                   where=f"region {name!r}",
                                   hint=f"create a log of at least {_mib(2 * need + 2 * seg)}: two images, so that "
                                        "retention can write a base beside the one in use")

    def can_base(self) -> bool:
        """Whether the log holds a new base beside the state it keeps (two images and two segments)."""
        return 2 * self.state_bytes() + 2 * int(self.session.log.volume.segment_bytes) <= self.capacity()

    def free_bytes(self) -> int:
        """Bytes the appender can still write before the log is full."""
        log = self.session.log
        vol = log.volume
        from concordia.wal import format as F

        sb = vol.superblock  # a new object whenever a segment is taken or freed
        if self._free[0] is not sb:
            self._free = (sb, sum(1 for e in sb.segments if e.state == F.SEG_FREE) * int(sb.segment_bytes))
        free = self._free[1]
        if not log.writable:  # a read-only session (Session(create=False)) has no appender until it writes
            return free
        app = log.appender
        if app.seg is not None:
            free += app.seg.offset + app.seg.nbytes - app.pos
        return free

    def reserve(self) -> int:
        """Free space below which the log is under pressure: the retention
        reserve (`wal.compaction.retention_reserve`, the rule a compaction
        follows too) with four checkpoints of the last one's size."""
        # a base of every region (with the ends of the segments it crosses) and a
        # few more checkpoints fit below it, so the switch that frees space comes in time
        return retention_reserve(self.state_bytes(), int(self.session.log.volume.segment_bytes), 4 * self.last_bytes)

    # ---------------------------------------------------------------- pacing
    def _note_rate(self, log_bytes: int) -> None:
        """Measure a committed checkpoint's record bytes (`rate`, `peak`); the
        caller leaves out a checkpoint that wrote a region whole (no delta)."""
        n = float(log_bytes)
        if self.rate == 0.0:
            self.rate = self.peak = n
            return
        self.rate += RATE_WEIGHT * (n - self.rate)
        self.peak = max(n, self.peak * (1 - RATE_WEIGHT))

    def headroom(self) -> int:
        """Free bytes kept beyond any forecast: a segment (a switch frees whole
        segments, and the one being written is never all usable), two of the
        largest checkpoints lately, and the catalog and region descriptors a
        switch appends."""
        return (int(self.session.log.volume.segment_bytes) + 2 * int(self.peak) + (64 << 10)
                + 512 * len(self._names))

    def need(self, image: int, slice_bytes: int) -> int:
        """Free bytes a base job of `image` bytes, written `slice_bytes` a
        hook, uses up from its start to its switch: the image, a checkpoint at
        the measured rate for each hook (the copies, each slice, the catalog,
        the switch) and the `headroom`."""
        hooks = 3 + -(-int(image) // max(1, int(slice_bytes)))
        return int(image) + hooks * int(self.rate) + self.headroom()

    def _slice(self, log_bytes: int) -> int:
        """The policy's slice: `slice_bytes`, else MIN_SLICE or twice the checkpoint's bytes."""
        return int(self.policy.slice_bytes or max(MIN_SLICE, 2 * int(log_bytes)))

    def _paced(self, job, slice_bytes: int) -> int:
        """The slice the job writes now: at least `slice_bytes`, and enough that
        what is left of it is written before the checkpoints meanwhile (at the
        measured rate) leave less than two checkpoints and the headroom free;
        all that is left when even one slice a hook would not make it."""
        left = max(1, int(job.total) - int(job.done_bytes))
        rate = max(1, int(self.rate))
        room = self.free_bytes() - left - 2 * rate - self.headroom()
        if room <= rate:
            return left
        return max(int(slice_bytes), -(-left * rate // room))

    def _cost(self, epoch: int) -> np.ndarray:
        """Log bytes a base of each region at `epoch` writes: none for a region
        that epoch wrote whole (its records are the base: an image entry,
        FORMAT.md §12.2), else a full image."""
        if not self.policy.image_bases:
            return self._image
        return np.where(self._whole == epoch, 0, self._image)

    def _stale(self, epoch: int = 0) -> np.ndarray:
        """A mask over the slots: the regions whose bases hold the oldest part
        of the log, where a base of them at `epoch` frees more than it writes.
        Regions are taken oldest base first (one with no base holds the log
        from its start); a base of the first k lets a switch free the log up
        to where the next one's starts; the k that frees the most beyond the
        images it writes (`_cost`) is taken (none when no k frees a segment
        more than it writes)."""
        pins = self._pin
        mask = np.zeros(pins.size, bool)
        if not pins.size:
            return mask
        order = np.argsort(pins, kind="stable")
        p = pins[order]
        low = max(int(p[0]), int(self.session.log.volume.superblock.oldest_lsn))
        upto = np.maximum(np.append(p[1:], int(self.session.log.appender.write_lsn)), low)
        gain = (upto - low) - np.cumsum(self._cost(epoch)[order])
        k = int(np.argmax(gain))
        if gain[k] > int(self.session.log.volume.segment_bytes):  # a switch frees whole segments
            mask[order[:k + 1]] = True
        return mask

    def base_fits(self, image: int, space) -> bool:
        """Whether a base of `image` bytes, with its catalog and descriptors,
        fits `space` (a `wal.compaction.Space`; `takes`)."""
        return takes(space, image + (64 << 10) + 512 * len(self._names), self._base_record())

    def _record_bytes(self) -> int:
        """Payload bytes of a BASE record of a job written at once: the
        policy's slice, or MIN_SLICE, or PRESSURE_RECORD_SHARE of a segment."""
        seg = int(self.session.log.volume.segment_bytes) // PRESSURE_RECORD_SHARE
        return max(int(self.policy.slice_bytes or MIN_SLICE), seg)

    def _base_record(self) -> int:
        """Bytes of the largest BASE record a job writes under pressure
        (`_record_bytes`, of the smallest pages)."""
        from concordia.wal import format as F

        pb = int(self._pbytes.min()) if self._pbytes.size else 4096
        return F.page_batch_length(max(1, self._record_bytes() // pb), pb)

    def _records_of(self, payload: int) -> int:
        """Log bytes of `payload` bytes of pages written as a job under pressure
        writes them (`_record_bytes` a record, of the smallest pages): each
        record's header and tables besides its pages.  (A job's `total` counts
        pages only; with 256-byte pages the tables add 3%, which a log short
        of space does not have.)"""
        from concordia.wal import format as F

        pb = int(self._pbytes.min()) if self._pbytes.size else 4096
        per = max(1, self._record_bytes() // pb)
        return int(payload) + -(-int(payload) // (per * pb)) * (F.page_batch_length(per, pb) - per * pb)

    def _affordable(self, names: list, epoch: int = 0) -> list:
        """The longest run of `names`, oldest base first, whose base at `epoch`
        the free space takes now (`base_fits`, `_cost`): a job the log cannot
        finish would only leave its records in the way."""
        from concordia.wal.compaction import free_space

        space = free_space(self.session.log)
        slots = sorted((self._slot[n] for n in names), key=lambda i: int(self._pin[i]))
        cost = self._cost(epoch)
        out, image = [], 0
        for i in slots:
            image += int(cost[i])
            if not self.base_fits(image, space):
                break
            out.append(self._names[i])
        return sorted(out)

    def room(self, left, whole=()) -> bool:
        """Whether `left` (a `wal.compaction.Space`: what a checkpoint that may
        coalesce would leave free) lets retention free space after it, so
        that the log never fills past the point where it can (`EpochRunner.room`):
        room for the rest of the job under way (or about to begin), else for a
        base of every region (`base_fits`), counting the segments a switch
        keeping only the newest epoch frees first (`_freeable`); whole: names
        of regions the checkpoint writes whole, whose base after it is its own
        records (an image entry) and writes nothing.  Always while retention is
        off or the log cannot hold a base beside the state."""
        if not self.policy.retain or not self.session.log.writable or not self.can_base():
            return True
        self._sync()
        if self.job is not None:
            return self.base_fits(self._records_of(max(0, int(self.job.total) - int(self.job.done_bytes))), left)
        if self._starting is not None:
            st = self._starting
            return self.base_fits(int(sum(int(self._image[self._slot[n]]) for n in st.names if n not in st.imaged)),
                                  left)
        whole = whole if self.policy.image_bases else ()
        state = self._state - sum(int(self._image[self._slot[n]]) for n in whole if n in self._slot)
        if self.base_fits(state, left):
            return True
        from concordia.wal.compaction import Space

        return self.base_fits(state, Space(left.tail, left.free_segments + self._freeable(), left.capacity))

    def _freeable(self) -> int:
        """Live segments a switch keeping only the newest epoch frees without a
        new base: the floor goes to the newest base of all (a base's epoch
        keeps its own records), every region reads its newest base and the
        epochs after it, and the segments wholly below all that go; 0 when a
        region has no base or an epoch needed is not known."""
        from concordia.wal.snapshot import current_catalog

        log = self.session.log
        newest: dict = {}
        for e in current_catalog(log).entries:
            if e.epoch >= newest.get(e.region_id, (0, 0))[0]:
                newest[e.region_id] = (int(e.epoch), int(e.first_lsn))
        latest = int(log.last_committed_epoch or 0)
        bases = [newest.get(r.id) for r in self.regions]
        if not bases or None in bases:
            return 0
        floor = max(b[0] for b in bases)
        low = int(log.appender.write_lsn)
        for epoch, first in bases:
            need = floor if epoch == floor else epoch + 1  # the floor's records, or the deltas after the base
            mark = self.known.epochs.get(need)
            if mark is None and need <= latest:
                return 0
            low = min(low, first, mark[0] if mark is not None else low)
        return sum(1 for seg in log.volume.live_segments()[:-1] if seg.end_lsn <= low)

    @property
    def pacing(self) -> dict:
        """What the pacing sees now: the measured rate and peak (record bytes per
        checkpoint), the free bytes, `need` of a base of the whole state at the
        policy's slice, the headroom, whether the log is short, the
        checkpoints coalesced since the last commit, and whether those found
        nothing more to free (`exhausted`)."""
        self._sync()
        return {"rate": int(self.rate), "peak": int(self.peak), "free": self.free_bytes(),
                "need": self.need(self._state, self._slice(self.rate)), "headroom": self.headroom(),
                "short": self.short, "coalescing": self.coalescing, "exhausted": self.exhausted}

    @property
    def base_staging(self) -> dict | None:
        """Who writes the BASE records of jobs' copies besides the host: the
        base stager's kernels ("gpu", or "cpu" for the numpy twin), the
        records it wrote, and why it stopped (None while it works); None
        without one."""
        st = self.base_stager
        if st is None:
            return None
        return {"kernels": st.k.name, "records": st.records, "error": st.error}

    def bound(self, r) -> int:
        """Delta bytes after which `r` is due a base: the policy's
        `base_every_bytes`, else a quarter of the region, and at least its
        page and CHAIN_FLOOR_SHARE of a segment."""
        b = self.policy.base_every_bytes
        if b:
            return int(b)
        floor = int(self.session.log.volume.segment_bytes) // CHAIN_FLOOR_SHARE
        return max(r.page_bytes, r.array.nbytes // 4, floor)

    # ---------------------------------------------------------------- the hook
    def after_commit(self, stats, moved: bool = False) -> None:
        """Called by the session once `stats.epoch` has committed, or once a
        checkpoint has coalesced instead (`stats.coalesced`).  moved: the
        epoch was pending, so the arrays no longer hold its state."""
        self.last = None
        if not moved:
            self._copy_next = None  # decided again at this epoch, whose state the arrays hold
        if stats.coalesced:
            self._after_coalesced(stats)
            return
        self.coalescing = 0  # a run of coalesced checkpoints ends with a commit
        self.exhausted = False
        if not self.policy.retain:
            return
        app = self.session.log.appender
        self.known.epochs[stats.epoch] = stats.log_at or (self._mark, app.last_commit_lsn)
        self.last_bytes = int(stats.log_bytes)
        if not stats.base:
            self._note_rate(stats.log_bytes)
        try:
            self._after_commit(stats, moved)
        finally:
            self._mark = app.write_lsn

    def _after_commit(self, stats, moved: bool) -> None:
        now = time.monotonic()
        self.times.append((stats.epoch, now))
        keep_s = self.policy.keep_seconds
        while self.times and (not keep_s or now - self.times[0][1] > keep_s) and len(self.times) > 1:
            self.times.popleft()
        self._sync()
        self._add_chain(stats)
        if not self.can_base():
            self.error = (f"the log ({_mib(self.capacity())}) cannot hold a base beside the state it keeps "
                          f"({_mib(2 * self.state_bytes())} with it): no automatic bases")
            return
        try:
            self._know_bases()
            free = self.free_bytes()
            pressure = free < self.reserve()
            full = self.need(self._state, self._slice(stats.log_bytes))
            self.short = free < full
            if self.job is None and self._starting is None and self._copy_next is None:
                # a job starts with its host copies alone; the job and its slices follow from the next hook
                stale = self._stale(stats.epoch) if free < 2 * full else None
                if self._maybe_start(stats.epoch, pressure, stats.log_bytes, stale, moved) and not pressure:
                    self.last = "start"
                    return
            if self._starting is not None:
                self._begin()
            if self.job is not None:
                self._advance(pressure, self._slice(stats.log_bytes))
            elif (self.pending_floor and (self.short or self._window_start(stats.epoch) > self.pending_floor)
                  or pressure):
                # under pressure with no base the log takes now: a switch keeping only the
                # newest epoch frees what older epochs hold, so that a base fits at the next hook
                self._switch(stats.epoch, pressure)
        except Exception as exc:  # the epoch has committed: the caller's checkpoint stands (`_failed`)
            self._failed(exc)

    def _failed(self, exc) -> None:
        """A step failed: say why, drop the job (nothing was switched; the
        checkpoint stands).  Any failure, not only the log's: one out of
        memory for a host copy, say, must not make the checkpoint that
        committed look failed to its caller (nor end a generate()); a failed
        sync has stopped the writer, and the next checkpoint says so."""
        self.error = (exc.one_line() if hasattr(exc, "one_line")
                      else f"{type(exc).__name__}: {exc}".splitlines()[0])
        self.counts["errors"] += 1
        if self.job is not None:
            self.job.abort()
        self.job = None
        self.job_ready = False
        self._starting = None

    def _know_bases(self) -> None:
        """At the first hook: which regions have a catalogued base, and where the
        newest of each starts (a region's pin, module doc)."""
        if self.based is not None:
            return
        from concordia.wal.snapshot import current_catalog

        entries = current_catalog(self.session.log).entries
        ids = {e.region_id: e for e in sorted(entries, key=lambda e: e.epoch)}  # the newest per region
        self.based = {r.name for r in self.regions if r.id in ids}
        for r in self.regions:
            if r.id in ids:
                i = self._slot[r.name]
                self._pin[i] = max(int(self._pin[i]), int(ids[r.id].first_lsn))

    def _after_coalesced(self, stats) -> None:
        """A checkpoint coalesced: warn at the first of a run, and free what can
        be freed now (module doc)."""
        self.counts["coalesced"] += 1
        self.coalescing += 1
        log = self.session.log
        if self.coalescing == 1:
            warnings.warn(LogPressureWarning(
                f"the log has {self.free_bytes()} bytes free, too few for this checkpoint: it coalesced (nothing "
                "written; its pages are carried by the next checkpoint that commits) while retention frees space",
                where=str(log.backend.where),
                hint="a larger log, fewer checkpoints, or a smaller keep_epochs"), stacklevel=4)
        if not self.policy.retain or not log.writable or not self.can_base():
            return
        app = log.appender
        latest = int(log.last_committed_epoch or 0)
        try:
            self._sync()
            self._know_bases()
            self.short = True
            if self._starting is not None:
                self._begin()
            if self.job is not None:
                self._advance(True, 0)  # the rest at once, switched keeping the newest epoch
            elif latest and self._pushed != latest:
                # once for each committed epoch: a switch keeping only it (frees what the
                # window holds), and a base of every region at it, folded from the log
                # (the arrays hold pages that epoch lacks), in the room kept for it (`room`)
                self._pushed = latest
                self._switch(latest, True)
                self._fold(latest)
            elif latest and not self.exhausted:
                self._exhausted(latest)
        except Exception as exc:  # as in `_after_commit`
            self._failed(exc)
        finally:
            self._mark = app.write_lsn

    def _exhausted(self, latest: int) -> None:
        """Coalesced checkpoints found the log as free as retention can make
        it (every region based at the newest committed epoch, only it kept):
        say so once, with the size a log needs for checkpoints that rewrite
        the state, since they coalesce until their pages fit beside a base."""
        self.exhausted = True
        self.counts["exhausted"] += 1
        seg = int(self.session.log.volume.segment_bytes)
        cap = self.capacity()
        warnings.warn(LogPressureWarning(
            f"retention has freed all it can (every region based at epoch {latest}, the only epoch kept; "
            f"{_mib(cap - self.free_bytes())} of {_mib(cap)} in use): checkpoints coalesce until their pages fit "
            "beside a base of the state",
            where=str(self.session.log.backend.where),
            hint=f"a log of at least {_mib(3 * self._state + 2 * seg)} for checkpoints that rewrite most of "
                 "the state (a region written whole is its own base): three images of it and two segments"),
            stacklevel=4)

    def _fold(self, epoch: int) -> None:
        """A base of every region at committed `epoch` (those based there
        already are left as they are), folded from the log (no host copy is
        that epoch's state once the arrays moved on), written and switched at
        once keeping only that epoch."""
        from concordia.wal.compaction import Compaction

        self.counts["jobs"] += 1
        self._chain[:] = 0
        self._since[:] = epoch
        images = self._images_at(epoch, self.regions.names)
        self.job = Compaction(self.session.log, epoch, live={}, chunk_bytes=int(self.policy.slice_bytes or MIN_SLICE),
                              regions=[n for n in self.regions.names if n not in images], images=images)
        self.job_pressure = True
        self.job_ready = False
        self._advance(True, 0)

    def _due(self, epoch: int, log_bytes: int) -> np.ndarray | None:
        """Which regions need a base now (a mask over the slots; None: none).
        So that the chain a recovery reads stays within its bound, a base starts
        once the chain would pass the bound before a base started now is in
        force (its slices and switch take about `2 + image / slice` epochs more,
        the chain growing at its pace since it restarted), but not before the
        chain is half the bound, nor on a pace judged over fewer epochs than
        that (else once it has passed the bound)."""
        chain, bound = self._chain, self._bounds
        half = 2 * chain > bound
        if not half.any():  # most hooks: no chain is half its bound yet
            return None
        sl = self._slice(log_bytes)
        takes = 2 + -(-self._state // sl)
        age = np.maximum(epoch - self._since, 1)
        soon = (age >= takes) & half & (chain + chain / age * takes > bound)
        return (chain > bound) | soon

    def _maybe_start(self, epoch: int, pressure: bool, log_bytes: int = 0, stale=None, moved: bool = False) -> bool:
        """Start a base job when a chain is due (`_due`), a region is stale
        (`stale`, a mask, when the log is short of twice a job's need), or
        under pressure; True if one started.  moved: the arrays hold a later
        step than `epoch` (it was pending)."""
        over = self._due(epoch, log_bytes)
        if stale is not None and stale.any():
            over = stale if over is None else over | stale
        if not pressure and (over is None or not over.any()):
            return False
        if over is None:
            over = np.zeros(len(self._names), bool)
        regions = self.regions
        due = [self._names[i] for i in np.flatnonzero(over)]
        # the due regions alone: a region with no catalogued base yet (its first full write
        # holds it) gets one when the log needs the space it holds (`stale`), not with the
        # first region due (a token buffer due at the second step based the whole state then)
        names = regions.names if pressure else sorted(due)
        names = self._affordable(names, epoch)
        if not names:
            if self._affordable(regions.names, epoch) != regions.names:
                self.error = f"no room in the log for a base ({_mib(self.free_bytes())} free): none started"
            return False
        if moved and not pressure:
            # the arrays hold a later step than the epoch just committed (it was
            # pending): the copies are taken at the next epoch's launch (`launched`)
            self._copy_next = (names, pressure)
            return True
        # the copies are the state of the epoch just committed (nothing ran since;
        # under pressure after a pending epoch, none: folded from the log);
        # the job that takes them is made at the next hook (`_begin`)
        # (a region this epoch wrote whole needs no copy: its base is an image entry)
        imaged = (self._whole == epoch) if self.policy.image_bases else np.zeros(len(self._names), bool)
        live = {} if moved else {n: self._host_copy(regions[n]) for n in names
                                 if regions[n].nbytes <= LIVE_COPY_BYTES and not imaged[self._slot[n]]}
        if not moved:
            self._keep_ahead([n for n in names if imaged[self._slot[n]]])
        self._start(epoch, names, live, pressure)
        return True

    def _start(self, epoch: int, names: list, live: dict, pressure: bool) -> None:
        # the regions this epoch wrote whole, known now: by the job's first hook a later
        # epoch has replaced what `_whole` says of them
        imaged = {n for n in names if self._whole[self._slot[n]] == epoch} if self.policy.image_bases else set()
        self._starting = _Starting(epoch, names, live, pressure, imaged)
        self.counts["jobs"] += 1
        for n in names:  # the chain restarts at the base's epoch
            self._chain[self._slot[n]] = 0
            self._since[self._slot[n]] = epoch

    def launched(self, epoch: int) -> None:
        """Epoch `epoch` was queued on the device and the caller has not run
        on: the arrays hold its state (in stream order), so a job decided at
        the last commit takes its copies now, at this epoch (`_begin` runs
        once it has committed)."""
        if self._copy_next is None:
            return
        names, pressure = self._copy_next
        self._copy_next = None
        regions = self.regions
        try:
            live = {n: self._host_copy(regions[n]) for n in names
                    if n in regions.names and regions[n].nbytes <= LIVE_COPY_BYTES}
        except Exception as exc:  # the epoch is queued: the caller's checkpoint stands (`_failed`)
            self._failed(exc)
            return
        self._start(epoch, [n for n in names if n in regions.names], live, pressure)

    def not_committed(self, epoch: int) -> None:
        """Epoch `epoch`, `launched`, will not commit (a trigger's arena epoch
        that failed after its step went): the copies taken for it are
        dropped, and the job is decided again at the next commit.  Its
        number may name another epoch later."""
        if self._starting is not None and self._starting.epoch == epoch:
            self._starting = None

    def _host_copy(self, r) -> np.ndarray:
        """The bytes of region `r` as they are now, in a buffer of this
        session's: the one of the region's last job (that job is over) while
        the kept buffers stay within KEPT_COPY_BYTES, else a new one.  A device
        region's bytes are copied straight into it (pinned memory when it is
        kept and at least PIN_COPY_BYTES: the copy runs at the bus's speed,
        with no copy on the host)."""
        buf = self._kept(r)
        if buf is None:
            buf = np.empty(int(r.nbytes), np.uint8)
        if r.on_gpu:
            r.flat.get(out=buf)
        else:
            np.copyto(buf, r.flat)
        return buf

    def _kept(self, r, *, touch: bool = False) -> np.ndarray | None:
        """Region `r`'s kept copy buffer (`_host_copy`), made when it has none
        of its size and the kept buffers have room, else None.  touch: a new
        pageable buffer's pages are written now (a pinned one's already are),
        so that a later copy into it does not fault them in."""
        n = int(r.nbytes)
        buf = self._copies.get(r.name)
        if buf is not None and buf.nbytes == n:
            return buf
        self._copies.pop(r.name, None)
        self._images.pop(r.name, None)
        if sum(b.nbytes for b in self._copies.values()) + n > KEPT_COPY_BYTES:
            return None
        buf, dev = _pinned(n) if r.on_gpu and n >= PIN_COPY_BYTES else (np.empty(n, np.uint8), None)
        if dev is not None:
            self._images[r.name] = dev
        elif touch:  # pageable (pinning faults its pages in)
            buf.fill(0)
        self._copies[r.name] = buf
        return buf

    def _keep_ahead(self, names) -> None:
        """The kept buffers of regions a job bases without a copy (written
        whole at its epoch: an image entry), made now, at that job.  The
        next job copies them inside a step (`launched`), where making them
        (pinning costs about 3 ms a buffer, faulting pages in as much)
        stalled a decode step by 150 to 250 ms."""
        for n in names:  # the job's names: registered regions
            if self.regions[n].nbytes <= LIVE_COPY_BYTES:
                self._kept(self.regions[n], touch=True)

    def _begin(self) -> None:
        """The job of the copies `_maybe_start` took: a `Compaction` at their
        epoch, checked against the digests its commit states (a region the commit
        does not state is folded from the log instead)."""
        from concordia.wal.compaction import Compaction

        epoch, names, live, pressure, imaged = self._starting
        self._starting = None
        stated = self._commit_digests(self.known.epochs[epoch][1])
        regions = self.regions
        images = self._images_at(epoch, names, stated, imaged)
        names = [n for n in names if n not in images]
        live = {n: b for n, b in live.items() if regions[n].id in stated and n not in images}
        digests = {n: int(stated[regions[n].id]) for n in live}
        self.job = Compaction(self.session.log, epoch, regions=names, live=live,
                              digests=digests if len(live) == len(names) else None,
                              chunk_bytes=int(self.policy.slice_bytes or MIN_SLICE), stage=self._stage(live),
                              images=images)
        self.job_pressure = pressure
        self.job_ready = False

    def _images_at(self, epoch: int, names: list, stated: dict | None = None, known: set = frozenset()) -> dict:
        """{name: image entry} of the regions among `names` that committed
        `epoch` wrote whole (FORMAT.md §12.2): their base at that epoch is the
        epoch's own records, and the job writes nothing for them.  stated:
        the epoch commit's digests (read when None); known: names known to be
        written whole at `epoch` besides those `_whole` still says so of."""
        from concordia.wal.snapshot import image_entries

        whole = [n for n in names if n in known or self._whole[self._slot[n]] == epoch]
        mark = self.known.epochs.get(epoch)
        if not self.policy.image_bases:
            return {}
        if not whole or mark is None:
            return {}
        if stated is None:
            stated = self._commit_digests(mark[1])
        ids = {self.regions[n].id: n for n in whole}
        got = image_entries(self.session.log, {rid: int(self._npages[self._slot[n]]) for rid, n in ids.items()},
                            epoch, mark[0], mark[1], stated)
        return {ids[rid]: entry for rid, entry in got.items()}

    def _stage(self, live: dict) -> dict:
        """{name: BASE record writer} of the live copies the base stager can
        read: the device's view of a pinned copy, or the copy itself for
        host kernels (a stager a caller set: the numpy twin)."""
        st = self._base_stager()
        if st is None or st.error is not None:
            return {}
        if st.k.xp is np:
            return {n: st.writer(b) for n, b in live.items()}
        return {n: st.writer(self._images[n]) for n, b in live.items()
                if n in self._images and self._copies.get(n) is b}

    def _base_stager(self):
        """The session's base stager: the one a caller set, else one on the
        device kernels of a log the device writes (made when there is one)."""
        if self.base_stager is None:
            self.base_stager = self.session.runner.base_stager()
        return self.base_stager

    def _commit_digests(self, lsn: int) -> dict:
        """{region id: digest} of the commit record at `lsn` (read back from the log)."""
        from concordia.wal import format as F
        from concordia.wal.snapshot import record_at

        log = self.session.log
        _, off, h = record_at(log, lsn)
        body = log.volume.backend.view[off + F.RECORD_HEADER_SIZE: off + F.RECORD_HEADER_SIZE + h.count]
        return dict(F.decode_commit_body(body, h).digests)

    def _advance(self, pressure: bool, slice_bytes: int) -> None:
        """One step of the job, each in a hook of its own so that no checkpoint
        pays for two: a slice of its BASE records (`_paced`); once they are
        written, its catalog (appended, not yet current); then the superblock
        write that switches to it.  Under pressure the job is written and
        switched at once."""
        job = self.job
        if job.prepared:
            self._switched(job)
        elif pressure or self.job_pressure:
            while not job.step(self._record_bytes()):
                pass
            self.counts["slices"] += 1
            self._prepare(job, job.epoch, True)
            self._switched(job)
        elif not self.job_ready:
            self.job_ready = job.step(self._paced(job, slice_bytes))
            self.last = "base"
            self.counts["slices"] += 1
        elif self._prepare(job, job.epoch, False, floor_at=job.epoch if self.short else 0):
            self.last = "catalog"
        else:
            self._switched(job)  # nothing to write

    def _window_start(self, latest: int) -> int:
        """The oldest epoch the kept window holds, for a log whose newest epoch is `latest`."""
        k = self.policy.keep_epochs
        start = latest - int(k) + 1 if k else latest
        if self.policy.keep_seconds:
            if time.monotonic() - self.opened <= self.policy.keep_seconds:
                return 0  # epochs from before this session may still be young enough
            start = min(start, self.times[0][0]) if self.times else start
        return max(0, start)

    def _switch(self, epoch: int, pressure: bool) -> None:
        """A switch with no new base, so that the floor follows the newest bases
        once the window has moved past them, or at once while the log is short
        (in two hooks, as a job's)."""
        from concordia.wal.compaction import Compaction

        job = Compaction(self.session.log, epoch, regions=[], live={}, digests={})
        if self._prepare(job, epoch, pressure, floor_at=self.pending_floor if self.short else 0) and not pressure:
            self.job, self.job_ready, self.last = job, True, "catalog"
        else:
            self._switched(job)

    def _prepare(self, job, epoch: int, pressure: bool, floor_at: int = 0) -> bool:
        """The job's catalog under the kept window (`Compaction.prepare`); the
        window starts at `floor_at` at the latest (the log is short: the floor
        may move up to the newest bases)."""
        log = self.session.log
        latest = int(log.last_committed_epoch or 0)
        # the window never reaches below the floor a switch has set (its epochs are gone)
        start = latest if pressure else max(self._window_start(latest), int(floor_at),
                                            int(log.volume.superblock.oldest_epoch))
        # the session's policy is its window, counted in committed epochs (one per epoch
        # from start; 0: every epoch), and no limit on bases: what the switch stores
        # in the log is what `concordia-wal compact` applies when told nothing
        keep = max(1, latest - start + 1) if start else 0
        self.known.window_start = start
        return job.prepare(keep_bases=0, keep_epochs=keep, known=self.known)

    def _switched(self, job) -> None:
        """The job's superblock write (`Compaction.switch`), and what follows from it."""
        rep = job.switch()
        eps = self.known.epochs  # in commit order: the epochs it forgets are its first ones
        below = min(rep.floor_epoch, self._oldest_cut(rep.floor_epoch) + 1)
        for ep in list(itertools.takewhile(lambda e: e < below, eps)):
            del eps[ep]
        self.job = None
        self.job_pressure = False
        self.job_ready = False
        self.reports.append(rep)
        self.counts["switches"] += 1
        self.counts["segments_freed"] += len(rep.segments_freed)
        self.counts["scans"] += int(rep.scanned)
        self.last = "switch"
        if rep.folded or rep.imaged:
            self.based.update(rep.folded)
            self.based.update(rep.imaged)
            for name, entry in zip(rep.folded, job.new):  # where each new base starts
                self._pin[self._slot[name]] = int(entry.first_lsn)
            for name in rep.imaged:
                self._pin[self._slot[name]] = int(job.images[name].first_lsn)
            self.pending_floor = job.epoch
            self.counts["bases"] += len(rep.folded)
            self.counts["images"] += len(rep.imaged)
        if rep.floor_epoch >= self.pending_floor:
            self.pending_floor = 0

    def _oldest_cut(self, floor: int) -> int:
        """The oldest of the regions' newest catalogued bases at or before
        `floor` (0: a region has none): a switch keeps what every epoch after
        it wrote while that base is in use (a region that never changes is
        not based again for a long time), so the session keeps knowing those
        epochs (`Known`) and a switch needs no scan of the log."""
        from concordia.wal.snapshot import current_catalog

        newest: dict = {}
        for e in current_catalog(self.session.log).entries:
            if e.epoch <= floor:
                newest[e.region_id] = max(newest.get(e.region_id, 0), int(e.epoch))
        return min((newest.get(r.id, 0) for r in self.regions), default=int(floor))

    @property
    def job_epoch(self) -> int | None:
        """The epoch of the base job being made or written (None: no job)."""
        if self._starting is not None:
            return self._starting.epoch
        return None if self.job is None else int(self.job.epoch)

    def to_json(self) -> dict:
        return {"counts": dict(self.counts), "error": self.error, "busy": self.job_epoch is not None,
                "free_bytes": self.free_bytes(), "capacity": self.capacity(),
                "floor_epoch": self.reports[-1].floor_epoch if self.reports else 0, "pacing": self.pacing}


def takes(space, nbytes: int, record: int) -> bool:
    """Whether `space` (a `wal.compaction.Space`) takes `nbytes` written in
    records of at most `record` bytes: the appender moves to a fresh segment
    only for a record that does not fit the rest of one, so each segment
    takes its capacity less one record at the least."""
    cap = int(space.capacity)
    r = min(int(record), cap)
    return max(0, int(space.tail) - r) + int(space.free_segments) * (cap - r) >= int(nbytes)


def _mib(n: int) -> str:
    return f"{-(-n // (1 << 20))} MiB"


__all__ = ["Retention", "LIVE_COPY_BYTES", "record_bytes", "takes"]
