"""The fused MoE MLP in W8A8 blockwise FP8 (issue 20): fused_moe.py's two grouped GEMMs on e4m3.

    out[t] = sum_j w[t, j] * W2[e_tj] @ (silu(G[e_tj] @ h[t]) * (U[e_tj] @ h[t]))

Weights e4m3 with one float32 scale per block: w13 [E, 2I, H] with w13_scale [E, 2I / BN, ceil(H / 128)]
and w2 [E, H, I] with w2_scale [E, H / BN, ceil(I / 128)], where BN (a power of two up to 128) divides
I and H, so a block never spans the gate and the up rows (the layout of the hub's FP8 MoE checkpoints
when BN = 128). Activations are quantized per row and 128-channel group by kernels/fp8_blockwise.py's
quantize_activation (a launch of its own: quantizing inside the GEMM measured slower): the hidden state
before gate/up, the SiLU-and-mul product before down. Each K step of 128 sums its e4m3 products in
float32 and scales them by the row's and the weight block's scales; the steps add in K order. Slot
layout, the gated epilogue, the weighted down rows and the fixed-order sum over the k choices are
fused_moe.py's (moe_align_block_size, moe_sum).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout_kernels.fp8_blockwise import quantize_activation
from rollout_kernels.fp8_blockwise_ref import BLOCK, FP8_DTYPE, fp8_blockwise_matmul_ref, quantize_activation_ref
from rollout_kernels.fused_moe import block_slots, expert_tile, moe_sum, moe_sum_ref, store_tile, tile_columns
from rollout_kernels.fused_moe_config import get_config
from rollout_kernels.moe_align import moe_align_block_size


@triton.jit(do_not_specialize=["numel", "num_blocks_m"])
def _moe_gemm_fp8_kernel(
    A, AScale, B, BScale, C, TopkWeights, SortedIds, ExpertIds, NumPostPadded,
    N, K, numel, num_blocks_m,
    stride_am, stride_asm, stride_be, stride_bn, stride_bse, stride_bsn, stride_cm,
    SLOTS_PER_ROW: tl.constexpr,  # A row of slot s is s // SLOTS_PER_ROW: top_k for gate/up, 1 for down
    GATED: tl.constexpr,  # B holds 2N rows (gate, up); write silu(gate) * up
    MUL_WEIGHT: tl.constexpr,  # scale row s by TopkWeights[s]
    SCALE_BLOCK_N: tl.constexpr,  # BN: weight rows per scale row
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = expert_tile(tl.program_id(0), N, num_blocks_m, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(NumPostPadded):
        return  # past the last expert's blocks (the grid is sized for the worst case)

    slots, mask_m, rows = block_slots(SortedIds, pid_m, numel, SLOTS_PER_ROW, BLOCK_M)
    expert = tl.load(ExpertIds + pid_m).to(tl.int64)
    offs_n, offs_bn = tile_columns(pid_n, N, BLOCK_N)
    scale_rows = offs_bn // SCALE_BLOCK_N  # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K)
    b_base = B + expert * stride_be
    s_base = BScale + expert * stride_bse
    up_rows = N * stride_bn  # the up half of w13: N rows below the gate rows
    up_scales = (N // SCALE_BLOCK_N) * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + offs_k
        mask_k = k < K
        a = tl.load(A + rows[:, None] * stride_am + k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        a_scale = tl.load(AScale + rows * stride_asm + kb, mask=mask_m, other=0.0)  # [BLOCK_M]
        b_ptrs = b_base + offs_bn[None, :] * stride_bn + k[:, None]  # [BLOCK_K, BLOCK_N]
        b = tl.load(b_ptrs, mask=mask_k[:, None], other=0.0)
        b_scale = tl.load(s_base + scale_rows * stride_bsn + kb)  # [BLOCK_N]
        acc += tl.dot(a, b, out_dtype=tl.float32) * a_scale[:, None] * b_scale[None, :]
        if GATED:
            b_up = tl.load(b_ptrs + up_rows, mask=mask_k[:, None], other=0.0)
            up_scale = tl.load(s_base + up_scales + scale_rows * stride_bsn + kb)
            acc_up += tl.dot(a, b_up, out_dtype=tl.float32) * a_scale[:, None] * up_scale[None, :]
    store_tile(C, acc, acc_up, TopkWeights, slots, mask_m, offs_n, N, stride_cm, GATED, MUL_WEIGHT)


def _launch(a_q, a_scale, b_q, b_scale, c, weights, layout, numel: int, n: int, k: int, slots_per_row: int,
            gated: bool, block_rows: int, config: dict) -> None:
    sorted_ids, expert_ids, num_post_padded = layout
    block_n = min(config["BLOCK_SIZE_N"], block_rows)
    num_blocks_m = expert_ids.numel()
    grid = (num_blocks_m * triton.cdiv(n, block_n),)
    _moe_gemm_fp8_kernel[grid](
        a_q, a_scale, b_q, b_scale, c, weights if weights is not None else a_scale, sorted_ids, expert_ids,
        num_post_padded, n, k, numel, num_blocks_m,
        a_q.stride(0), a_scale.stride(0), b_q.stride(0), b_q.stride(1), b_scale.stride(0), b_scale.stride(1),
        c.stride(0),
        SLOTS_PER_ROW=slots_per_row, GATED=gated, MUL_WEIGHT=weights is not None, SCALE_BLOCK_N=block_rows,
        BLOCK_M=config["BLOCK_SIZE_M"], BLOCK_N=block_n, BLOCK_K=BLOCK, GROUP_M=config["GROUP_SIZE_M"],
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )


def _check(hidden, w13, w13_scale, w2, w2_scale, topk_ids, block_rows: int) -> tuple[int, int, int, int]:
    num_experts, two_i, hidden_size = w13.shape
    inter = two_i // 2
    assert w13.dtype == w2.dtype == FP8_DTYPE, f"w13 / w2 must be e4m3, got {w13.dtype} / {w2.dtype}"
    assert w2.shape == (num_experts, hidden_size, inter), f"w2 {tuple(w2.shape)} vs w13 {tuple(w13.shape)}"
    assert inter % block_rows == 0 and hidden_size % block_rows == 0, (
        f"block rows {block_rows} must divide I {inter} and H {hidden_size}")
    assert w13_scale.shape == (num_experts, two_i // block_rows, triton.cdiv(hidden_size, BLOCK)), tuple(w13_scale.shape)
    assert w2_scale.shape == (num_experts, hidden_size // block_rows, triton.cdiv(inter, BLOCK)), tuple(w2_scale.shape)
    assert hidden.dim() == 2 and hidden.shape[1] == hidden_size and hidden.stride(1) == 1
    assert topk_ids.shape[0] == hidden.shape[0]
    return num_experts, hidden_size, inter, topk_ids.shape[1]


def fused_experts_fp8(hidden: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                      w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, block_rows: int,
                      configs: tuple[dict, dict] | None = None) -> torch.Tensor:
    """hidden [T, H] (bf16 / fp16 / fp32), e4m3 experts with their block scales (module docstring),
    topk_weights [T, k] float32, topk_ids [T, k] int32 -> [T, H] in hidden's dtype. `configs`: (gate/up,
    down) launch configs sharing BLOCK_SIZE_M (BLOCK_SIZE_K is always the scale block's 128); default:
    fused_moe_config's for T tokens in float8_e4m3fn (a tuned file, else the untuned rule by rows per
    expert: decode batches get small M tiles)."""
    num_experts, hidden_size, inter, top_k = _check(hidden, w13, w13_scale, w2, w2_scale, topk_ids, block_rows)
    w13_config, w2_config = configs or get_config(hidden.shape[0], num_experts, top_k, inter, hidden_size, FP8_DTYPE)
    assert w13_config["BLOCK_SIZE_M"] == w2_config["BLOCK_SIZE_M"], "both GEMMs walk one expert-sorted layout"
    num_tokens, numel = hidden.shape[0], hidden.shape[0] * top_k
    out = torch.empty((numel, hidden_size), dtype=hidden.dtype, device=hidden.device)
    if numel == 0:
        return out.view(num_tokens, top_k, hidden_size).sum(1)
    layout = moe_align_block_size(topk_ids, num_experts, w13_config["BLOCK_SIZE_M"])
    mid = moe_gate_up_fp8(hidden, w13, w13_scale, top_k, layout, w13_config, block_rows)
    moe_down_fp8(mid, w2, w2_scale, topk_weights, layout, w2_config, block_rows, out)
    return moe_sum(out.view(num_tokens, top_k, hidden_size))


def moe_gate_up_fp8(hidden: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, top_k: int, layout,
                    config: dict, block_rows: int) -> torch.Tensor:
    """fused_moe.moe_gate_up on e4m3 experts: hidden [T, H] -> [T * top_k, I] in hidden's dtype
    (layout = moe_align_block_size(topk_ids, E, BLOCK_SIZE_M); the tuner times this half alone)."""
    numel, inter, hidden_size = hidden.shape[0] * top_k, w13.shape[1] // 2, w13.shape[2]
    mid = torch.empty((numel, inter), dtype=hidden.dtype, device=hidden.device)
    h_q, h_scale = quantize_activation(hidden)  # [T, H] e4m3, [T, HB]
    _launch(h_q, h_scale, w13, w13_scale, mid, None, layout, numel, inter, hidden_size, top_k, True, block_rows,
            config)
    return mid


def moe_down_fp8(mid: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, topk_weights: torch.Tensor, layout,
                 config: dict, block_rows: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """fused_moe.moe_down on e4m3 experts: mid [T * k, I], topk_weights [T, k] float32 -> [T * k, H],
    row s weighted by topk_weights.flat[s]."""
    numel, (hidden_size, inter) = mid.shape[0], w2.shape[1:]
    if out is None:
        out = torch.empty((numel, hidden_size), dtype=mid.dtype, device=mid.device)
    mid_q, mid_scale = quantize_activation(mid)  # [T * k, I] e4m3, [T * k, IB]
    _launch(mid_q, mid_scale, w2, w2_scale, out, topk_weights.reshape(-1).contiguous(), layout, numel, hidden_size,
            inter, 1, False, block_rows, config)
    return out


def fused_experts_fp8_ref(hidden: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                          w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                          block_rows: int) -> torch.Tensor:
    """fused_experts_fp8 in torch, expert by expert, with the kernels' roundings: the gated product
    and the weighted down rows rounded to hidden's dtype, the k choices summed in float32."""
    _check(hidden, w13, w13_scale, w2, w2_scale, topk_ids, block_rows)
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1).long()
    weights = topk_weights.reshape(-1).float()
    inter = w13.shape[1] // 2
    block = (block_rows, BLOCK)
    h_q, h_scale = quantize_activation_ref(hidden)
    mid = torch.zeros((flat.numel(), inter), dtype=hidden.dtype, device=hidden.device)
    for expert in flat.unique().tolist():
        slots = (flat == expert).nonzero().squeeze(1)
        rows = slots // top_k
        gate_up = fp8_blockwise_matmul_ref(h_q[rows], h_scale[rows], w13[expert], w13_scale[expert],
                                           torch.float32, None, block)  # [n, 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        mid[slots] = (gate / (1.0 + torch.exp(-gate)) * up).to(hidden.dtype)
    mid_q, mid_scale = quantize_activation_ref(mid)
    down = torch.zeros((flat.numel(), w2.shape[1]), dtype=hidden.dtype, device=hidden.device)
    for expert in flat.unique().tolist():
        slots = (flat == expert).nonzero().squeeze(1)
        y = fp8_blockwise_matmul_ref(mid_q[slots], mid_scale[slots], w2[expert], w2_scale[expert], torch.float32,
                                     None, block)
        down[slots] = (y * weights[slots, None]).to(hidden.dtype)
    return moe_sum_ref(down.view(num_tokens, top_k, -1))
