#!/usr/bin/env bash
# Where one EPOCH task's time goes (issue 31's latency_ms), and which path
# suits which table: for 1, 64 and 1024 regions of 16 pages, the EPOCH task's
# median round trip on each path (one block, cx_epoch_small; the driver's
# launches), the same with each phase stamped on the device
# (device_epoch.STAMPS; on the driver's path each stamp adds a one-thread
# launch), and Session.checkpoint() on the host path, through the functions
# `bench executor-session` measures with.  Diagnostic only: the figures a
# claim rests on come from the bench.  Writes $OUT/epoch-latency.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
export CUDA_MODULE_LOADING=EAGER
timeout -k 5 "${EPOCH_LATENCY_S:-200}" python3 - "$OUT/epoch-latency.json" <<'PY'
import json, os, sys
import cupy as cp
from concordia.tools.bench import executor_session as b
from concordia.tools.bench.files import Scratch

out = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode()}
reps = int(os.environ.get("EPOCH_LATENCY_REPS", "30"))
with Scratch("epoch-latency") as scratch:
    log = scratch.log("session", "shm")
    for n in (1, 64, 1024):
        row = {"host_ms": b._checkpoint_ms(scratch, log, n, reps, cp, "host", "auto")["ckpt_ms"]}
        for path, small in (("small", 1 << 40), ("driver", 0)):
            row[path + "_ms"] = b._device_epoch_ms(cp, log, n, reps, scratch, small_pages=small)
            row[path + "_phases_us"] = b._device_epoch_ms(cp, log, n, reps, scratch, stamps=True, small_pages=small)
        out[str(n)] = row
        print(n, json.dumps(row), flush=True)
        with open(sys.argv[1] + ".part", "w") as f:  # whole or not there: a kill leaves no half file
            json.dump(out, f, indent=1)
        os.replace(sys.argv[1] + ".part", sys.argv[1])
PY
