"""Open + plan time of a file log holding a base epoch and a small delta
epoch, opened with every page CRC checked (a Session's open before this
change), with only the last one-sync commit's pages checked (a Session's open
now) and read-only without page checks (bench recover's open).  With `full`
the delta epoch is left out, so the last commit holds every page (a first
checkpoint, or what bench recover writes): then "last" checks them all.
Usage: python3 scripts/open_paths_probe.py [DIR] [GiB] [full]   (default /dev/shm, 2)"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from concordia.devmem import open_backend
from concordia.wal import Log
from concordia.wal.planner import plan


def main(folder: str = "/dev/shm", gib: int = 2, full: bool = False) -> None:
    path = os.path.join(folder, f"concordia-open-paths-{os.getpid()}.log")
    pages = np.random.default_rng(0).integers(0, 255, (128, 65536), dtype=np.uint8)  # 8 MiB per batch
    batches = gib * 128
    try:
        log = Log.create(open_backend(f"file:{path}", size=(gib * 1024 + 64 * 10) << 20, create=True),
                         segment_size=64 << 20)
        rid = log.define_region("kv", np.uint8, (gib << 30,), 65536, "kv")
        for b in range(batches):
            log.appender.append_page_batch(1, rid, np.arange(128) + b * 128, pages)
        log.appender.commit(1, {})
        if not full:
            log.appender.append_page_batch(2, rid, np.arange(128), pages)  # a delta of 8 MiB
            log.appender.commit(2, {})
        log.close()
        for _ in range(2):
            for writable, check in ((True, True), (True, "last"), (False, False)):
                t0 = time.perf_counter()
                lg = Log.open(f"file:{path}", writable=writable, check_pages=check)
                t1 = time.perf_counter()
                plan(lg)
                t2 = time.perf_counter()
                lg.close()
                what = {True: "writable, every page checked", "last": "writable, last commit's pages",
                        False: "read-only, no page checked"}[check]
                print(f"{what:<31} "
                      f"open {t1 - t0:.3f} s  plan {t2 - t1:.3f} s  total {t2 - t0:.3f} s", flush=True)
    finally:
        if os.path.exists(path):
            os.unlink(path)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/dev/shm", int(sys.argv[2]) if len(sys.argv) > 2 else 2,
         len(sys.argv) > 3 and sys.argv[3] == "full")
