#!/usr/bin/env bash
# Issue 31's executor="auto", on the GPU machine: scripts/gpu/executor_session.sh
# with the arena route's GPU tests (the default session deciding for the resident
# path after its first epoch among them) and `bench executor-session --parts device`
# into $OUT/executor-auto.json: the device's EPOCH handler, the device trigger's
# stall, and `latency_ms` with the default session's row beside resident and host
# (`auto_took`: the path it decided on; a goal says whether that was the one that won).
# Run from the repo root with $OUT set:
#   PART_LIMIT_S_executor_auto=200 bash scripts/gpu_suite.sh executor_auto
set -uo pipefail
cd "$(dirname "$0")/../.."
EXECUTOR_SESSION_NAME=executor-auto EXECUTOR_SESSION_PARTS=device \
  EXECUTOR_SESSION_TESTS="tests/session/test_arena_route.py -m gpu" \
  EXECUTOR_SESSION_TESTS_S="${EXECUTOR_AUTO_TESTS_S:-60}" EXECUTOR_SESSION_BENCH_S="${EXECUTOR_AUTO_BENCH_S:-150}" \
  exec bash scripts/gpu/executor_session.sh
