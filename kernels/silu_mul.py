"""silu(gate) * up for the fused gate_up projection output, one launch.

x [T, 2I] holds gate in x[:, :I] and up in x[:, I:] (as `SiluAndMul`); the
math is float32, rounded once to the output dtype (the torch module rounds
silu(gate) to the activation dtype before the multiply: identical for float32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, I, sx0, so0, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    row = x_ptr + t * sx0
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + I + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + t * so0 + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


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
        x, out, inter, x.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """The kernel's math in plain torch (float32, one rounding)."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
