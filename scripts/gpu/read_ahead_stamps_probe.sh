#!/usr/bin/env bash
# Where a fresh process's read-ahead recovery spends its time, unprofiled (issue
# 30's ctx-512 figure): scripts/gpu/read_ahead_probe.py stamps, FRESH_REPS
# (default 2) children recovering as `bench model`'s fresh_read_ahead child
# does, with the recovery's functions clocked (read_ahead_stamps.py), a
# StaticCache of READ_AHEAD_CTX tokens (default 512).
# Run from the repo root with $OUT set; writes $OUT/read_ahead_stamps.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
export HF_HUB_OFFLINE=1
CTX=${READ_AHEAD_CTX:-512} timeout -k 5 "${READ_AHEAD_STAMPS_S:-150}" \
  python3 scripts/gpu/read_ahead_probe.py stamps "$OUT/read_ahead_stamps.txt"
