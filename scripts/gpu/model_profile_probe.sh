#!/usr/bin/env bash
# Where the host's time inside generate()'s checkpoint criterion goes on the
# H200 (issue 32's every-step overhead): `bench model --parts decode` (one
# measured round) under cProfile, then what the criterion, the checkpoint, the
# settle of the pending epoch, the guard's capture and retention's hook call,
# with their cumulative times (the model's compile and the other settings are
# in the same profile: read the callees, not the totals).
# MODEL_PROFILE_ROWS: the settings profiled (bench model --decode-rows; all of them when unset; the baseline always runs).
# Writes $OUT/model-profile.txt and $OUT/model-profile.json (the bench's JSON).
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to a folder for results}"
export HF_HUB_OFFLINE=1
unset CUBLAS_WORKSPACE_CONFIG
callees=()
for name in "transformers.py.*__call__" "session.py.*checkpoint" "session.py.*settle" _finish_table capture \
            after_commit _after_commit _advance launch complete _commit "step_trigger.py.*step" _keep_armed \
            "arena_route.py.*rotate" "device_epoch.py.*rotate" step_gate adopt_arena "arena.py.*adopt" \
            "device_epoch.py.*_open" "device_epoch.py.*pause" "device_epoch.py.*_arm" "arena.py.*__init__" describe \
            "host.py.*call"; do
  callees+=(--callees "$name")
done
python3 scripts/gpu/profile_wal.py "$OUT/model-profile.txt" "${callees[@]}" -- bench model --parts decode \
  --decode-reps 1 ${MODEL_PROFILE_ROWS:+--decode-rows "$MODEL_PROFILE_ROWS"} \
  --json --out "$OUT/model-profile.json" --force
