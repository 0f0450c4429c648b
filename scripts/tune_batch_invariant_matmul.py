"""Tune the batch-invariant matmul's launch configs for every weight shape of a model (GPU only).

    python scripts/tune_batch_invariant_matmul.py --model recipes/configs/qwen3-0.6b --write
    python scripts/tune_batch_invariant_matmul.py --model recipes/configs/qwen3-8b --quick

The shapes are the model's own: it is built on the meta device and every matrix the on-policy mode
runs through the matmul is listed (linear layers, the LM head, the MoE router). For each shape and
each reduction (BLOCK_K, SPLIT_K: the K-sum order, one per shape), every tile config is timed at one
batch size per bucket of M (decode batches, the GRPO shape's 1,024 rows, a prefill chunk) and kept
for the bucket only if its output equals the reduction's reference config bit for bit at that M
(kernels/batch_invariant_config.py says why tiles may follow M; a tile that changed bits is counted
and printed). A reduction's score is the weighted mean over buckets of its best tile's time over
cuBLAS's at the same M (decode at 256 rows counts most, as in an RL rollout); the best scoring
reduction is the shape's. --write saves its table where the engine reads it. Prints one row per
shape: the reduction, each bucket's tile and its time / cuBLAS.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rollout_kernels.batch_invariant_config import (CONFIG_DIR, DEFAULT, config_file_name, config_for_rows,  # noqa: E402
                                                    parse_config, split_chunk)

# (max_m of the bucket (None: every M above), M timed for it, weight in the score)
BUCKETS = ((16, 16, 0.1), (64, 64, 0.1), (256, 256, 0.5), (1024, 1024, 0.1), (None, 2048, 0.2))


def reductions(quick: bool) -> list[dict]:
    """The K-sum orders to try: K in 1, 2 or 4 splits of BLOCK_K 64 chunks (a tile may take BLOCK_K 128
    where that splits K at the same points)."""
    return [{"BLOCK_K": 64, "SPLIT_K": split} for split in ((1, 4) if quick else (1, 2, 4))]


def tiles(m: int, k: int, reference: dict, quick: bool) -> list[dict]:
    """Tile configs worth timing at M rows for the reduction `reference`: 64-row tiles up to 64 rows
    (the wide MMA's height), 64 or 128 past; BLOCK_K 64 or 128 where it splits K as the reference does."""
    blocks_m = (64,) if m <= 64 else (64, 128)
    blocks_n = (64, 128) if quick else (64, 128, 256)
    blocks_k = [bk for bk in (64, 128) if split_chunk(k, {**reference, "BLOCK_K": bk}) == split_chunk(k, reference)]
    warps_stages = ((4, 3),) if quick else ((4, 3), (4, 4), (4, 5), (8, 3))
    return [{"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}
            for bm, bn, bk, (warps, stages) in itertools.product(blocks_m, blocks_n, blocks_k, warps_stages)]


def model_shapes(model_dir: str) -> list[tuple[int, int]]:
    """(N, K) of every matrix the model multiplies through the batch-invariant matmul."""
    from rollout_cli.models.build import load_model_config
    from rollout_cli.models.layers import Linear
    from rollout_cli.models.moe import TopKRouter
    from rollout_cli.models.registry import model_class_for

    config = load_model_config(model_dir)
    with torch.device("meta"):
        model = model_class_for(config)(config, 16)
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, (Linear, TopKRouter))}
    shapes.add((config.vocab_size, config.hidden_size))  # the LM head (tied or not)
    return sorted(shapes)


def seconds(fn) -> float:
    """Median seconds of one call."""
    import triton

    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e-3


