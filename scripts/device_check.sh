#!/usr/bin/env bash
# One device call: engine GPU tests, rollout bench (with the HF baseline), the decode kernel alone,
# then the kernel GPU tests. Logs and JSON reports go to $OUT.
set -uo pipefail
# kernels/ installs as rollout_kernels; without installing, a link on PYTHONPATH gives the same name.
mkdir -p /tmp/rollout_path && ln -sfn "$PWD/kernels" /tmp/rollout_path/rollout_kernels
export PYTHONPATH=$PWD:/tmp/rollout_path PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
timeout 150 python3 -m pytest -q -m gpu tests/e2e/test_gpu_engine.py -p no:cacheprovider -x 2>&1 | tee "$OUT/gpu_engine_tests.log" | tail -15
timeout 200 python3 -m rollout_cli.cli.main bench --model recipes/configs/qwen3-0.6b --load-format dummy \
    --num-prompts 256 --input-len 256 --output-len 512 --baseline hf --json "$OUT/bench_qwen3_0.6b.json" 2>&1 | tail -22
timeout 60 python3 - <<'PY' 2>&1 | tee "$OUT/decode_kernel.log"
import json, torch
from rollout_cli.bench import measure_hbm_bandwidth
from rollout_kernels.decode_attention import benchmark_decode_attention
bw = measure_hbm_bandwidth(torch.device("cuda"))
print("hbm copy bandwidth TB/s", round(bw / 1e12, 3))
print(json.dumps(benchmark_decode_attention(batch=64, context=4096, hbm_bytes_per_s=bw)))
PY
timeout 90 python3 -m rollout_cli.cli.main bench --model recipes/configs/qwen3-0.6b --load-format dummy \
    --num-prompts 256 --input-len-range 100 1024 --output-len-range 100 1024 --temperature 0.6 \
    --json "$OUT/bench_qwen3_0.6b_mixed.json" 2>&1 | tail -16
