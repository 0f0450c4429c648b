"""Tune the batch-invariant matmul's launch config for every weight shape of a model (GPU only).

    python scripts/tune_batch_invariant_matmul.py --model recipes/configs/qwen3-0.6b --write
    python scripts/tune_batch_invariant_matmul.py --model recipes/configs/qwen3-8b --quick

The shapes are the model's own: it is built on the meta device and every matrix the on-policy mode
runs through the matmul is listed (linear layers, the LM head, the MoE router). For each shape
every candidate config is timed at several batch sizes M (decode batches and a prefill chunk);
its score is the weighted mean of its time over cuBLAS's at the same M (decode at 256 counts
most, as in an RL rollout), and the best scoring config is the shape's, for every M: the
batch-invariance rule (kernels/batch_invariant_config.py). --write saves it where the engine reads
it. Prints one row per shape: the chosen config and its time / cuBLAS at each M.
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

from rollout_kernels.batch_invariant_config import CONFIG_DIR, DEFAULT, KEYS, config_file_name  # noqa: E402

# M -> weight in the score: a decode-heavy rollout, with the tail's small batches and prefill chunks
BATCH_WEIGHTS = {1: 0.1, 32: 0.1, 256: 0.6, 2048: 0.2}


def candidates(quick: bool) -> list[dict]:
    """Configs to time: tiles, K chunk, K split, warps and stages."""
    blocks_m, blocks_n = ((64,), (64, 128)) if quick else ((32, 64, 128), (64, 128, 256))
    splits = (1, 4) if quick else (1, 2, 4, 8)
    stages = ((4, 3),) if quick else ((4, 3), (8, 4))
    out = [dict(DEFAULT)]
    for bm, bn, split, (warps, stage) in itertools.product(blocks_m, blocks_n, splits, stages):
        config = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 64, "SPLIT_K": split, "num_warps": warps,
                  "num_stages": stage}
        if config not in out:
            out.append(config)
    return out


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


def time_config(x: torch.Tensor, w: torch.Tensor, config: dict | None) -> float:
    """Median seconds of one matmul (config None: cuBLAS)."""
    import triton

    from rollout_kernels.batch_invariant_matmul import batch_invariant_matmul

    out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    if config is None:
        return triton.testing.do_bench(lambda: torch.matmul(x, w.t(), out=out), return_mode="median") * 1e-3
    return triton.testing.do_bench(lambda: batch_invariant_matmul(x, w, out=out, config=config),
                                   return_mode="median") * 1e-3


def tune_shape(n: int, k: int, dtype: torch.dtype, configs: list[dict]) -> tuple[dict, dict]:
    """-> (best config, {M: (its seconds, cuBLAS seconds)})."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype)
    inputs = {m: torch.randn(m, k, device="cuda", generator=gen).to(dtype) for m in BATCH_WEIGHTS}
    cublas = {m: time_config(x, w, None) for m, x in inputs.items()}
    best, best_score, best_times = None, float("inf"), {}
    for config in configs:
        try:
            times = {m: time_config(x, w, config) for m, x in inputs.items()}
        except torch.AcceleratorError:  # a fault poisons the CUDA context: every later config would fail too
            raise
        except Exception as error:  # a config the GPU cannot hold (shared memory): skipped, said
            print(f"  N={n} K={k} {config}: {type(error).__name__}", file=sys.stderr)
            continue
        score = sum(weight * times[m] / cublas[m] for m, weight in BATCH_WEIGHTS.items())
        if score < best_score:
            best, best_score, best_times = config, score, times
    return best, {m: (best_times[m], cublas[m]) for m in BATCH_WEIGHTS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a checkpoint or config directory (config.json)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quick", action="store_true", help="a few candidates (a smoke run)")
    parser.add_argument("--write", action="store_true", help=f"save each shape's config under {CONFIG_DIR}")
    parser.add_argument("--out-dir", default=str(CONFIG_DIR))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tuning times kernels on a GPU: run it on the device")
    import triton

    dtype = getattr(torch, args.dtype)
    configs = candidates(args.quick)
    print(f"{len(configs)} candidate configs; M weights {BATCH_WEIGHTS}")
    print(f"{'N':>7} {'K':>6}  config{'':<44} " + " ".join(f"{'M=' + str(m) + ' /cuBLAS':>13}" for m in BATCH_WEIGHTS))
    for n, k in model_shapes(args.model):
        best, times = tune_shape(n, k, dtype, configs)
        shown = ",".join(f"{best[key]}" for key in KEYS)
        print(f"{n:>7} {k:>6}  {shown:<50} " + " ".join(f"{times[m][0] / times[m][1]:>13.2f}" for m in times))
        if args.write:
            Path(args.out_dir).mkdir(parents=True, exist_ok=True)
            record = {"device": torch.cuda.get_device_name(), "triton": triton.__version__,
                      "command": " ".join(sys.argv), "config": best,
                      "seconds_vs_cublas": {str(m): list(t) for m, t in times.items()}}
            (Path(args.out_dir) / config_file_name(n, k, dtype)).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
