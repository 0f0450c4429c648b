#!/usr/bin/env bash
# One device call for issue 8's engine part (at most ~8 minutes on an H200; each part has a timeout and
# later parts get what is left of the budget, so the call ends in time even when a part hangs):
#   1. GPU tests of the hybrid kernels (decode / prefill conv and delta rule, the linear-state batch);
#   2. tests/e2e/test_gpu_hybrid.py: hybrid engines on the Triton backend with CUDA graphs against HF
#      (float32), eager Triton (bf16) and the torch path (n=4 prefix sharing, preemption);
#   3. `rollout bench` on the Qwen3-Next-80B-A3B slice (recipes/configs/qwen3-next-80b-a3b-12l, dummy
#      weights): 256 prompts x 256 in x 2048 out;
#   4. the chunked delta-rule prefill benchmark at Qwen3-Next's linear-layer shape;
#   5. if time is left, a small bench line with the HF transformers baseline (its torch fallback is slow).
# Then a summary table. Logs and JSON go to $OUT. torch_memory_saver: carry .whl (docs/device-runs.md);
# without it the memory-release test skips.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
BUDGET_S=${BUDGET_S:-470}
DEADLINE=$(( $(date +%s) + BUDGET_S ))
NEXT=recipes/configs/qwen3-next-80b-a3b-12l
: > "$OUT/parts.tsv"

# part NAME MAX_SECONDS LOG CMD...: runs CMD under timeout min(MAX_SECONDS, time left), output to LOG
part() {
    local name=$1 max=$2 log=$3
    shift 3
    local left=$(( DEADLINE - $(date +%s) ))
    local limit=$(( max < left ? max : left ))
    if [[ " ${SKIP:-} " == *" $name "* ]]; then  # SKIP="kernel_tests ..." leaves parts out
        echo "== $name: skipped (SKIP)"
        printf '%s\tskipped\t0\n' "$name" >> "$OUT/parts.tsv"
        return
    fi
    if (( limit < 30 )); then
        echo "== $name: skipped (${left} s of the budget left)"
        printf '%s\tskipped\t0\n' "$name" >> "$OUT/parts.tsv"
        return
    fi
    echo "== $name (timeout ${limit} s)"
    local start=$(date +%s)
    timeout -k 15 "$limit" "$@" > "$log" 2>&1
    local rc=$?
    printf '%s\trc=%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - start ))" >> "$OUT/parts.tsv"
    tail -6 "$log"
}
BENCH=(env COLUMNS=200 python3 -m rollout_cli.cli.main bench --load-format dummy)

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
part kernel_tests 130 "$OUT/hybrid_kernel_tests.log" python3 -m pytest -q -p no:cacheprovider \
    tests/kernels/test_chunk_gated_delta_rule.py tests/kernels/test_causal_conv1d_varlen.py \
    tests/kernels/test_linear_state_triton.py tests/kernels/test_gated_delta_rule_decode.py \
    tests/kernels/test_causal_conv1d_decode.py
part engine_tests 160 "$OUT/gpu_hybrid_tests.log" python3 -m pytest -q -p no:cacheprovider -rs tests/e2e/test_gpu_hybrid.py
part bench_256x256x2048 200 "$OUT/bench_next.log" "${BENCH[@]}" --model $NEXT --num-prompts 256 --input-len 256 \
    --output-len 2048 --json "$OUT/bench_next.json"
part chunk_gdr_bench 45 "$OUT/chunk_gdr_bench.log" python3 -c "
from rollout_kernels.chunk_gated_delta_rule_bench import benchmark_chunk_gated_delta_rule
for seq_len in (1024, 4096):
    print(seq_len, benchmark_chunk_gated_delta_rule(num_seqs=4, seq_len=seq_len))"
part bench_hf_16x256x128 170 "$OUT/bench_next_hf.log" "${BENCH[@]}" --model $NEXT --num-prompts 16 --input-len 256 \
    --output-len 128 --max-running 16 --baseline hf --baseline-batch 16 --json "$OUT/bench_next_hf.json"

python3 - "$OUT" <<'PY'
import json, os, re, sys

out = sys.argv[1]
rows = []
for line in open(os.path.join(out, "parts.tsv")):
    name, status, seconds = line.rstrip("\n").split("\t")
    rows.append((name, f"{status}, {seconds} s"))
for name, log in (("kernel tests", "hybrid_kernel_tests.log"), ("engine tests", "gpu_hybrid_tests.log")):
    path = os.path.join(out, log)
    text = open(path).read() if os.path.exists(path) else ""
    found = re.findall(r"^=*\s*(\d+ (?:passed|failed|skipped|error).*?) in [\d.]+s", text, re.M)
    rows.append((name, found[-1] if found else "no pytest summary (timed out or not run)"))


def bench_rows(label, path):
    if not os.path.exists(path):
        rows.append((label, "no report"))
        return
    report = json.load(open(path))
    r, bw = report["rollout"], report["bandwidth"]
    rows.append((f"{label}: output tok/s", f"{r['output_tokens_per_s']:,.1f} ({r['requests']} requests, {r['seconds']:.1f} s)"))
    if r.get("decode_step_ms") is not None:
        rows.append((f"{label}: decode step / GPU idle", f"{r['decode_step_ms']:.2f} ms / {r['decode_gpu_idle_share']:.1%}"))
    if bw.get("fraction_of_limit") is not None:
        rows.append((f"{label}: fraction of bandwidth limit", f"{bw['fraction_of_limit']:.1%} of {bw['limit_output_tokens_per_s']:,.0f} tok/s"))
    capture, peak = r["cuda_graph_capture_s"], r["peak_memory_gib"]
    rows.append((f"{label}: graph capture / peak memory",
                 f"{capture if capture is None else round(capture, 1)} s / {peak if peak is None else round(peak, 1)} GiB"))
    if "hf" in report:
        rows.append((f"{label}: HF generate", f"{report['hf']['output_tokens_per_s']:,.1f} tok/s (batch {report['hf']['batch']}), "
                     f"speed-up {report['speedup_vs_hf']:.2f}x"))


bench_rows("bench 256x256x2048", os.path.join(out, "bench_next.json"))
bench_rows("bench 16x256x128 + HF", os.path.join(out, "bench_next_hf.json"))
chunk = os.path.join(out, "chunk_gdr_bench.log")
if os.path.exists(chunk):
    for line in open(chunk):
        if re.match(r"^\d+ ", line):
            rows.append((f"chunk delta rule, 4 x {line.split()[0]}", line.split(" ", 1)[1].strip()[:150]))
width = max(len(k) for k, _ in rows)
print("\n== summary")
for key, value in rows:
    print(f"{key:<{width}}  {value}")
PY
