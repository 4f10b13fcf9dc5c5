"""Epochs a consumer commits with no host step: the arena.

A resident executor's trigger takes epochs while the caller's thread does
nothing for them (it may be stalled, or hold the GIL).  Such an epoch cannot
ask the log's appender for space or commit through it, so the space is
reserved ahead: an arena is one extent of the log (`Appender.reserve_extent`)
into which the consumer writes epoch after epoch, each one's page batches and
then its own commit record (a table pass's `plan_epoch` and `write_epoch`,
the records the device's table pass writes, the commit by
`table.write_commit` / table.cu's `table_commit`; with a trigger's snapshot,
through a host buffer first: `take`).  What the consumer needs to go on lives in a few words
(`WORDS`): the bytes used so far, the LSN of the last commit (the next one's
`aux`), the last epoch, the epochs taken, the triggers missed for want of
room and the epoch lost (below).  A GPU consumer keeps them in memory it
maps, the CPU twin in a numpy array; `take` is the twin of the device's EPOCH
handler.

An epoch is tried only when the arena still has room for `bound` record
bytes and its commit.  Where every page of every row, all written, fits half
a segment, `bound` is that (`full_bound`): no epoch tried then can fail to
fit.  A larger table (a model's state, gigabytes, against a segment of
megabytes) would never have an arena, so its `bound` is what its epochs
write (twice the table's last epoch, at least `ARENA_MIN_BYTES`, at most
what a segment holds beside a commit): a decode step's new rows, not
the whole cache.  Such an arena is made as large as it may be (a whole
segment: each arena taken on costs its consumer a pause and the host a few
milliseconds, so the fewer the better), and each epoch written moves the
room the next is tried with (`expect`, a word: twice its record bytes, at
least `bound`, at most what the whole arena holds beside a commit, so that
an epoch of more than half a segment is still tried).  An arena cut
from the rest of a segment is smaller, and an epoch larger than it is lost,
so the rest is taken only once the table's epochs have a size known
(`last_epoch_bytes`: its last epoch's, or before its first, that of the
epoch an arena lost before the table was made, the loss having made every
region whole and the table new; without it every later epoch would be lost
the same way, each written whole).  Only a table whose last epoch alone
does not fit a segment has no arena (`too_large`: its epochs take the
session's path), or, before its first, one made after two arenas in a row
lost an epoch larger than a segment.  An epoch that writes more than the
room left (a cache reset, a new prompt) is *lost*: detection, which moves
the detectors on, has run, and nothing of it was written.  The arena then
takes no further epoch (`lost` names it), and the session's next call takes
the arena on and makes every region's next checkpoint whole
(`EpochRunner.adopt_arena`): what the lost epoch would have held is in the
next commit, and a crash before it recovers the last commit, as for a missed
epoch.  Only tables whose rows find their dirty pages on the device (shadow
copies, fingerprints, a static cache's positions from length words the
caller keeps beside it: `table.DEVICE_DETECTORS`) are taken here: a row whose
pages the host lists (a cache whose length a callable gives, block tables)
needs the host.

The session's next call takes the arena's epochs on (`adopt`): the extent is
finished at the bytes used (its unused end given back when nothing was
reserved after it), every record in it checked as any producer's are, and
each commit record, in order, checked and taken on as the appender's own
(`Appender.adopt_commit`).  A crash before that loses nothing committed: the
records are in the log, each commit after its records (FORMAT.md §10, 4c),
and the slot after the last commit is zero.

Only where written bytes need no persist call (shared memory, huge pages):
there a record is durable when written."""

from __future__ import annotations

import numpy as np

from concordia.checkpoint.table import DEVICE_DETECTORS, records_bytes
from concordia.regions.errors import SessionError
from concordia.wal import format as fmt
from concordia.wal import pagecrc

#: the arena's words (64 bytes), the consumer's state between its epochs
WORDS = np.dtype([("used", "<u8"), ("last_commit", "<u8"), ("last_epoch", "<u8"), ("epochs", "<u8"),
                  ("missed", "<u8"), ("lost", "<u8"), ("expect", "<u8"), ("adapt", "<u8")])
assert WORDS.itemsize == 64

#: how many epochs of the largest size an arena is made for, and its least size
#: (less when the rest of the segment being written holds one epoch: no roll over)
ARENA_EPOCHS = 8
ARENA_MIN_BYTES = 256 << 10


