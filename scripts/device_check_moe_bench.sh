#!/usr/bin/env bash
# One device call for issue 5's end-to-end lines (about 8 minutes): `rollout bench` on a
# Qwen3-30B-A3B-shaped dummy checkpoint, routing capture off vs on in the same engine, then the
# same workload with the HF transformers baseline. Logs and JSON go to $OUT.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
Q30=recipes/configs/qwen3-30b-a3b
bench() { COLUMNS=200 python3 -m rollout_cli.cli.main bench --load-format dummy "$@" 2>&1; }
echo "== 30B-A3B fixed 256x256x512, routing capture off vs on"
timeout 200 bash -c "$(declare -f bench); bench --model $Q30 --num-prompts 256 --input-len 256 --output-len 512 --capture-routing compare --json $OUT/b30_capture.json" | tee "$OUT/b30_capture.log" | sed -n 3,24p
echo "== 30B-A3B fixed 256x256x512, HF baseline"
timeout 300 bash -c "$(declare -f bench); bench --model $Q30 --num-prompts 256 --input-len 256 --output-len 512 --baseline hf --json $OUT/b30_hf.json" | tee "$OUT/b30_hf.log" | sed -n 3,24p
