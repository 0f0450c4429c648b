"""RMSNorm, optionally fused with the residual add, in one launch.

Matches `rollout_cli.models.layers.RMSNorm` rounding step for step:
    s      = (x + residual)                      # in the activation dtype (fused variant)
    normed = weight * (s32 * rsqrt(mean(s32^2) + eps)).to(dtype)
where the last product is rounded once to promote(weight.dtype, dtype), as torch does.
`zero_centred=True` is the Qwen3-Next / Qwen3.5 variant (models/norms.ZeroCentredRMSNorm, w stored
zero-centred): normed = (s32 * rsqrt(mean(s32^2) + eps) * (1 + w32)).to(dtype), rounded once.

`rms_norm_fp8` writes the normed rows as an FP8 linear layer reads them (e4m3 values and one float32
scale per token and 128 channels, kernels/fp8_blockwise.py) instead of the rows themselves: the same
bits as the norm then quantize_activation, in one launch.

One program per row. Rows may be strided (a slice of a wider tensor) and the
input may be 3-D [T, H, D] (per-head q/k norm on a strided view of a fused qkv
output): the last dim must be contiguous, the leading two dims take any strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout_kernels.e4m3 import emulate_e4m3, quantize_groups
from rollout_kernels.fp8_blockwise_ref import BLOCK, FP8_DTYPE, FP8_MAX, _MIN_AMAX, empty_activation_scales

MAX_N = 65536  # one row is one block


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, s_ptr,
    H, N,
    sx0, sx1, sr0, sr1, so0, so1, sro0, sro1, sq0, ss0, ss1,
    eps,
    HAS_RESIDUAL: tl.constexpr, ZERO_CENTRED: tl.constexpr, BLOCK_N: tl.constexpr,
    QUANT_GROUP: tl.constexpr = 0, FP8_MAX_C: tl.constexpr = 448.0, MIN_AMAX: tl.constexpr = 1e-12,
    EMULATE_E4M3: tl.constexpr = False,
):
    # rows are (t, h) pairs of a [T, H, N] view; 2-D inputs have H == 1
    row = tl.program_id(0).to(tl.int64)
    t = row // H
    h = row % H
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + t * sx0 + h * sx1 + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + t * sr0 + h * sr1 + cols, mask=mask, other=0.0)
        # the add is rounded to the activation dtype, as `x + residual` is in torch
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + t * sro0 + h * sro1 + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTRED:
        y = (xf * rstd) * (1.0 + w)  # all in float32, rounded once at the store
    else:
        # (x32 * rstd) is rounded to the activation dtype before the weight multiply, as in torch
        y = (xf * rstd).to(x.dtype).to(tl.float32) * w
    if QUANT_GROUP == 0:
        tl.store(out_ptr + t * so0 + h * so1 + cols, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # FP8 activations for the next linear layer, quantized from the values the plain kernel would
        # store (rounded to out's dtype first), per token and group of QUANT_GROUP channels: the same
        # bits as this kernel then fp8_blockwise.quantize_activation, one launch and no [T, N] round trip
        groups = tl.arange(0, BLOCK_N // QUANT_GROUP)
        rounded = tl.reshape(y.to(out_ptr.dtype.element_ty).to(tl.float32), (BLOCK_N // QUANT_GROUP, QUANT_GROUP))
        q, scale = quantize_groups(rounded, FP8_MAX_C, MIN_AMAX, EMULATE_E4M3)
        qcols = groups[:, None] * QUANT_GROUP + tl.arange(0, QUANT_GROUP)[None, :]
        tl.store(q_ptr + t * sq0 + qcols, q.to(q_ptr.dtype.element_ty), mask=qcols < N)
        tl.store(s_ptr + t * ss0 + groups * ss1, scale, mask=groups * QUANT_GROUP < N)


def _as3d(x: torch.Tensor) -> torch.Tensor:
    return x.unsqueeze(1) if x.dim() == 2 else x


def _check_rows(name: str, t: torch.Tensor, shape, dtype=None) -> None:
    assert t.dim() in (2, 3), f"{name} must be [T, N] or [T, H, N], got {tuple(t.shape)}"
    assert tuple(t.shape) == tuple(shape), f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}"
    assert t.stride(-1) == 1 or t.shape[-1] == 1, f"{name} must be contiguous in its last dim"
    if dtype is not None:
        assert t.dtype == dtype, f"{name} has dtype {t.dtype}, expected {dtype}"


def _launch(x, residual, weight, eps, out, residual_out, zero_centred: bool, quant=None) -> None:
    """quant: None, or (q [T, N] e4m3, scale [T, N / group] float32, group): store FP8 rows, not `out`
    (whose dtype still says what the values are rounded to before they are quantized)."""
    n = x.shape[-1]
    assert 1 <= n <= MAX_N, f"rms_norm supports 1 <= N <= {MAX_N}, got {n}"
    assert weight.dim() == 1 and weight.shape[0] == n and weight.stride(0) == 1, "weight must be contiguous [N]"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), f"unsupported dtype {x.dtype}"
    assert x.device == weight.device == out.device
    x3, o3 = _as3d(x), _as3d(out)
    r3 = _as3d(residual) if residual is not None else x3
    ro3 = _as3d(residual_out) if residual_out is not None else o3
    rows = x3.shape[0] * x3.shape[1]
    if rows == 0:
        return
    q, scale, group = quant if quant is not None else (o3, o3, 0)  # unused pointers when not quantizing
    block_n = triton.next_power_of_2(n)
    assert not group or (x.dim() == 2 and n % group == 0 and block_n >= group), "FP8 rows: [T, N], N whole groups"
    _rms_norm_kernel[(rows,)](
        x3, r3, weight, o3, ro3, q, scale,
        x3.shape[1], n,
        x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
        o3.stride(0), o3.stride(1), ro3.stride(0), ro3.stride(1), q.stride(0), scale.stride(0), scale.stride(1),
        float(eps),
        HAS_RESIDUAL=residual is not None,
        ZERO_CENTRED=zero_centred,
        BLOCK_N=block_n,
        QUANT_GROUP=group, FP8_MAX_C=FP8_MAX, MIN_AMAX=_MIN_AMAX, EMULATE_E4M3=emulate_e4m3(),
        num_warps=4 if n <= 2048 else 8 if n <= 8192 else 16,
    )


def _out_dtype(x, weight, zero_centred: bool) -> torch.dtype:
    # `weight * x.to(dtype)` promotes; the zero-centred variant casts back to x's dtype
    return x.dtype if zero_centred else torch.promote_types(weight.dtype, x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
             zero_centred: bool = False) -> torch.Tensor:
    """x [T, N] or [T, H, N] (strided rows allowed) -> normed, same shape.

    dtype of the result: promote(weight.dtype, x.dtype), as `weight * x` gives in torch (x's dtype
    when zero_centred). `out` may be given (any row strides, e.g. `out=x` for in place); else a new tensor.
    """
    out_dtype = _out_dtype(x, weight, zero_centred)
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    _check_rows("x", x, x.shape)
    _check_rows("out", out, x.shape, out_dtype)
    _launch(x, None, weight, eps, out, None, zero_centred)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None, zero_centred: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual) then RMSNorm; returns (normed, new_residual). IN PLACE by default:

    new_residual = x + residual (rounded to x.dtype) is written into `residual`,
    normed is written into `x` (needs weight.dtype == x.dtype); pass `out` /
    `residual_out` to write elsewhere. x, residual: [T, N] or [T, H, N], same dtype.
    """
    out_dtype = _out_dtype(x, weight, zero_centred)
    if out is None:
        assert out_dtype == x.dtype, (
            f"in-place fused_add_rms_norm needs weight dtype {weight.dtype} == x dtype {x.dtype}; pass out=")
        out = x
    if residual_out is None:
        residual_out = residual
    _check_rows("x", x, x.shape)
    _check_rows("residual", residual, x.shape, x.dtype)
    _check_rows("out", out, x.shape, out_dtype)
    _check_rows("residual_out", residual_out, x.shape, x.dtype)
    _launch(x, residual, weight, eps, out, residual_out, zero_centred)
    return out, residual_out


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 zero_centred: bool = False, group: int = BLOCK, scale_outer_major: bool = False,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """RMSNorm (after the residual add, if `residual` is given) with its output quantized for an FP8
    linear layer, in one launch: x [T, N] -> (x_q [T, N] e4m3, x_scale [T, N / group] float32, the new
    residual or None). Bit for bit what rms_norm / fused_add_rms_norm then quantize_activation give
    (same scale layout option); the normed rows themselves are never written. The residual add is in
    place, into `residual`, as fused_add_rms_norm's default."""
    out_dtype = _out_dtype(x, weight, zero_centred)
    _check_rows("x", x, x.shape)
    assert x.dim() == 2, f"rms_norm_fp8 takes [T, N] rows, got {tuple(x.shape)}"
    if residual is not None:
        _check_rows("residual", residual, x.shape, x.dtype)
    t, n = x.shape
    q = torch.empty((t, n), dtype=FP8_DTYPE, device=x.device)
    scale = empty_activation_scales(t, n // group, x.device, scale_outer_major)
    rounding = torch.empty((1, 1), dtype=out_dtype, device=x.device)  # only its dtype is read
    _launch(x, residual, weight, eps, rounding, residual, zero_centred, quant=(q, scale, group))
    return q, scale, residual


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False) -> torch.Tensor:
    """RMSNorm._norm (ZeroCentredRMSNorm._norm when zero_centred) in plain torch."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centred:
        return (x32 * (1.0 + weight.float())).to(x.dtype)
    return weight * x32.to(x.dtype)


def fused_add_rms_norm_ref(x, residual, weight, eps, zero_centred: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm.forward(x, residual) in plain torch: (normed, x + residual)."""
    s = x + residual
    return rms_norm_ref(s, weight, eps, zero_centred), s
