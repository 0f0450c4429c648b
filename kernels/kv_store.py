"""Write each token's k and v rows into the KV pools at its slot, one launch; the FP8 pool's writers.

k_pool/v_pool [S, KVH, D] (e.g. one layer of a [L, S, KVH, D] pool), slots [T]
int64; k/v [T, KVH, D] may be strided views (e.g. of a fused qkv output).
A negative slot skips the token (padding rows of a CUDA-graph batch).
Duplicate slots in one call: one of the writes wins, as with index assignment.

FP8 pools (`--kv-cache-dtype fp8`, issue 20): float8_e4m3fn with one float32 scale per tensor (per
layer, k and v apart): pool = e4m3(clamp(x / scale, +-448)), x ~= pool * scale (the torch codec and
references: kv_fp8_ref.py). The writers (store_kv, qk_norm_rope_store) quantize through
`pool_value` (rounding under the interpreter: e4m3.py); the attention kernels read a row as q's dtype (e4m3 -> bf16/fp32 is exact) and fold the scales into the softmax scale (k) and the
output (v), so no element is multiplied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout_kernels.e4m3 import emulate_e4m3, round_to_e4m3_grid
from rollout_kernels.kv_fp8_ref import KV_FP8_DTYPE, check_pool_dtype, to_pool_ref


@triton.jit
def pool_value(x, inv_scale, POOL_FP8: tl.constexpr, EMULATE_E4M3: tl.constexpr):
    """What a pool row holds for values x (any float dtype): x itself, or for an FP8 pool
    clamp(x * inv_scale) ready for the e4m3 store (on the e4m3 grid already under the interpreter)."""
    if POOL_FP8:
        y = tl.clamp(x.to(tl.float32) * inv_scale, -448.0, 448.0)
        if EMULATE_E4M3:
            y = round_to_e4m3_grid(y)
        return y
    else:
        return x


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kp_ptr, vp_ptr, slot_ptr,
    D, HD, sk0, sk1, sv0, sv1, skp0, skp1, svp0, svp1, k_inv_scale, v_inv_scale,
    BLOCK: tl.constexpr, POOL_FP8: tl.constexpr, EMULATE_E4M3: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    e = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # flat (head, dim) index
    # a negative slot writes nothing (as one mask expression: the interpreter mistypes bool & scalar bool)
    mask = e < tl.where(slot >= 0, HD, 0)
    h = e // D
    d = e % D
    k = pool_value(tl.load(k_ptr + t * sk0 + h * sk1 + d, mask=mask), k_inv_scale, POOL_FP8, EMULATE_E4M3)
    v = pool_value(tl.load(v_ptr + t * sv0 + h * sv1 + d, mask=mask), v_inv_scale, POOL_FP8, EMULATE_E4M3)
    tl.store(kp_ptr + slot * skp0 + h * skp1 + d, k.to(kp_ptr.dtype.element_ty), mask=mask)
    tl.store(vp_ptr + slot * svp0 + h * svp1 + d, v.to(vp_ptr.dtype.element_ty), mask=mask)


def store_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k_pool[slots[t]] = k[t]; v_pool[slots[t]] = v[t] for every t with slots[t] >= 0 (in place);
    FP8 pools get the values quantized with their scales (the module docstring).
    Slots must be < S (not checked: no host sync)."""
    assert k.dim() == 3 and k.shape == v.shape, f"k/v must be [T, KVH, D] alike, got {tuple(k.shape)}, {tuple(v.shape)}"
    assert k_pool.dim() == 3 and k_pool.shape == v_pool.shape, "k_pool/v_pool must be [S, KVH, D] alike"
    assert k_pool.shape[1:] == k.shape[1:], f"pool rows {tuple(k_pool.shape[1:])} != k rows {tuple(k.shape[1:])}"
    assert k.dtype == v.dtype and k_pool.dtype == v_pool.dtype, "k and v, and the two pools, must share a dtype"
    check_pool_dtype(k_pool, k.dtype, "the pools")
    for name, x in (("k", k), ("v", v), ("k_pool", k_pool), ("v_pool", v_pool)):
        assert x.stride(2) == 1 or x.shape[2] == 1, f"{name} must be contiguous in head_dim"
    assert slots.shape == (k.shape[0],) and slots.dtype == torch.int64, "slots must be [T] int64"
    assert slots.stride(0) == 1 or k.shape[0] <= 1
    assert k.device == v.device == k_pool.device == v_pool.device == slots.device
    num_tokens, kv_heads, head_dim = k.shape
    hd = kv_heads * head_dim
    if num_tokens == 0 or hd == 0:
        return
    block = min(2048, triton.next_power_of_2(hd))
    _store_kv_kernel[(num_tokens, triton.cdiv(hd, block))](
        k, v, k_pool, v_pool, slots,
        head_dim, hd, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), 1.0 / k_scale, 1.0 / v_scale,
        BLOCK=block, POOL_FP8=k_pool.dtype == KV_FP8_DTYPE, EMULATE_E4M3=emulate_e4m3(), num_warps=4,
    )


def store_kv_ref(k_pool, v_pool, slots, k, v, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Index assignment in plain torch (in place), skipping negative slots; FP8 pools quantized."""
    keep = slots >= 0
    k_pool[slots[keep]] = to_pool_ref(k_pool, k[keep], k_scale)
    v_pool[slots[keep]] = to_pool_ref(v_pool, v[keep], v_scale)
