#!/usr/bin/env bash
# One device call for the fused MoE (issue 5, GPU part), about 6 minutes on an H200:
#   1. GPU tests of the MoE kernels (bf16) and of MoE engines with CUDA graphs (HF parity, graph == eager);
#   2. the tuner on the Qwen3-30B-A3B expert shape (E=128, top-8, H=2048, I=768, bf16), writing
#      $OUT/E=128,N=768,K=2048,dtype=bfloat16.json (copy it to kernels/configs/fused_moe/ to ship it);
#   3. the kernel benchmark table (decode 1-256 tokens, prefill 1024-8192) with the tuned file vs the default.
# Logs go to $OUT.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
Q30=recipes/configs/qwen3-30b-a3b/config.json
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
echo "== GPU tests"
timeout 130 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_moe_routing.py \
    tests/kernels/test_moe_align.py tests/kernels/test_fused_moe.py tests/e2e/test_gpu_moe_engine.py \
    2>&1 | tee "$OUT/moe_gpu_tests.log" | tail -15
echo "== tuner"
timeout 170 python3 scripts/tune_fused_moe.py --model-config $Q30 --buckets 1,4,16,64,128,256,1024,4096 \
    --out "$OUT" --time-budget-s 140 --rep-ms 5 2>&1 | tee "$OUT/tune.log" | grep -v "skip" | tail -25
echo "== benchmark"
timeout 50 python3 scripts/bench_fused_moe.py --model-config $Q30 --config-dir "$OUT" --json "$OUT/bench_fused_moe.json" \
    2>&1 | tee "$OUT/bench_fused_moe.log"
