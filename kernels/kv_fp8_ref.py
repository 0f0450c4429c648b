"""The FP8 (e4m3) KV pool's codec in plain torch: what kernels/kv_store.py's writers store and the
attention kernels read, as references and for the engine's torch path (no Triton import: a CPU
install without triton runs `--kv-cache-dtype fp8` through these).

A pool row holds e4m3(clamp(x / scale, +-448)) with one float32 scale per tensor (per layer, k and
v apart); x ~= row * scale."""

from __future__ import annotations

import torch

KV_FP8_DTYPE = torch.float8_e4m3fn
KV_FP8_MAX = 448.0  # largest finite e4m3fn value


def check_pool_dtype(pool: torch.Tensor, dtype: torch.dtype, name: str = "pool") -> None:
    """A pool holds `dtype` (the model's) or, in FP8, e4m3."""
    assert pool.dtype in (dtype, KV_FP8_DTYPE), f"{name} has dtype {pool.dtype}, expected {dtype} or {KV_FP8_DTYPE}"


def quantize_kv_ref(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x (any float dtype) -> e4m3 pool values for a per-tensor scale."""
    return (x.float() * (1.0 / scale)).clamp(-KV_FP8_MAX, KV_FP8_MAX).to(KV_FP8_DTYPE)


def to_pool_ref(pool: torch.Tensor, x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as `pool` stores it: quantized for an FP8 pool, cast otherwise."""
    return quantize_kv_ref(x, scale) if pool.dtype == KV_FP8_DTYPE else x.to(pool.dtype)


def from_pool_ref(rows: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Pool rows back in `dtype`: an FP8 pool's times its scale (in float32, then rounded)."""
    if rows.dtype == KV_FP8_DTYPE:
        return (rows.float() * scale).to(dtype)
    return rows.to(dtype)
