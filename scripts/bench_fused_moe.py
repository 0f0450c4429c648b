"""Table of the fused MoE kernel alone (kernels/fused_moe_bench.py) at decode and prefill batch sizes.

    python scripts/bench_fused_moe.py [--model-config recipes/configs/qwen3-30b-a3b/config.json] \
        [--config-dir DIR] [--tokens 1,2,4,...] [--json OUT.json]

Each row: time per call (routing kernel + align + both GEMMs + top-k sum) and the two GEMMs alone,
GB/s and fraction of the measured HBM bandwidth (bytes = weights of the experts touched + hidden in
and out), TFLOP/s. With --config-dir, the tuned file there is used and compared with the default.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from rollout_cli.bench_limits import measure_hbm_bandwidth
from rollout_kernels.fused_moe_bench import benchmark_fused_moe
from rollout_kernels.fused_moe_config import default_config, fit_to_shape, load_configs

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-config", default="recipes/configs/qwen3-30b-a3b/config.json")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--config-dir", help="directory holding a tuned JSON for this shape (else the shipped one)")
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256,1024,4096,8192")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_fused_moe.py needs a CUDA device", file=sys.stderr)
        return 2
    cfg = json.loads(Path(args.model_config).read_text())
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    top_k, hidden = cfg["num_experts_per_tok"], cfg["hidden_size"]
    inter = cfg.get("moe_intermediate_size", cfg.get("intermediate_size"))
    dtype = DTYPES[args.dtype]
    hbm = measure_hbm_bandwidth(torch.device("cuda"))
    tuned = load_configs(experts, inter, hidden, dtype, args.config_dir) is not None
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {hbm / 1e9:.0f} GB/s; E={experts} top_k={top_k} "
          f"H={hidden} I={inter} {args.dtype}; configs: {'tuned file' if tuned else 'default (no tuned file)'}")
    head = (f"{'tokens':>6} {'experts':>7} {'BM':>3} {'us':>8} {'gemm us':>8} {'GB/s':>6} {'HBM':>5} "
            f"{'GEMM HBM':>8} {'TFLOP/s':>7}")
    if tuned:
        head += f" {'default us':>10}"
    print(head)
    rows = []
    for t in (int(x) for x in args.tokens.split(",")):
        r = benchmark_fused_moe(t, experts, top_k, hidden, inter, dtype, hbm_bytes_per_s=hbm,
                                config_dir=args.config_dir)
        line = (f"{t:>6} {r['experts_touched']:>7.1f} {r['block_m']:>3} {r['time_us']:>8.1f} {r['gemm_us']:>8.1f} "
                f"{r['gb_per_s']:>6.0f} {r['hbm_fraction']:>5.0%} {r['gemm_hbm_fraction']:>8.0%} {r['tflops']:>7.1f}")
        if tuned:
            base = default_config(t, experts, top_k, dtype)
            d = benchmark_fused_moe(t, experts, top_k, hidden, inter, dtype, hbm_bytes_per_s=hbm,
                                    configs=(fit_to_shape(base, inter, hidden), fit_to_shape(base, hidden, inter)))
            r["default_time_us"] = d["time_us"]
            line += f" {d['time_us']:>10.1f}"
        print(line, flush=True)
        rows.append(r)
    if args.json:
        Path(args.json).write_text(json.dumps({"hbm_bytes_per_s": hbm, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
