#!/usr/bin/env bash
# One device call for the fused attention prologue (kernels/qk_norm_rope_store.py): its GPU tests and
# the sibling kernels', the kernel vs the unfused chain, then Qwen3-0.6B `rollout bench` with the
# fused prologue and without (TritonAttentionBatch.fuses_qk_norm_rope_store patched off). Parts:
#   bash scripts/device_check_qkfuse.sh tests kernel e2e
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
PARTS=${*:-tests kernel e2e}
BENCH="bench --load-format dummy --model recipes/configs/qwen3-0.6b --num-prompts 256 --input-len 256 --output-len 512"
for part in $PARTS; do
    case $part in
    tests) timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_qk_norm_rope_store.py \
               tests/kernels/test_rmsnorm.py tests/kernels/test_rotary.py tests/kernels/test_kv_store.py 2>&1 \
               | tee "$OUT/qkfuse_tests.log" | tail -25 ;;
    kernel) timeout 150 python3 scripts/bench_qk_norm_rope_store.py 2>&1 | tee "$OUT/qkfuse_kernel.log" ;;
    e2e) for mode in fused unfused; do
             echo "== $mode: rollout $BENCH"
             COLUMNS=200 timeout 130 python3 -c "
import sys
import rollout_cli.engine.execution.triton_attention as ta
ta.TritonAttentionBatch.fuses_qk_norm_rope_store = sys.argv.pop(1) == 'fused'
from rollout_cli.cli.main import app
app(prog_name='rollout')" $mode $BENCH --json "$OUT/qkfuse_$mode.json" 2>&1 | tee "$OUT/qkfuse_$mode.log" \
                 | grep -E "│" | grep -E "tok/s|decode step|output"
         done ;;
    *) echo "unknown part $part" ;;
    esac
done
