#!/usr/bin/env bash
# Session on the GPU: the gpu-marked session tests (device staging included),
# the demo on the device, and bench recover (sizes from RECOVER_SIZES, default
# 1,10,40 GiB) with whatever time is left of SESSION_BUDGET_S (bench recover
# writes its JSON after every row, so a run cut short keeps what it measured).
# Run from the repository root; results go to "$OUT" (session-tests.xml,
# demo.json, recover.json, recover.png).
# Runs with the driver's default (lazy) module loading, as a user's process
# would: loading eagerly, a fresh process's first GEMM loads every cuBLAS
# kernel (2.2-2.7 s on the H200, docs/results/first-step-probe.json), which the
# demo's recovery timeline then shows as reintegration time.
set -uo pipefail
unset CUDA_MODULE_LOADING
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
start=$(date +%s)
budget=${SESSION_BUDGET_S:-300}
rc=0
# test_gpu_staging.py: checkpoints staged on the device (zero copy into a
# registered shm mapping, pinned ring for file logs) byte-identical to numpy's;
# test_restore_gpu.py: the device restore pipeline equal to the host applier
timeout 150 python3 -m pytest ${SESSION_TESTS:-tests/session/test_gpu.py tests/session/test_gpu_staging.py tests/session/test_restore_gpu.py} -q -m gpu \
  -p no:cacheprovider --junitxml="$OUT/session-tests.xml" 2>&1 | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
[ -n "${SESSION_SKIP_DEMO:-}" ] || timeout 60 python3 -c "import sys; from concordia.tools.entry import concordia; sys.argv[0] = 'concordia'; concordia()" demo --device gpu --steps 160 --json \
  --log "file:$OUT/demo-work/demo.log" > "$OUT/demo.json" || rc=1
rm -rf "$OUT/demo-work"
[ -n "${SESSION_SKIP_DEMO:-}" ] || python3 -c "import json; d=json.load(open('$OUT/demo.json')); print('demo identical:', d['identical'], 'timeline ms:', [(p['phase'], round(p['ms'],1)) for p in d['timeline']], 'warm ms:', round(d['recovery'].get('warm_ms', 0)), 'waited', round(d['recovery'].get('warm_wait_ms', 0)))" || rc=1
left=$(( budget - ($(date +%s) - start) - 5 ))
echo "bench recover: ${left}s left"
timeout -k 5 "$left" python3 -c "import sys; from concordia.tools.entry import concordia_wal; sys.argv[0] = 'concordia-wal'; concordia_wal()" bench recover --sizes "${RECOVER_SIZES:-1,10,40}" \
  ${RECOVER_ARGS:-} --json --plot --out "$OUT/recover.json" --force > /dev/null || rc=1
python3 -c "
import json; d=json.load(open('$OUT/recover.json'))
print('ceiling', round(d['ceiling']['GBps'],1), 'GB/s')
for r in d['rows']:
    if 'error' in r: print(r['tier'], round(r['GiB'],2), 'failed:', r['error']); continue
    print(r['tier'], round(r['GiB'],2), 'GiB total', round(r['total_s'],3), 's restore', round(r['restore_s'],3), round(100*r['ratio_to_ceiling']), '% of ceiling; open', round(r['open_s'],3), 'plan', round(r['plan_s'],3), 'host read', round(r['host_read_GBps'],1), 'GB/s waits fill/copy', r['fill_wait_s'], r['copy_wait_s'], 'via', r['via'], 'pin path', r.get('pin_restore_s'), r.get('pin_GBps'), 'reg wait', r.get('pin_register_wait_s'), 'pins kept', r.get('pin_pins_kept'), 'pin stop', r.get('pin_pin_stop_s'), 'refused', r.get('pin_pin_refused'), 'registered', r.get('registered_restore_s'), r.get('registered_GBps'), 'Session.recover', r.get('session_total_s'), 'torch.load', r['torch_load_s'])
" || rc=1
df -h /tmp /dev/shm | tail -2
exit $rc
