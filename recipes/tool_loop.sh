#!/usr/bin/env bash
# Multi-turn RL with a tool: episodes of the calculator environment (recipes/envs/calculator.py),
# trained with the GRPO recipe on the environment's reward, the tool results masked out of the loss.
#   for each iteration: rollout run --env (episodes of model turns and tool results) -> train -> next checkpoint
#
# Settings (environment variables, with defaults):
#   MODEL=recipes/example_model     starting checkpoint
#   WORKDIR=/tmp/rollout-tools      prompts, episodes, checkpoints, metrics.jsonl
#   ITERATIONS=2  PROMPTS=16        rounds, and calculator problems per round
#   GROUP_SIZE=4  MAX_TURNS=4       episodes per problem (the GRPO group), model turns per episode
#   MAX_NEW_TOKENS=24               tokens per model turn
#   LR=1e-2  TRAIN_STEPS=2  DEVICE=auto  ROLLOUT=rollout  PYTHON=python
# Appends one JSON line per iteration to $WORKDIR/metrics.jsonl: the trainer's line (mean_reward,
# logprob_mismatch over the model's tokens, ...) and the episodes' turns and prefix hit rate.
set -euo pipefail

MODEL=${MODEL:-recipes/example_model}
WORKDIR=${WORKDIR:-/tmp/rollout-tools}
ITERATIONS=${ITERATIONS:-2}
PROMPTS=${PROMPTS:-16}
GROUP_SIZE=${GROUP_SIZE:-4}
MAX_TURNS=${MAX_TURNS:-4}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-24}
LR=${LR:-1e-2}
TRAIN_STEPS=${TRAIN_STEPS:-2}
DEVICE=${DEVICE:-auto}
ROLLOUT=${ROLLOUT:-rollout}
PYTHON=${PYTHON:-python}
HERE=$(cd "$(dirname "$0")" && pwd)

mkdir -p "$WORKDIR"
checkpoint="$MODEL"
for iteration in $(seq 1 "$ITERATIONS"); do
    prompts="$WORKDIR/prompts_$iteration.parquet"
    episodes="$WORKDIR/episodes_$iteration"
    $PYTHON "$HERE/envs/calculator.py" "$prompts" --count "$PROMPTS" --seed "$iteration" >/dev/null
    rm -rf "$episodes"
    $ROLLOUT run --model "$checkpoint" --device "$DEVICE" --data "$prompts" --out "$episodes" \
        --env "$HERE/envs/calculator.py" --max-turns "$MAX_TURNS" --n "$GROUP_SIZE" \
        --max-new-tokens "$MAX_NEW_TOKENS" --seed "$iteration" --quiet
    trained=$($PYTHON "$HERE/train_grpo.py" --trajectories "$episodes" --model "$checkpoint" \
        --out "$WORKDIR/ckpt_$iteration" --reward env --lr "$LR" --steps "$TRAIN_STEPS")
    episode_stats=$($PYTHON -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1]))['episodes']))" \
        "$episodes/manifest.json")
    $PYTHON -c "import json,sys; print(json.dumps({'iteration': int(sys.argv[1]), **json.loads(sys.argv[2]),
'episodes': json.loads(sys.argv[3])}))" "$iteration" "$trained" "$episode_stats" | tee -a "$WORKDIR/metrics.jsonl"
    checkpoint="$WORKDIR/ckpt_$iteration"
done
