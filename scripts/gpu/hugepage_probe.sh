#!/usr/bin/env bash
# What a fresh process pays to let the copy engine read a shm log: registering
# the mapping plain, after populating it on several threads, with shmem huge
# pages, and beside host threads copying the other half (issue 9's restore).
# Run from the repo root with $OUT set; writes $OUT/hugepage_probe.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
timeout -k 5 150 python3 scripts/hugepage_probe.py "$OUT/hugepage_probe.json"
