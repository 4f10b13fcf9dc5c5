#!/usr/bin/env bash
# Issue 31's RECOVER on the device, on the GPU machine: scripts/gpu/executor_session.sh
# with the ring recovery's tests (tests/session/test_restore_ring_gpu.py, and the
# CPU twin's tests beside them) and `bench executor-session --parts recover` into
# $OUT/executor-recover.json: a resident session's recovery onto the device (one
# RECOVER task of a persistent kernel) against the host path's pipeline, both
# through Session.recover(into=) of CuPy targets, at 64 MiB and 1 GiB.
# Run from the repo root with $OUT set:
#   PART_LIMIT_S_executor_recover=200 bash scripts/gpu_suite.sh executor_recover
exec bash "$(dirname "$0")/executor_session.sh" recover
