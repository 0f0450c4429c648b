"""Tune the fused MoE GEMMs' launch configs on this GPU and write kernels/configs/fused_moe/-style JSON.

    python scripts/tune_fused_moe.py --model-config recipes/configs/qwen3-30b-a3b/config.json \
        --buckets 1,8,32,64,128,256,1024,4096 --out kernels/configs/fused_moe --time-budget-s 170

For each batch bucket T (tokens) and each BLOCK_SIZE_M that suits T * top_k / E rows per expert,
every candidate gate/up config is timed, then, with the winner's output as input, every down
config; the BLOCK_SIZE_M with the smallest sum wins. Times are medians of CUDA-graph replays over
several random routings (kernels/fused_moe_bench.py). Candidates are compiled first, in parallel
worker processes that fill Triton's on-disk cache (one compile serves every bucket: batch-size
ints are not specialised). With --time-budget-s the remaining time is split over the remaining
buckets, each trying its candidates most-promising first; a bucket that runs out keeps its best.
`--dtype float8_e4m3fn` tunes the W8A8 kernels (kernels/fused_moe_fp8.py) that `--quantization fp8`
runs: e4m3 experts, bf16 activations quantized inside, BLOCK_SIZE_K the scale block's 128.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float8_e4m3fn": torch.float8_e4m3fn}  # W8A8: e4m3 experts, bf16 activations quantized in the kernel
SMEM_LIMIT = 200 * 1024  # bytes of pipelined tiles we allow (H100/H200: 227 KiB per block)


def block_ms(num_tokens: int, num_experts: int, top_k: int) -> list[int]:
    rows = num_tokens * top_k / num_experts  # slots per expert, on average
    if rows <= 4:
        return [16]
    if rows <= 16:
        return [16, 32]
    if rows <= 64:
        return [32, 64]
    return [64, 128]


def candidates(block_m: int, n: int, k: int, elt: int, gated: bool, fp8: bool = False) -> list[dict]:
    """Launch configs for one GEMM (N = n output columns, K = k), most promising first. fp8: e4m3
    weights (elt 1), activations read in bf16, BLOCK_SIZE_K the scale block's 128."""
    if block_m <= 32:  # few rows per expert: the GEMM streams weights; many programs, deep pipelines
        space = itertools.product([32, 64, 16, 128], [128, 64, 256], [1], [4], [4, 3, 5])
    else:
        space = itertools.product([128, 64, 256], [64, 128, 32], [8, 1], [4, 8], [3, 4])
    out = []
    for bn, bk, group, warps, stages in space:
        bn, bk = min(bn, max(16, triton_next_pow2(n))), min(bk, max(16, triton_next_pow2(k)))  # small shapes
        if fp8:
            bk = 128
        tile_bytes = (gated + 1) * bk * bn * elt + block_m * bk * (2 if fp8 else elt)
        if stages * tile_bytes > SMEM_LIMIT:
            continue
        if (gated + 1) * block_m * bn > 128 * 32 * warps:  # fp32 accumulators: <= 128 registers per thread
            continue
        cfg = dict(BLOCK_SIZE_M=block_m, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=group,
                   num_warps=warps, num_stages=stages)
        if cfg not in out:
            out.append(cfg)
    return out


def triton_next_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


def job_key(kind: str, cfg: dict) -> str:
    return f"{kind} {json.dumps(cfg, sort_keys=True)}"


def moe_problem(shape, dtype: torch.dtype, num_tokens: int, routings: int = 1, init_weights: bool = True):
    """(problem, gate_up(hidden, layout, cfg), down(mid, topk_weights, layout, cfg)) for `dtype`: the bf16 /
    fp16 / fp32 kernels, or for float8_e4m3fn the W8A8 ones on the problem's experts quantized in blocks
    of (the largest power of two up to 128 dividing I and H) x 128 rows, as the engine quantizes them."""
    from rollout_kernels.fused_moe import moe_down, moe_gate_up
    from rollout_kernels.fused_moe_bench import make_problem

    num_experts, top_k, hidden, inter = shape
    fp8 = dtype == torch.float8_e4m3fn
    p = make_problem(num_tokens, num_experts, top_k, hidden, inter, torch.bfloat16 if fp8 else dtype, routings,
                     init_weights=init_weights)
    if not fp8:
        return (p, lambda h, lay, cfg: moe_gate_up(h, p.w13, top_k, lay, cfg),
                lambda m, w, lay, cfg: moe_down(m, p.w2, w, lay, cfg))
    from rollout_kernels.fp8_blockwise_ref import quantize_weight_blockwise
    from rollout_kernels.fused_moe_fp8 import moe_down_fp8, moe_gate_up_fp8

    rows = math.gcd(128, inter, hidden)

    def quantized(w):  # [E, N, K] -> e4m3 [E, N, K], scales [E, N / rows, K / 128]
        pairs = [quantize_weight_blockwise(w[e], (rows, 128)) for e in range(w.shape[0])]
        return torch.stack([q for q, _ in pairs]), torch.stack([sc for _, sc in pairs])

    (w13, s13), (w2, s2) = quantized(p.w13), quantized(p.w2)
    return (p, lambda h, lay, cfg: moe_gate_up_fp8(h, w13, s13, top_k, lay, cfg, rows),
            lambda m, w, lay, cfg: moe_down_fp8(m, w2, s2, w, lay, cfg, rows))


