"""Decode-step kernels alone on the GPU: the sampler's knobs, decode attention by KV splits, and
(when present) the fused q/k norm + rotary + KV store against the unfused chain. One table each.

    python3 scripts/bench_decode_kernels.py [--json FILE]

HBM bandwidth is measured in the same run (device-to-device copy, read + write bytes).
"""

from __future__ import annotations

import argparse
import json

import torch

from rollout_cli.bench_limits import measure_hbm_bandwidth  # the copy `rollout bench` measures the limit with


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from rollout_kernels.decode_attention import benchmark_decode_attention
    from rollout_kernels.sampling_bench import benchmark_sample

    hbm = measure_hbm_bandwidth(torch.device("cuda"))
    print(f"copy bandwidth {hbm / 1e9:.0f} GB/s")
    rows = {"sampler": [], "decode_attention": [], "qk_prologue": []}
    print("sampler, B 256, V 151936, bf16")
    print(f"{'setting':>9} {'chunk':>6} {'block_v':>7} {'warps1':>6} {'us':>8} {'HBM':>5}")
    for setting in ("plain", "greedy", "filtered"):
        for chunk, block_v, warps in ((8192, 2048, 4), (8192, 4096, 8), (4096, 1024, 4)):
            r = benchmark_sample(setting=setting, hbm_bytes_per_s=hbm, chunk=chunk, block_v=block_v,
                                 num_warps_partials=warps)
            r.update(chunk=chunk, block_v=block_v, num_warps_partials=warps)
            rows["sampler"].append(r)
            print(f"{setting:>9} {chunk:>6} {block_v:>7} {warps:>6} {r['time_us']:>8.1f} {r['hbm_fraction']:>5.0%}")
    print("decode attention, 16 q / 8 kv heads, D 128, bf16")
    print(f"{'batch':>5} {'context':>7} {'splits':>6} {'us':>8} {'HBM':>5}")
    for batch, context, splits in ((256, 512, 1), (256, 512, 2), (256, 768, 1), (64, 4096, 1), (64, 4096, 2),
                                   (64, 4096, 4)):
        r = benchmark_decode_attention(batch=batch, context=context, num_kv_splits=splits, hbm_bytes_per_s=hbm)
        rows["decode_attention"].append(r)
        print(f"{batch:>5} {context:>7} {splits:>6} {r['time_us']:>8.1f} {r['hbm_fraction']:>5.0%}")
    # Qwen3-8B's group of 4 q heads per kv head: in the session-14 `--profile` run (contexts ~256-288)
    # its stage 1 read the KV at ~80% of HBM (0.6B, group 2: ~83%); sweep (BLOCK_N, num_warps, num_stages)
    print("decode attention, 32 q / 8 kv heads (Qwen3-8B), D 128, bf16, 1 split, stage-1 knobs")
    print(f"{'batch':>5} {'context':>7} {'config':>10} {'us':>8} {'HBM':>5}")
    for batch, context in ((256, 512), (256, 768)):
        for config in ((64, 4, 3), (32, 4, 3), (64, 8, 3), (128, 4, 2), (128, 8, 3), (64, 4, 4), (32, 2, 4)):
            r = benchmark_decode_attention(batch=batch, context=context, num_heads=32, num_kv_heads=8,
                                           num_kv_splits=1, hbm_bytes_per_s=hbm, stage1_config=config)
            rows["decode_attention"].append(r)
            print(f"{batch:>5} {context:>7} {str(config):>10} {r['time_us']:>8.1f} {r['hbm_fraction']:>5.0%}")
    try:
        from rollout_kernels.qk_norm_rope_store import benchmark_qk_norm_rope_store
    except ImportError:
        benchmark_qk_norm_rope_store = None
    if benchmark_qk_norm_rope_store is not None:
        print("q/k norm + rotary + KV store, 16 q / 8 kv heads, D 128, bf16")
        for tokens in (64, 256, 4096):
            r = benchmark_qk_norm_rope_store(num_tokens=tokens)
            rows["qk_prologue"].append(r)
            print(tokens, {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
