"""A primary for the standby tests: checkpoints EPOCHS epochs of a known state
into LOG, optionally keeps a heartbeat and leaves an uncommitted tail, prints
"ready PID" and waits to be killed.

    python -m tests.standby.primary LOG EPOCHS [--heartbeat SECONDS] [--tail]
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

SIZE = 16 << 20
SEGMENT = 2 << 20


def state(epoch: int) -> dict:
    """The arrays as of `epoch` (every epoch changes a few pages of each)."""
    kv = np.arange(64 * 1024, dtype=np.float32)
    table = np.zeros((64, 64), np.int32)
    for e in range(1, epoch + 1):
        kv[(e * 4099) % kv.size] = -e
        kv[-1] = e
        table[e % 64, :] = e
    return {"kv": kv, "table": table}


def write(spec: str, epochs: int, tail: bool = False):
    """A Session that has committed `epochs` epochs (left open)."""
    from concordia import Session

    s = Session(spec, size=SIZE, segment_size=SEGMENT, overwrite=True)
    st = state(0)
    s.register("kv", st["kv"], kind="kv", page_bytes=4096)
    s.register("table", st["table"], page_bytes=4096)
    for e in range(1, epochs + 1):
        new = state(e)
        for k in st:
            st[k][...] = new[k]
        s.checkpoint()
    if tail:   # records of a next epoch that never commits
        st["kv"][:] = 12345
        rid = s.log.regions["kv"].id
        s.log.appender.append_page_batch(epochs + 1, rid, np.arange(4, dtype=np.uint32),
                                         st["kv"].view(np.uint8)[:4 * 4096].reshape(4, 4096))
        s.log.appender.sync()
    return s


def main(argv):
    spec, epochs = argv[0], int(argv[1])
    hb_s = float(argv[argv.index("--heartbeat") + 1]) if "--heartbeat" in argv else None
    s = write(spec, epochs, tail="--tail" in argv)
    hb = None
    if hb_s:
        from concordia.standby import Heartbeat

        hb = Heartbeat(s.log, period_s=hb_s).start()
    print(f"ready {os.getpid()}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1:])
