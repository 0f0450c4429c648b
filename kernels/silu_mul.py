"""silu(gate) * up for the fused gate_up projection output, one launch.

x [T, 2I] holds gate in x[:, :I] and up in x[:, I:] (as `SiluAndMul`); the
math is float32, rounded once to the output dtype (the torch module rounds
silu(gate) to the activation dtype before the multiply: identical for float32).
`silu_and_mul_fp8` writes the result quantized for the FP8 down projection (e4m3 values, one float32
scale per token and 128 channels): the same bits as silu_and_mul then quantize_activation, one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout_kernels.e4m3 import emulate_e4m3, quantize_groups
from rollout_kernels.fp8_blockwise_ref import BLOCK, FP8_DTYPE, FP8_MAX, _MIN_AMAX, empty_activation_scales


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, q_ptr, s_ptr, I, sx0, so0, sq0, ss0, ss1, BLOCK: tl.constexpr,
                     QUANT_GROUP: tl.constexpr = 0, FP8_MAX_C: tl.constexpr = 448.0,
                     MIN_AMAX: tl.constexpr = 1e-12, EMULATE_E4M3: tl.constexpr = False):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    row = x_ptr + t * sx0
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + I + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    if QUANT_GROUP == 0:
        tl.store(out_ptr + t * so0 + cols, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # FP8 rows for the down projection: the values the plain store would write (rounded to out's
        # dtype), quantized per group of QUANT_GROUP channels; BLOCK is whole groups
        groups = tl.program_id(1) * (BLOCK // QUANT_GROUP) + tl.arange(0, BLOCK // QUANT_GROUP)
        rounded = tl.reshape(y.to(out_ptr.dtype.element_ty).to(tl.float32), (BLOCK // QUANT_GROUP, QUANT_GROUP))
        q, scale = quantize_groups(rounded, FP8_MAX_C, MIN_AMAX, EMULATE_E4M3)
        qcols = groups[:, None] * QUANT_GROUP + tl.arange(0, QUANT_GROUP)[None, :]
        tl.store(q_ptr + t * sq0 + qcols, q.to(q_ptr.dtype.element_ty), mask=qcols < I)
        tl.store(s_ptr + t * ss0 + groups * ss1, scale, mask=groups * QUANT_GROUP < I)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, 2I] (rows may be strided) -> out [T, I] (new, or the given `out`, rows may be strided)."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be [T, 2I], got {tuple(x.shape)}"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), f"unsupported dtype {x.dtype}"
    assert x.stride(1) == 1 or x.shape[1] <= 1, "x must be contiguous in its last dim"
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    assert out.shape == (num_tokens, inter), f"out has shape {tuple(out.shape)}, expected {(num_tokens, inter)}"
    assert out.dtype == x.dtype and out.device == x.device
    assert out.stride(1) == 1 or inter <= 1, "out must be contiguous in its last dim"
    if num_tokens == 0 or inter == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        x, out, out, out, inter, x.stride(0), out.stride(0), 0, 0, 0, BLOCK=block, num_warps=4)
    return out


def silu_and_mul_fp8(x: torch.Tensor, group: int = BLOCK, scale_outer_major: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up quantized for an FP8 linear layer in one launch: x [T, 2I] -> (q [T, I] e4m3,
    scale [T, I / group] float32; strides (1, T) when scale_outer_major). Bit for bit silu_and_mul then
    fp8_blockwise.quantize_activation; the [T, I] activation itself is never written."""
    assert x.dim() == 2 and x.shape[1] % (2 * group) == 0, f"x must be [T, 2I] with I whole groups, got {tuple(x.shape)}"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), f"unsupported dtype {x.dtype}"
    assert x.stride(1) == 1, "x must be contiguous in its last dim"
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    q = torch.empty((num_tokens, inter), dtype=FP8_DTYPE, device=x.device)
    scale = empty_activation_scales(num_tokens, inter // group, x.device, scale_outer_major)
    if num_tokens == 0:
        return q, scale
    rounding = torch.empty((1,), dtype=x.dtype, device=x.device)  # only its dtype is read
    block = max(group, min(1024, triton.next_power_of_2(inter)))
    _silu_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        x, rounding, q, scale, inter, x.stride(0), 0, q.stride(0), scale.stride(0), scale.stride(1), BLOCK=block,
        QUANT_GROUP=group, FP8_MAX_C=FP8_MAX, MIN_AMAX=_MIN_AMAX, EMULATE_E4M3=emulate_e4m3(), num_warps=4)
    return q, scale


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """The kernel's math in plain torch (float32, one rounding)."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
