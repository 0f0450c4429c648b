"""Does a launch config change a batch-invariant matmul's bits? (GPU only.)

    python scripts/check_batch_invariant_tiles.py

For weight shapes of Qwen3-8B and Qwen3-0.6B and batch sizes from decode to a prefill chunk, runs
every (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) config that fits in shared memory through both load
paths of kernels/batch_invariant_matmul.py (TMA on aligned operands; the pointer kernel on the same
rows one element off the 16-byte alignment) and compares each output with the default config's bit
for bit: the measurement behind kernels/batch_invariant_config.py's rule that tiles may follow M.
Also times the fastest config of each path against cuBLAS. Prints one row per (shape, M) and the
count of configs whose bits differed.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_kernels.batch_invariant_matmul import batch_invariant_matmul, tma_loads_fit  # noqa: E402

# (N, K): SPLIT_K (the reduction every config of the shape keeps)
SHAPES = {(4096, 4096): 1, (6144, 4096): 1, (24576, 4096): 1, (4096, 12288): 4, (151936, 4096): 1,
          (2048, 1024): 1, (1024, 3072): 1, (6144, 1024): 1}
BATCH_SIZES = (16, 256, 1024, 2048)


def microseconds(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e3


def off_alignment(x: torch.Tensor) -> torch.Tensor:
    """x's values one element past a 16-byte boundary: the TMA unit cannot load it, the pointer kernel runs."""
    shifted = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)[1:].view(x.shape)
    return shifted.copy_(x)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("this checks GPU kernels: run it on the device")
    configs = [{"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}
               for bm, bn, bk, (warps, stages) in itertools.product(
                   (64, 128), (64, 128, 256), (64, 128), ((4, 3), (4, 4), (8, 3), (8, 4), (4, 5)))]
    ran = differed = 0
    print(f"{'N':>7} {'K':>6} {'M':>5} {'cuBLAS us':>9} {'pointer best / cuBLAS':>34} {'TMA best / cuBLAS':>34}")
    for (n, k), split in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
        for m in BATCH_SIZES:
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            paths = {"pointer": off_alignment(x), "TMA": x}
            assert tma_loads_fit(x, w) and not tma_loads_fit(paths["pointer"], w)
            out = torch.empty(m, n, dtype=x.dtype, device="cuda")
            reference = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": split, "num_warps": 4, "num_stages": 3}
            want = batch_invariant_matmul(x, w, config=reference).clone()
            cublas = microseconds(lambda: torch.matmul(x, w.t(), out=out))
            best = {}
            for tile, (path, operand) in itertools.product(configs, paths.items()):
                config = {**tile, "SPLIT_K": split}
                try:
                    batch_invariant_matmul(operand, w, out=out, config=config)
                except torch.AcceleratorError:
                    raise
                except Exception:  # more shared memory than the GPU has: not a config that can run
                    continue
                ran += 1
                if not torch.equal(out, want):
                    differed += 1
                    print(f"  bits differ: {path} N={n} K={k} M={m} {config}", file=sys.stderr)
                    continue
                time = microseconds(lambda: batch_invariant_matmul(operand, w, out=out, config=config))
                if time < best.get(path, (float("inf"),))[0]:
                    best[path] = (time, config)
            cells = [f"{best[p][0] / cublas:.2f} {best[p][1]['BLOCK_M']}x{best[p][1]['BLOCK_N']}x{best[p][1]['BLOCK_K']}"
                     f"/{best[p][1]['num_warps']}w{best[p][1]['num_stages']}s" if p in best else "-" for p in paths]
            print(f"{n:>7} {k:>6} {m:>5} {cublas:>9.1f} {cells[0]:>34} {cells[1]:>34}", flush=True)
    print(f"{ran} configs ran, {differed} changed a bit")


if __name__ == "__main__":
    main()
