"""What taking a resident session's arena on costs the host: `Session.settle()`
after a few decode-like epochs, each writing a few pages of every region, and
inside it `Arena.adopt` (a component figure: the walk, the appender's checks,
each commit taken on).  On the CPU the epochs are the consumer thread's (the
device's EPOCH handler writes the same records); the arena swap of a GPU's step
trigger takes its arena on the same way (`DeviceEpochs.rotate`).
Usage: python3 scripts/arena_take_on_probe.py [OUT.json] [REGIONS] [EPOCHS] [ROUNDS] [REGION_KIB]
(defaults: no JSON, 173 regions (a Qwen3-0.6B's protected state with a LoRA on
q and v), 4 epochs an arena, 40 rounds, 1024 KiB a region; the log is 1 GiB,
or four times the state where that is more)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

import concordia
from concordia.checkpoint.arena import Arena


def main(out: str | None = None, regions: int = 173, epochs: int = 4, rounds: int = 40, region_kib: int = 1024) -> dict:
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 255, region_kib << 10, dtype=np.uint8) for _ in range(regions)]
    size = max(1 << 30, -(-4 * regions * (region_kib << 10) // (64 << 20)) * (64 << 20))
    adopt_s, settle_s, taken = [], [], []
    inner = Arena.adopt

    def adopt(self, app):
        t = time.perf_counter()
        try:
            return inner(self, app)
        finally:
            adopt_s.append(time.perf_counter() - t)

    Arena.adopt = adopt
    log = f"/dev/shm/concordia-take-on-{os.getpid()}"
    try:
        with concordia.Session(f"shm:{log}", size=size, executor="resident") as s:
            for i, a in enumerate(arrays):
                s.register(f"r{i}", a, page_bytes=4096)
            s.checkpoint()
            s.settle()
            for _ in range(rounds + 2):  # the first two unmeasured
                for _ in range(epochs):
                    for a in arrays:
                        a[rng.integers(0, a.size, 4)] += 1
                    s.checkpoint(wait=False)
                n = len(adopt_s)
                t = time.perf_counter()
                s.settle()
                settle_s.append(time.perf_counter() - t)
                taken.append(len(adopt_s) - n)
            via = sorted(s.runner.paths)
    finally:
        Arena.adopt = inner
        if os.path.exists(log):  # the probe's own log: none left behind
            os.unlink(log)
    settle_s, adopt_s = settle_s[2:], adopt_s[-sum(taken[2:]):] if sum(taken[2:]) else []
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    res = {"probe": "arena_take_on", "commit": head, "regions": regions, "region_kib": region_kib,
           "epochs_per_round": epochs,
           "rounds": rounds, "via": via, "arenas_taken_on": len(adopt_s),
           "settle_ms_median": statistics.median(settle_s) * 1e3 if settle_s else None,
           "adopt_ms_median": statistics.median(adopt_s) * 1e3 if adopt_s else None}
    print(f"{'commit':>8} {'regions':>8} {'epochs':>7} {'settle ms':>10} {'adopt ms':>9} {'arenas':>7}")
    nan = float("nan")
    print(f"{head:>8} {regions:>8} {epochs:>7} {res['settle_ms_median'] or nan:>10.3f} "
          f"{res['adopt_ms_median'] or nan:>9.3f} {len(adopt_s):>7}")
    if out:  # whole or not at all
        with open(out + ".tmp", "w") as f:
            json.dump(res, f, indent=1)
        os.replace(out + ".tmp", out)
    return res


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0] or None if args else None, *(int(x) for x in args[1:5]))
