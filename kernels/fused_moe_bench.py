"""`benchmark_fused_moe`: the fused MoE on CUDA, timed inside CUDA graphs (as the engine replays decode
steps), with the traffic and FLOP counts the tuner (scripts/tune_fused_moe.py) shares.

Bytes that must move for one call: the weights of every expert the batch touches (w13 and w2 rows
of that expert, once) plus the hidden states in and the output out. Intermediates are not counted,
so `hbm_fraction` is against what an ideal kernel would have to read. FLOPs: 2 * T * k * 3 * I * H.

Several independent routings (`num_routings`) are timed back to back in one graph and averaged, so
a small batch does not find its experts' weights still in L2 from the previous repetition.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from rollout_kernels.fused_moe import fused_experts, moe_down, moe_gate_up
from rollout_kernels.fused_moe_config import get_config
from rollout_kernels.moe_align import moe_align_block_size
from rollout_kernels.moe_routing import topk_softmax


@dataclass
class MoeProblem:
    hidden: list[torch.Tensor]  # num_routings x [T, H]
    logits: list[torch.Tensor]  # num_routings x [T, E] float32
    routings: list[tuple[torch.Tensor, torch.Tensor]]  # (weights [T, k] float32, ids [T, k] int32) per routing
    w13: torch.Tensor  # [E, 2I, H]
    w2: torch.Tensor  # [E, H, I]
    top_k: int

    @property
    def num_tokens(self) -> int:
        return self.hidden[0].shape[0]

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, I, H)"""
        return self.w2.shape[0], self.w2.shape[2], self.w2.shape[1]

    def experts_touched(self) -> float:
        """Distinct experts per routing, averaged."""
        return sum(ids.unique().numel() for _, ids in self.routings) / len(self.routings)

    def bytes_per_call(self) -> float:
        num_experts, inter, hidden = self.shape
        elt = self.w13.element_size()
        return self.experts_touched() * 3 * inter * hidden * elt + 2 * self.num_tokens * hidden * elt

    def flops_per_call(self) -> float:
        _, inter, hidden = self.shape
        return 2.0 * self.num_tokens * self.top_k * 3 * inter * hidden


def make_problem(num_tokens: int, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 dtype: torch.dtype = torch.bfloat16, num_routings: int = 1, device="cuda", seed: int = 0,
                 init_weights: bool = True) -> MoeProblem:
    """Random weights (scaled to unit-variance outputs), hidden states and router logits (near-uniform routing)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shape13, shape2 = (num_experts, 2 * intermediate_size, hidden_size), (num_experts, hidden_size, intermediate_size)
    if init_weights:
        w13 = (torch.randn(shape13, device=device, generator=gen) / hidden_size ** 0.5).to(dtype)
        w2 = (torch.randn(shape2, device=device, generator=gen) / intermediate_size ** 0.5).to(dtype)
    else:  # compile-only callers: values do not matter
        w13, w2 = torch.zeros(shape13, dtype=dtype, device=device), torch.zeros(shape2, dtype=dtype, device=device)
    hidden = [torch.randn((num_tokens, hidden_size), device=device, generator=gen).to(dtype)
              for _ in range(num_routings)]
    logits = [torch.randn((num_tokens, num_experts), device=device, generator=gen) for _ in range(num_routings)]
    routings = [topk_softmax(x, top_k, renormalize=True) for x in logits]
    return MoeProblem(hidden, logits, routings, w13, w2, top_k)


def time_in_graph(fn, rep_ms: int = 20) -> float:
    """Median seconds of fn() replayed from a CUDA graph (no launch overhead, no L2 flush)."""
    return triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e-3


def default_num_routings(num_tokens: int) -> int:
    return 8 if num_tokens <= 64 else 2


def benchmark_fused_moe(num_tokens: int, num_experts: int = 128, top_k: int = 8, hidden_size: int = 2048,
                        intermediate_size: int = 768, dtype=torch.bfloat16, hbm_bytes_per_s: float | None = None,
                        configs: tuple[dict, dict] | None = None, config_dir: str | None = None,
                        num_routings: int | None = None) -> dict:
    """Time one MoE layer's experts on CUDA for a batch of `num_tokens` (defaults: Qwen3-30B-A3B's shape).

    `time_us`: routing kernel (top-k softmax of given logits) + align + both GEMMs + top-k sum, per call;
    `gemm_us`: the two GEMMs alone (precomputed layout). `configs` (gate/up, down) default to
    get_config(..., config_dir): the tuned file if there is one, else the default.
    """
    assert torch.cuda.is_available(), "benchmark_fused_moe needs a CUDA device"
    num_routings = num_routings or default_num_routings(num_tokens)
    p = make_problem(num_tokens, num_experts, top_k, hidden_size, intermediate_size, dtype, num_routings)
    if configs is None:
        configs = get_config(num_tokens, num_experts, top_k, intermediate_size, hidden_size, dtype, config_dir)
    w13_cfg, w2_cfg = configs

    def full():
        for h, x in zip(p.hidden, p.logits):
            weights, ids = topk_softmax(x, top_k, True, dtype)
            fused_experts(h, p.w13, p.w2, weights, ids, configs=configs)

    layouts = [moe_align_block_size(ids, num_experts, w13_cfg["BLOCK_SIZE_M"]) for _, ids in p.routings]

    def gemms():
        for h, (weights, _), layout in zip(p.hidden, p.routings, layouts):
            moe_down(moe_gate_up(h, p.w13, top_k, layout, w13_cfg), p.w2, weights, layout, w2_cfg)

    seconds = time_in_graph(full) / num_routings
    gemm_seconds = time_in_graph(gemms) / num_routings
    total, flops = p.bytes_per_call(), p.flops_per_call()
    result = {
        "num_tokens": num_tokens, "num_experts": num_experts, "top_k": top_k, "hidden_size": hidden_size,
        "intermediate_size": intermediate_size, "dtype": str(dtype).removeprefix("torch."),
        "experts_touched": p.experts_touched(), "block_m": w13_cfg["BLOCK_SIZE_M"],
        "time_us": seconds * 1e6, "gemm_us": gemm_seconds * 1e6, "bytes": total,
        "gb_per_s": total / seconds / 1e9, "tflops": flops / seconds / 1e12,
    }
    if hbm_bytes_per_s is not None:
        result["hbm_fraction"] = total / seconds / hbm_bytes_per_s
        result["gemm_hbm_fraction"] = total / gemm_seconds / hbm_bytes_per_s
    return result
