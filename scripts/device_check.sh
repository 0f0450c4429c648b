#!/usr/bin/env bash
# One device call for issues 3 and 4 (about 8 minutes): GPU engine, memory, weight-update and
# sampler tests, then one `rollout bench` per line of docs/benchmarks.md (Qwen3-0.6B fixed with
# HF, mixed lengths, GRPO shape; Qwen3-8B fixed with HF), then the control-plane timings on the
# Qwen3-8B shape (reload, CUDA IPC update, release / resume). Logs and JSON go to $OUT.
# MoE (issue 5): scripts/moe_device_check.sh and scripts/device_check_moe_bench.sh.
# torch_memory_saver travels as a wheel: carry .whl (docs/device-runs.md says how to fetch it).
set -uo pipefail
# kernels/ installs as rollout_kernels; without installing, a link on PYTHONPATH gives the same name.
mkdir -p /tmp/rollout_path && ln -sfn "$PWD/kernels" /tmp/rollout_path/rollout_kernels
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/rollout_path:/tmp/site PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
bench() { COLUMNS=200 python3 -m rollout_cli.cli.main bench --load-format dummy "$@" 2>&1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
timeout 200 python3 -m pytest -q -m gpu tests/e2e/test_gpu_engine.py tests/e2e/test_gpu_memory.py \
    tests/e2e/test_gpu_weight_updates.py tests/kernels/test_sampling.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -6
Q06=recipes/configs/qwen3-0.6b
echo "== 0.6B fixed 256x256x512, HF baseline"
timeout 150 bash -c "$(declare -f bench); bench --model $Q06 --num-prompts 256 --input-len 256 --output-len 512 --baseline hf --json $OUT/b06_fixed.json" | tee "$OUT/b06_fixed.log" | head -19
echo "== 0.6B mixed lengths"
timeout 60 bash -c "$(declare -f bench); bench --model $Q06 --num-prompts 256 --input-len-range 100 1024 --output-len-range 100 1024 --temperature 0.6 --json $OUT/b06_mixed.json" | sed -n 3,14p
echo "== 0.6B GRPO 64 x n16, 512 in, 1024 out"
timeout 70 bash -c "$(declare -f bench); bench --model $Q06 --num-prompts 64 --n 16 --input-len 512 --output-len 1024 --json $OUT/b06_grpo.json" | sed -n 3,16p
echo "== 8B fixed 256x256x512, HF baseline"
timeout 200 bash -c "$(declare -f bench); bench --model recipes/configs/qwen3-8b --num-prompts 256 --input-len 256 --output-len 512 --baseline hf --json $OUT/b8_fixed.json" | tee "$OUT/b8_fixed.log" | sed -n 3,20p
echo "== control plane, Qwen3-8B shape"
timeout 200 python3 scripts/control_plane_bench.py --config recipes/configs/qwen3-8b --workdir /tmp/cp 2>&1 | tee "$OUT/control_plane.log" | tail -12
