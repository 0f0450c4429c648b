"""`benchmark_chunk_gated_delta_rule`: the chunked gated delta rule prefill timed on CUDA, and the
FLOP count its TFLOP/s figures use (scripts/bench_gdn_vs_fla.py counts flash-linear-attention's with it too).

Separate from the launcher (`chunk_gated_delta_rule.py`): the engine never times anything.
"""

from __future__ import annotations

import torch
import triton

from rollout_kernels.chunk_gated_delta_rule import chunk_gated_delta_rule_varlen


def chunk_gated_delta_rule_flops(num_tokens: int, num_v_heads: int, k_dim: int, v_dim: int, chunk_size: int) -> int:
    """Matmul FLOPs of the chunked form (the count FLA-style TFLOP/s figures use; the triangular
    inverse is left out): per token and value head, K K^T, w, Q K^T (C dk each), u and the intra-chunk
    output (C dv each), w S, the state update and Q S (dk dv each), 2 FLOPs per multiply-add."""
    C = chunk_size
    return 2 * num_tokens * num_v_heads * (3 * C * k_dim + 2 * C * v_dim + 3 * k_dim * v_dim)


def benchmark_chunk_gated_delta_rule(num_seqs: int = 4, seq_len: int = 4096, num_k_heads: int = 16,
                                     num_v_heads: int = 32, k_dim: int = 128, v_dim: int = 128,
                                     dtype=torch.bfloat16, chunk_size: int = 64) -> dict:
    """Time one chunk_gated_delta_rule_varlen call on CUDA (triton.testing.do_bench, median): num_seqs
    prompts of seq_len tokens packed in one batch, each from its own state slot (Qwen3-Next's linear
    layer shape by default: 16 key heads, 32 value heads, 128 x 128). TFLOP/s counts
    chunk_gated_delta_rule_flops; the states keep advancing from call to call (the decay keeps them bounded)."""
    assert torch.cuda.is_available(), "benchmark_chunk_gated_delta_rule needs a CUDA device"
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    T = num_seqs * seq_len
    q = torch.randn((T, num_k_heads, k_dim), dtype=dtype, device=device, generator=gen)
    k = torch.randn((T, num_k_heads, k_dim), dtype=dtype, device=device, generator=gen)
    v = torch.randn((T, num_v_heads, v_dim), dtype=dtype, device=device, generator=gen)
    g = -0.1 * torch.rand((T, num_v_heads), device=device, generator=gen)
    beta = torch.rand((T, num_v_heads), dtype=dtype, device=device, generator=gen)
    states = torch.randn((num_seqs + 1, num_v_heads, k_dim, v_dim), device=device, generator=gen) * 0.01
    index = torch.arange(1, num_seqs + 1, device=device)
    cu_seqlens = [i * seq_len for i in range(num_seqs + 1)]

    def step():
        chunk_gated_delta_rule_varlen(q, k, v, g, beta, states, index, cu_seqlens, chunk_size)

    step()
    seconds = triton.testing.do_bench(step, return_mode="median") * 1e-3
    flops = chunk_gated_delta_rule_flops(T, num_v_heads, k_dim, v_dim, chunk_size)
    return {
        "num_seqs": num_seqs, "seq_len": seq_len, "num_k_heads": num_k_heads, "num_v_heads": num_v_heads,
        "k_dim": k_dim, "v_dim": v_dim, "dtype": str(dtype).removeprefix("torch."), "chunk_size": chunk_size,
        "time_us": seconds * 1e6, "flops": flops, "tflop_per_s": flops / seconds / 1e12,
        "tokens_per_s": T / seconds,
    }
