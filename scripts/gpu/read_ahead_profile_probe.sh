#!/usr/bin/env bash
# Where the host time of a read-ahead recovery goes (issue 30's ctx-512 figure,
# `concordia.prefetch`): scripts/gpu/read_ahead_probe.py profile, a StaticCache
# of READ_AHEAD_CTX tokens (default 512), REPS times (default 3).
# Run from the repo root with $OUT set; writes $OUT/read_ahead_profile.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
export HF_HUB_OFFLINE=1
CTX=${READ_AHEAD_CTX:-512} timeout -k 5 "${READ_AHEAD_PROFILE_S:-200}" \
  python3 scripts/gpu/read_ahead_probe.py profile "$OUT/read_ahead_profile.txt"
