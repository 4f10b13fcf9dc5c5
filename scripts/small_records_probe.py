"""How a fresh process recovers a log of many small records (issue 30, the
every-step checkpoints of issue 32), on the host: REGIONS regions of 4 KiB
pages registered (KV of them 512 KiB, the rest 8 KiB), a base checkpoint,
then EPOCHS checkpoints that each write one page of every KV region and of 8
small ones (a decode step's new row).  A fresh process per round then opens
the log (`Session(create=False)`) and recovers it (`recover()`, the host
path); its open and recovery seconds, and the recovery's phases, are printed
as one JSON line per round and their medians at the end.
Usage: python3 scripts/small_records_probe.py [EPOCHS] [ROUNDS] [KV] [REGIONS]"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import numpy as np


def write(spec: str, epochs: int, kv: int, regions: int) -> dict:
    from concordia import Session

    big = {f"kv{i}": np.zeros((64, 8192), np.uint8) for i in range(kv)}
    small = {f"s{i}": np.zeros(8192, np.uint8) for i in range(regions - kv)}
    t0 = time.perf_counter()
    with Session(spec, create=True, overwrite=True, size=2 << 30) as s:
        for name, a in {**big, **small}.items():
            s.register(name, a, kind="kv", page_bytes=4096)
        s.checkpoint()
        for e in range(epochs):
            for a in big.values():
                a[e % 64, :256] = e % 250 + 1
            for a in list(small.values())[:8]:
                a[:16] = e % 256
            s.checkpoint()
    return {"epochs": epochs, "regions": regions, "write_s": time.perf_counter() - t0}


def read(spec: str) -> dict:
    from concordia import Session

    t0 = time.perf_counter()
    with Session(spec, create=False) as s:
        t1 = time.perf_counter()
        s.recover()
        t2 = time.perf_counter()
        phases = {k: round(v["s"], 4) for k, v in s.last_recovery.phases.items()}
    return {"open_s": t1 - t0, "recover_s": t2 - t1, "total_s": t2 - t0, "phases": phases}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--read":
        print(json.dumps(read(sys.argv[2])), flush=True)
        return
    epochs = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    kv = int(sys.argv[3]) if len(sys.argv) > 3 else 56
    regions = int(sys.argv[4]) if len(sys.argv) > 4 else 173
    from concordia.tools.bench.files import Scratch

    with Scratch("small-records") as scratch:   # the log goes, however the run ends
        spec = scratch.log("probe", "shm")
        print(json.dumps(write(spec, epochs, kv, regions)), flush=True)
        runs = []
        for _ in range(rounds):
            r = subprocess.run([sys.executable, __file__, "--read", spec], capture_output=True, text=True)
            if r.returncode != 0:   # the reader's own last line, not a traceback of this one
                err = [ln for ln in r.stderr.splitlines() if ln.strip()]
                sys.exit(f"small_records_probe: the reader failed: {err[-1] if err else f'exit {r.returncode}'}")
            runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
            print(json.dumps(runs[-1]), flush=True)
    print(json.dumps({k: round(statistics.median(r[k] for r in runs), 4)
                      for k in ("open_s", "recover_s", "total_s")} | {"median_of": rounds}))


if __name__ == "__main__":
    main()
