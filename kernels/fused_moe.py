"""Fused mixture-of-experts MLP: grouped GEMMs over expert-sorted token slots.

    out[t] = sum_j w[t, j] * W2[e_tj] @ (silu(G[e_tj] @ h[t]) * (U[e_tj] @ h[t])),  e_tj = topk_ids[t, j]

with w13 [E, 2I, H] (gate rows G first, then up rows U) and w2 [E, H, I], as `FusedExperts` holds
them. Slot s = t * k + j is one (token, choice) pair; `moe_align_block_size` groups the slots by
expert into blocks of BLOCK_M, so one program of a grouped GEMM multiplies BLOCK_M slots of one
expert by a [BLOCK_K, BLOCK_N] tile of that expert's weights. Three steps after the routing:

  gate/up  [numel, I]:  program (block, n-tile) computes the gate and the up tile of the same
           columns (two accumulators) and writes silu(gate) * up: SiLU-and-mul in the epilogue,
           the [numel, 2I] product never reaches memory. Row of A for slot s: h[s // k].
  down     [numel, H]:  intermediate row s times W2[e]^T, scaled by w[s] in the epilogue,
           written to its slot's row (no atomics).
  sum      [T, H]:      out[t] = sum over j = 0..k-1 of down[t * k + j], float32, fixed order.

Determinism and batch invariance: no atomics and no split-K; each output row depends only on
its own token (rows of a tile never mix), and the k partial results are summed in choice order.
Bits can change between batch-size buckets only through a different tuned tile config.

Graph capture: grids are sized from shapes (the worst-case block count); programs past the
device-side num_post_padded exit at once. Padding slots (id numel) load zeros and store nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout_kernels.fused_moe_config import get_config
from rollout_kernels.moe_align import moe_align_block_size

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def expert_tile(pid, N, num_blocks_m, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of a grouped GEMM program in grouped ordering: GROUP_M consecutive M blocks share
    each B tile while it is in L2 (this kernel's and kernels/fused_moe_fp8.py's)."""
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_blocks_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m


