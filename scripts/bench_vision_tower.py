"""Time the vision tower alone on the GPU (issue 23: the encoder step should reach >= 50% of the bf16 matmul
peak): random weights of a checkpoint's vision config, B images of W x H, bf16; prints TFLOP/s (the tower's
matmul FLOPs, models/vision.VisionTower.matmul_flops) against a measured cuBLAS peak, then the top kernels.

    python scripts/bench_vision_tower.py --config recipes/configs/qwen3-vl-8b --images 8 17 64 --size 448 448
"""

from __future__ import annotations

import argparse

import torch

from rollout_cli.bench_limits import _median_cuda_seconds, measure_matmul_flops
from rollout_cli.models.build import load_model_config
from rollout_cli.models.layers import enable_triton_kernels
from rollout_cli.models.vision import VisionTower


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--images", type=int, nargs="+", default=[17])
    parser.add_argument("--size", type=int, nargs=2, default=[448, 448])
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    vision = load_model_config(args.config).vision_config
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        tower = VisionTower(vision).eval()
    torch.set_default_dtype(torch.float32)
    for p in tower.parameters():
        p.data.normal_(0, 0.02)
    enable_triton_kernels(tower)  # as the engine runs it on a GPU (the Triton rotary kernel)
    peak = measure_matmul_flops(torch.device("cuda"))
    patch = vision.patch_size
    grid = (1, args.size[1] // patch, args.size[0] // patch)
    width = vision.in_channels * vision.temporal_patch_size * patch * patch
    print(f"matmul peak {peak / 1e12:.0f} TFLOP/s; images of {args.size[0]} x {args.size[1]}: grid {grid}")
    for count in args.images:
        pixels = torch.randn(count * grid[1] * grid[2], width, device="cuda")
        grids = [grid] * count
        with torch.inference_mode():
            seconds = _median_cuda_seconds(lambda: tower(pixels, grids), runs=8, warmups=2)
        flops = tower.matmul_flops(grids)
        print(f"{count:4d} images: {seconds * 1e3:8.1f} ms, {flops / seconds / 1e12:6.1f} TFLOP/s, "
              f"{flops / seconds / peak:.0%} of peak")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            tower(pixels, grids)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
