#!/usr/bin/env bash
# Why the restore's "pin" path (pieces of the log mapping pinned ahead of the
# copy engine) moved only 8-12 GB/s on the H200 machine while a mapping pinned
# whole moved 33-41: host-to-device copies from a 4 GiB shm mapping pinned in
# different ways, pinning and copying timed apart.  Writes $OUT/pin_probe.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
timeout -k 5 100 python3 scripts/pin_probe.py "$OUT/pin_probe.json"
