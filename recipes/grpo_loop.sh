#!/usr/bin/env bash
# Offline GRPO loop with one long-lived rollout engine:
#   serve -> for each iteration: rollout run --n G, release-memory, score + train, resume-memory,
#   reload-weights -> shutdown.
#
# Settings (environment variables, with defaults):
#   MODEL=recipes/example_model        starting checkpoint (HF directory with safetensors)
#   DATA=recipes/prompts.parquet       prompt Parquet (verl layout works as it is)
#   WORKDIR=/tmp/rollout-grpo          trajectories, checkpoints, engine socket, metrics.jsonl
#   ITERATIONS=4                       rollout + train + reload rounds
#   GROUP_SIZE=8                       samples per prompt (the GRPO group)
#   LIMIT=16                           prompts per iteration (first rows of DATA); empty = all
#   MAX_NEW_TOKENS=16  TEMPERATURE=1.0 rollout settings
#   REWARD=digit_fraction              a name from recipes/rewards.py (answer_match for real models)
#   LR=1e-2  TRAIN_STEPS=4             trainer settings (recipes/train_grpo.py)
#   DEVICE=auto  DTYPE=auto            engine and trainer device and dtype (auto: cuda + bfloat16 where
#                                      there is a GPU, else cpu + float32); the trainer runs while the
#                                      engine's memory is released
#   DETERMINISTIC=0                    1: engine and trainer in the on-policy mode (serve --deterministic,
#                                      train_grpo.py --deterministic): logprob_mismatch is exactly 0
#   ROLLOUT=rollout  PYTHON=python     commands to run
# Appends one JSON line per iteration to $WORKDIR/metrics.jsonl: iteration, weight_version,
# mean_reward, rollout_seconds, train_seconds, reload_seconds, logprob_mismatch, release_seconds,
# resume_seconds. The engine's GPU memory is released while the trainer runs (on the CPU the same
# state machine drops the KV pool and the weights); after resume the new checkpoint is loaded.
# The engine is shut down at the end and on any error or signal (trap): no daemon is left behind.
set -euo pipefail

MODEL=${MODEL:-recipes/example_model}
DATA=${DATA:-recipes/prompts.parquet}
WORKDIR=${WORKDIR:-/tmp/rollout-grpo}
ITERATIONS=${ITERATIONS:-4}
GROUP_SIZE=${GROUP_SIZE:-8}
LIMIT=${LIMIT-16}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-16}
TEMPERATURE=${TEMPERATURE:-1.0}
REWARD=${REWARD:-digit_fraction}
LR=${LR:-1e-2}
TRAIN_STEPS=${TRAIN_STEPS:-4}
DEVICE=${DEVICE:-auto}
DTYPE=${DTYPE:-auto}
DETERMINISTIC=${DETERMINISTIC:-0}
ROLLOUT=${ROLLOUT:-rollout}
PYTHON=${PYTHON:-python}
HERE=$(cd "$(dirname "$0")" && pwd)

mkdir -p "$WORKDIR"
SOCKET="$WORKDIR/engine.sock"
SERVE_PID=""

cleanup() {
    if [ -n "$SERVE_PID" ] && kill -0 "$SERVE_PID" 2>/dev/null; then
        $ROLLOUT shutdown --engine "$SOCKET" >/dev/null 2>&1 || kill "$SERVE_PID" 2>/dev/null || true
        wait "$SERVE_PID" 2>/dev/null || true
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

now() { date +%s.%N; }

on_policy_args=()
[ "$DETERMINISTIC" = 1 ] && on_policy_args=(--deterministic)
$ROLLOUT serve --model "$MODEL" --socket "$SOCKET" --device "$DEVICE" --dtype "$DTYPE" "${on_policy_args[@]}" >"$WORKDIR/serve.log" 2>&1 &
SERVE_PID=$!
for _ in $(seq 1 240); do
    # the socket answers while the engine loads (state loading); jobs are refused until it serves
    state=$($ROLLOUT status --engine "$SOCKET" 2>/dev/null | awk '$1 == "state" {print $2}') || true
    [ -n "$state" ] && [ "$state" != loading ] && break
    kill -0 "$SERVE_PID" 2>/dev/null || { echo "error: rollout serve exited; see $WORKDIR/serve.log" >&2; exit 1; }
    sleep 0.5
done
$ROLLOUT status --engine "$SOCKET" >/dev/null

limit_args=()
[ -n "$LIMIT" ] && limit_args=(--limit "$LIMIT")
checkpoint="$MODEL"
for iteration in $(seq 1 "$ITERATIONS"); do
    traj="$WORKDIR/traj_$iteration"
    rm -rf "$traj"
    t0=$(now)
    $ROLLOUT run --engine "$SOCKET" --data "$DATA" --out "$traj" --n "$GROUP_SIZE" \
        --max-new-tokens "$MAX_NEW_TOKENS" --temperature "$TEMPERATURE" --seed "$iteration" "${limit_args[@]}" --quiet
    t1=$(now)
    $ROLLOUT release-memory --engine "$SOCKET" >/dev/null
    t_released=$(now)
    train_json=$($PYTHON "$HERE/train_grpo.py" --trajectories "$traj" --model "$checkpoint" \
        --out "$WORKDIR/ckpt_$iteration" --reward "$REWARD" --temperature "$TEMPERATURE" --lr "$LR" \
        --steps "$TRAIN_STEPS" --seed "$iteration" --device "$DEVICE" --dtype "$DTYPE" "${on_policy_args[@]}" \
        2>"$WORKDIR/train_$iteration.log" | tail -1) \
        || { echo "error: the trainer failed; see $WORKDIR/train_$iteration.log:" >&2; tail -5 "$WORKDIR/train_$iteration.log" >&2; exit 1; }
    t2=$(now)
    $ROLLOUT resume-memory --engine "$SOCKET" >/dev/null
    t_resumed=$(now)
    $ROLLOUT reload-weights "$WORKDIR/ckpt_$iteration" --engine "$SOCKET" >/dev/null
    t3=$(now)
    checkpoint="$WORKDIR/ckpt_$iteration"
    $PYTHON - "$iteration" "$traj" "$t0" "$t1" "$t_released" "$t2" "$t_resumed" "$t3" "$train_json" >>"$WORKDIR/metrics.jsonl" <<'PY'
import json, sys
import pyarrow.parquet as pq
iteration, traj, t0, t1, t_released, t2, t_resumed, t3, train = sys.argv[1:]
versions = set(pq.read_table(f"{traj}/trajectories", columns=["weight_version"]).column(0).to_pylist())
assert len(versions) == 1, f"trajectories of one iteration carry several weight versions: {versions}"
train = json.loads(train)
print(json.dumps({
    "iteration": int(iteration), "weight_version": versions.pop(), "mean_reward": train["mean_reward"],
    "rollout_seconds": round(float(t1) - float(t0), 3), "train_seconds": round(float(t2) - float(t_released), 3),
    "reload_seconds": round(float(t3) - float(t_resumed), 3), "logprob_mismatch": train["logprob_mismatch"],
    "release_seconds": round(float(t_released) - float(t1), 3), "resume_seconds": round(float(t_resumed) - float(t2), 3),
}))
PY
    tail -1 "$WORKDIR/metrics.jsonl"
done
