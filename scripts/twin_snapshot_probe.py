"""How long the CPU twin's trigger holds a step for its epoch, with the host
snapshot (the step goes once the epoch is read; it crosses into the arena
after) and without it (`ResidentExecutor.snapshot_max = 0`: the step holds
until the commit is in).  A producer rewrites DIRTY_MIB of a region every
step (every page of it dirty), then works STEP_MS more (a sleep: the GIL let
go, as while a step waits for its device), and marks the step; the trigger
takes an epoch at every step into the session's arena on shm.  The two ways alternate,
ROUNDS runs each, STEPS steps a run; prints each way's median hold (ms a
step) and the ratio.  A component figure, on the host: the product's trigger
on a GPU is the persistent kernel's (`bench model --parts decode`).
Usage: python3 scripts/twin_snapshot_probe.py [DIRTY_MIB] [STEPS] [ROUNDS] [STEP_MS]"""

from __future__ import annotations

import os
import statistics
import sys
import time
import uuid

import numpy as np

from concordia import Session
from concordia.policy import Policy

dirty_mib = int(sys.argv[1]) if len(sys.argv) > 1 else 4
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 100
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
step_ms = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0


def run(snapshot: bool) -> tuple[float, int]:
    name = f"twin-snapshot-probe-{uuid.uuid4().hex[:10]}"
    try:
        with Session(f"shm:{name}", size=(2 * dirty_mib * steps + 256) << 20, segment_size=64 << 20, executor="resident",
                     policy=Policy(retain=False)) as s:
            a = np.zeros(dirty_mib << 20, np.uint8)
            s.register("a", a, detect="shadow", page_bytes=4096)
            s.checkpoint()
            if not snapshot:
                s.resident.snapshot_max = 0
            tr = s.resident.step_trigger(1)
            for k in range(1, steps + 1):
                a[:] = k % 251   # every page of the region dirty
                if step_ms:
                    time.sleep(step_ms / 1e3)
                tr.step()
            n, held_s, _ = tr.held()
            snapped = tr.snapshot_epochs
            tr.disarm()
            s.settle()
            assert s.log.verify()["corrupt"] == 0
    finally:
        if os.path.exists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")
    return held_s / n * 1e3, snapped


took = {True: [], False: []}
snapped = {True: [], False: []}
for _ in range(rounds):
    for way in (True, False):
        ms, k = run(way)
        took[way].append(ms)
        snapped[way].append(k)
for way in (True, False):
    print(f"{'snapshot' if way else 'no snapshot':>12}: hold {statistics.median(took[way]):.3f} ms a step "
          f"(runs {', '.join(f'{x:.3f}' for x in took[way])}), epochs through the snapshot {snapped[way]}")
print(f"hold with the snapshot / without: {statistics.median(took[True]) / statistics.median(took[False]):.3f} "
      f"({dirty_mib} MiB dirty a step, {step_ms:g} ms more work a step, {steps} steps a run, {rounds} runs each, "
      "alternating)")
