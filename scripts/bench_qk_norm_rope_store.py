"""Fused q/k norm + RoPE + KV store vs the unfused Triton chain (CUDA), one JSON line per shape.

    source scripts/device_env.sh && python3 scripts/bench_qk_norm_rope_store.py
"""

import json

from rollout_kernels.qk_norm_rope_store import benchmark_qk_norm_rope_store

SHAPES = [
    dict(),  # Qwen3-0.6B decode at batch 256: 16 q heads, 8 kv heads, head_dim 128, q/k norm
    dict(block_h=2), dict(block_h=4), dict(block_h=8),
    dict(qk_norm=False),  # Llama / Qwen2
    dict(num_tokens=64), dict(num_tokens=1024),
    dict(num_heads=32, num_kv_heads=8),  # Qwen3-8B
    dict(num_heads=32, num_kv_heads=8, block_h=4),
]

if __name__ == "__main__":
    for kw in SHAPES:
        row = benchmark_qk_norm_rope_store(**kw)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
