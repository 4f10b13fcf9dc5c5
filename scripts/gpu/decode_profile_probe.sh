#!/usr/bin/env bash
# Where the decode-shaped checkpoint's time goes on the H200 (issue 32's
# <= 1.0 ms goal): `bench checkpoint --parts decode` with its phase medians
# (detect, stage, commit, other; a row with retention off), then the same
# bench under cProfile, its top functions by own time and by cumulative time
# (DECODE_PROFILE=0 leaves the profile out).
# Writes $OUT/checkpoint-decode.json and $OUT/decode-profile.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
wal=(python3 -c "import sys; from concordia.tools.entry import concordia_wal; sys.argv[0] = 'concordia-wal'; concordia_wal()")
status=0
"${wal[@]}" bench checkpoint --parts decode --reps 20 --json --out "$OUT/checkpoint-decode.json" --force \
  > /dev/null || status=1
python3 - "$OUT/checkpoint-decode.json" <<'PY' || status=1
import json, sys
d = json.load(open(sys.argv[1]))["decode_shaped"]
for k, v in d.items():
    if "ms" in k or "bytes" in k or "pages" in k or "staging" in k or "retention" in k:
        print(k, round(v, 3) if isinstance(v, float) else v)
PY
if [ "${DECODE_PROFILE:-1}" != 0 ]; then  # DECODE_PROFILE=0: the figures alone
  python3 scripts/gpu/profile_wal.py "$OUT/decode-profile.txt" -- bench checkpoint --parts decode --reps 10 \
    --out /tmp/prof.json --force || status=1
fi
exit $status
