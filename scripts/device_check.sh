#!/usr/bin/env bash
# One device call: engine GPU tests, the sampler's GPU tests, the decode-attention kernel alone,
# then `rollout bench` lines (Qwen3-0.6B shape: fixed workload with the HF baseline, mixed
# lengths, GRPO shape). Logs and JSON reports go to $OUT.
set -uo pipefail
# kernels/ installs as rollout_kernels; without installing, a link on PYTHONPATH gives the same name.
mkdir -p /tmp/rollout_path && ln -sfn "$PWD/kernels" /tmp/rollout_path/rollout_kernels
export PYTHONPATH=$PWD:/tmp/rollout_path PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
Q06=recipes/configs/qwen3-0.6b
bench() { COLUMNS=200 python3 -m rollout_cli.cli.main bench --model $Q06 --load-format dummy --attention-backend triton "$@" 2>&1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
timeout 150 python3 -m pytest -q -m gpu tests/e2e/test_gpu_engine.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
timeout 30 python3 - <<'PY' 2>&1 | tee "$OUT/decode_splits.log"
import torch
from rollout_cli.bench import measure_hbm_bandwidth
from rollout_kernels.decode_attention import benchmark_decode_attention
bw = measure_hbm_bandwidth(torch.device("cuda"))
for batch, context in ((256, 512), (64, 4096)):
    for splits in (1, 2, 4, 16):
        r = benchmark_decode_attention(batch=batch, context=context, num_kv_splits=splits, hbm_bytes_per_s=bw)
        print(f"decode attention B={batch} ctx={context} splits={splits}: {r['time_us']:.0f} us, {r['hbm_fraction']:.1%} of HBM")
PY
echo "== fixed 256x256x512 with HF baseline"
timeout 130 bash -c "$(declare -f bench); Q06=$Q06; bench --num-prompts 256 --input-len 256 --output-len 512 --baseline hf --json $OUT/bench_fixed.json --profile" > "$OUT/bench_fixed.log"
head -24 "$OUT/bench_fixed.log"
echo "== GRPO 64 x n16, 512 in, 1024 out"
timeout 60 bash -c "$(declare -f bench); Q06=$Q06; bench --num-prompts 64 --n 16 --input-len 512 --output-len 1024 --json $OUT/bench_grpo.json" | tee "$OUT/bench_grpo.log" | head -20