def tune_reduction(w: torch.Tensor, inputs: dict, reduction: dict, quick: bool) -> tuple[list, int]:
    """-> ([(max_m, best tile config, its seconds) per bucket], tiles refused for changed bits)."""
    from rollout_kernels.batch_invariant_matmul import batch_invariant_matmul

    reference = {**DEFAULT, **reduction}
    table, refused = [], 0
    for max_m, m, _ in BUCKETS:
        x = inputs[m]
        out = torch.empty((m, w.shape[0]), dtype=x.dtype, device=x.device)
        want = batch_invariant_matmul(x, w, config=reference).clone()
        best, best_time = None, float("inf")
        for tile in tiles(m, w.shape[1], reference, quick):
            config = {**reference, **tile}
            try:
                got = batch_invariant_matmul(x, w, out=out, config=config)
                if not torch.equal(got, want):
                    refused += 1
                    print(f"  N={w.shape[0]} K={w.shape[1]} M={m} {config}: bits differ from the reference",
                          file=sys.stderr)
                    continue
                time = seconds(lambda: batch_invariant_matmul(x, w, out=out, config=config))
            except torch.AcceleratorError:  # a fault poisons the CUDA context: every later config would fail too
                raise
            except Exception as error:  # a config the GPU cannot hold (shared memory): skipped, said
                print(f"  N={w.shape[0]} K={w.shape[1]} {config}: {type(error).__name__}", file=sys.stderr)
                continue
            if time < best_time:
                best, best_time = config, time
        table.append((max_m, best, best_time))
    return table, refused


def tune_shape(n: int, k: int, dtype: torch.dtype, quick: bool) -> dict:
    """The shape's file content: the best reduction's table, each bucket's time over cuBLAS."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype)
    inputs = {m: torch.randn(m, k, device="cuda", generator=gen).to(dtype) for _, m, _ in BUCKETS}
    cublas = {}
    for m, x in inputs.items():
        out = torch.empty((m, n), dtype=dtype, device="cuda")
        cublas[m] = seconds(lambda: torch.matmul(x, w.t(), out=out))
    best = None
    for reduction in reductions(quick):
        table, refused = tune_reduction(w, inputs, reduction, quick)
        if any(config is None for _, config, _ in table):
            continue
        score = sum(weight * time / cublas[m] for (_, m, weight), (_, _, time) in zip(BUCKETS, table))
        if best is None or score < best[0]:
            best = (score, table, refused)
    score, table, refused = best
    ratios = {str(m): round(time / cublas[m], 2) for (_, m, _), (_, _, time) in zip(BUCKETS, table)}
    by_batch = []
    for max_m, config, _ in table[:-1]:
        if by_batch and by_batch[-1]["config"] == config:  # one entry for neighbouring buckets of one tile
            by_batch[-1]["max_m"] = max_m
        else:
            by_batch.append({"max_m": max_m, "config": config})
    while by_batch and by_batch[-1]["config"] == table[-1][1]:  # a tail of the reference's own tile
        by_batch.pop()
    return {"config": table[-1][1], "by_batch": by_batch, "time_over_cublas": ratios, "tiles_with_other_bits": refused}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a checkpoint or config directory (config.json)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quick", action="store_true", help="a few candidates (a smoke run)")
    parser.add_argument("--write", action="store_true", help=f"save each shape's table under {CONFIG_DIR}")
    parser.add_argument("--out-dir", default=str(CONFIG_DIR))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tuning times kernels on a GPU: run it on the device")
    import triton

    dtype = getattr(torch, args.dtype)
    print(f"buckets (max M, M timed, weight) {BUCKETS}")
    print(f"{'N':>7} {'K':>6} {'BK,SPLIT':>9} {'refused':>7}  " + " ".join(f"{'M=' + str(m):>24}" for _, m, _ in BUCKETS))
    for n, k in model_shapes(args.model):
        record = tune_shape(n, k, dtype, args.quick)
        table = parse_config(record, k, f"the tuned N={n} K={k}")  # as the engine will read the file
        configs = {m: config_for_rows(table, m) for _, m, _ in BUCKETS}
        reference = record["config"]
        cells = [f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']}/{c['num_warps']}w{c['num_stages']}s "
                 f"{record['time_over_cublas'][str(m)]:.2f}" for m, c in configs.items()]
        print(f"{n:>7} {k:>6} {reference['BLOCK_K']:>6},{reference['SPLIT_K']:<2} "
              f"{record['tiles_with_other_bits']:>7}  " + " ".join(f"{cell:>24}" for cell in cells), flush=True)
        if args.write:
            Path(args.out_dir).mkdir(parents=True, exist_ok=True)
            record = {"device": torch.cuda.get_device_name(), "triton": triton.__version__,
                      "command": " ".join(sys.argv), **record}
            (Path(args.out_dir) / config_file_name(n, k, dtype)).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
