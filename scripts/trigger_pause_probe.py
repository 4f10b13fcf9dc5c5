"""Why a resident session's device trigger stops taking epochs (issue 32):
`bench model --parts decode` on the given rows (default every_8_resident,
one measured round), with the arena route's `rotate` watched.  Prints each
row's trigger figures (epochs fired against the steps' due epochs) and every
distinct reason a rotation was refused, with how often and the first
traceback of each.  Runs the Qwen3-0.6B shape on CUDA, the tiny model on the CPU.
Usage: python3 scripts/trigger_pause_probe.py [ROWS] [STEPS]"""

from __future__ import annotations

import collections
import sys
import traceback

import concordia.tools.bench.model as bench
from concordia.checkpoint import device_epoch

rows = tuple((sys.argv[1] if len(sys.argv) > 1 else "every_8_resident").split(","))
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 128
refused: collections.Counter = collections.Counter()
first: dict = {}
engine_rotate = device_epoch.DeviceEpochs.rotate


def watched_engine_rotate(self):
    try:
        return engine_rotate(self)
    except BaseException as exc:
        key = f"{type(exc).__name__}: {str(exc).splitlines()[0][:240]}"
        refused[key] += 1
        first.setdefault(key, traceback.format_exc(limit=12))
        raise


device_epoch.DeviceEpochs.rotate = watched_engine_rotate
res = bench.probe_decode(rows, steps)
for r in res["decode"]:
    t = r["retention"].get("trigger")
    due = steps // r["every"] if r["every"] else 0
    print(f"every {r['every']} {r['executor']}: overhead {r['overhead']:.4f}, due {due}, trigger {t}")
print(f"refused rotations (both rounds): {sum(refused.values())}")
for key, n in refused.most_common():
    print(f"{n:6d}  {key}\n{first[key]}")
