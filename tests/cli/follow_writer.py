"""The writer of the follower test, in a process of its own:

    python -m tests.cli.follow_writer LOG EPOCHS FOLLOWER_OUT [READY]

Appends EPOCHS epochs (one page batch of PAGES pages and a commit each, about
an eighth of a 1 MiB segment, so a roll over every few epochs) to the log the
test made.  The log is far smaller than what is written: when fewer than
three segments are free, the segments wholly below the last record the
follower has printed (the last line of FOLLOWER_OUT) are reclaimed, up to the
oldest segment that begins with an epoch's first record (whole epochs only, as
compaction frees them, and as few as that allows), and the writer waits for
the follower when there are none.  Prints one JSON line of
counts at the end.  READY: a file made once the log is open for writing
(the open cuts the log and writes its region descriptor again, so a
follower started before it would see that cut and show the descriptor twice)."""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from concordia.wal import Log
from concordia.wal import format as F

PAGES = 32
PAGE = 4096


def follower_lsn(path: str) -> int:
    """LSN of the last record the follower printed (-1 before the first)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 8192))
            tail = f.read()
    except FileNotFoundError:
        return -1
    lines = tail.split(b"\n")[:-1]  # the last piece has no newline yet (or is empty)
    for line in reversed(lines):
        try:
            return int(json.loads(line)["lsn"])
        except (ValueError, KeyError):
            continue
    return -1


def main(log_name: str, epochs: int, out: str, ready: str | None = None) -> None:
    log = Log.open(log_name, writable=True)
    if ready:
        open(ready, "w").close()
    app, vol = log.appender, log.volume
    info = log.region("r")
    rid = info.id
    descriptor = F.encode_region_body(info.name, info.dtype, info.shape, info.page_bytes, info.kind)
    desc_lsn = next(r.lsn for r in log.records() if r.kind == F.REC_REGION)
    pages = np.random.default_rng(0).integers(0, 256, (2 * PAGES, PAGE), dtype=np.uint8)
    reclaimed = waits = 0
    clean: list = []  # base LSNs of segments that begin with an epoch's first record
    for e in range(1, epochs + 1):
        while sum(s.state == F.SEG_FREE for s in vol.superblock.segments) < 3:
            # only whole epochs go: below a segment no epoch runs into (a commit whose
            # records were reclaimed would count records the log no longer holds, V-C4)
            # The oldest such segment only, so that every reclaim frees the fewest segments
            # whatever the follower's pace: the log holds as many segments at the end of every
            # run, not as many as a race between the two processes left.
            seen = follower_lsn(out)
            below = [b for b in clean if vol.superblock.oldest_lsn < b <= seen]
            freed = vol.reclaim_segments(below[0]) if below else []
            clean = [b for b in clean if b > vol.superblock.oldest_lsn]
            reclaimed += len(freed)
            if not freed:
                waits += 1
                time.sleep(0.002)
            elif vol.superblock.oldest_lsn > desc_lsn:
                # the region's descriptor went with the reclaimed segments: write it again
                # (as compaction does), so that the log still names what its batches hold
                desc_lsn = app.append_record(type=F.REC_REGION, epoch=0, body=descriptor, region_id=rid,
                                             page_bytes=info.page_bytes)
        lo = e % PAGES
        lsn = app.append_page_batch(e, rid, np.arange(lo, lo + PAGES, dtype=np.uint32), pages[lo:lo + PAGES])
        if lsn == app.seg.base_lsn + F.SEGMENT_HEADER_SIZE:
            clean.append(app.seg.base_lsn)
        app.commit(e, digests={rid: 0})
        if e % 4 == 0:
            time.sleep(0.0005)  # let the follower catch up with the head now and then
    rolls = vol.superblock.next_segment_seq - 1
    log.close()
    print(json.dumps({"epochs": epochs, "segments_taken": rolls, "reclaimed": reclaimed, "waits": waits}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None)
