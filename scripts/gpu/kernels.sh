#!/usr/bin/env bash
# GPU kernels on the H200: the gpu-marked tests (records byte-identical to the
# numpy twins, CRC32C equal to the crc32c package, bit-exact scatter, KV
# scanner, stage_delta, the Session's device staging), then the checkpoint
# benchmark sized to finish in about two minutes (CHECKPOINT_PARTS=e2e,... runs
# only the parts named).
# Run from the repo root with $OUT set; writes $OUT/kernels-tests.txt,
# $OUT/checkpoint.json and $OUT/checkpoint.png.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
export CUDA_MODULE_LOADING=EAGER
status=0
[ "${KERNELS_TESTS:-1}" = 0 ] || timeout -k 5 120 python3 -m pytest tests/gpu_kernels tests/session/test_gpu_staging.py -m gpu -q -p no:cacheprovider \
  2>&1 | tee "$OUT/kernels-tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
# shellcheck disable=SC2086  # CHECKPOINT_ARGS: extra options, split on purpose
timeout -k 5 150 python3 -c "import sys; from concordia.tools.entry import concordia_wal; sys.argv[0] = 'concordia-wal'; concordia_wal()" bench checkpoint --json --out "$OUT/checkpoint.json" --force \
  --plot "$OUT/checkpoint.png" --reps 10 --parts "${CHECKPOINT_PARTS:-detect,stage,e2e,kv}" ${CHECKPOINT_ARGS:-} \
  >/dev/null 2>"$OUT/checkpoint.err"
rc=$?
cat "$OUT/checkpoint.err"
[ $rc -eq 0 ] || status=1
python3 - "$OUT/checkpoint.json" <<'PY' || true
import json, sys
doc = json.load(open(sys.argv[1]))
print("device:", doc["device"])
for k, v in doc["summary"].items():
    print(f"  {k}: {v:.3g}" if isinstance(v, float) else f"  {k}: {v}")
for r in doc.get("e2e", []):
    kernel = lambda d: f"kernel {r[f'detect_kernel_s_{d}'] * 1e3:.3f}, " if f"detect_kernel_s_{d}" in r else ""
    cells = [f"{d} {r[f'gpu_checkpoint_s_{d}'] * 1e3:.3f} ms ({kernel(d)}"
             f"reads {r[f'device_reads_{d}']}) {r[f'speedup_{d}']:.0f}x" if f"speedup_{d}" in r
             else f"{d} {r.get(f'session_error_{d}')}" for d in ("shadow", "fingerprint", "stores")]
    print(f"  e2e {r['region_bytes'] >> 20} MiB host {r['host_scan_checkpoint_s'] * 1e3:.1f} ms | " + " | ".join(cells))
PY
exit $status