def why_not(table, backend) -> str | None:
    """Why epochs of `table` (a RegionTable) cannot be taken in an arena of a
    log on `backend`, or None when they can."""
    if backend.persist_path != "none":
        return f"the log's tier needs a persist call ({backend.persist_path}) before a commit"
    rows = np.flatnonzero(~np.isin(table.entries["detector"], DEVICE_DETECTORS))
    if rows.size:
        return f"region {table.names[int(rows[0])]!r} has its dirty pages listed by the host"
    return None


def last_epoch_bytes(table, *, lost_again: bool = False) -> int:
    """What the next epoch of `table` is guessed to write: its last epoch's
    record bytes; before it has one, those of the epoch an arena lost before
    the table was made (`arena_hint`: the loss made every region whole and
    the table new), with `lost_again` only once a second arena in a row lost
    one (one loss is as often a one-off, a new prompt's cache); 0: none known."""
    if table.last_bytes:
        return int(table.last_bytes)
    if lost_again and table.arena_losses < 2:
        return 0
    return int(table.arena_hint)


def too_large(table, app, full: int | None = None) -> str | None:
    """Why no arena of the log `app` appends to can hold one epoch of `table`
    (an arena takes at most a segment): every page of every row does not
    fit, and neither does the table's last epoch (`last_epoch_bytes`: after
    two losses in a row, the lost one's; at least ARENA_MIN_BYTES) with its
    commit; or None.  `full`: full_bound(table), when known."""
    whole = app.segment_capacity
    full = full_bound(table) if full is None else full
    need = min(full, max(last_epoch_bytes(table, lost_again=True), ARENA_MIN_BYTES)) + table.commit_length
    if need > whole:
        return (f"an epoch of {need} bytes (the last one's records and its commit) needs an arena of more "
                f"than a segment ({whole} bytes)")
    return None


def full_bound(table) -> int:
    """Record bytes one epoch of `table` can need: every page of every row."""
    return records_bytes(table, table.entries["pages"])


def epoch_bound(table, app, full: int | None = None) -> int:
    """The record bytes an epoch of `table` is tried with (module doc): every
    page of every row (`full`, `full_bound`) where that and the commit fit
    half a segment of `app` (no epoch is then lost), else twice the table's
    last epoch (`last_epoch_bytes`), at least ARENA_MIN_BYTES, at most what
    a segment holds beside the commit (an epoch that writes more is lost)."""
    full = full_bound(table) if full is None else full
    if full <= app.segment_capacity // 2 - table.commit_length:
        return full
    return min(full, max(2 * last_epoch_bytes(table), ARENA_MIN_BYTES), app.segment_capacity - table.commit_length)


