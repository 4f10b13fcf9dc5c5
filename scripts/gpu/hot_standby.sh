#!/usr/bin/env bash
# Issue 30's hot standby on the H200, as root: the device mirror's GPU tests,
# then `bench standby --follow` (a primary checkpointing every step of
# HOT_STANDBY_GIB GiB of KV, default 10, for HOT_STANDBY_STEPS_S seconds under a
# warm standby and then under a hot one, on a hugetlb log; reports hot_vs_warm
# and the phases of each).  Reserves huge pages and mounts hugetlbfs
# (scripts/hugepages.sh), and puts the setting back.  Writes
# $OUT/hot-standby-tests.txt and $OUT/standby-follow.json.  Run with
#   PART_LIMIT_S_hot_standby=300 bash scripts/gpu_suite.sh hot_standby
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
unset CUDA_MODULE_LOADING
gib=${HOT_STANDBY_GIB:-10}
mnt=/mnt/concordia-huge
bash scripts/hugepages.sh setup "$(( 4 * ${gib%.*} + 12 ))" "$mnt" >/dev/null || { echo "hot_standby: no huge pages"; exit 2; }
trap 'bash scripts/hugepages.sh teardown "$mnt"' EXIT
export CONCORDIA_HUGETLB_DIR=$mnt
rc=0
WAL=(python3 -c "import sys; from concordia.tools.wal_cli import main; sys.argv[0] = 'concordia-wal'; main()")

timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs tests/standby/test_mirror.py \
  > "$OUT/hot-standby-tests.txt" 2>&1 || rc=1
tail -n 3 "$OUT/hot-standby-tests.txt"

timeout -k 5 240 "${WAL[@]}" bench standby --follow --gib "$gib" --tier hugetlb \
  --steps-s "${HOT_STANDBY_STEPS_S:-3}" --json --out "$OUT/standby-follow.json" --force > /dev/null || rc=1
python3 -c "
import json; d=json.load(open('$OUT/standby-follow.json'))
for k in ('warm', 'hot'):
    x = d[k]
    print(k, round(x['GiB'], 2), 'GiB', x['device'], ': kill->decoding', round(x['kill_to_decoding_s'], 3), 's, detect',
          round(x['kill_to_detect_s'], 3), 'isolate', round(x['isolate_s'], 3), 'restore', round(x['restore_s'], 3),
          'decode', round(x['first_decode_s'], 3), 'epoch', x['epoch'], '|', x['restore'].get('via'))
print('hot_vs_warm', round(d['hot_vs_warm'], 3), 'to restored', round(d['hot_vs_warm_to_restored'], 3))
" || rc=1
exit $rc
