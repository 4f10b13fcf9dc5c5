#!/usr/bin/env bash
# The region table's checkpoint on the H200: the gpu-marked tests of the table
# pass (device records byte-identical to the numpy twin for 1, 16 and 1,024
# regions of mixed detectors and page sizes), of the Session's device staging
# and of the page kernels (which read through common.cuh's shared page code), then `bench checkpoint` with the regions sweep (1 to
# 1,024 regions sharing 1 GiB, one dirty page each), the decode-shaped step
# and one dirty page end to end against host scanning (256 MiB to 8 GiB).
# Run from the repo root with $OUT set (about 4 minutes: PART_LIMIT_S=300);
# writes $OUT/checkpoint-table-tests.txt, $OUT/checkpoint.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
export CUDA_MODULE_LOADING=EAGER
status=0
timeout -k 5 130 python3 -m pytest tests/session/test_gpu_table.py tests/session/test_gpu_staging.py tests/gpu_kernels/test_gpu.py \
  -m gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/checkpoint-table-tests.txt" | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
# shellcheck disable=SC2086  # TABLE_BENCH_ARGS: extra options, split on purpose
timeout -k 5 150 python3 -c "import sys; from concordia.tools.entry import concordia_wal; sys.argv[0] = 'concordia-wal'; concordia_wal()" bench checkpoint --json \
  --out "$OUT/checkpoint.json" --force --reps 10 --parts "${TABLE_PARTS:-regions,decode,e2e}" \
  --e2e-sizes "${TABLE_E2E_SIZES:-256M,1G,4G,8G}" ${TABLE_BENCH_ARGS:-} >/dev/null 2>"$OUT/checkpoint.err"
rc=$?
cat "$OUT/checkpoint.err"
[ $rc -eq 0 ] || status=1
python3 - "$OUT/checkpoint.json" <<'PY' || status=1
import json, sys
doc = json.load(open(sys.argv[1]))
print("device:", doc["device"])
c = doc.get("regions_ceilings") or {}
if c:
    print(f"ceilings: HBM read {c['hbm_read_Bps'] / 1e9:.0f} GB/s, device to host {c['d2h_Bps'] / 1e9:.1f} GB/s, "
          f"host scan of {c['host_scan_bytes'] >> 20} MiB {c['host_scan_s'] * 1e3:.1f} ms")
goal = {1: 0.35, 1024: 1.0}
for r in doc.get("regions", []):
    if "ckpt_ms" not in r:
        print(f"regions {r['regions']}: {r.get('error')}")
        continue
    g = goal.get(r["regions"])
    print(f"regions {r['regions']:>5}: {r['ckpt_ms']:.3f} ms (min {r['ckpt_ms_min']:.3f}, floor {r['floor_ms']:.3f}, "
          f"reads {r['device_reads']}, table {r['table_pass']})" + (f"  goal <= {g} ms: {r['ckpt_ms'] <= g}" if g else ""))
d = doc.get("decode_shaped") or {}
for p, what in (("", "KV by positions"), ("fingerprint_", "KV by fingerprints")):
    if p + "ckpt_ms" in d:
        print(f"decode-shaped, {what}: {d[p + 'ckpt_ms']:.3f} ms adapters updated, "
              f"{d.get(p + 'ckpt_ms_adapters_clean', float('nan')):.3f} ms clean ({d[p + 'dirty_pages']} pages, "
              f"{d[p + 'log_bytes'] / 2**20:.2f} MiB logged)" + (f"  goal <= 1.0 ms: {d['ckpt_ms'] <= 1.0}" if not p else ""))
    elif d:
        print(f"decode-shaped, {what}:", d.get(p + "error"))
for r in doc.get("e2e", []):
    if "speedup" in r:
        print(f"e2e {r['region_bytes'] >> 20} MiB: {r['gpu_checkpoint_s'] * 1e3:.3f} ms ({r['detector']}), host scan "
              f"{r['host_scan_checkpoint_s'] * 1e3:.1f} ms, {r['speedup']:.0f}x  goal >= 300x: {r['speedup'] >= 300}")
PY
exit $status