class Arena:
    """One extent of the log for epochs a consumer commits itself (module doc).
    `first_epoch`: the number the first epoch takes; `reason`: what took them
    (their statistics' reason); `words`: a WORDS array of one row to keep
    the words in (a GPU consumer's mapped memory), else one of its own;
    `least`: the epochs the rest of a segment must hold to be taken as the
    arena (a consumer that swaps arenas with room for several kept)."""

    def __init__(self, app, table, first_epoch: int, nbytes: int | None = None, *, reason: str = "trigger",
                 label: str = "cpu-mapped", words: np.ndarray | None = None, least: int = 1):
        self.table = table
        self.reason = reason
        self.label = label  # the path its epochs took (their statistics' `via`)
        #: the record bytes an epoch is tried with (`epoch_bound`): every page where
        #: that fits half a segment, so that no epoch is lost, else twice the last
        #: epoch's, at most what a segment holds (the arena is then a segment)
        full = full_bound(table)
        self.bound = epoch_bound(table, app, full)
        adapt = self.bound < full  # the room moves with each epoch (`expect`)
        need = self.bound + table.commit_length
        if nbytes is None:  # what is left of the segment being written, when one epoch fits there
            why = too_large(table, app, full)
            if why is not None:
                raise ValueError(why)
            # a table whose every page fits half a segment: ARENA_EPOCHS of its epochs, within half a segment
            small = not adapt and need <= app.segment_capacity // 2
            nbytes = min(max(ARENA_EPOCHS * need, ARENA_MIN_BYTES), app.segment_capacity // 2) if small \
                else app.segment_capacity
            rest = app.segment_rest // fmt.RECORD_ALIGN * fmt.RECORD_ALIGN
            # the rest of the segment being written, where it holds `least` epochs; with no epoch of this
            # table known (`last_epoch_bytes` 0: ARENA_MIN_BYTES is no guess), not the rest but a segment
            if rest >= least * need and (not adapt or last_epoch_bytes(table)):
                nbytes = min(nbytes, rest)
        if nbytes < need:
            raise ValueError(f"an arena of {nbytes} bytes cannot hold one epoch of {need} bytes")
        self.ext = app.reserve_extent(fmt.align64(nbytes))
        #: the words (one WORDS row): here, or where a GPU consumer writes them (mapped host memory)
        self.words = np.zeros(1, WORDS) if words is None else words
        self.words[0] = 0
        #: {region id: digest} of the last commit taken on (`adopt`): the regions' digests now
        self.digests: dict | None = None
        #: {epoch: CheckpointStats} handed out for epochs before they are taken on
        #: (arena_route.py): the runner fills and lists these instead of new ones
        self.given: dict = {}
        w = self.words[0]
        w["last_commit"] = app.last_commit_lsn
        w["last_epoch"] = first_epoch - 1
        w["expect"] = self.bound
        w["adapt"] = int(adapt)

    def word(self, name: str) -> int:
        return int(self.words[0][name])

    @property
    def room(self) -> bool:
        """Whether the next epoch can be tried: no epoch was lost here, and
        `expect` record bytes (`bound`, or twice the last epoch's, at most what
        the arena holds) and the commit fit."""
        return self.holds(1)

    def holds(self, epochs: int) -> bool:
        """Whether `epochs` more epochs can be tried here, each with `expect`
        record bytes and its commit (no epoch lost here)."""
        return not self.word("lost") and self.ext.length - self.word("used") >= \
            epochs * (self.word("expect") + self.table.commit_length)

    @property
    def lost(self) -> int:
        """The epoch detected but not written for want of room (module doc), or 0."""
        return self.word("lost")

    def take(self, tpass, *, snapshot=None, release=None) -> int | None:
        """One epoch of `tpass` (a HostTablePass over this arena's table) into
        the arena, its commit included: the twin of the device's EPOCH
        handler.  Returns its number, or None: there was no room (the miss
        is counted; nothing was detected), or the epoch's records did not
        fit what was left (`lost` names it; the detectors moved on).

        With `release` (a trigger's: `release(epoch)` lets its producer go)
        and `snapshot` (`snapshot(nbytes)`: a host buffer of that many bytes,
        or None where the epoch is too large for one), the twin of the
        device's snapshot (executor.cu: via_snapshot): the epoch, records and
        commit, is written into the snapshot, `release` is called once every
        region has been read, and the bytes are then copied into the arena,
        the commit last, while the producer goes on.  An epoch too large for
        the snapshot is written into the arena, `release` not called: the
        caller lets its producer go after, as without one.  The arena's bytes
        are the same either way."""
        w = self.words[0]
        if not self.room:
            w["missed"] += 1
            return None
        at, epoch = int(w["used"]), int(w["last_epoch"]) + 1
        lsn = self.ext.lsn + at
        view, commit = self.ext.view[at:], self.table.commit_length
        plan = tpass.plan_epoch()
        used = int(plan[3])
        if used + commit > view.size:
            w["lost"] = epoch
            return None
        snap = snapshot(used + commit) if snapshot is not None and release is not None else None
        kw = dict(lsn=lsn, salt=self.ext.salt, epoch=epoch, prev_commit=int(w["last_commit"]))
        if snap is not None:
            tpass.write_epoch(plan, snap, **kw)
            release(epoch)   # every region read: the producer goes on while the epoch crosses into the arena
            self._cross(view, snap, used, commit)
        else:
            tpass.write_epoch(plan, view, **kw)
        w["used"] = at + used + commit
        if w["adapt"]:  # twice this one, at most all the arena holds (executor.cu: epoch_close)
            w["expect"] = max(min(2 * used, self.ext.length - self.table.commit_length), self.bound)
        w["last_commit"] = lsn + used
        w["last_epoch"] = epoch
        w["epochs"] += 1
        return epoch

    @staticmethod
    def _cross(view, snap, used: int, commit: int) -> None:
        """A snapshot's epoch into the arena: its records, the header slot
        after its commit zeroed where it lies in the extent (as
        `table.write_commit` leaves it), then the commit (FORMAT.md §10, 4c:
        a crash before it leaves records no commit covers, which recovery
        ignores, and the slot after a commit is zero once the commit is there)."""
        view[:used] = snap[:used]
        end = used + commit
        if end + fmt.RECORD_HEADER_SIZE <= view.size:
            view[end:end + fmt.RECORD_HEADER_SIZE] = 0
        view[used:end] = snap[used:end]

    def adopt(self, app) -> list:
        """Finish the arena and take its commits on (module doc): returns
        [(epoch, LSN of its first record, commit LSN, pages per table row
        (int64), record bytes)] in order.  What follows the last commit that could be taken
        on (a record that is not one, a commit written wrong) is covered by
        one pad record before the refusal is raised, so the log holds no
        damage and no epoch of it."""
        said = self.word("used")
        used = min(said, self.ext.length)  # a word past the extent (a producer's fault): the extent is all there is
        offs, h, good = self._walk(used)
        offsets = offs if good == used else np.append(offs, good)
        if good < used:
            self._pad(good, used)
        # the appender checks that the records at these offsets tile the bytes used, and counts them; their
        # headers, checked by the walk, it reads again only where a pad follows them
        app.finish_extent(self.ext, used, len(offsets), offsets=offsets, trim=True,
                          checked=h if good == used else None)
        ids = self.table.entries["region_id"].astype(np.int64)
        order = self.table.commit_order  # the rows in region-id order
        kinds = h["type"]
        out, i0, start = [], 0, 0
        for ci in np.flatnonzero(kinds == fmt.REC_COMMIT).tolist():
            pos = int(offs[ci])
            try:
                info = app.adopt_commit(int(h["epoch"][ci]), self.ext.lsn + pos)
            except BaseException:
                self._pad(start, used)
                raise
            batches = h[i0:ci]  # the epoch's page batches (`_walk`: nothing else comes before its commit)
            rows = order[np.searchsorted(ids, batches["region_id"].astype(np.int64), sorter=order)]
            pages = np.bincount(rows, weights=batches["count"], minlength=len(ids)).astype(np.int64)
            out.append((int(h["epoch"][ci]), self.ext.lsn + start, self.ext.lsn + pos, pages,
                        int(batches["length"].sum())))
            self.digests = info.digests
            i0, start = ci + 1, pos + int(h["length"][ci])
        if said > used:  # the cause, whatever the walk found within the extent
            raise SessionError(f"the arena's words say {said} bytes were written into its extent of {used}: "
                               f"its epochs up to lsn 0x{self.ext.lsn + good:x} are taken on, the rest padded over",
                               where=f"segment {self.ext.segment} @ {self.ext.offset:#x}")
        if good < used:
            raise SessionError(f"the arena holds no whole record or commit after lsn 0x{self.ext.lsn + good:x}: "
                               f"its last {used - good} bytes are padded over, no epoch of them taken on",
                               where=f"segment {self.ext.segment} @ {self.ext.offset + good:#x}")
        return out

    def _walk(self, used: int) -> tuple[np.ndarray, np.ndarray, int]:
        """(offsets, headers, end) of the records up to the end of the last
        commit before any header that is not a record an epoch here writes
        (one the appender would refuse, another type, a region not in the
        table): the offsets found by their lengths, then every header checked
        at once (its CRC, reserved bytes, LSN, salt, type and region), as the
        appender checks a producer's records (`finish_extent` with offsets)."""
        view = self.ext.view
        # one call of the helper for an arena's thousands of records, their headers copied as it meets them
        offs, rows = pagecrc.walk_lengths(view, used, headers=True)
        h, ok = fmt.record_headers_at(view, offs, self.ext.lsn, self.ext.salt, rows=rows)
        kinds = h["type"]  # the whole byte (R-T1): an epoch here writes page batches and commits only
        ours = np.isin(h["region_id"], self.table.entries["region_id"])
        ok &= np.where(kinds == fmt.REC_PAGE_BATCH, ours, kinds == fmt.REC_COMMIT)
        bad = np.flatnonzero(~ok)
        n = int(bad[0]) if bad.size else len(offs)
        commits = np.flatnonzero(kinds[:n] == fmt.REC_COMMIT)
        upto = int(commits[-1]) + 1 if commits.size else 0
        good = int(offs[upto - 1] + h["length"][upto - 1]) if upto else 0
        return offs[:upto], h[:upto], good

    def _pad(self, start: int, end: int) -> None:
        """One pad record over [start, end) of the arena: what it covered is no record."""
        if end > start:
            fmt.encode_pad_header_into(fmt.record_header_bytes(self.ext.view, start), length=end - start,
                                       lsn=self.ext.lsn + start, epoch=0, salt=self.ext.salt)
