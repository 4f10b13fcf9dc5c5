#!/usr/bin/env bash
# The house move on the H200 (issue: region state has one owner, restore has
# one room, the Session is a facade): the whole GPU suite at this tree, and
# the two benchmarks the move must not slow, run before and after it in the
# same process lifetime of the machine, alternating, so that the machine's
# drift falls on both alike:
#   bench checkpoint --parts regions   (1 to 1,024 regions sharing 1 GiB, one dirty page each)
#   bench recover --sizes 10 --tiers shm   (10 GiB of KV: open, plan, restore; Session.recover)
# "before" is the tree of $HOUSE_BEFORE_DIR (default .before: `git archive
# <commit>` of the commit before the move, carried along, never committed),
# installed beside this one in /tmp/site-before.
# HOUSE_PARTS picks what runs (default "suite checkpoint recover"); HOUSE_SUITE_ARGS
# names the suite's test files instead of all of tests/ (a part of the suite,
# when the device time left is short: say so beside its summary line); HOUSE_ROUNDS
# how many before/after pairs of each benchmark (default 2; HOUSE_CHECKPOINT_ROUNDS
# and HOUSE_RECOVER_ROUNDS set one benchmark's alone).
# Run through scripts/gpu_suite.sh (wheels and this tree installed, $OUT set):
#   PART_LIMIT_S=560 bash scripts/gpu_suite.sh house
# Writes $OUT/gpu-suite.txt (the suite's output and summary line),
# $OUT/house-<bench>-<tree>-<round>.json and $OUT/house.txt (the comparison).
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
parts=${HOUSE_PARTS:-suite checkpoint recover}
rounds=${HOUSE_ROUNDS:-2}
ck_rounds=${HOUSE_CHECKPOINT_ROUNDS:-$rounds}
rc_rounds=${HOUSE_RECOVER_ROUNDS:-$rounds}
before=${HOUSE_BEFORE_DIR:-.before}
status=0
after_path=$PYTHONPATH
before_path=/tmp/site-before:$PYTHONPATH

if [[ " $parts " == *" suite "* ]]; then
  # the whole GPU suite, as `pytest -m gpu` runs it (every test marked gpu)
  timeout -k 10 "${HOUSE_SUITE_S:-330}" python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs ${HOUSE_SUITE_ARGS:-tests} \
    > "$OUT/gpu-suite.txt" 2>&1
  rc=$?
  tail -n 40 "$OUT/gpu-suite.txt"
  [ $rc -eq 0 ] || status=1
fi

if [[ " $parts " == *" checkpoint "* || " $parts " == *" recover "* ]]; then
  if [ ! -d "$before" ]; then
    echo "house: no tree before the move at $before"; exit 2
  fi
  rm -rf /tmp/site-before
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site-before \
    "$before" || { echo "house: installing the tree before the move failed"; exit 2; }
fi

bench() {  # bench NAME TREE ROUND ARGS...
  local name=$1 tree=$2 round=$3
  shift 3
  local path=$after_path
  [ "$tree" = before ] && path=$before_path
  PYTHONPATH=$path timeout -k 5 "${HOUSE_BENCH_S:-200}" python3 -c \
    "import sys; from concordia.tools.entry import concordia_wal; sys.argv[0] = 'concordia-wal'; concordia_wal()" \
    bench "$name" "$@" --json --out "$OUT/house-$name-$tree-$round.json" > /dev/null 2> "$OUT/house-$name-$tree-$round.err"
  local rc=$?
  echo "house: bench $name $tree round $round rc=$rc"
  [ $rc -eq 0 ] || { tail -n 5 "$OUT/house-$name-$tree-$round.err"; status=1; }
}

for r in $(seq 1 $(( ck_rounds > rc_rounds ? ck_rounds : rc_rounds ))); do
  for tree in before after; do
    if [[ " $parts " == *" checkpoint "* ]] && [ "$r" -le "$ck_rounds" ]; then
      bench checkpoint "$tree" "$r" --parts regions --reps 10
    fi
    if [[ " $parts " == *" recover "* ]] && [ "$r" -le "$rc_rounds" ]; then
      bench recover "$tree" "$r" --sizes 10 --tiers shm --no-torch --registered-max-gib 0
    fi
  done
done

python3 - "$OUT" "$(( ck_rounds > rc_rounds ? ck_rounds : rc_rounds ))" <<'PY' | tee "$OUT/house.txt" || status=1
import json, os, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])

def load(name, tree):
    docs = []
    for r in range(1, rounds + 1):
        path = os.path.join(out, f"house-{name}-{tree}-{r}.json")
        if os.path.exists(path):
            docs.append(json.load(open(path)))
    return docs

def line(what, before, after):
    if not before or not after:
        print(f"{what}: missing ({len(before)} before, {len(after)} after)")
        return
    b, a = statistics.median(before), statistics.median(after)
    print(f"{what}: before {b:.4f}, after {a:.4f}, after/before {a / b:.3f} "
          f"(runs before {[round(x, 4) for x in before]}, after {[round(x, 4) for x in after]})")

cb, ca = load("checkpoint", "before"), load("checkpoint", "after")
counts = sorted({row["regions"] for d in cb + ca for row in d.get("regions", []) if "ckpt_ms" in row})
for n in counts:
    pick = lambda docs: [row["ckpt_ms"] for d in docs for row in d.get("regions", [])
                         if row.get("regions") == n and "ckpt_ms" in row]
    line(f"bench checkpoint, {n} regions, ckpt_ms (median of 10)", pick(cb), pick(ca))
rb, ra = load("recover", "before"), load("recover", "after")
for key in ("total_s", "restore_s", "plan_s", "open_s", "session_total_s"):
    pick = lambda docs: [row[key] for d in docs for row in d.get("rows", []) if row.get(key) is not None
                         and abs(row.get("GiB", 0) - 10) < 0.5 and row.get("tier") == "shm"]
    line(f"bench recover, 10 GiB shm, {key}", pick(rb), pick(ra))
for d in (cb + ca)[:1]:
    print("device:", d.get("device"))
PY
exit $status
