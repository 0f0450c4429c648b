#!/usr/bin/env bash
# One device call: GPU tests, the decode-attention kernel alone, and rollout bench.
# Usage on the device: bash scripts/device_check.sh [bench-args...]; logs go to $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pytest -q -m gpu tests/kernels tests/e2e/test_gpu_engine.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
python3 - <<'PY' 2>&1 | tee "$OUT/decode_kernel.log"
import json, torch
from rollout_cli.bench import measure_hbm_bandwidth
from rollout_kernels.decode_attention import benchmark_decode_attention
bw = measure_hbm_bandwidth(torch.device("cuda"))
print("hbm copy bandwidth TB/s", round(bw / 1e12, 3))
print(json.dumps(benchmark_decode_attention(batch=64, context=4096, hbm_bytes_per_s=bw)))
PY
