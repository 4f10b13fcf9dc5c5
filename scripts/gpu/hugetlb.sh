#!/usr/bin/env bash
# The hugetlb tier and the warm standby on the H200 machine, as root: reserves
# huge pages and mounts hugetlbfs (scripts/hugepages.sh), runs the gpu tests of
# the tier, `bench recover` on hugetlb logs (sizes HUGETLB_SIZES, default
# 1,10,40 GiB; the ceiling, pinned H2D, measured in the same run) and
# `bench standby` (HUGETLB_STANDBY_GIB, default 10 GiB of KV), then puts the
# huge page setting back.  Writes $OUT/hugetlb-tests.xml,
# $OUT/recover-hugetlb.json (rows "tier": "hugetlb" for docs/results/recover.json)
# and $OUT/standby.json.  About 4 minutes; run with PART_LIMIT_S=300:
#   PART_LIMIT_S=300 bash scripts/gpu_suite.sh hugetlb
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
unset CUDA_MODULE_LOADING
start=$(date +%s)
sizes=${HUGETLB_SIZES:-1,10,40}
# the largest log (40 GiB of KV in 1 GiB segments: 47 GiB) and nothing else at a time
gib=${HUGETLB_GIB:-48}
mnt=/mnt/concordia-huge
if ! bash scripts/hugepages.sh setup "$gib" "$mnt" >/dev/null; then
  echo "hugetlb: $gib GiB of huge pages not to be had; trying 16 GiB and sizes 1,10"
  gib=16 sizes=1,10
  bash scripts/hugepages.sh setup "$gib" "$mnt" >/dev/null || { echo "hugetlb: no huge pages"; exit 2; }
fi
trap 'bash scripts/hugepages.sh teardown "$mnt"' EXIT
export CONCORDIA_HUGETLB_DIR=$mnt
grep -i '^HugePages_' /proc/meminfo
rc=0
WAL=(python3 -c "import sys; from concordia.tools.entry import concordia_wal; sys.argv[0] = 'concordia-wal'; concordia_wal()")

timeout 90 python3 -m pytest tests/session/test_restore_hugetlb.py tests/devmem/test_conformance.py \
  tests/standby/test_standby.py -k "hugetlb or Hugetlb or gpu_standby" -q -p no:cacheprovider \
  --junitxml="$OUT/hugetlb-tests.xml" 2>&1 | tail -5
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1

# the standby first (about 40 s: the primary writes 10 GiB), then bench recover with
# what is left of 285 s (it writes its JSON after every row: a run cut short keeps them)
timeout -k 5 90 "${WAL[@]}" bench standby --gib "${HUGETLB_STANDBY_GIB:-10}" --tier hugetlb \
  --json --out "$OUT/standby.json" --force > /dev/null || rc=1
python3 -c "
import json; d=json.load(open('$OUT/standby.json'))
print('standby', round(d['GiB'],2), 'GiB', d['tier'], ': kill->decoding', round(d['kill_to_decoding_s'],3), 's (goal', d['goals']['kill_to_decoding_s'], ')',
      'detect', round(d['kill_to_detect_s'],3), 'isolate', round(d['isolate_s'],3), 'restore', round(d['restore_s'],3),
      round(d['restore_GBps'],1), 'GB/s', 'decode', round(d['first_decode_s'],3), 'via', d['restore'].get('via'), 'warm', {k: round(v,3) for k,v in d['warm'].items() if k.endswith('_s')})
" || rc=1

left=$(( 285 - ($(date +%s) - start) ))
echo "bench recover: ${left}s left"
timeout -k 5 "$left" "${WAL[@]}" bench recover --tiers hugetlb --sizes "$sizes" --no-torch \
  --registered-max-gib 10 --json --out "$OUT/recover-hugetlb.json" --force > /dev/null || rc=1
python3 -c "
import json; d=json.load(open('$OUT/recover-hugetlb.json'))
print('ceiling', round(d['ceiling']['GBps'],1), 'GB/s', d['ceiling']['what'])
for r in d['rows']:
    if 'error' in r: print(r['tier'], round(r['GiB'],2), 'failed:', r['error']); continue
    print(r['tier'], round(r['GiB'],2), 'GiB: total', round(r['total_s'],3), 's, restore', round(r['restore_s'],3), 's,',
          round(100*r['ratio_to_ceiling']), '% of ceiling via', r['via'], '| copied', r.get('copy_restore_s'), round(100*r.get('copy_ratio_to_ceiling', 0)),
          '% | registered', r.get('registered_restore_s'), 'reg', r.get('registered_register_s'), '| Session.recover', r.get('session_total_s'))
" || rc=1

exit $rc
