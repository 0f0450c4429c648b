"""Rotate-half RoPE over the first `rotary_dim` dims of each q and k head, in place, one launch.

Same math as `rollout_cli.models.layers.RotaryEmbedding`: with half = R // 2,
    out[:half]  = x[:half] * cos[:half] - x[half:R] * sin[:half]
    out[half:R] = x[half:R] * cos[half:] + x[:half] * sin[half:]
    out[R:]     = x[R:]                           (partial rotary: passed through)
computed in float32 and rounded once to the q/k dtype. (The torch module casts
cos/sin to q.dtype and computes in that dtype: identical for float32, a few ulp
less accurate for bf16/fp16.)

Grid: (T, head blocks of q + head blocks of k); each program loads its token's
cos/sin row once and rotates a [BLOCK_H, half] tile of heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _apply_rotary_kernel(
    q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr,
    HQ, HK, sq0, sq1, sk0, sk1, s_cs,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    nqb = tl.cdiv(HQ, BLOCK_H)
    if hb < nqb:
        base = q_ptr + t * sq0
        s_head = sq1
        num_heads = HQ
        h0 = hb * BLOCK_H
    else:
        base = k_ptr + t * sk0
        s_head = sk1
        num_heads = HK
        h0 = (hb - nqb) * BLOCK_H
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_R)
    dmask = d < HALF
    cs_row = pos * s_cs
    cos1 = tl.load(cos_ptr + cs_row + d, mask=dmask, other=0.0)[None, :]  # [1, BLOCK_R] fp32
    cos2 = tl.load(cos_ptr + cs_row + HALF + d, mask=dmask, other=0.0)[None, :]
    sin1 = tl.load(sin_ptr + cs_row + d, mask=dmask, other=0.0)[None, :]
    sin2 = tl.load(sin_ptr + cs_row + HALF + d, mask=dmask, other=0.0)[None, :]
    h = h0 + tl.arange(0, BLOCK_H)
    mask = (h < num_heads)[:, None] & dmask[None, :]
    ptr1 = base + h.to(tl.int64)[:, None] * s_head + d[None, :]  # [BLOCK_H, BLOCK_R]
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    o1 = x1f * cos1 - x2f * sin1
    o2 = x2f * cos2 + x1f * sin2
    tl.store(ptr1, o1.to(x1.dtype), mask=mask)
    tl.store(ptr1 + HALF, o2.to(x1.dtype), mask=mask)


def _check_heads(name, x, num_tokens, head_dim, dtype):
    assert x.dim() == 3, f"{name} must be [T, heads, head_dim], got {tuple(x.shape)}"
    assert x.shape[0] == num_tokens and x.shape[2] == head_dim, f"{name} has shape {tuple(x.shape)}"
    assert x.stride(2) == 1, f"{name} must be contiguous in head_dim"
    assert x.dtype == dtype, f"{name} has dtype {x.dtype}, expected {dtype}"


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """IN PLACE: rotates q [T, H, D] and k [T, KVH, D] (any token/head strides, e.g. views of a
    fused qkv output) by positions [T] int64 using float32 tables cos/sin [max_pos, R], R <= D even.
    Returns (q, k). Positions must lie in [0, max_pos) (not checked: no host sync)."""
    num_tokens, _, head_dim = q.shape
    _check_heads("q", q, num_tokens, head_dim, q.dtype)
    _check_heads("k", k, num_tokens, head_dim, q.dtype)
    assert q.dtype in (torch.float32, torch.float16, torch.bfloat16), f"unsupported dtype {q.dtype}"
    assert positions.shape == (num_tokens,) and positions.dtype == torch.int64, "positions must be [T] int64"
    assert cos.dim() == 2 and cos.shape == sin.shape, "cos/sin must be [max_pos, rotary_dim]"
    assert cos.dtype == sin.dtype == torch.float32, "cos/sin tables must be float32"
    assert cos.stride(1) == 1 and sin.stride(1) == 1 and cos.stride(0) == sin.stride(0), "cos/sin must be contiguous"
    rotary_dim = cos.shape[1]
    assert rotary_dim % 2 == 0 and 2 <= rotary_dim <= head_dim, f"bad rotary_dim {rotary_dim} for head_dim {head_dim}"
    assert positions.stride(0) == 1 or num_tokens <= 1
    assert q.device == k.device == positions.device == cos.device == sin.device
    if num_tokens == 0:
        return q, k
    half = rotary_dim // 2
    block_r = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(max(q.shape[1], k.shape[1])), max(1, 2048 // block_r)))
    grid = (num_tokens, triton.cdiv(q.shape[1], block_h) + triton.cdiv(k.shape[1], block_h))
    _apply_rotary_kernel[grid](
        q, k, positions, cos, sin,
        q.shape[1], k.shape[1], q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        HALF=half, BLOCK_H=block_h, BLOCK_R=block_r, num_warps=4,
    )
    return q, k


def apply_rotary_ref(q, k, positions, cos, sin, compute_dtype: torch.dtype | None = torch.float32):
    """Out of place. compute_dtype=float32: the kernel's math; compute_dtype=None: exactly
    RotaryEmbedding.forward (cos/sin cast to q.dtype, math in q.dtype)."""
    rotary_dim = cos.shape[1]
    dtype = compute_dtype or q.dtype
    c = cos[positions].to(dtype).unsqueeze(1)  # [T, 1, R]
    s = sin[positions].to(dtype).unsqueeze(1)

    def rotate(x):
        xr = x[..., :rotary_dim].to(dtype)
        half = rotary_dim // 2
        rot_half = torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)
        return torch.cat(((xr * c + rot_half * s).to(x.dtype), x[..., rotary_dim:]), dim=-1)

    return rotate(q), rotate(k)