def _compile_worker(job) -> list[str]:
    """In a fresh process: launch each (kind, config) once on a one-token problem; returns the keys that failed."""
    shape, dtype_name, jobs = job
    import torch

    from rollout_kernels.moe_align import moe_align_block_size

    num_experts, top_k, hidden, inter = shape
    p, gate_up, down = moe_problem(shape, DTYPES[dtype_name], 1, init_weights=False)
    weights, ids = p.routings[0]
    failed = []
    mid = torch.zeros((top_k, inter), dtype=p.w13.dtype, device=p.w13.device)
    for kind, cfg in jobs:
        try:
            layout = moe_align_block_size(ids, num_experts, cfg["BLOCK_SIZE_M"])
            if kind == "w13":
                gate_up(p.hidden[0], layout, cfg)
            else:
                down(mid, weights, layout, cfg)
            if mid.is_cuda:
                torch.cuda.synchronize()
        except Exception:  # out of shared memory / registers: the tuner skips it
            failed.append(job_key(kind, cfg))
    return failed


def compile_all(shape, dtype_name: str, jobs: list, workers: int) -> set[str]:
    if workers <= 1 or not jobs:
        return set(_compile_worker((shape, dtype_name, jobs)))
    chunks = [jobs[i::workers] for i in range(workers)]
    failed = set()
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(_compile_worker, (shape, dtype_name, c)) for c in chunks if c]
        for future in futures:
            try:
                failed.update(future.result())
            except Exception as err:  # a crashed worker: its kernels compile (or fail) in the tuning loop
                print(f"compile worker failed: {type(err).__name__}: {err}", file=sys.stderr)
    return failed


