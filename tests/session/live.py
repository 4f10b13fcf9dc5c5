"""Child processes of the live-log tests: a writer that commits epoch after
epoch of a state any process can recompute, and readers that recover from the
same log while it writes.

    python -m tests.session.live writer LOG STOPFILE     # prints "epoch N" after each commit
    python -m tests.session.live reader LOG COUNT MODE   # MODE: create-false | readonly

State at epoch e: PAGES pages of PAGE bytes, zero at first; epoch e rewrites
page e % PAGES with the bytes of `pattern(e)`.  A reader prints one line per
recovery: "ok EPOCH" when the recovered bytes are exactly `state(EPOCH)`,
"bad EPOCH ..." otherwise.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

PAGES = 64
PAGE = 4096
LOG_SIZE = 64 << 20
SEGMENT = 1 << 20


def pattern(e: int) -> np.ndarray:
    return np.random.default_rng(e).integers(0, 256, PAGE, dtype=np.uint8)


def state(e: int) -> np.ndarray:
    out = np.zeros((PAGES, PAGE), np.uint8)
    for p in range(PAGES):
        last = e - ((e - p) % PAGES)  # the newest epoch <= e that wrote page p
        if last >= 1:
            out[p] = pattern(last)
    return out.reshape(-1)


def writer(log: str, stop: str) -> None:
    from concordia import Session

    region = np.zeros(PAGES * PAGE, np.uint8)
    with Session(log, size=LOG_SIZE, segment_size=SEGMENT) as s:
        s.register("r", region, page_bytes=PAGE)
        e = 0
        while not os.path.exists(stop):
            e += 1
            p = e % PAGES
            region[p * PAGE:(p + 1) * PAGE] = pattern(e)
            assert s.checkpoint().epoch == e
            print(f"epoch {e}", flush=True)
            if s.log.volume.live_segments() and len(s.log.volume.live_segments()) > 48:
                break  # the log is nearly full: the readers have had their overlap
            time.sleep(0.002)
        print("done", flush=True)


def reader(log: str, count: int, mode: str) -> None:
    """`count` recoveries, each of a later epoch than the one before: the
    reader waits (up to a minute) for the writer to commit past what it last
    saw, so that the recoveries see the log grow however the machine is loaded."""
    from concordia import Session
    from concordia.wal import Log

    prev = 0
    for _ in range(count):
        deadline = time.monotonic() + 60
        while prev:
            # beside the writer (live: a record in flight, seen half written, is read again, not called damage)
            with Log.open(log, writable=False, live=True) as lg:
                if (lg.last_committed_epoch or 0) > prev:
                    break
            if time.monotonic() > deadline:
                print(f"stalled: no epoch after {prev} within a minute", flush=True)
                return
            time.sleep(0.002)
        if mode == "readonly":
            s = Session(log, create=False, readonly=True)
        else:
            s = Session(log, create=False)
        with s:
            got = s.recover()["r"]
            e = s.last_recovery.epoch
        want = state(e)
        prev = e
        if got.tobytes() == want.tobytes():
            print(f"ok {e}", flush=True)
        else:
            bad = int(np.flatnonzero(got != want)[0])
            print(f"bad {e} first differing byte {bad}", flush=True)


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "writer":
        writer(sys.argv[2], sys.argv[3])
    else:
        reader(sys.argv[2], int(sys.argv[3]), sys.argv[4])
