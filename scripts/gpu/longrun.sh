#!/usr/bin/env bash
# A session that runs for 100,000 epochs against one 64 MiB shm log, with and
# without retention (bench longrun: numpy state of 4 MiB, one dirty page a
# checkpoint, on this host's CPU; the GPU is not used).  Each configuration is
# capped at LONGRUN_SECONDS (default 100) so the part stays under 4 minutes.
# Run from the repository root; results go to "$OUT" (longrun.json, longrun.png).
set -uo pipefail
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
rc=0
timeout -k 5 220 python3 -c "import sys; from concordia.tools.entry import concordia_wal; sys.argv[0] = 'concordia-wal'; concordia_wal()" \
  bench longrun --epochs "${LONGRUN_EPOCHS:-100000}" --noretain-epochs 20000 --seconds "${LONGRUN_SECONDS:-100}" \
  --json --out "$OUT/longrun.json" --force --plot "$OUT/longrun.png" > /dev/null || rc=1
python3 -c "
import json; d=json.load(open('$OUT/longrun.json'))
for c in d['configs'].values():
    r = c['recovery_s_by_epoch']
    print(c['config'], c['epochs'], 'epochs; ckpt median', round(c['ckpt_ms_median'], 3), 'ms p99', round(c['ckpt_ms_p99'], 3),
          'ms; recovery first', round(r[0][1], 4), 's last', round(r[-1][1], 4), 's; log full', c['log_full'])
print('p99 during compaction', d.get('during_compaction'), 'ms, without', d.get('without'), 'ms')
for k, v in d['configs'].get('retain', {}).get('during_compaction', {}).get('by_hook', {}).items():
    print('  hook', k, v['checkpoints'], 'checkpoints: median', round(v['ckpt_ms_median'], 3), 'ms p99', round(v['ckpt_ms_p99'], 3), 'ms')
" || rc=1
exit $rc