def tune_bucket(num_tokens: int, shape, dtype: torch.dtype, deadline: float, rep_ms: int, failed: set, log) -> dict:
    from rollout_kernels.fused_moe_bench import default_num_routings, time_in_graph
    from rollout_kernels.fused_moe_config import W2_KEYS, default_config, fit_to_shape
    from rollout_kernels.moe_align import moe_align_block_size

    num_experts, top_k, hidden, inter = shape
    routings = default_num_routings(num_tokens)
    p, gate_up, down = moe_problem(shape, dtype, num_tokens, routings)
    fp8 = dtype == torch.float8_e4m3fn
    elt = torch.empty((), dtype=dtype).element_size()

    def time_w13(cfg, layouts):
        return time_in_graph(lambda: [gate_up(h, lay, cfg) for h, lay in zip(p.hidden, layouts)],
                             rep_ms) / routings

    def time_w2(cfg, layouts, mids):
        return time_in_graph(lambda: [down(m, w, lay, cfg)
                                      for m, (w, _), lay in zip(mids, p.routings, layouts)], rep_ms) / routings

    def best_of(kind, configs, timer, until):
        best = (float("inf"), None)
        for cfg in configs:
            if job_key(kind, cfg) in failed:
                continue
            if time.monotonic() > until and best[1] is not None:
                break
            try:
                best = min(best, (timer(cfg), cfg), key=lambda x: x[0])
            except Exception as err:  # a config the compile step could not build
                log(f"  skip {cfg}: {type(err).__name__}")
        return best

    default = default_config(num_tokens, num_experts, top_k, dtype)
    bms = block_ms(num_tokens, num_experts, top_k)
    results = []
    for i, bm in enumerate(bms):
        layouts = [moe_align_block_size(ids, num_experts, bm) for _, ids in p.routings]
        # each BLOCK_SIZE_M gets its share of what is left (half each GEMM); the last one takes the rest
        now = time.monotonic()
        share = now + (deadline - now) / (len(bms) - i)
        t13, cfg13 = best_of("w13", candidates(bm, inter, hidden, elt, True, fp8), lambda c: time_w13(c, layouts),
                             now + (share - now) / 2)
        mids = [gate_up(h, lay, cfg13) for h, lay in zip(p.hidden, layouts)]
        t2, cfg2 = best_of("w2", candidates(bm, hidden, inter, elt, False, fp8), lambda c: time_w2(c, layouts, mids),
                           share)
        results.append((t13 + t2, cfg13, cfg2, t13, t2))
        deadline_reached = time.monotonic() > share
        log(f"  T={num_tokens} BLOCK_M={bm}: gate/up {t13 * 1e6:.1f} us, down {t2 * 1e6:.1f} us"
            + (" (budget hit)" if deadline_reached else ""))
    total, cfg13, cfg2, t13, t2 = min(results, key=lambda r: r[0])
    # the untuned default, for the record
    d13, d2 = fit_to_shape(default, inter, hidden), fit_to_shape(default, hidden, inter)
    dlayouts = [moe_align_block_size(ids, num_experts, d13["BLOCK_SIZE_M"]) for _, ids in p.routings]
    dmids = [gate_up(h, lay, d13) for h, lay in zip(p.hidden, dlayouts)]
    default_us = (time_w13(d13, dlayouts) + time_w2(d2, dlayouts, dmids)) * 1e6
    entry = {**cfg13, "w2": {k: cfg2[k] for k in W2_KEYS}}
    _, inter_size, hidden_size = p.shape
    # the weights move at the experts' element size (e4m3: 1 byte), activations in the problem's dtype
    bytes_ = p.bytes_per_call() - (0 if not fp8 else p.experts_touched() * 3 * inter_size * hidden_size)
    return {"entry": entry, "us": total * 1e6, "w13_us": t13 * 1e6, "w2_us": t2 * 1e6, "default_us": default_us,
            "gb_per_s": bytes_ / total / 1e9}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-config",
                        help="HF config.json of a MoE model (experts, top-k, hidden, moe intermediate)")
    parser.add_argument("--experts", type=int)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--inter", type=int, help="the experts' intermediate size")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--buckets", default="1,2,4,8,16,32,64,128,256,512,1024,2048,4096")
    parser.add_argument("--out", default="kernels/configs/fused_moe", help="directory for the JSON file")
    parser.add_argument("--time-budget-s", type=float, default=None, help="stop trying candidates after this")
    parser.add_argument("--compile-workers", type=int, default=max(1, min(16, (os.cpu_count() or 2) - 1)))
    parser.add_argument("--rep-ms", type=int, default=10, help="CUDA-graph replay time per candidate")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("tune_fused_moe.py needs a CUDA device", file=sys.stderr)
        return 2
    from rollout_kernels.fused_moe_config import config_file_name, parse_configs

    shape = [args.experts, args.top_k, args.hidden, args.inter]
    if args.model_config:
        cfg = json.loads(Path(args.model_config).read_text())
        found = [cfg.get("num_experts", cfg.get("num_local_experts")), cfg.get("num_experts_per_tok"),
                 cfg.get("hidden_size"), cfg.get("moe_intermediate_size", cfg.get("intermediate_size"))]
        shape = [s if s is not None else f for s, f in zip(shape, found)]
    if any(s is None for s in shape):
        print("give --model-config or all of --experts --top-k --hidden --inter", file=sys.stderr)
        return 2
    shape = tuple(int(s) for s in shape)
    num_experts, top_k, hidden, inter = shape
    dtype = DTYPES[args.dtype]
    buckets = sorted({int(b) for b in args.buckets.split(",")})
    start = time.monotonic()
    deadline = start + args.time_budget_s if args.time_budget_s else float("inf")

    def log(msg):
        print(f"[{time.monotonic() - start:6.1f}s] {msg}", flush=True)

    elt = torch.empty((), dtype=dtype).element_size()
    jobs = {}
    for t in buckets:
        for bm in block_ms(t, num_experts, top_k):
            for kind, n, k in (("w13", inter, hidden), ("w2", hidden, inter)):
                for c in candidates(bm, n, k, elt, kind == "w13", dtype == torch.float8_e4m3fn):
                    jobs[job_key(kind, c)] = (kind, c)
    log(f"E={num_experts} top_k={top_k} H={hidden} I={inter} {args.dtype}: compiling {len(jobs)} kernels "
        f"in {args.compile_workers} workers")
    failed = compile_all(shape, args.dtype, list(jobs.values()), args.compile_workers)
    log(f"compiled ({len(failed)} configs failed to build and will be skipped if tried)")

    out = Path(args.out) / config_file_name(num_experts, inter, hidden, dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    tuned, timings = {}, {}
    for i, t in enumerate(buckets):
        now = time.monotonic()
        bucket_deadline = now + (deadline - now) / (len(buckets) - i)
        result = tune_bucket(t, shape, dtype, bucket_deadline, args.rep_ms, failed, log)
        tuned[str(t)] = result.pop("entry")
        timings[str(t)] = {k: round(v, 2) for k, v in result.items()}
        log(f"T={t}: {result['us']:.1f} us ({result['gb_per_s']:.0f} GB/s), "
            f"default config {result['default_us']:.1f} us")
        data = {
            "device": torch.cuda.get_device_name(), "triton": __import__("triton").__version__,
            "torch": torch.__version__, "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
            "buckets": tuned, "timings_us": timings,
        }
        parse_configs(data, "tuner output")  # what the loader will accept
        out.write_text(json.dumps(data, indent=1) + "\n")  # after every bucket: a killed run keeps what it tuned
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
