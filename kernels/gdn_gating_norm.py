"""The two elementwise pieces around a Gated DeltaNet layer's recurrence, one launch each.

gdn_gating: the decay and the write strength of the delta rule from the layer's projections
    a, b [T, Hv] (strided slices of in_proj_ba's output), A_log, dt_bias [Hv]
    g    [T, Hv] float32 = -exp(A_log32) * softplus(a32 + dt_bias32)   (<= 0; the state decays by exp(g))
    beta [T, Hv] b.dtype = sigmoid(b)
  replacing four torch launches (sigmoid, exp, add + softplus, mul) per layer.

gated_rms_norm: the layer's output norm, per value head
    x, z [T, H, D] (or [N, D]; strided rows), weight [D]
    out  = ((weight * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype)) * silu(z32)).to(dtype)
  rounded step for step as models/norms.GatedRMSNorm (and HF's Qwen3NextRMSNormGated): the normed
  row is rounded to the activation dtype, the weight product rounded once more, the gate applied
  in float32. One program per (token, head) row.

Plain-torch references `gdn_gating_ref` and `gated_rms_norm_ref` sit beside the launchers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rollout_kernels.rmsnorm import _as3d  # [N, D] rows as [N, 1, D], like rms_norm's

MAX_D = 16384  # one row of gated_rms_norm is one block
SOFTPLUS_THRESHOLD = 20.0  # torch's softplus default: above it, softplus(x) = x


@triton.jit
def _sigmoid(x):
    # exp of -|x| only: no overflow for large negative x (float32 math)
    e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def _gdn_gating_kernel(
    a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr,
    T, H,
    sa0, sb0, sg0, sbeta0,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # a tile of BLOCK_T tokens x all H heads; the last dim of every tensor is contiguous
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    heads = tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < T) & (heads[None, :] < H)
    a = tl.load(a_ptr + rows[:, None] * sa0 + heads[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + rows[:, None] * sb0 + heads[None, :], mask=mask, other=0.0).to(tl.float32)
    a_log = tl.load(a_log_ptr + heads, mask=heads < H, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + heads, mask=heads < H, other=0.0).to(tl.float32)
    x = a + dt_bias[None, :]
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    g = -tl.exp(a_log)[None, :] * softplus
    beta = _sigmoid(b)
    tl.store(g_ptr + rows[:, None] * sg0 + heads[None, :], g, mask=mask)
    tl.store(beta_ptr + rows[:, None] * sbeta0 + heads[None, :], beta.to(beta_ptr.dtype.element_ty), mask=mask)


def _check_2d(name: str, t: torch.Tensor, shape) -> None:
    assert t.dim() == 2 and tuple(t.shape) == tuple(shape), f"{name} must be {tuple(shape)}, got {tuple(t.shape)}"
    assert t.stride(1) == 1 or t.shape[1] == 1, f"{name} must be contiguous in its last dim"


def gdn_gating(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [T, Hv] (row stride free), a_log, dt_bias [Hv] -> (g [T, Hv] float32, beta [T, Hv] b.dtype)."""
    assert a.dim() == 2, f"a must be [T, Hv], got {tuple(a.shape)}"
    T, H = a.shape
    _check_2d("b", b, (T, H))
    for name, p in (("A_log", a_log), ("dt_bias", dt_bias)):
        assert p.shape == (H,) and p.stride(0) == 1, f"{name} must be contiguous [{H}], got {tuple(p.shape)}"
    _check_2d("a", a, (T, H))
    assert a.device == b.device == a_log.device == dt_bias.device, "a, b, A_log and dt_bias must share a device"
    g = torch.empty((T, H), dtype=torch.float32, device=a.device)
    beta = torch.empty((T, H), dtype=b.dtype, device=a.device)
    if T == 0:
        return g, beta
    block_h = triton.next_power_of_2(H)
    block_t = max(1, min(64, 2048 // block_h))
    _gdn_gating_kernel[(triton.cdiv(T, block_t),)](
        a, b, a_log, dt_bias, g, beta, T, H, a.stride(0), b.stride(0), g.stride(0), beta.stride(0),
        BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4,
    )
    return g, beta


def gdn_gating_ref(a, b, a_log, dt_bias) -> tuple[torch.Tensor, torch.Tensor]:
    """models/gated_deltanet.GatedDeltaNet's gating in plain torch."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float(), threshold=SOFTPLUS_THRESHOLD)
    return g, b.sigmoid()


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, z_ptr, w_ptr, out_ptr,
    H, D,
    sx0, sx1, sz0, sz1, so0, so1,
    eps,
    BLOCK_D: tl.constexpr,
):
    # rows are (t, h) pairs of [T, H, D] views; 2-D inputs have H == 1
    row = tl.program_id(0).to(tl.int64)
    t = row // H
    h = row % H
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + t * sx0 + h * sx1 + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)  # rounded to the activation dtype, as in torch
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    wx = (normed * w).to(x.dtype).to(tl.float32)  # `weight * x.to(dtype)`: one more rounding
    z = tl.load(z_ptr + t * sz0 + h * sz1 + cols, mask=mask, other=0.0).to(tl.float32)
    y = wx * (z * _sigmoid(z))  # silu in float32
    tl.store(out_ptr + t * so0 + h * so1 + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """x, z [N, D] or [T, H, D] (strided rows, last dim contiguous), weight [D] in x's dtype -> out, x's shape."""
    assert x.dim() in (2, 3), f"x must be [N, D] or [T, H, D], got {tuple(x.shape)}"
    assert tuple(z.shape) == tuple(x.shape), f"z has shape {tuple(z.shape)}, expected {tuple(x.shape)}"
    d = x.shape[-1]
    assert 1 <= d <= MAX_D, f"gated_rms_norm supports 1 <= D <= {MAX_D}, got {d}"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), f"unsupported dtype {x.dtype}"
    assert weight.shape == (d,) and weight.stride(0) == 1, f"weight must be contiguous [{d}]"
    assert weight.dtype == x.dtype, f"weight dtype {weight.dtype} must equal x's {x.dtype}"
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    assert tuple(out.shape) == tuple(x.shape) and out.dtype == x.dtype, "out must match x's shape and dtype"
    for name, t in (("x", x), ("z", z), ("out", out)):
        assert t.stride(-1) == 1 or d == 1, f"{name} must be contiguous in its last dim"
    assert x.device == z.device == weight.device == out.device, "x, z, weight and out must share a device"
    x3, z3, o3 = _as3d(x), _as3d(z), _as3d(out)
    rows = x3.shape[0] * x3.shape[1]
    if rows == 0:
        return out
    _gated_rms_norm_kernel[(rows,)](
        x3, z3, weight, o3, x3.shape[1], d,
        x3.stride(0), x3.stride(1), z3.stride(0), z3.stride(1), o3.stride(0), o3.stride(1),
        float(eps), BLOCK_D=triton.next_power_of_2(d), num_warps=4 if d <= 2048 else 8,
    )
    return out


def gated_rms_norm_ref(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """models/norms.GatedRMSNorm in plain torch."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x32.to(dtype) * F.silu(z.float())).to(dtype)
