#!/usr/bin/env bash
# Why a read ahead beside a model's build runs slower than the same read alone
# (issue 30, ctx 32k on an H100: the prefetch thread's open took 9.2 s beside
# the build against 0.8 s alone): scripts/gpu/read_ahead_probe.py contention,
# a StaticCache of CONTENTION_CTX tokens (default 32768), the read ahead also
# under each GIL switch interval of CONTENTION_INTERVALS (default 0.001,0.0002;
# empty: the default interval only).
# Run from the repo root with $OUT set; writes $OUT/read_ahead_contention.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
export HF_HUB_OFFLINE=1
CTX=${CONTENTION_CTX:-32768} INTERVALS=${CONTENTION_INTERVALS-0.001,0.0002} \
  timeout -k 5 "${CONTENTION_S:-280}" python3 scripts/gpu/read_ahead_probe.py contention "$OUT/read_ahead_contention.txt"
