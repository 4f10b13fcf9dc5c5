#!/usr/bin/env bash
# The whole GPU check-and-benchmark run, on the H200 machine, from the repo root.
# Needs .whl/ (scripts/fetch_device_wheels.sh) carried along and $OUT set.
# Installs the wheels and the project into /tmp/site, then runs every
# scripts/gpu/<part>.sh but the probes (*_probe.sh), or only the parts named as
# arguments, with a time limit each, keeping each part's log under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to a folder for results}"
# Only a few files may come back from the machine: parts write into a staging
# folder, and everything is packed into $OUT/results.tgz at the end.
final_out=$OUT
export OUT=/tmp/gpu-out
rm -rf "$OUT"; mkdir -p "$OUT"
# A benchmark cut by SIGKILL (its part's `timeout -k` running out before its
# cleanup ended) leaves its scratch folder in /dev/shm, holding memory that a
# later part needs (huge pages for a 40 GiB state).  This machine runs one
# command at a time, so any such folder now is a leftover of an earlier call.
for d in /dev/shm/concordia-bench-*; do
  [ -e "$d" ] && { echo "gpu_suite: removing $d, left by a cut run"; rm -rf "$d"; }
done
trap 'tar -C "$OUT" -czf "$final_out/results.tgz" . ; cp "$OUT/summary.txt" "$final_out/" 2>/dev/null' EXIT
export PYTHONUNBUFFERED=1
site=/tmp/site
rm -rf "$site"   # pip --target keeps an older copy of a package unless told to replace it
# Bytecode is compiled at install, as pip does for a user: a fresh process that
# compiled its modules' sources paid 0.13 s more for it in every recovery figure.
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target "$site" .whl/*.whl \
  || { echo "gpu_suite: wheel install failed"; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$site" .whl/crcmod-*.tar.gz \
  || echo "gpu_suite: crcmod not installed (tests that need it will say so)"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target "$site" . \
  || { echo "gpu_suite: project install failed"; exit 2; }
# PYTHONSAFEPATH: `python -m` and `python -c` would otherwise put the repo root
# first on sys.path, where the bare concordia/ folder (without its wal/, devmem/,
# gpu_kernels/, tools/ siblings mapped in) shadows the installed package.
# The repo root comes after the installed copy only so that tests can import
# their shared helpers as `tests.<part>....`, as they do under pytest here.
export PYTHONPATH="$site:$PWD" PATH="$site/bin:$PATH" PYTHONSAFEPATH=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import cupy, numpy, sys; print("python", sys.version.split()[0], "cupy", cupy.__version__, "numpy", numpy.__version__)' | tee -a "$OUT/gpu.txt"

parts=("$@")
if [ ${#parts[@]} -eq 0 ]; then
  # probes (*_probe) answer one question each and run only when named
  for f in scripts/gpu/*.sh; do
    case "$f" in *_probe.sh) ;; *) parts+=("$(basename "$f" .sh)") ;; esac
  done
fi
limit=${PART_LIMIT_S:-240}
status=0
for p in "${parts[@]}"; do
  echo "=== $p"
  start=$(date +%s)
  own="PART_LIMIT_S_$p"   # a part's own limit, e.g. PART_LIMIT_S_model=400
  timeout -k 10 "${!own:-$limit}" bash "scripts/gpu/$p.sh" >"$OUT/$p.log" 2>&1
  rc=$?
  echo "=== $p rc=$rc $(( $(date +%s) - start ))s" | tee -a "$OUT/summary.txt"
  tail -n 25 "$OUT/$p.log"
  [ $rc -eq 0 ] || status=1
done
exit $status
