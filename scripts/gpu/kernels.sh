#!/usr/bin/env bash
# GPU kernels on the H200: the gpu-marked tests (records byte-identical to the
# numpy twins, CRC32C equal to the crc32c package, bit-exact scatter, KV
# scanner), then the checkpoint benchmark sized to finish in about two minutes.
# Run from the repo root with $OUT set; writes $OUT/kernels-tests.txt,
# $OUT/checkpoint.json and $OUT/checkpoint.png.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
export CUDA_MODULE_LOADING=EAGER
status=0
timeout -k 5 100 python3 -m pytest tests/gpu_kernels -m gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/kernels-tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
timeout -k 5 150 python3 -c "from concordia.tools.wal_cli import main; main()" bench checkpoint --json --out "$OUT/checkpoint.json" \
  --plot "$OUT/checkpoint.png" --reps 10 >/dev/null 2>"$OUT/checkpoint.err"
rc=$?
cat "$OUT/checkpoint.err"
[ $rc -eq 0 ] || status=1
python3 - "$OUT/checkpoint.json" <<'PY' || true
import json, sys
doc = json.load(open(sys.argv[1]))
print("device:", doc["device"])
for k, v in doc["summary"].items():
    print(f"  {k}: {v:.3g}" if isinstance(v, float) else f"  {k}: {v}")
PY
exit $status
