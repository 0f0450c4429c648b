#!/usr/bin/env bash
# One device call for issue 8's kernels (a few minutes): the hybrid kernels' tests on the GPU (the
# interpreter-tested ones run natively in float32/float16, plus the bf16 GPU tests), then the chunked
# delta-rule prefill benchmark at Qwen3-Next's linear-layer shape. Logs go to $OUT.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_chunk_gated_delta_rule.py \
    tests/kernels/test_causal_conv1d_varlen.py tests/kernels/test_linear_state_triton.py \
    tests/kernels/test_gated_delta_rule_decode.py tests/kernels/test_causal_conv1d_decode.py \
    tests/kernels/test_gdn_gating_norm.py \
    2>&1 | tee "$OUT/hybrid_kernel_tests.log" | tail -8
timeout 120 python3 - <<'PY' 2>&1 | tee "$OUT/chunk_gdr_bench.log"
from rollout_kernels.chunk_gated_delta_rule_bench import benchmark_chunk_gated_delta_rule
for seq_len in (1024, 4096):
    print(seq_len, benchmark_chunk_gated_delta_rule(num_seqs=4, seq_len=seq_len))
PY
