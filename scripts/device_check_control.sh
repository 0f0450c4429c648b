#!/usr/bin/env bash
# One device call for the control plane and the decode fixes: GPU engine + memory tests,
# the fixed 0.6B bench with the HF baseline, and the control-plane timings on a Qwen3-8B shape.
# Needs torch_memory_saver: carry .whl (see docs/device-runs.md).
set -uo pipefail
mkdir -p /tmp/rollout_path && ln -sfn "$PWD/kernels" /tmp/rollout_path/rollout_kernels
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/rollout_path:/tmp/site PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 200 python3 -m pytest -q -m gpu tests/e2e/test_gpu_engine.py tests/e2e/test_gpu_memory.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
echo "== fixed 256x256x512 with HF baseline"
COLUMNS=200 timeout 150 python3 -m rollout_cli.cli.main bench --model recipes/configs/qwen3-0.6b --load-format dummy \
  --num-prompts 256 --input-len 256 --output-len 512 --baseline hf --json "$OUT/bench_fixed.json" 2>&1 | tee "$OUT/bench_fixed.log" | head -22
echo "== control plane, Qwen3-8B shape"
timeout 240 python3 scripts/control_plane_bench.py --config recipes/configs/qwen3-8b --workdir /tmp/cp 2>&1 | tee "$OUT/control_plane.log" | tail -14
