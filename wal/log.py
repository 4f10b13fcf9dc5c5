"""`Log`: a volume, its recovered state and its appender, behind one object.

    log = Log.create("shm:name", size=1 << 30)
    rid = log.define_region("kv", np.float16, (n, 4096), 4096, "kv")
    log.appender.append_page_batch(1, rid, ids, pages)
    log.appender.commit(1, digests={rid: d})
    log.close()
    log = Log.open("shm:name", mode=RecoveryMode.TOLERATE_TAIL, reporter=print)

Opening for writing cuts the log after its last valid commit (FORMAT.md §10.5);
that is only done in TOLERATE_TAIL and ABSOLUTE mode, the modes that never
drop anything before the last commit.  A writable log holds the backend's
advisory writer lock (`Backend.lock`) from before its first byte is touched
until `close`, so a second writer is refused (LockedError) rather than cutting
or overwriting what the first one writes.  Read-only opens take no lock.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Iterator

import numpy as np

from concordia.devmem import Backend, open_backend

from . import format as F
from .appender import Appender
from .errors import CorruptionError, RegionError, TornTailError, UsageError
from .reader import (_REC, NEXT_VALID_CHUNK, Dropped, Record, RecoveryMode, ScanResult, Scanner, recover,
                     thread_map, verify)
from .volume import FORMAT_ANYWAY_HINT, Volume, check_format_target


#: how often a read-only open beside a live writer walks again before damage stands,
#: and how long it waits in between (a record is written in well under this)
LIVE_RETRIES = 4
LIVE_PAUSE = 0.005


class Log:
    def __init__(self, vol: Volume, result: ScanResult, mode: RecoveryMode, *, writable: bool,
                 appender: Appender | None):
        self.volume = vol
        self.backend = vol.backend
        self.mode = mode
        self.writable = writable
        self._result = result
        self._appender = appender
        self._stale = False
        self._regions = {info.id: info for info in result.regions.values()}
        self._by_name: dict | None = None   # `regions`, kept until a region is defined
        # moved_on's: its follower past the last commit read (each call reads on from where the last one
        # stopped) and its answer once it is yes (a log that moved on past this open stays so)
        self._follow = None
        self._moved = False
        self._follow_lock = threading.Lock()
        self._reopened: tuple | None = None   # moved_on's last read-only open and the bytes it read (_open_reads)
        # Log.open's: seconds walking the log (walk_s) and cutting its tail (cut_s); the LSN
        # before which a walk made already was taken (walked_before_lsn, 0: none)
        self.open_stats: dict = {}
        if appender is not None:
            appender.on_write = self._mark_stale

    # -- opening ----------------------------------------------------------------
    @classmethod
    def create(cls, target, *, size: int | None = None, segment_size: int | None = None,
               zero: bool = True, overwrite: bool = False,
               hint=FORMAT_ANYWAY_HINT) -> "Log":
        """Format `target` (a Backend or a log name) as an empty log, writable.
        segment_size None: `volume.default_segment_size` of the size (64 MiB,
        smaller for a log under 512 MiB).  A named target that holds anything
        (a log, any nonzero byte) is refused and left unchanged
        (TargetNotEmptyError with `hint`) unless `overwrite`; a Backend the
        caller opened is formatted as given (the caller checks it with
        `volume.check_format_target` where it may hold someone's data)."""
        owned = not isinstance(target, Backend)
        if owned:
            check_format_target(target, overwrite=overwrite, hint=hint)  # before anything is created or grown
        backend = open_backend(target, size=size, create=True) if owned else target
        try:
            backend.lock()
            vol = Volume.create(backend, size=size, segment_size=segment_size, zero=zero)
        except BaseException:
            if owned:
                # a file this call made goes again: a failed create leaves nothing behind
                getattr(backend, "discard", backend.close)()
            raise
        return cls(vol, ScanResult(), RecoveryMode.TOLERATE_TAIL, writable=True,
                   appender=Appender(vol, segment=None, pos=None))

    @classmethod
    def open(cls, target, *, writable: bool = True, mode=RecoveryMode.TOLERATE_TAIL,
             reporter: Callable[[Dropped], None] | None = None, check_pages: bool = True,
             live: bool = False, refuse: bool = True, walked: Callable | None = None,
             decided: "Decided | None" = None) -> "Log":
        """Open and recover a log.  Every dropped byte range reaches `reporter`.
        With writable=True the space after the last valid commit is zeroed and
        writing continues there.

        `mode` is what the open refuses (CorruptionError, TornTailError) and
        the mode this Log's plans take by default (`planner.plan`).
        refuse=False (read-only only) refuses nothing at open: the log is read
        as SKIP_CORRUPT reads it, every damaged range is reported, and the
        decision is the plan's, in `mode` or the one a plan names, as the
        command lines make it (`decide`): how `Session(log, create=False)`
        opens a log, so that every recovery mode can be asked of any log the
        command lines can read.

        writable=False is the read-only recovery path: no writer lock, nothing
        cut or written, so it works beside a live writer (and beside other
        readers); the uncommitted tail is left for the next writer to cut.
        live=True (read-only only) says a writer may be appending right now:
        the walk may then pass a record while it is being written and find the
        commit written after it, which reads as damage before a commit; such a
        verdict is checked by walking again (up to LIVE_RETRIES times) and
        stands only when the damage stays where it was.

        walked (writable, check_pages False or "last"): a callable(Volume)
        returning (items, lsn), the walk of the log's live segments up to
        `lsn` made already (a following standby's mirror, `Mirror.walked`), or
        None; the open walks only on from `lsn` (a record boundary, which may
        lie inside a segment).

        decided (writable): a `Log.decide` made of this backend before the
        lock was taken (a standby, while its primary exits); used when
        `decided.holds()` says the log is as it was then, else the open
        decides again."""
        mode = RecoveryMode.parse(mode)
        if writable and mode not in (RecoveryMode.TOLERATE_TAIL, RecoveryMode.ABSOLUTE):
            raise UsageError(f"a log is opened for writing only in tolerate_tail or absolute mode, not {mode.value}",
                             hint="open read-only to inspect it in this mode")
        if writable and live:
            raise UsageError("live=True is for read-only opens beside a writer", hint="pass writable=False")
        if writable and not refuse:
            raise UsageError("refuse=False is for read-only opens: a writer refuses damage before the last commit",
                             hint="pass writable=False")
        read_as = mode if refuse else RecoveryMode.SKIP_CORRUPT
        owned = not isinstance(target, Backend)
        backend = open_backend(target, readonly=not writable) if owned else target
        try:
            if writable:
                backend.lock()  # before the open reads what it will cut
            t0 = time.perf_counter()
            vol, res = cls._recover_live(backend, read_as, reporter, check_pages) if live else (None, None)
            walked_to = 0
            reused = writable and decided is not None and decided.backend is backend and \
                decided.mode is read_as and decided.check_pages == check_pages and decided.holds()
            if reused:
                vol, res, walked_to = decided.vol, decided.res, decided.walked_to
                if reporter is not None:
                    for d in res.dropped:
                        reporter(d)
            elif vol is None:
                vol, res, walked_to = cls._decide(backend, writable, read_as, reporter, check_pages,
                                                  walked if writable else None)
            t1 = time.perf_counter()
            appender = cls._prepare_write(vol, res) if writable else None
            timing = {"walk_s": t1 - t0, "cut_s": time.perf_counter() - t1, "walked_before_lsn": walked_to}
            if reused:
                timing["decided_before_s"] = decided.seconds   # the decision, made before the lock
            if writable:
                _keep_walk_before_cut(res, vol)
            elif live:
                _snapshot_at_cut(res, vol)
        except BaseException:
            if owned:
                backend.close()
            raise
        log = cls(vol, res, mode, writable=writable, appender=appender)
        log.open_stats = timing
        return log

    @staticmethod
    def _decide(backend, writable: bool, mode, reporter, check_pages, walked) -> tuple:
        """(Volume, ScanResult, walked_to): the walk and the decision of an
        open, from `walked` (`Log.open`'s) where it gives the walk up to a point."""
        vol = Volume.open(backend, writable=writable)
        done = walked(vol) if walked is not None and check_pages is not True else None
        if done is None:
            return vol, recover(vol, mode, reporter, check_pages=check_pages), 0
        items, walked_to = done
        rest = Scanner(vol, check_pages=False).items(ScanResult(), from_lsn=walked_to, start_lsn=walked_to)
        return vol, recover(vol, mode, reporter, check_pages=check_pages, items=items + list(rest)), walked_to

    @classmethod
    def decide(cls, backend, *, holds: Callable[[], bool], check_pages="last",
               walked: Callable | None = None, mode=RecoveryMode.TOLERATE_TAIL) -> "Decided":
        """What a writable `Log.open(backend, decided=)` would decide, made
        now, without the lock: nothing is written.  `holds()`, asked once the
        lock is held, says whether the log is still as it was read here (a
        standby: its follower finds nothing new and nothing cut); only then
        does the open take this decision instead of making its own.  Raises
        what the open would raise for the log as it is now."""
        t0 = time.perf_counter()
        mode = RecoveryMode.parse(mode)
        vol, res, walked_to = cls._decide(backend, True, mode, None, check_pages, walked)
        seq = vol.superblock.sequence

        def same() -> bool:   # a switch or a new segment writes the superblock
            return _superblock_sequence(backend) == seq and holds()

        return Decided(backend, vol, res, walked_to, mode, check_pages, same, time.perf_counter() - t0)

    @staticmethod
    def _recover_live(backend, mode, reporter, check_pages):
        """(Volume, ScanResult) of a read-only open beside a live writer: a
        walk that raises for damage, or (SKIP_CORRUPT, which raises for none)
        reports damage before a commit, is made again (with a fresh superblock)
        until two walks find the same damage, or LIVE_RETRIES walks were made.
        What reaches `reporter` is what the walk that stood dropped."""
        seen = None
        for attempt in range(LIVE_RETRIES + 1):
            dropped: list = []
            vol = Volume.open(backend, writable=False)
            failure = None
            try:
                res = recover(vol, mode, dropped.append, check_pages=check_pages)
            except (CorruptionError, TornTailError) as exc:
                failure, verdict = exc, (exc.where, exc.message)
            else:
                verdict = tuple((d.where, d.reason) for d in dropped if d.kind == "corrupt") or None
            if verdict is not None and attempt < LIVE_RETRIES and verdict != seen:
                seen = verdict
                time.sleep(LIVE_PAUSE)  # let the record in flight be finished
                continue
            if failure is not None:
                raise failure
            if reporter is not None:
                for d in dropped:
                    reporter(d)
            return vol, res
        raise AssertionError("unreachable")

    @staticmethod
    def _prepare_write(vol: Volume, res: ScanResult) -> Appender:
        """Cut after the last commit: free later live segments, zero the rest of the
        cut segment, write again the region descriptors that lay after the cut."""
        live = [s for s in vol.live_segments() if s.index not in res.bad_segments]
        # copies: the bytes are about to be zeroed or reused
        tail_regions = [(rec.region_id, rec.page_bytes, bytes(rec.body)) for rec in res.tail_regions]
        all_live = vol.live_segments()
        cut = res.cut
        cat_lsn = vol.superblock.catalog_lsn
        if cat_lsn:
            # V-N2: a switched snapshot or compaction no commit has followed yet is kept
            for rec in res.records:
                if rec.lsn == cat_lsn and rec.kind == F.REC_CATALOG:
                    cat_seg = next(s for s in live if s.index == rec.segment)
                    if cut is None or rec.lsn > res.last_commit_lsn:
                        cut = (cat_seg, rec.offset + rec.length)
                        tail_regions = [(r.region_id, r.page_bytes, bytes(r.body)) for r in res.tail_regions
                                        if r.lsn > rec.lsn]
                    break
        if cut is not None:
            seg, pos = cut
        elif live:
            seg, pos = live[0], live[0].offset + F.SEGMENT_HEADER_SIZE
        else:
            seg, pos = None, None
        if seg is not None:
            later = [s.index for s in all_live if s.seq > seg.seq]
            if later:
                vol.free_segments(later, invalidate=True)
            end = seg.offset + seg.nbytes
            if _zero_tail(vol.backend.array, pos, end):
                vol.backend.persist(pos, end - pos)
        elif all_live:
            vol.free_segments([s.index for s in all_live], invalidate=True)
        app = Appender(vol, segment=seg, pos=pos, last_committed_epoch=res.last_committed_epoch,
                       last_commit_lsn=res.last_commit_lsn)
        for region_id, page_bytes, body in tail_regions:
            app.append_record(type=F.REC_REGION, epoch=0, body=body, region_id=region_id,
                              page_bytes=page_bytes)
        return app

    def walk_through_commit(self) -> tuple | None:
        """(items, commit): the open's walk (Scanner items, LSN order) from its
        first live record through the commit record of the last committed
        epoch, and that record; None when the open did not keep its walk
        (`walk_kept`), found damage before that commit, or commits
        nothing.  A follower started just past `commit` (`Follower(after=)`)
        returns every record after it, as one that walked these items would."""
        res = self._fresh()
        if not res.walk or not res.last_committed_epoch:
            return None
        for i, it in enumerate(res.walk):
            if it.tag != _REC:
                return None   # damage before the commit: a follower from the start says where
            h = it.header
            if h.type == F.REC_COMMIT and h.lsn == res.last_commit_lsn:
                return (res.walk[:i + 1], it) if h.epoch == res.last_committed_epoch else None
        return None

    def moved_on(self) -> bool:
        """Whether the log may hold more than this open read (a read-only
        open beside a writer): an epoch committed since (a commit past the
        last one read), or a superblock written since (segments added,
        switched or freed).  What the tail holds beyond that (an epoch begun,
        not committed) is not counted.  Each call reads on from where the
        last one stopped (the records after the last commit are walked once:
        a read ahead asks first, on its thread, and the recovery's own
        question then costs a header or two, and no open of the volume
        where none of the bytes an open reads changed, `_volume_now`); a yes
        is kept."""
        from .errors import WalError
        from .reader import Follower, record_kind

        with self._follow_lock:
            if self._moved:
                return True
            try:
                now = self._volume_now()   # the volume as an open makes it now, for the question and the walk
                if now.superblock.sequence != self.volume.superblock.sequence:
                    self._moved = True
                    return True
                if self._follow is None:
                    last = self.last_commit_record()
                    if last is None:
                        return True   # none to look past: read again
                    self._follow = Follower(self.backend, check_pages=False, after=last)
                items = self._follow.poll(now)
            except WalError:
                self._moved = True
                return True
            except BaseException:   # the follower may have passed records it did not show: start again
                self._follow = None
                raise
            self._moved = any(it[0] == _REC and record_kind(it.header.type) == F.REC_COMMIT for it in items)
            return self._moved

    def _volume_now(self) -> Volume:
        """The volume `Volume.open(self.backend, writable=False)` makes now,
        without that open where it need not be made.  A read-only open decodes
        both superblock slots and reads segment headers (`Volume._adopt`): a
        function of those bytes alone (the backend's size is fixed), so while
        they are the bytes an earlier open read, its volume is the one a new
        open would make (the sequence, the segments adopted and all).  An open
        is kept only where it read no other bytes: both slots valid (a bad one
        has slot B searched for and live segments' headers read), in the
        geometry of this log's superblock (the ranges `_open_reads` copies),
        and the bytes the same before and after it (so that it read those,
        not a change a writer made while it read).  A header a writer
        prepared and withdrew again while the open read (a commit's, then a
        sync's) may stand adopted in a kept volume: harmless, as the
        follower passes over a segment whose header is not intact and its
        poll stops there.  Logs whose slots and headers pass _REOPEN_MAX_BYTES
        are opened afresh each time (the copy would cost more than the open)."""
        seen = _open_reads(self.volume)
        if seen is not None and self._reopened is not None and self._reopened[1] == seen:
            return self._reopened[0]
        now = Volume.open(self.backend, writable=False)
        keep = (seen is not None and not now.slot_problems and _geometry(now) == _geometry(self.volume)
                and _open_reads(self.volume) == seen)
        self._reopened = (now, seen) if keep else None
        return now

    def last_commit_record(self):
        """The commit record of the last committed epoch as a walk's item
        (`Found`), found from the decision alone (an open that did not keep
        its walk, `walk_kept`), or None when it commits nothing."""
        from .reader import Found, intact_header

        res = self._fresh()
        lsn = res.last_commit_lsn
        if not res.last_committed_epoch or not lsn:
            return None
        seg = next((sg for sg in self.volume.live_segments() if sg.base_lsn <= lsn < sg.end_lsn), None)
        if seg is None:
            return None
        off = seg.offset + lsn - seg.base_lsn
        h = intact_header(seg, off, self.volume.backend.view)   # at its own LSN, in this incarnation
        if h is None or h.type != F.REC_COMMIT or h.epoch != res.last_committed_epoch:
            return None
        return Found(_REC, seg, off, h)

    # -- state ------------------------------------------------------------------------
    def _mark_stale(self):
        self._stale = True

    def _fresh(self) -> ScanResult:
        """The recovered state, rescanned when this process appended since."""
        if self._stale:
            self._result = recover(self.volume, RecoveryMode.TOLERATE_TAIL, None)
            self._stale = False
        return self._result

    @property
    def appender(self) -> Appender:
        if self._appender is None:
            raise UsageError("log opened read-only: no appender")
        return self._appender

    @property
    def regions(self) -> dict:
        """{name: RegionInfo(id, name, dtype, shape, page_bytes, kind, nbytes, pages)}, in id
        order: a dict of the caller's own (a recovery asks for it once a region)."""
        return dict(self._named())

    def region_named(self, name: str) -> F.RegionInfo | None:
        """The region of this name, or None (no dict made: a register asks once a region)."""
        return self._named().get(name)

    def _named(self) -> dict:
        if self._by_name is None:
            self._by_name = {info.name: info for info in sorted(self._regions.values(), key=lambda r: r.id)}
        return self._by_name

    def region(self, key) -> F.RegionInfo:
        """A region by name or id."""
        if isinstance(key, (int, np.integer)):
            if int(key) in self._regions:
                return self._regions[int(key)]
        else:
            for info in self._regions.values():
                if info.name == key:
                    return info
        raise RegionError(f"no region {key!r} in this log")

    def define_region(self, name: str, dtype, shape, page_bytes: int, kind: str = "opaque", *,
                      logical: str = "", framework: str = "array") -> int:
        """Describe a region in the log (persisted at once); returns its id.  The same
        name with the same attributes returns the existing id.  `dtype` is the byte
        layout (a numpy type string); `logical` names the dtype the bytes hold when
        numpy's own names do not ("bfloat16", "float8_e4m3fn"), `framework` what the
        region was registered as ("array" or "torch").  Either sets the volume's
        LOGICAL_DTYPE feature first (FORMAT.md §2.3, §7)."""
        body = F.encode_region_body(name, dtype, shape, page_bytes, kind, logical=logical, framework=framework)
        for info in self._regions.values():
            if info.name == name:
                want = F.decode_region_body(body, info.id, page_bytes)
                if want != info:
                    raise RegionError(f"region {name!r} is already defined as {info.logical_dtype}"
                                      f"{list(info.shape)} ({info.framework}) pages of {info.page_bytes} "
                                      f"({info.kind})")
                return info.id
        rid = max(self._regions, default=-1) + 1
        if F.region_needs_feature(body):
            self.volume.enable_incompat(F.FEATURE_LOGICAL_DTYPE)
        self.appender.append_record(type=F.REC_REGION, epoch=0, body=body, region_id=rid, page_bytes=page_bytes)
        self._regions[rid] = F.decode_region_body(body, rid, page_bytes)
        self._by_name = None
        return rid

    @property
    def last_committed_epoch(self) -> int:
        if self._appender is not None:
            return self._appender.last_committed_epoch
        return self._result.last_committed_epoch

    @property
    def commits(self) -> list:
        """CommitInfo of every committed epoch, oldest first."""
        return list(self._fresh().commits)

    @property
    def dropped(self) -> list:
        """What recovery at open gave up (Dropped ranges)."""
        return list(self._result.dropped)

    @property
    def incomplete_epochs(self) -> list:
        return list(self._result.incomplete_epochs)

    def records(self, start_lsn: int | None = None, end_lsn: int | None = None, *,
                committed_only: bool = True) -> Iterator[Record]:
        """Valid records in LSN order, every checksum checked at recovery.  With
        committed_only (the default) records of epochs without a commit are left out."""
        res = self._fresh()
        committed = {c.epoch for c in res.commits}
        for rec in res.records:
            if start_lsn is not None and rec.lsn < start_lsn:
                continue
            if end_lsn is not None and rec.lsn >= end_lsn:
                break
            if committed_only and rec.epoch and rec.epoch not in committed:
                continue
            yield rec

    def verify(self, *, check_pages: bool = True) -> dict:
        """Check every checksum; report all problems (see reader.verify)."""
        return verify(self.volume, check_pages=check_pages)

    def info(self) -> dict:
        sb = self.volume.superblock
        live = self.volume.live_segments()
        return {
            "uuid": sb.uuid.hex(), "volume_bytes": sb.volume_bytes, "segment_bytes": sb.segment_bytes,
            "segments": sb.segment_count, "live_segments": len(live), "next_lsn": sb.next_lsn,
            "oldest_lsn": sb.oldest_lsn, "oldest_epoch": sb.oldest_epoch, "catalog_lsn": sb.catalog_lsn,
            "last_committed_epoch": self.last_committed_epoch,
            "regions": [r._asdict() for r in self.regions.values()],
            "backend": self.backend.info(),
        }

    def close(self) -> None:
        """Persist what was appended and release the log.  A writer stopped by a
        failed sync writes nothing more: the log is released as it is."""
        stopped = self._appender is not None and self._appender.stopped is not None
        if self._appender is not None and self._appender.outstanding and not stopped:
            raise UsageError(f"{len(self._appender.outstanding)} reservations not persisted at close")
        try:
            if self._appender is not None and not stopped:
                self._appender.sync()  # a failure stops the writer; the log is released all the same
        finally:
            self._result = ScanResult()
            self._appender = None
            self.volume.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.close()
        else:
            self.volume.close()


def _snapshot_at_cut(res: ScanResult, vol: Volume) -> None:
    """A live read-only open answers as of its commit point (R-D2: its last
    commit, a catalog switched after it (V-N2, kept as a cut keeps it), or the
    damage that hides a commit), and of the last commit record it read, which
    decides, committing or not, what the last commits are (§10.4b, R-D1): what
    lies after them is being written (or is the uncommitted tail a writer's
    cut will drop), so the planner plans from the walk up to there
    (walk_end_lsn; walked again up to it when the walk was not kept), never
    from a walk of the log as it has grown since, which could hold a commit
    whose records it saw torn.  The torn tail the open found after it is kept
    (`tail_dropped`) for the plans to report, so that ABSOLUTE refuses it as
    the command lines do."""
    end_lsn = max(res.commit_point_end, res.last_commit_record_end)
    if res.cut is not None:
        seg, end = res.cut
        end_lsn = max(end_lsn, seg.lsn(end))
    if end_lsn < 0:
        res.walk, res.walk_end_lsn = None, None
        return
    res.tail_dropped = _tail_damage(res, vol, end_lsn)
    if res.walk is not None:
        res.walk = [it for it in res.walk if it[1].lsn(it[2]) < end_lsn]
    res.walk_end_lsn = end_lsn
    res.walk_oldest_lsn = vol.superblock.oldest_lsn


def _tail_damage(res: ScanResult, vol: Volume, end_lsn: int) -> list:
    """The torn tail past `end_lsn` (the open's commit point) as Dropped
    ranges, every page of it checked: an open that checked pages only where
    V-C4 needs them (check_pages="last") has not looked at the tail's."""
    from .reader import _DMG, Scanner

    walk = res.walk
    if walk is not None:
        items = list(walk)  # check_pages_of puts damaged ranges in place of records
        tail = [i for i, it in enumerate(items) if it.seg.lsn(it.offset) >= end_lsn]
        if res.walk_checked_pages is not True:
            Scanner(vol, check_pages=False).check_pages_of(items, tail)
        found = [items[i] for i in tail]
    else:  # the walk was too long to keep: the segments reaching past the commit point again
        found = [it for it in Scanner(vol, check_pages=True).items(ScanResult(), from_lsn=end_lsn)
                 if it.seg.lsn(it.offset) >= end_lsn]
    segs = {sg.index: sg for sg in vol.live_segments()}
    out = [d for d in res.dropped if d.kind == "torn" and d.segment in segs
           and segs[d.segment].lsn(d.offset) >= end_lsn]  # those before it the plans walk themselves
    seen = {(d.segment, d.offset) for d in out}
    for it in found:
        if it.tag == _DMG and (it.seg.index, it.offset) not in seen:
            out.append(Dropped(it.seg.index, it.offset, it.length, it.reason, "torn"))
    return out


#: the most bytes `_open_reads` copies to compare (both slots and every segment header: some 16,000
#: segments); a log of more is opened afresh at each `moved_on`, as before
_REOPEN_MAX_BYTES = 4 << 20


def _geometry(vol: Volume) -> tuple:
    """Where a volume's superblock slots and segment headers lie (FORMAT.md §2)."""
    sb = vol.superblock
    return sb.slot_bytes, sb.segments_off, sb.segment_bytes, sb.segment_count


def _open_reads(vol: Volume) -> bytes | None:
    """A copy of the bytes a read-only `Volume.open` of `vol`'s backend reads
    when both slots are valid and state `vol`'s geometry: both superblock
    slots, [0, 2*slot_bytes), and the header of every segment (FORMAT.md §2);
    None when the media end before the last segment, or the bytes pass
    _REOPEN_MAX_BYTES."""
    slot_bytes, off, seg_bytes, count = _geometry(vol)
    arr = vol.backend.array
    end = off + count * seg_bytes
    if end > arr.size or 2 * slot_bytes + count * F.SEGMENT_HEADER_SIZE > _REOPEN_MAX_BYTES:
        return None
    heads = arr[off:end].reshape(count, seg_bytes)[:, :F.SEGMENT_HEADER_SIZE]
    return arr[:2 * slot_bytes].tobytes() + heads.tobytes()


def _superblock_sequence(backend) -> int:
    """The sequence of the superblock in force now (each switch, segment added
    or freed writes the next)."""
    return Volume.open(backend, writable=False).superblock.sequence


@dataclasses.dataclass(frozen=True)
class Decided:
    """A writable open's walk and decision made before its lock (`Log.decide`)."""

    backend: Backend
    vol: Volume
    res: ScanResult
    walked_to: int
    mode: RecoveryMode
    check_pages: bool | str
    holds: Callable[[], bool]   # the log is still as it was read (asked with the lock held)
    seconds: float              # how long the decision took


def _keep_walk_before_cut(res: ScanResult, vol: Volume) -> None:
    """Writing changes what a walk finds after the cut (zeroed, freed, region
    descriptors written again, new records), never before it, where a writable
    open leaves only valid records (damage there refuses the open): keep those
    items for the planner, which walks on from the cut (planner._walk_of_open)."""
    if res.walk is None or res.cut is None:
        res.walk = None
        return
    seg, end = res.cut
    cut_lsn = seg.lsn(end)
    res.walk = [it for it in res.walk if it[1].lsn(it[2]) < cut_lsn]
    res.walk_end_lsn = cut_lsn
    res.walk_oldest_lsn = vol.superblock.oldest_lsn


def _zero_tail(arr: np.ndarray, pos: int, end: int) -> bool:
    """Zero arr[pos:end] where it is not zero already; True when a byte was
    written.  Slices of NEXT_VALID_CHUNK bytes over threads (`thread_map`): a
    cut segment's tail of old bytes is up to a segment long, and the writer
    that takes over waits for it."""

    def clear(lo: int) -> bool:
        part = arr[lo:min(end, lo + NEXT_VALID_CHUNK)]
        if not part.any():
            return False
        part[:] = 0
        return True

    return any(thread_map(clear, range(pos, end, NEXT_VALID_CHUNK)))
