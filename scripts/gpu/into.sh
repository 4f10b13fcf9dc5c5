#!/usr/bin/env bash
# Issue 30's `into_10gib` and `fresh_total_10gib_hugetlb_s` on the H200, as
# root: `bench into` (INTO_GIB GiB, default 10, of state in 40 bf16 CUDA
# tensors, written by one process, recovered by fresh ones into their own
# tensors, on shm and hugetlb, beside the pinned host-to-device copy measured
# in each).  Reserves huge pages and mounts hugetlbfs (scripts/hugepages.sh),
# and puts the setting back.  Writes $OUT/into.json.  Run with
#   PART_LIMIT_S_into=300 bash scripts/gpu_suite.sh into
# INTO_ARGS adds options, e.g. INTO_ARGS="--readers 3 --variant pin:CONCORDIA_RESTORE_READ=pin"
# (readers of the same log under other settings, alternated with the default's).
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
gib=${INTO_GIB:-10}
mnt=/mnt/concordia-huge
huge_gib=$(python3 -c "import math; print(math.ceil(1.25 * $gib) + 6)")
bash scripts/hugepages.sh setup "$huge_gib" "$mnt" >/dev/null || { echo "into: no huge pages"; exit 2; }
trap 'bash scripts/hugepages.sh teardown "$mnt"' EXIT
export CONCORDIA_HUGETLB_DIR=$mnt
read -ra extra <<< "${INTO_ARGS:-}"   # split on blanks, never globbed
WAL=(python3 -c "import sys; from concordia.tools.entry import concordia_wal; sys.argv[0] = 'concordia-wal'; concordia_wal()")
timeout -k 5 "${INTO_BENCH_S:-280}" "${WAL[@]}" bench into --gib "$gib" --tiers "${INTO_TIERS:-shm,hugetlb}" \
  "${extra[@]}" --out "$OUT/into.json" --force