@triton.jit
def block_slots(SortedIds, pid_m, numel, SLOTS_PER_ROW: tl.constexpr, BLOCK_M: tl.constexpr):
    """The BLOCK_M slots of M block pid_m: (slot ids, which are real, not padding, their rows of A)."""
    slots = tl.load(SortedIds + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M] int32; numel marks padding
    return slots, slots < numel, (slots // SLOTS_PER_ROW).to(tl.int64)


@triton.jit
def tile_columns(pid_n, N, BLOCK_N: tl.constexpr):
    """(output columns of tile pid_n, the same wrapped into [0, N): loads stay in bounds, stores mask)."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_n, (offs_n % N).to(tl.int64)


@triton.jit
def store_tile(C, acc, acc_up, TopkWeights, slots, mask_m, offs_n, N, stride_cm,
               GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr):
    """The epilogue: silu(gate) * up (GATED), times the slot's routing weight (MUL_WEIGHT), to C's rows."""
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(TopkWeights + slots, mask=mask_m, other=0.0)[:, None]
    c_ptrs = C + slots.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=mask_m[:, None] & (offs_n[None, :] < N))


# batch-size dependent ints are not specialised: one compile serves every bucket (and the tuner's
# compile workers)
@triton.jit(do_not_specialize=["numel", "num_blocks_m"])
def _moe_gemm_kernel(
    A, B, C, TopkWeights, SortedIds, ExpertIds, NumPostPadded,
    N, K, numel, num_blocks_m,
    stride_am, stride_be, stride_bn, stride_cm,
    SLOTS_PER_ROW: tl.constexpr,  # A row of slot s is s // SLOTS_PER_ROW: top_k for gate/up, 1 for down
    GATED: tl.constexpr,  # B holds 2N rows (gate, up); write silu(gate) * up
    MUL_WEIGHT: tl.constexpr,  # scale row s by TopkWeights[s]
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_m, pid_n = expert_tile(tl.program_id(0), N, num_blocks_m, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(NumPostPadded):
        return  # past the last expert's blocks (the grid is sized for the worst case)

    slots, mask_m, rows = block_slots(SortedIds, pid_m, numel, SLOTS_PER_ROW, BLOCK_M)
    expert = tl.load(ExpertIds + pid_m).to(tl.int64)
    offs_n, offs_bn = tile_columns(pid_n, N, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = A + rows[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    b_ptrs = B + expert * stride_be + offs_bn[None, :] * stride_bn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up_offset = N * stride_bn
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            b = tl.load(b_ptrs)
        else:
            mask_k = offs_k < K - k0
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=mask_k[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if GATED:
            if EVEN_K:
                b_up = tl.load(b_ptrs + up_offset)
            else:
                b_up = tl.load(b_ptrs + up_offset, mask=mask_k[:, None], other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    store_tile(C, acc, acc_up, TopkWeights, slots, mask_m, offs_n, N, stride_cm, GATED, MUL_WEIGHT)


@triton.jit
def _moe_sum_kernel(X, Out, H, stride_xt, stride_xk, stride_ot, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # choice order, every time: batch invariant
        acc += tl.load(X + t * stride_xt + j * stride_xk + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + t * stride_ot + cols, acc.to(Out.dtype.element_ty), mask=mask)


def _check_layout(sorted_ids, expert_ids, num_post_padded, block_m: int) -> None:
    for name, t in (("sorted_ids", sorted_ids), ("expert_ids", expert_ids), ("num_post_padded", num_post_padded)):
        assert t.dim() == 1 and t.dtype == torch.int32 and t.is_contiguous(), f"{name} must be contiguous 1-d int32"
    assert sorted_ids.numel() == expert_ids.numel() * block_m, (
        f"sorted_ids has {sorted_ids.numel()} entries, expected expert_ids ({expert_ids.numel()}) * BLOCK_M ({block_m})")


def _launch_gemm(a, b, c, weights, layout, numel: int, n: int, k: int, slots_per_row: int, gated: bool,
                 config: dict) -> None:
    sorted_ids, expert_ids, num_post_padded = layout
    block_m = config["BLOCK_SIZE_M"]
    _check_layout(sorted_ids, expert_ids, num_post_padded, block_m)
    num_blocks_m = expert_ids.numel()
    grid = (num_blocks_m * triton.cdiv(n, config["BLOCK_SIZE_N"]),)
    _moe_gemm_kernel[grid](
        a, b, c, weights if weights is not None else c, sorted_ids, expert_ids, num_post_padded,
        n, k, numel, num_blocks_m,
        a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        SLOTS_PER_ROW=slots_per_row, GATED=gated, MUL_WEIGHT=weights is not None,
        BLOCK_M=block_m, BLOCK_N=config["BLOCK_SIZE_N"], BLOCK_K=config["BLOCK_SIZE_K"],
        GROUP_M=config["GROUP_SIZE_M"], EVEN_K=k % config["BLOCK_SIZE_K"] == 0,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )


def moe_gate_up(hidden: torch.Tensor, w13: torch.Tensor, top_k: int, layout, config: dict,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [T, H], w13 [E, 2I, H], layout = moe_align_block_size(topk_ids, E, BLOCK_SIZE_M)
    -> out [T * top_k, I]: row s = silu(G[e] h[s // k]) * (U[e] h[s // k]) for the expert e of slot s."""
    assert hidden.dim() == 2 and w13.dim() == 3, (
        f"hidden {tuple(hidden.shape)} / w13 {tuple(w13.shape)}: want [T, H] / [E, 2I, H]")
    assert hidden.dtype in _DTYPES and w13.dtype == hidden.dtype, f"dtypes hidden {hidden.dtype}, w13 {w13.dtype}"
    num_tokens, hidden_size = hidden.shape
    assert w13.shape[2] == hidden_size and w13.shape[1] % 2 == 0, (
        f"w13 {tuple(w13.shape)} vs hidden size {hidden_size}")
    assert hidden.stride(1) == 1 and w13.stride(2) == 1, "hidden and w13 must be contiguous in the hidden dim"
    inter = w13.shape[1] // 2
    numel = num_tokens * top_k
    if out is None:
        out = torch.empty((numel, inter), dtype=hidden.dtype, device=hidden.device)
    assert out.shape == (numel, inter) and out.dtype == hidden.dtype and out.stride(1) == 1, (
        f"out {tuple(out.shape)} {out.dtype}: want [{numel}, {inter}] {hidden.dtype}, contiguous rows")
    if numel == 0:
        return out
    _launch_gemm(hidden, w13, out, None, layout, numel, inter, hidden_size, top_k, True, config)
    return out


def moe_down(inter: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, layout, config: dict,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """inter [T * k, I] (moe_gate_up's output), w2 [E, H, I], topk_weights [T, k] float32
    -> out [T * k, H]: row s = topk_weights.flat[s] * W2[e] inter[s]."""
    assert inter.dim() == 2 and w2.dim() == 3, (
        f"inter {tuple(inter.shape)} / w2 {tuple(w2.shape)}: want [T*k, I] / [E, H, I]")
    assert inter.dtype in _DTYPES and w2.dtype == inter.dtype, f"dtypes inter {inter.dtype}, w2 {w2.dtype}"
    numel, inter_size = inter.shape
    hidden_size = w2.shape[1]
    assert w2.shape[2] == inter_size, f"w2 {tuple(w2.shape)} vs intermediate size {inter_size}"
    assert inter.stride(1) == 1 and w2.stride(2) == 1, "inter and w2 must be contiguous in the intermediate dim"
    assert topk_weights.dtype == torch.float32 and topk_weights.is_contiguous() and topk_weights.numel() == numel, (
        f"topk_weights must be contiguous float32 with {numel} entries")
    if out is None:
        out = torch.empty((numel, hidden_size), dtype=inter.dtype, device=inter.device)
    assert out.shape == (numel, hidden_size) and out.dtype == inter.dtype and out.stride(1) == 1, (
        f"out {tuple(out.shape)} {out.dtype}: want [{numel}, {hidden_size}] {inter.dtype}, contiguous rows")
    if numel == 0:
        return out
    _launch_gemm(inter, w2, out, topk_weights, layout, numel, hidden_size, inter_size, 1, False, config)
    return out


def moe_sum(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, k, H] -> out [T, H], summed over k in float32 in order j = 0..k-1, rounded once."""
    assert x.dim() == 3 and x.dtype in _DTYPES and x.stride(2) == 1, (
        f"x {tuple(x.shape)}: want [T, k, H], contiguous H")
    num_tokens, top_k, hidden_size = x.shape
    if out is None:
        out = torch.empty((num_tokens, hidden_size), dtype=x.dtype, device=x.device)
    assert out.shape == (num_tokens, hidden_size) and out.dtype == x.dtype and out.stride(1) == 1
    if num_tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(hidden_size))
    _moe_sum_kernel[(num_tokens, triton.cdiv(hidden_size, block))](
        x, out, hidden_size, x.stride(0), x.stride(1), out.stride(0), TOP_K=top_k, BLOCK_H=block, num_warps=4)
    return out


def fused_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, configs: tuple[dict, dict] | None = None,
                  config_dir: str | None = None) -> torch.Tensor:
    """hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k] float32, topk_ids [T, k] int32
    -> [T, H] in hidden's dtype. `configs`: (gate/up, down) launch configs; default: get_config for T."""
    assert topk_ids.dim() == 2 and topk_ids.shape == topk_weights.shape, (
        f"topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)}: want [T, k] both")
    assert topk_ids.shape[0] == hidden.shape[0], f"{topk_ids.shape[0]} routed tokens for {hidden.shape[0]} hidden rows"
    assert w2.shape[0] == w13.shape[0] and w2.shape[1] == w13.shape[2] and w13.shape[1] == 2 * w2.shape[2], (
        f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} disagree: want [E, 2I, H] and [E, H, I]")
    num_tokens, top_k = topk_ids.shape
    num_experts, hidden_size, inter_size = w2.shape
    if configs is None:
        configs = get_config(num_tokens, num_experts, top_k, inter_size, hidden_size, hidden.dtype, config_dir)
    w13_config, w2_config = configs
    assert w13_config["BLOCK_SIZE_M"] == w2_config["BLOCK_SIZE_M"], "both GEMMs walk the same blocks: one BLOCK_SIZE_M"
    layout = moe_align_block_size(topk_ids, num_experts, w13_config["BLOCK_SIZE_M"])
    inter = moe_gate_up(hidden, w13, top_k, layout, w13_config)  # [T * k, I]
    down = moe_down(inter, w2, topk_weights, layout, w2_config)  # [T * k, H]
    return moe_sum(down.view(num_tokens, top_k, hidden_size))


def moe_gate_up_ref(hidden: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """[T * k, I], float32 math per expert, rounded once."""
    flat = topk_ids.reshape(-1).long()
    top_k, inter = topk_ids.shape[1], w13.shape[1] // 2
    out = torch.empty((flat.numel(), inter), dtype=hidden.dtype, device=hidden.device)
    for expert in flat.unique().tolist():
        slots = (flat == expert).nonzero().squeeze(1)
        gate, up = (hidden[slots // top_k].float() @ w13[expert].float().T).chunk(2, dim=-1)
        out[slots] = (torch.nn.functional.silu(gate) * up).to(hidden.dtype)
    return out


def moe_down_ref(inter: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
                 ) -> torch.Tensor:
    """[T * k, H], float32 math per expert, rounded once."""
    flat = topk_ids.reshape(-1).long()
    weights = topk_weights.reshape(-1).float()
    out = torch.empty((flat.numel(), w2.shape[1]), dtype=inter.dtype, device=inter.device)
    for expert in flat.unique().tolist():
        slots = (flat == expert).nonzero().squeeze(1)
        out[slots] = ((inter[slots].float() @ w2[expert].float().T) * weights[slots, None]).to(inter.dtype)
    return out


def moe_sum_ref(x: torch.Tensor) -> torch.Tensor:
    return x.float().sum(dim=1).to(x.dtype)


def fused_experts_ref(hidden, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """The three steps in plain torch, with the kernels' roundings (activation dtype between steps)."""
    inter = moe_gate_up_ref(hidden, w13, topk_ids)
    down = moe_down_ref(inter, w2, topk_weights, topk_ids)
    return moe_sum_ref(down.view(topk_ids.shape[0], topk_ids.shape[1], -1))
