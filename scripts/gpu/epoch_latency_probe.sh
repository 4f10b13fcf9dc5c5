#!/usr/bin/env bash
# Where one EPOCH task's time goes (issue 31's latency_ms): for 1 and 1024
# regions, the EPOCH task's median round trip, the same with each phase
# stamped on the device (device_epoch.STAMPS; every stamp adds a one-thread
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
    for n in (1, 1024):
        row = {"resident_ms": b._device_epoch_ms(cp, log, n, reps, scratch),
               "phases_us": b._device_epoch_ms(cp, log, n, reps, scratch, stamps=True),
               "host_ms": b._checkpoint_ms(scratch, log, n, reps, cp, "host", "auto")["ckpt_ms"]}
        out[str(n)] = row
        print(n, json.dumps(row), flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
PY
