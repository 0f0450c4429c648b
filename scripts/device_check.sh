#!/usr/bin/env bash
# Device calls for docs/benchmarks.md: GPU tests, then one `rollout bench` per line of its newest
# section, then the control-plane timings. Name the parts to run (default: all, about 12 minutes,
# more than one device call allows: split it), e.g.
#   bash scripts/device_check.sh tests b06 b8 mixed grpo moe30     # issues 3 and 5, one call
#   bash scripts/device_check.sh moe30hf control                     # the slow HF MoE baseline, issue 4
# Parts: tests (GPU engine + MoE engine tests), b06 (Qwen3-0.6B fixed, HF baseline), b8 (Qwen3-8B
# fixed, HF baseline), mixed, grpo, moe30 (Qwen3-30B-A3B, capture off/on/on/off), moe30hf (the same
# with the HF baseline; a call of its own: HF stops after 400 s and reports a bound), control (reload, CUDA IPC, release / resume on the 8B shape), memtests
# (memory, weight-update and sampler GPU tests), kernels (every kernel's GPU tests), hybrid (the
# Qwen3-Next slice, 256 x 256 in x 2048 out), dense12 (the dense model of the same active size, same
# workload: issue 8's comparison), hybridhf (the slice with the HF baseline, stopped after 120 s: a
# bound, HF on its torch fallback), kernels8 (the GPU tests of the kernels issue 8 added or changed),
# hybridtests (the hybrid engine's GPU tests), longout (the slice with dense MLPs against dense12 at
# 2048 and 8192 output tokens: linear against full attention at equal weights per step), fla (our
# Gated DeltaNet kernels against flash-linear-attention's in one run; carry .whl_fla holding the
# fla-core wheel, installed apart so that HF's baseline keeps its torch fallback), gdnsweep (issue 25 item 5:
# each of our Gated DeltaNet prefill kernels' time under its launch knobs, 4 x 4096 and 16 x 256; no FLA), det (issue 19's test
# files compiled on the GPU, all their tests: bf16 invariance of the kernels, the scorer, Gated
# DeltaNet decode = prefill, the deterministic engine with CUDA graphs, the trainer), det06 / det8 /
# detmixed / detgrpo / detmoe30 / detnext (`rollout bench --deterministic`: the default and the on-policy mode
# in one run, ABBA, on the b06 / b8 / mixed / grpo / moe30 workloads, and the hybrid slice's), fp8b8 / fp8moe30 (issue 20: bf16 then
# --quantization fp8 on the b8 / moe30 workloads), fp8both8 (the b8 workload with FP8 weights and the FP8 KV cache), tail06 / turns06 (issue 21's targets: the GRPO workload
# long-tailed with carry-over, 256 ten-turn episodes), fp8kvtests (FP8 KV cache kernels' GPU tests, decode
# attention over an e4m3 pool against bf16), reason8 / reason06 (issue 25's long-output workload: 1024 in,
# U[1024, 16384] out; preemptions, recomputed tokens, peak batch, the last 10%'s time), pace (admission pacing against
# --no-admission-pacing, ABBA, on 1,024 mixed-length requests through 256 seats: finishes staggered), controlfp8 (control, FP8 weights: reloads re-quantize; run it with control in one call), cascade (issue 25 item 1: decode attention reading a GRPO group's shared prompt once, against plain decode,
# kernel alone, GPU tests first), sharedgrpo (the GRPO workload without and with --shared-prefix-attention, its engine GPU test first; the
# kernel's GPU tests are cascade's), kvsweep (decode attention's stage-1
# tiles over bf16 and e4m3 pools at the 8B's heads, e4m3 with q-dtype and fp16 dots: which tile each pool dtype wants), fp8kv8 (issue 20's FP8 KV target: 8B, 1024 in x 4096 out, both caches), fidelity (issue 19's table, both
# modes, HF bf16 teacher forcing), fidelitymoe / fidelitynext (the same table on 4 layers of the 30B-A3B / Qwen3-Next
# shapes, dummy weights, no HF; fidelitynext32: the Next slice in float32), fp8price06 / fp8pricemoe / fp8pricenext (issue 20's price in
# fidelity per model family: FP8 weights, KV cache, both, scored in bf16; random weights, 4 layers of the MoE / Next), recipe06 (recipes/grpo_loop.sh --deterministic on a random Qwen3-0.6B-shaped
# checkpoint, engine and trainer on the GPU in bf16: logprob_mismatch must be 0.0), tunebi06 / tunebi8 (tune the batch-invariant matmul for the 0.6B / 8B
# shapes, write kernels/configs/batch_invariant_matmul/ and tar it to $OUT/tunebi*.tar to commit; run before det06 /
# det8 in the same call), bitests (the batch-invariant matmul's GPU tests: every shipped table keeps each row's bits), bitiles
# (scripts/check_batch_invariant_tiles.py: does any tile / BLOCK_K / stages / load path change a bit), fp8 (issue 20's FP8 kernels: their GPU tests, then scripts/bench_fp8_gemm.py --write: the GEMM's tables, used by
# later parts of the call, tarred to $OUT/fp8_tables.tar), cublas (which shapes cuBLASLt's blockwise FP8 GEMM
# gets right: scripts/cublas_blockwise_shapes.py), tunefp8moe (the W8A8 fused MoE's configs on the 30B-A3B
# shape, to $OUT), vlmtests
# (issue 23: the VLM GPU tests, graphs vs eager, float32 vs HF), vlm8 (issue 23's target: the Qwen3-VL-8B shape, one
# 448 x 448 image per prompt, HF stopped after 300 s), vtower (the vision tower alone: TFLOP/s, top kernels), spec06
# (issue 22: the GRPO shape greedy, without and with --speculative siblings: eager verify steps against graphs),
# specnext (siblings on the 12-layer Qwen3-Next slice: verify steps with the state kept per draft position), mtpnext
# (--speculative mtp on the same slice with dummy weights: a random head, so this prices the head's pass and the
# eager steps, not the acceptance of a trained head; its plain runs are eager too, next12_plain is the graph baseline).
# spectests (issue 22's GPU tests: the verify kernels compiled, dense verify steps on the decode graphs, MTP with
# graphs and chained drafts on the hybrids), overlap (issue 25 item 2: decoder layers of the 8B / 0.6B shapes as one batch,
# as two halves on one stream, and as two halves on two streams, each a CUDA graph), specmodels (issue 22's targets: scripts/train_speculation_models.py trains a small Qwen3-Next-shaped model with
# its MTP head and a dense one on the standard library's code, 2 minutes each, then bench --speculative mtp at
# batch 32 (128 prompts), siblings on 64 x n16 held-out code prompts, and mtp at batch 256 (compute-bound: no slower), greedy; then scripts/diagnose_mtp.py: the GPU's tokens and drafts against the CPU's; its parts spectrain specmtp32 specsiblings
# specmtp256 specdiag run alone too, SPEC_MINUTES sets the training time, SPEC_LAYERS the trunk's depth (8);
# specmtp32k1: one draft token; specmtp32all: every decode step drafting, profiled; specsiblings1: siblings at T 1; specprof: the
# MTP line at batch 32 with --profile: torch.profiler's kernels and host operators of a short run, prefill included). masktests (--sampling-mask: the kept-set kernel
# compiled against the sampler, masked samples beside graph-replayed ones, HF logits replayed over the masks).
# Logs and JSON go to $OUT.
# torch_memory_saver and the daemon's web stack travel as wheels: `bash scripts/device_wheels.sh`, then carry .whl.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
PARTS=${*:-tests b06 b8 mixed grpo moe30 moe30hf control memtests}
PARTS=${PARTS//specmodels/spectrain specmtp32 specsiblings specmtp256 specdiag}  # issue 22's trained pair, in order
SPEC=${SPEC:-/tmp/spec}  # where spectrain writes the pair; a later call on the same warm machine finds it there
Q06=recipes/configs/qwen3-0.6b Q8=recipes/configs/qwen3-8b Q30=recipes/configs/qwen3-30b-a3b
QVL8=recipes/configs/qwen3-vl-8b
NEXT=recipes/configs/qwen3-next-80b-a3b-12l DENSE12=recipes/configs/qwen3-dense-a3b-12l
NEXTMLP=recipes/configs/qwen3-next-dense-mlp-12l
bench() {  # NAME TIMEOUT ARGS...: one bench, its table to the log and the reply, its JSON to $OUT
    local name=$1 limit=$2; shift 2
    echo "== $name: rollout bench $*"
    COLUMNS=200 timeout "$limit" python3 -m rollout_cli.cli.main bench --load-format dummy "$@" \
        --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log" | grep -E "│|limit tok/s" | grep -vE "requests /|preemptions|peak memory"
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
for part in $PARTS; do
    case $part in
    tests) timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/e2e/test_gpu_engine.py \
               tests/e2e/test_gpu_moe_engine.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
           grep -q " failed" "$OUT/gpu_tests.log" && { echo "GPU tests failed: no benches"; exit 1; } ;;
    memtests) timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/e2e/test_gpu_memory.py \
               tests/e2e/test_gpu_weight_updates.py tests/kernels/test_sampling.py tests/kernels/test_sampling_chunked.py 2>&1 | tee "$OUT/gpu_memtests.log" | tail -4 ;;
    kernels) timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels 2>&1 \
               | tee "$OUT/gpu_kernel_tests.log" | grep -E "^FAILED|passed|failed" | tail -20 ;;
    kernels8) timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_gdn_gating_norm.py \
               tests/kernels/test_rmsnorm.py tests/kernels/test_chunk_gated_delta_rule.py \
               tests/kernels/test_qk_norm_rope_store.py tests/kernels/test_sampling.py tests/kernels/test_sampling_chunked.py 2>&1 \
               | tee "$OUT/gpu_kernel8_tests.log" | grep -E "^FAILED|passed|failed" | tail -20 ;;
    spectests) timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_linear_verify_kernels.py \
               tests/e2e/test_gpu_engine.py tests/e2e/test_gpu_hybrid.py -k "verify or mtp or draft" 2>&1 | tee "$OUT/gpu_spec_tests.log" | grep -E "^FAILED|passed|failed" | tail -12 ;;
    masktests) timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_sampling_support.py \
               tests/e2e/test_gpu_engine.py::test_sampling_masks_on_the_gpu_sampler 2>&1 \
               | tee "$OUT/gpu_mask_tests.log" | grep -E "^FAILED|passed|failed" | tail -12 ;;
    hybridtests) timeout 200 python3 -m pytest -q -p no:cacheprovider tests/e2e/test_gpu_hybrid.py tests/kernels/test_linear_verify_kernels.py 2>&1 \
               | tee "$OUT/gpu_hybrid_tests.log" | grep -E "^FAILED|passed|failed" | tail -12 ;;
    fla) python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fla_site .whl_fla/*.whl \
           && PYTHONPATH=$PYTHONPATH:/tmp/fla_site timeout 240 python3 scripts/bench_gdn_vs_fla.py --json "$OUT/gdn_vs_fla.json" \
           2>&1 | tee "$OUT/gdn_vs_fla.log" | tail -45 ;;
    gdnsweep) timeout 400 python3 scripts/bench_gdn_vs_fla.py --sweep --json "$OUT/gdn_sweep.json" 2>&1 \
           | tee "$OUT/gdn_sweep.log" | tail -44 ;;
    hybrid) bench next12_fixed 150 --model $NEXT --num-prompts 256 --input-len 256 --output-len 2048 ;;
    dense12) bench dense12_fixed 150 --model $DENSE12 --num-prompts 256 --input-len 256 --output-len 2048 ;;
    longout) for len in 2048 8192; do  # linear vs full attention at the same weights per step, two output lengths
               bench nextmlp_$len 200 --model $NEXTMLP --num-prompts 256 --input-len 256 --output-len $len
               bench dense12_$len 200 --model $DENSE12 --num-prompts 256 --input-len 256 --output-len $len; done ;;
    hybridhf) bench next12_hf 420 --model $NEXT --num-prompts 256 --input-len 256 --output-len 2048 --baseline hf \
               --baseline-time-limit 120 ;;
    b06) bench b06_fixed 150 --model $Q06 --num-prompts 256 --input-len 256 --output-len 512 --baseline hf --profile ;;
    b8) bench b8_fixed 200 --model $Q8 --num-prompts 256 --input-len 256 --output-len 512 --baseline hf --profile ;;
    mixed) bench b06_mixed 60 --model $Q06 --num-prompts 256 --input-len-range 100 1024 --output-len-range 100 1024 --temperature 0.6 ;;
    grpo) bench b06_grpo 70 --model $Q06 --num-prompts 64 --n 16 --input-len 512 --output-len 1024 ;;
    moe30) bench b30_capture 150 --model $Q30 --num-prompts 256 --input-len 256 --output-len 512 --capture-routing compare ;;
    moe30hf) bench b30_hf 580 --model $Q30 --num-prompts 256 --input-len 256 --output-len 512 --baseline hf --baseline-time-limit 400 ;;
    bitests) timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_batch_invariant_matmul.py 2>&1 \
               | tee "$OUT/gpu_bi_tests.log" | grep -E "^FAILED|passed|failed" | tail -12 ;;
    bitiles) timeout 500 python3 scripts/check_batch_invariant_tiles.py 2>"$OUT/bitiles.err" | tee "$OUT/bitiles.log" | tail -34 ;;
    det) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_batch_invariant_matmul.py \
               tests/kernels/test_batch_invariant_attention.py tests/kernels/test_sampling_score.py \
               tests/kernels/test_linear_attention_invariance.py tests/kernels/test_chunk_gated_delta_rule.py \
               tests/e2e/test_gpu_deterministic.py 2>&1 | tee "$OUT/gpu_det_tests.log" | grep -E "^FAILED|passed|failed" | tail -12 ;;
    det06) bench b06_det 300 --model $Q06 --num-prompts 256 --input-len 256 --output-len 512 --deterministic ;;
    det8) bench b8_det 400 --model $Q8 --num-prompts 256 --input-len 256 --output-len 512 --deterministic ;;
    detmixed) bench b06_mixed_det 200 --model $Q06 --num-prompts 256 --input-len-range 100 1024 --output-len-range 100 1024 \
               --temperature 0.6 --deterministic ;;
    detgrpo) bench b06_grpo_det 250 --model $Q06 --num-prompts 64 --n 16 --input-len 512 --output-len 1024 --deterministic ;;
    detnext) bench next12_det 400 --model $NEXT --num-prompts 256 --input-len 256 --output-len 512 --deterministic ;;
    detmoe30) bench b30_det 500 --model $Q30 --num-prompts 256 --input-len 256 --output-len 512 --deterministic ;;
    tunebi06|tunebi8) model=$Q06; [ $part = tunebi8 ] && model=$Q8
               timeout 500 python3 scripts/tune_batch_invariant_matmul.py --model $model --write 2>&1 \
               | tee "$OUT/$part.log" | tail -12  # a tar: the JSON names hold "=" and ",", which $OUT does not return
               tar -C kernels/configs -cf "$OUT/$part.tar" batch_invariant_matmul ;;
    fp8) timeout 180 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_blockwise.py \
               tests/kernels/test_fp8_blockwise_config.py tests/kernels/test_fused_moe_fp8.py 2>&1 \
               | tee "$OUT/gpu_fp8_tests.log" | grep -E "^FAILED|passed|failed" | tail -8
           timeout 330 python3 scripts/bench_fp8_gemm.py --write --json "$OUT/fp8_gemm.json" 2>"$OUT/fp8_gemm.err" \
               | tee "$OUT/fp8_gemm.log" | tail -26  # the tables the later parts of this call run; a tar to commit
           tar -C kernels/configs -cf "$OUT/fp8_tables.tar" fp8_blockwise ;;
    cublas) timeout 120 python3 scripts/cublas_blockwise_shapes.py 2>&1 | tee "$OUT/cublas_shapes.log" | tail -14 ;;
    tunefp8moe) timeout 300 python3 scripts/tune_fused_moe.py --model-config $Q30/config.json --dtype float8_e4m3fn \
               --buckets 1,8,32,64,128,256,512,1024,4096 --time-budget-s 200 2>&1 | tee "$OUT/tune_fp8moe.log" | grep -E "T=[0-9]+:|wrote"
           tar -C kernels/configs -cf "$OUT/tune_fp8moe.tar" fused_moe ;;  # a tar: "=" and "," names do not come back
    fp8b8) bench b8_bf16 200 --model $Q8 --num-prompts 256 --input-len 256 --output-len 512
           bench b8_fp8 200 --model $Q8 --num-prompts 256 --input-len 256 --output-len 512 --quantization fp8 --profile ;;
    fp8both8) bench b8_fp8_fp8kv 200 --model $Q8 --num-prompts 256 --input-len 256 --output-len 512 --quantization fp8 \
               --kv-cache-dtype fp8 ;;
    fp8moe30) bench b30_bf16 200 --model $Q30 --num-prompts 256 --input-len 256 --output-len 512
           bench b30_fp8 200 --model $Q30 --num-prompts 256 --input-len 256 --output-len 512 --quantization fp8 --profile ;;
    fp8kvtests) timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_kv_pool.py tests/kernels/test_kv_store.py \
               tests/kernels/test_decode_attention.py tests/kernels/test_extend_attention.py tests/kernels/test_qk_norm_rope_store.py 2>&1 \
               | tee "$OUT/gpu_fp8kv_tests.log" | grep -E "^FAILED|passed|failed" | tail -8
           timeout 120 python3 -m pytest -q -p no:cacheprovider \
               "tests/e2e/test_gpu_engine.py::test_fp8_kv_cache_graphs_replay_the_eager_steps_and_match_the_torch_path" 2>&1 \
               | tee "$OUT/gpu_fp8kv_engine.log" | grep -E "^FAILED|passed|failed" | tail -4
           python3 -c "import torch; from rollout_kernels.decode_attention import benchmark_decode_attention as b
hbm = 4.8e12 if 'H200' in torch.cuda.get_device_name() else 3.35e12
for kv in (None, torch.float8_e4m3fn):
    for batch, ctx in ((256, 1024), (256, 4096), (64, 8192)):
        r = b(batch=batch, context=ctx, num_heads=32, num_kv_heads=8, kv_dtype=kv, num_kv_splits=1 if batch == 256 else 4, hbm_bytes_per_s=hbm)
        print(r['kv_dtype'], batch, ctx, round(r['time_us'], 1), 'us', round(r['hbm_fraction'], 3))" 2>&1 | tee "$OUT/fp8kv_decode.log" ;;
    kvsweep) python3 -c "import torch; from rollout_kernels.decode_attention import benchmark_decode_attention as b
hbm = 4.8e12 if 'H200' in torch.cuda.get_device_name() else 3.35e12
for kv, f16 in ((None, False), (torch.float8_e4m3fn, False), (torch.float8_e4m3fn, True)):  # f16: e4m3 -> f16 dots
    for batch, ctx in ((256, 3072), (64, 8192)):  # the 8B's heads; issue 20: e4m3 ran at ~50% of its limit
        for cfg in ((64, 4, 3), (128, 4, 3), (128, 8, 3), (64, 8, 4)):
            r = b(batch=batch, context=ctx, num_heads=32, num_kv_heads=8, kv_dtype=kv, num_kv_splits=1 if batch == 256 else 4,
                  hbm_bytes_per_s=hbm, stage1_config=cfg, f16_dots=f16)
            print(r['kv_dtype'], 'f16' if f16 else 'q', batch, ctx, cfg, round(r['time_us'], 1), 'us', round(r['hbm_fraction'], 3))" 2>&1 | tee "$OUT/kvsweep.log" ;;
    cascade) timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_shared_prefix_decode_attention.py 2>&1 \
               | tee "$OUT/gpu_cascade_tests.log" | grep -E "^FAILED|passed|failed" | tail -4
           python3 -c "import torch; from rollout_kernels.shared_prefix_decode_attention import benchmark_shared_prefix as b
hbm = 4.8e12 if 'H200' in torch.cuda.get_device_name() else 3.35e12
for heads in (16, 32):  # the 0.6B's and the 8B's heads, 8 kv heads; GRPO: 16 groups of n 16, 512-token prompts
    for kv in (None, torch.float8_e4m3fn):
        for suffix in (64, 512, 1024):
            for ps in (2, 4):
                r = b(num_groups=16, group_size=16, prefix_len=512, suffix_len=suffix, num_heads=heads, num_kv_heads=8,
                      kv_dtype=kv, prefix_splits=ps, hbm_bytes_per_s=hbm)
                print(heads, r['kv_dtype'], 'suffix', suffix, 'prefix splits', ps, 'plain', round(r['plain_us'], 1),
                      'us', round(r['plain_fraction'], 3), 'shared', round(r['shared_us'], 1), 'us',
                      round(r['shared_fraction'], 3), 'x', round(r['plain_us'] / r['shared_us'], 2))" 2>&1 | tee "$OUT/cascade.log" ;;
    sharedgrpo) timeout 150 python3 -m pytest -q -p no:cacheprovider \
               "tests/e2e/test_gpu_engine.py::test_shared_prefix_graphs_sample_what_the_plain_kernel_does" 2>&1 \
               | tee "$OUT/gpu_shared_prefix_tests.log" | grep -E "^FAILED|passed|failed" | tail -4
           bench b06_grpo_plain 100 --model $Q06 --num-prompts 64 --n 16 --input-len 512 --output-len 1024
           bench b06_grpo_shared 100 --model $Q06 --num-prompts 64 --n 16 --input-len 512 --output-len 1024 \
               --shared-prefix-attention ;;
    fp8kv8) bench b8_long_bf16kv 280 --model $Q8 --num-prompts 256 --input-len 1024 --output-len 4096
           bench b8_long_fp8kv 280 --model $Q8 --num-prompts 256 --input-len 1024 --output-len 4096 --kv-cache-dtype fp8 ;;
    reason8|reason06) model=$Q8; [ $part = reason06 ] && model=$Q06  # issue 25's long reasoning outputs
           bench ${part}_long 580 --model $model --num-prompts 256 --input-len 1024 --output-len-range 1024 16384
           grep -E "preemptions|peak running|fraction of" "$OUT/${part}_long.log" ;;
    tail06) bench b06_grpo_tail 300 --model $Q06 --num-prompts 64 --n 16 --input-len 512 --output-len 1024 \
               --long-tail 0.1 --carry-over 3 ;;
    pace) for run in 1_paced 2_unpaced 3_unpaced 4_paced; do  # admission pacing, ABBA: 1,024 mixed requests, 256 seats
              flag=; [ "${run#*_}" = unpaced ] && flag=--no-admission-pacing
              bench b06_mixed1024_$run 200 --model $Q06 --num-prompts 1024 --input-len-range 100 1024 \
                  --output-len-range 100 1024 --temperature 0.6 $flag
          done ;;
    turns06) bench b06_turns 300 --model $Q06 --num-prompts 256 --input-len 512 --output-len 256 --turns 10 \
               --observation-len 32 ;;
    fidelity) timeout 500 python3 scripts/fidelity_check.py --model $Q06 --random-weights /tmp/q06_random \
               --num-prompts 64 --n 4 --min-len 64 --max-len 512 --output-len 256 --modes default,deterministic --hf 2>&1 | tee "$OUT/fidelity.log" | tail -20 ;;
    fidelitymoe|fidelitynext|fidelitynext32) model=$Q30; [ $part != fidelitymoe ] && model=$NEXT  # 4 layers
               dtype=bfloat16; [ $part = fidelitynext32 ] && dtype=float32  # precision or a bug: the default mode's gap
               timeout 400 python3 scripts/fidelity_check.py --model $model --num-layers 4 --load-format dummy \
               --dtype $dtype --num-prompts 32 --n 4 --min-len 64 --max-len 256 --output-len 128 \
               --modes default,deterministic 2>&1 | tee "$OUT/$part.log" | tail -9 ;;
    fp8price06|fp8pricemoe|fp8pricenext) model=$Q06 layers=; [ $part = fp8pricemoe ] && model=$Q30 layers="--num-layers 4"
               [ $part = fp8pricenext ] && model=$NEXT layers="--num-layers 4"  # random weights, final norm x8
               timeout 500 python3 scripts/fidelity_check.py --model $model $layers --random-weights /tmp/$part \
               --num-prompts 32 --n 4 --min-len 64 --max-len 256 --output-len 256 --modes fp8,fp8kv,fp8both 2>&1 \
               | tee "$OUT/$part.log" | tail -4 ;;
    recipe06) python3 scripts/random_checkpoint.py $Q06 /tmp/q06_recipe --tokenizer-from recipes/example_model >/dev/null \
               && WORKDIR=/tmp/grpo06 MODEL=/tmp/q06_recipe DETERMINISTIC=1 ITERATIONS=2 GROUP_SIZE=8 LIMIT=16 \
               MAX_NEW_TOKENS=128 TRAIN_STEPS=2 ROLLOUT="python3 -m rollout_cli.cli.main" PYTHON=python3 \
               timeout 400 bash recipes/grpo_loop.sh 2>&1 | tee "$OUT/recipe06.log" | tail -4
           grep -q "^error: rollout serve" "$OUT/recipe06.log" && tail -25 /tmp/grpo06/serve.log ;;
    spectrain) timeout 330 python3 scripts/train_speculation_models.py --out $SPEC --minutes ${SPEC_MINUTES:-2} \
               --num-prompts 1024 ${SPEC_LAYERS:+--layers $SPEC_LAYERS} 2>&1 \
               | tee "$OUT/train_spec.log" | grep -E "step .*000 |wrote|tokens" ;;
    # the trained checkpoints' own weights: bench() passes --load-format dummy, and the last one given wins
    specmtp32) bench spec_mtp32 120 --model $SPEC/hybrid --data $SPEC/prompts.parquet --load-format auto \
               --num-prompts 128 --max-running 32 --output-len 256 --temperature 0 --speculative mtp \
               --num-draft-tokens 2 ;;
    specmtp32all) bench spec_mtp32_always 120 --model $SPEC/hybrid --data $SPEC/prompts.parquet --load-format auto \
               --num-prompts 128 --max-running 32 --output-len 256 --temperature 0 --speculative mtp \
               --num-draft-tokens 2 --speculative-always --profile ;;  # every decode step drafts, profiled
    specmtp32k1) bench spec_mtp32_k1 120 --model $SPEC/hybrid --data $SPEC/prompts.parquet --load-format auto \
               --num-prompts 128 --max-running 32 --output-len 256 --temperature 0 --speculative mtp \
               --num-draft-tokens 1 ;;  # one draft: no chain inside the step (the hybrid verify graphs' case)
    specsiblings) bench spec_siblings 120 --model $SPEC/dense --data $SPEC/prompts.parquet --load-format auto \
               --num-prompts 64 --n 16 --output-len 256 --temperature 0 --speculative siblings ;;
    specsiblings1) bench spec_siblings_t1 120 --model $SPEC/dense --data $SPEC/prompts.parquet --load-format auto \
               --num-prompts 64 --n 16 --output-len 256 --temperature 1 --speculative siblings ;;  # GRPO samples at T 1
    specmtp256) bench spec_mtp256 100 --model $SPEC/hybrid --data $SPEC/prompts.parquet --load-format auto \
               --num-prompts 1024 --output-len 256 --temperature 0 --speculative mtp --num-draft-tokens 2 ;;  # 4 waves: runs of 1 s were 20% apart
    specprof) COLUMNS=200 timeout 200 python3 -m rollout_cli.cli.main bench --model $SPEC/hybrid --data $SPEC/prompts.parquet \
               --num-prompts 128 --max-running 32 --output-len 256 --temperature 0 --speculative mtp \
               --num-draft-tokens 2 --profile --json "$OUT/spec_mtp32_prof.json" > "$OUT/spec_mtp32_prof.log" 2>&1
              grep -E "prefill steps|speculation|plain, drafts|gate|decode" "$OUT/spec_mtp32_prof.log"
              sed -n '/Name/,$p' "$OUT/spec_mtp32_prof.log" | cut -c1-200 | head -60 ;;
    specdiag) timeout 150 python3 scripts/diagnose_mtp.py --model $SPEC/hybrid --data $SPEC/prompts.parquet \
               --num-draft-tokens ${SPEC_DIAG_DRAFTS:-1} 2>&1 \
               | tee "$OUT/diagnose_mtp.log" | grep -E "^(cpu|cuda)" ;;
    control) timeout 200 python3 scripts/control_plane_bench.py --config $Q8 --workdir /tmp/cp 2>&1 | tee "$OUT/control_plane.log" | tail -12 ;;
    controlfp8) timeout 250 python3 scripts/control_plane_bench.py --config $Q8 --workdir /tmp/cp --quantization fp8 2>&1 \
               | tee "$OUT/control_plane_fp8.log" | tail -13 ;;
    vlmtests) timeout 240 python3 -m pytest -q -p no:cacheprovider tests/e2e/test_gpu_vlm.py 2>&1 \
               | tee "$OUT/gpu_vlm_tests.log" | grep -E "^FAILED|passed|failed" | tail -6 ;;
    spec06) bench b06_grpo_greedy 150 --model $Q06 --num-prompts 64 --n 16 --input-len 512 --output-len 1024 --temperature 0
            bench b06_grpo_greedy_spec 420 --model $Q06 --num-prompts 64 --n 16 --input-len 512 --output-len 1024 \
               --temperature 0 --speculative siblings
            grep -E "speculation|plain, drafts" "$OUT/b06_grpo_greedy_spec.log" ;;
    specnext) bench next12_spec 420 --model $NEXT --num-prompts 64 --n 4 --input-len 256 --output-len 512 \
               --temperature 0 --speculative siblings
            grep -E "speculation|plain, drafts" "$OUT/next12_spec.log" ;;
    mtpnext) bench next12_plain 150 --model $NEXT --num-prompts 64 --input-len 256 --output-len 512 --temperature 0
            bench next12_mtp 420 --model $NEXT --num-prompts 64 --input-len 256 --output-len 512 --temperature 0 \
               --speculative mtp
            grep -E "speculation|plain, drafts" "$OUT/next12_mtp.log" ;;
    vtower) timeout 200 python3 scripts/bench_vision_tower.py --config $QVL8 --images 4 17 64 --profile 2>&1 \
               | tee "$OUT/vision_tower.log" | head -40 ;;
    vlm8) bench vl8_images 580 --model $QVL8 --num-prompts 256 --input-len 256 --output-len 512 --images 1 \
               --image-size 448 448 --baseline hf --baseline-time-limit 300
          grep -E "vision tower" "$OUT/vl8_images.log" ;;
    overlap) timeout 300 python3 scripts/bench_microbatch_overlap.py --json "$OUT/microbatch_overlap.json" 2>&1 \
               | tee "$OUT/microbatch_overlap.log" | tail -8 ;;
    *) echo "unknown part $part" ;;
    esac
done
