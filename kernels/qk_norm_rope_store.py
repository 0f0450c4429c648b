"""Attention prologue in one launch: per-head q/k RMSNorm, RoPE, and the k/v write into the KV pool.

Why: on the decode path every attention layer used to launch rms_norm(q), rms_norm(k) (Qwen3),
apply_rotary(q, k) and store_kv(k, v) separately; at batch 256 on Qwen3-0.6B those tiny launches
cost ~0.2 ms of a 6.2 ms step. This kernel does the same work, with the same rounding, in one.

Shapes:
    q        [T, H, D]      view of the fused qkv output (token/head strides free), rotated IN PLACE
    k, v     [T, KVH, D]    views of the same output; read only (k itself is NOT normed or rotated:
                            only its pool row is)
    positions [T] int64; cos, sin [max_pos, R] float32, R <= D even (dims R..D pass through)
    k_pool, v_pool [S, KVH, D]  one layer of the pool; slots [T] int64, a negative slot skips
                            the token's KV write (CUDA-graph padding rows; its q is still processed)
    q_weight, k_weight [D] in q's dtype, or both None (no norm: Llama, Qwen2)

Effect: q = rope(norm_q(q)); k_pool[slot] = rope(norm_k(k)); v_pool[slot] = v.

Rounding steps are those of the unfused Triton chain (kernels/rmsnorm.py, kernels/rotary.py):
    normed = (x32 * rsqrt(sum(x32^2) / D + eps)).to(dtype).to(f32) * w32, rounded to dtype
    out[:h]  = normed[:h] * cos[:h] - normed[h:R] * sin[:h]      (f32, rounded once; h = R // 2)
    out[h:R] = normed[h:R] * cos[h:] + normed[:h] * sin[h:]
    out[R:]  = normed[R:]
The sum of squares is reduced over one [BLOCK_D] row per head with the same num_warps as rms_norm,
to keep the float32 reduction order close to rms_norm's. Under the interpreter the two are bit for
bit equal; compiled for the H200 they were not (session 13: the GPU tests comparing bit for bit
failed), so the GPU tests compare them to the dtype's rounding tolerance. The rotated
halves are reloaded from the input (L1-resident) and normed elementwise with that rstd: no
write-then-read of the normed row, no barrier.

Grid: (T, q head blocks + kv head blocks); a program handles BLOCK_H heads of one token, one head
at a time; kv programs also copy their v heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout_kernels.e4m3 import emulate_e4m3
from rollout_kernels.kv_fp8_ref import KV_FP8_DTYPE, check_pool_dtype
from rollout_kernels.kv_store import pool_value, store_kv, store_kv_ref
from rollout_kernels.rmsnorm import rms_norm, rms_norm_ref
from rollout_kernels.rotary import apply_rotary, apply_rotary_ref


@triton.jit
def _norm_rope_heads(src, s_src, dst, s_dst, w_ptr, num_heads, h0, lim, D, R, eps, inv_scale,
                     cols, d, dmask, cos1, cos2, sin1, sin2,
                     HAS_NORM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                     IN_PLACE: tl.constexpr, POOL_FP8: tl.constexpr, EMULATE_E4M3: tl.constexpr):
    """BLOCK_H heads from h0 of one token: normed (HAS_NORM), rotated, written to dst (row limit `lim`:
    0 writes nothing). IN_PLACE: dst is src (q), whose pass-through dims are already there; otherwise
    dst is a pool row, in src's dtype or e4m3 (POOL_FP8: kernels/kv_store.py's pool_value)."""
    if HAS_NORM:
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        w1 = tl.load(w_ptr + d, mask=dmask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    for i in tl.static_range(BLOCK_H):
        h = (h0 + i).to(tl.int64)
        # masks as `vector < scalar limit` (the interpreter mistypes bool & scalar bool)
        load_lim = tl.where(h < num_heads, D, 0)
        store_lim = tl.where(h < num_heads, lim, 0)
        half_lim = tl.where(h < num_heads, HALF, 0)
        row = src + h * s_src
        out = dst + h * s_dst
        x1 = tl.load(row + d, mask=d < half_lim, other=0.0)  # [BLOCK_R]
        x2 = tl.load(row + HALF + d, mask=d < half_lim, other=0.0)
        x1f = x1.to(tl.float32)
        x2f = x2.to(tl.float32)
        if HAS_NORM:
            # as _rms_norm_kernel: one [BLOCK_D] row, same reduction, same rounding
            x = tl.load(row + cols, mask=cols < load_lim, other=0.0)
            xf = x.to(tl.float32)
            rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
            y = ((xf * rstd).to(x.dtype).to(tl.float32) * w).to(x.dtype)
            # pass-through dims R..D: the normed values as they are
            pass_mask = (cols >= R) & (cols < store_lim)
            tl.store(out + cols, pool_value(y, inv_scale, POOL_FP8, EMULATE_E4M3).to(dst.dtype.element_ty),
                     mask=pass_mask)
            # the rotary kernel reads the normed values rounded to the dtype
            x1f = ((x1f * rstd).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype).to(tl.float32)
            x2f = ((x2f * rstd).to(x1.dtype).to(tl.float32) * w2).to(x1.dtype).to(tl.float32)
        elif R < D:
            if not IN_PLACE:  # q's pass-through dims are already in place
                x = tl.load(row + cols, mask=(cols >= R) & (cols < load_lim), other=0.0)
                tl.store(out + cols, pool_value(x, inv_scale, POOL_FP8, EMULATE_E4M3).to(dst.dtype.element_ty),
                         mask=(cols >= R) & (cols < store_lim))
        o1 = (x1f * cos1 - x2f * sin1).to(x1.dtype)
        o2 = (x2f * cos2 + x1f * sin2).to(x1.dtype)
        rot_lim = tl.where(store_lim > 0, HALF, 0)
        tl.store(out + d, pool_value(o1, inv_scale, POOL_FP8, EMULATE_E4M3).to(dst.dtype.element_ty), mask=d < rot_lim)
        tl.store(out + HALF + d, pool_value(o2, inv_scale, POOL_FP8, EMULATE_E4M3).to(dst.dtype.element_ty),
                 mask=d < rot_lim)


@triton.jit
def _qk_norm_rope_store_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, kp_ptr, vp_ptr, slot_ptr, qw_ptr, kw_ptr,
    HQ, HK, D, R,
    sq0, sq1, sk0, sk1, sv0, sv1, skp0, skp1, svp0, svp1, s_cs,
    eps, k_inv_scale, v_inv_scale,
    HAS_NORM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, POOL_FP8: tl.constexpr, EMULATE_E4M3: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    nqb = tl.cdiv(HQ, BLOCK_H)
    slot = tl.load(slot_ptr + t)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)  # [BLOCK_D] a whole head
    d = tl.arange(0, BLOCK_R)  # [BLOCK_R] one rotated half
    dmask = d < HALF
    cs_row = pos * s_cs
    cos1 = tl.load(cos_ptr + cs_row + d, mask=dmask, other=0.0)
    cos2 = tl.load(cos_ptr + cs_row + HALF + d, mask=dmask, other=0.0)
    sin1 = tl.load(sin_ptr + cs_row + d, mask=dmask, other=0.0)
    sin2 = tl.load(sin_ptr + cs_row + HALF + d, mask=dmask, other=0.0)
    if hb < nqb:  # q heads: in place
        _norm_rope_heads(q_ptr + t * sq0, sq1, q_ptr + t * sq0, sq1, qw_ptr, HQ, hb * BLOCK_H, D, D, R, eps, 1.0,
                         cols, d, dmask, cos1, cos2, sin1, sin2, HAS_NORM, HALF, BLOCK_H, True, False, False)
    else:  # k heads: into the pool row of the token's slot (none for a negative slot)
        h0 = (hb - nqb) * BLOCK_H
        lim = tl.where(slot >= 0, D, 0)
        _norm_rope_heads(k_ptr + t * sk0, sk1, kp_ptr + slot * skp0, skp1, kw_ptr, HK, h0, lim, D, R, eps,
                         k_inv_scale, cols, d, dmask, cos1, cos2, sin1, sin2, HAS_NORM, HALF, BLOCK_H, False,
                         POOL_FP8, EMULATE_E4M3)
        for i in tl.static_range(BLOCK_H):  # v heads of the same block: copied as they are
            h = (h0 + i).to(tl.int64)
            vl = tl.where(h < HK, lim, 0)
            vv = tl.load(v_ptr + t * sv0 + h * sv1 + cols, mask=cols < vl)
            tl.store(vp_ptr + slot * svp0 + h * svp1 + cols,
                     pool_value(vv, v_inv_scale, POOL_FP8, EMULATE_E4M3).to(vp_ptr.dtype.element_ty), mask=cols < vl)


def _check_heads(name, x, num_tokens, head_dim, dtype):
    assert x.dim() == 3, f"{name} must be [T, heads, head_dim], got {tuple(x.shape)}"
    assert x.shape[0] == num_tokens and x.shape[2] == head_dim, f"{name} has shape {tuple(x.shape)}"
    assert x.stride(2) == 1 or head_dim == 1, f"{name} must be contiguous in head_dim"
    assert x.dtype == dtype, f"{name} has dtype {x.dtype}, expected {dtype}"


def qk_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                       slots: torch.Tensor, q_weight: torch.Tensor | None = None,
                       k_weight: torch.Tensor | None = None, eps: float = 1e-6,
                       block_h: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """IN PLACE: q = rope(norm_q(q)); k_pool[slots[t]] = rope(norm_k(k[t])), v_pool[slots[t]] = v[t]
    for slots[t] >= 0 (e4m3 pools: quantized with k_scale / v_scale as kernels/kv_store.py says). k and v
    are not modified. Without weights (both None) there is no norm.
    Positions must lie in [0, max_pos) and slots below S (not checked: no host sync). Returns q."""
    assert q.dim() == 3, f"q must be [T, heads, head_dim], got {tuple(q.shape)}"
    num_tokens, num_heads, head_dim = q.shape
    dtype = q.dtype
    assert dtype in (torch.float32, torch.float16, torch.bfloat16), f"unsupported dtype {dtype}"
    _check_heads("q", q, num_tokens, head_dim, dtype)
    _check_heads("k", k, num_tokens, head_dim, dtype)
    _check_heads("v", v, num_tokens, head_dim, dtype)
    num_kv_heads = k.shape[1]
    assert v.shape[1] == num_kv_heads, f"k has {num_kv_heads} heads, v has {v.shape[1]}"
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        assert pool.dim() == 3 and tuple(pool.shape[1:]) == (num_kv_heads, head_dim), (
            f"{name} must be [S, {num_kv_heads}, {head_dim}], got {tuple(pool.shape)}")
        assert pool.stride(2) == 1 or head_dim == 1, f"{name} must be contiguous in head_dim"
        check_pool_dtype(pool, dtype, name)
    assert k_pool.shape[0] == v_pool.shape[0] and k_pool.dtype == v_pool.dtype, "k_pool and v_pool must be alike"
    assert positions.shape == (num_tokens,) and positions.dtype == torch.int64, "positions must be [T] int64"
    assert slots.shape == (num_tokens,) and slots.dtype == torch.int64, "slots must be [T] int64"
    assert positions.stride(0) == 1 or num_tokens <= 1, "positions must be contiguous"
    assert slots.stride(0) == 1 or num_tokens <= 1, "slots must be contiguous"
    assert cos.dim() == 2 and cos.shape == sin.shape, "cos/sin must be [max_pos, rotary_dim]"
    assert cos.dtype == sin.dtype == torch.float32, "cos/sin tables must be float32"
    assert cos.stride(1) == 1 and sin.stride(1) == 1 and cos.stride(0) == sin.stride(0), "cos/sin must be contiguous"
    rotary_dim = cos.shape[1]
    assert rotary_dim % 2 == 0 and 2 <= rotary_dim <= head_dim, f"bad rotary_dim {rotary_dim} for head_dim {head_dim}"
    assert (q_weight is None) == (k_weight is None), "pass both q_weight and k_weight, or neither"
    has_norm = q_weight is not None
    if has_norm:
        for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
            assert w.shape == (head_dim,) and w.stride(0) == 1, f"{name} must be contiguous [{head_dim}]"
            assert w.dtype == dtype, f"{name} has dtype {w.dtype}, expected q's {dtype}"
    tensors = (k, v, positions, cos, sin, k_pool, v_pool, slots) + ((q_weight, k_weight) if has_norm else ())
    assert all(x.device == q.device for x in tensors), "all tensors must be on q's device"
    assert head_dim <= 2048, f"head_dim {head_dim} > 2048 is not supported"
    if num_tokens == 0:
        return q
    half = rotary_dim // 2
    if block_h is None:
        block_h = 1
    grid = (num_tokens, triton.cdiv(num_heads, block_h) + triton.cdiv(num_kv_heads, block_h))
    _qk_norm_rope_store_kernel[grid](
        q, k, v, positions, cos, sin, k_pool, v_pool, slots,
        q_weight if has_norm else q, k_weight if has_norm else q,
        num_heads, num_kv_heads, head_dim, rotary_dim,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), cos.stride(0),
        float(eps), 1.0 / k_scale, 1.0 / v_scale,
        HAS_NORM=has_norm, HALF=half, BLOCK_H=block_h,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_R=triton.next_power_of_2(half),
        POOL_FP8=k_pool.dtype == KV_FP8_DTYPE, EMULATE_E4M3=emulate_e4m3(),
        num_warps=4,  # as rms_norm for head_dim <= 2048: the same reduction order
    )
    return q


def qk_norm_rope_store_ref(q, k, v, positions, cos, sin, k_pool, v_pool, slots,
                           q_weight=None, k_weight=None, eps: float = 1e-6, k_scale: float = 1.0,
                           v_scale: float = 1.0) -> torch.Tensor:
    """The chain in plain torch (q in place, pools in place): rms_norm_ref, apply_rotary_ref, store_kv_ref."""
    qn, kn = q, k
    if q_weight is not None:
        qn, kn = rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps)
    qr, kr = apply_rotary_ref(qn, kn, positions, cos, sin)
    q.copy_(qr)
    store_kv_ref(k_pool, v_pool, slots, kr, v, k_scale, v_scale)
    return q


def qk_norm_rope_store_chain(q, k, v, positions, cos, sin, k_pool, v_pool, slots,
                             q_weight=None, k_weight=None, eps: float = 1e-6, k_scale: float = 1.0,
                             v_scale: float = 1.0) -> torch.Tensor:
    """The unfused Triton chain this kernel replaces (what DecoderAttention launched before):
    rms_norm x2, apply_rotary, store_kv. q in place; k is left normed and rotated."""
    if q_weight is not None:
        rms_norm(q, q_weight, eps, out=q)
        rms_norm(k, k_weight, eps, out=k)
    apply_rotary(q, k, positions, cos, sin)
    store_kv(k_pool, v_pool, slots, k, v, k_scale, v_scale)
    return q


def benchmark_qk_norm_rope_store(num_tokens: int = 256, num_heads: int = 16, num_kv_heads: int = 8,
                                 head_dim: int = 128, rotary_dim: int | None = None, qk_norm: bool = True,
                                 dtype: torch.dtype = torch.bfloat16, num_slots: int = 65536,
                                 block_h: int | None = None) -> dict:
    """CUDA: median times (us, triton.testing.do_bench) of the fused kernel and of the unfused chain
    on one fused qkv buffer. -> {"fused_us", "chain_us", "speedup", ...shape}."""
    assert torch.cuda.is_available(), "benchmark_qk_norm_rope_store needs CUDA"
    dev = "cuda"
    rotary_dim = rotary_dim or head_dim
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, device=dev).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim: (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    max_pos = 4096
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, device=dev).float() / rotary_dim))
    emb = torch.outer(torch.arange(max_pos, device=dev, dtype=torch.float32), inv_freq).repeat(1, 2)
    cos, sin = emb.cos().contiguous(), emb.sin().contiguous()
    positions = torch.randint(0, max_pos, (num_tokens,), device=dev)
    slots = torch.randperm(num_slots, device=dev)[:num_tokens]
    k_pool = torch.zeros(num_slots, num_kv_heads, head_dim, device=dev, dtype=dtype)
    v_pool = torch.zeros_like(k_pool)
    qw = kw = None
    if qk_norm:
        qw = torch.randn(head_dim, device=dev).to(dtype)
        kw = torch.randn(head_dim, device=dev).to(dtype)
    from triton.testing import do_bench

    # values drift over repeated in-place calls (harmless for timing: same work every call)
    fused = do_bench(lambda: qk_norm_rope_store(q, k, v, positions, cos, sin, k_pool, v_pool, slots, qw, kw,
                                                block_h=block_h), return_mode="median")
    chain = do_bench(lambda: qk_norm_rope_store_chain(q, k, v, positions, cos, sin, k_pool, v_pool, slots, qw, kw),
                     return_mode="median")
    return dict(num_tokens=num_tokens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                rotary_dim=rotary_dim, qk_norm=qk_norm, dtype=str(dtype), block_h=block_h,
                fused_us=fused * 1e3, chain_us=chain * 1e3, speedup=chain / fused)
