#!/usr/bin/env bash
# Tests named in RECHECK_TESTS run against this tree and against the tree in
# .before (git archive of an earlier commit, carried, never committed), to
# tell a regression from a test that fails on both.  Writes $OUT/recheck.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
rm -rf /tmp/site-before
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site-before .before \
  || { echo "recheck: installing .before failed"; exit 2; }
root=$PWD
for tree in after before; do
  echo "=== $tree"
  if [ "$tree" = before ]; then
    (cd .before && PYTHONPATH=/tmp/site-before:$root/.before:/tmp/site timeout -k 5 "${RECHECK_S:-120}" \
      python3 -m pytest -q -p no:cacheprovider -m gpu ${RECHECK_TESTS} 2>&1 | tail -15)
  else
    timeout -k 5 "${RECHECK_S:-120}" python3 -m pytest -q -p no:cacheprovider -m gpu ${RECHECK_TESTS} 2>&1 | tail -15
  fi
done | tee "$OUT/recheck.txt"
