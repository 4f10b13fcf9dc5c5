#!/usr/bin/env bash
# Issue 31's executor="auto", on the GPU machine: scripts/gpu/executor_session.sh
# with the arena route's GPU tests (the default session deciding for the resident
# path after its first epoch among them) and `bench executor-session --parts device`
# into $OUT/executor-auto.json: the device's EPOCH handler, the device trigger's
# stall, and `latency_ms` with the default session's row beside resident and host
# (`auto_took`: the path it decided on; a goal says whether that was the one that won).
# Run from the repo root with $OUT set:
#   PART_LIMIT_S_executor_auto=200 bash scripts/gpu_suite.sh executor_auto
exec bash "$(dirname "$0")/executor_session.sh" auto
