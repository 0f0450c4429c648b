"""Blockwise FP8 (e4m3) in plain torch: the weights' quantization (once per load or update, any
device) and the references of kernels/fp8_blockwise.py's Triton kernels. No Triton import: the
engine quantizes weights with these on any install, and the CPU runs the references (the layout and
the arithmetic are in fp8_blockwise.py's docstring)."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
# A scale is amax times 1/448 (rounded to float32), not amax / 448: torch on CUDA divides by a Python
# scalar as a multiply by its float32 reciprocal, on the CPU it divides, and the two differ by an ulp.
# The multiply gives the same bits on both, and the kernels do the same (kernels/e4m3.e4m3_scale).
INV_FP8_MAX = 1.0 / FP8_MAX
BLOCK = 128  # the hub's weight_block_size [128, 128]
_MIN_AMAX = 1e-12  # an all-zero block gets a tiny scale instead of a division by zero


def _pad_to_blocks(w: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    n, k = w.shape
    pad_n, pad_k = -n % block_n, -k % block_k
    return torch.nn.functional.pad(w, (0, pad_k, 0, pad_n)) if pad_n or pad_k else w


def quantize_weight_blockwise(w: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] (any float dtype) -> (W_q [N, K] float8_e4m3fn, scale [ceil(N/BN), ceil(K/BK)] float32)."""
    assert w.dim() == 2, f"a weight is [N, K], got {tuple(w.shape)}"
    block_n, block_k = block
    n, k = w.shape
    padded = _pad_to_blocks(w.float(), block_n, block_k)
    blocks = padded.view(padded.shape[0] // block_n, block_n, padded.shape[1] // block_k, block_k)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=_MIN_AMAX) * INV_FP8_MAX  # [NB, KB]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(padded.shape)[:n, :k].contiguous(), scale


def dequantize_weight_blockwise(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)
                                ) -> torch.Tensor:
    """The float32 weight W_q * scale, [N, K]."""
    n, k = q.shape
    expanded = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return q.float() * expanded


# ---- references of the Triton kernels ----------------------------------------------------------

def empty_activation_scales(rows: int, groups: int, device, outer_major: bool = False) -> torch.Tensor:
    """An activation scale tensor [rows, groups] float32 to be written: row-major, or outer-dim-major
    (strides (1, rows)) as cuBLASLt's blockwise GEMM reads it."""
    if outer_major:
        return torch.empty((groups, rows), dtype=torch.float32, device=device).t()
    return torch.empty((rows, groups), dtype=torch.float32, device=device)


def quantize_activation_ref(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_activation in torch: the same amax rule per token and channel group."""
    m, k = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, -k % group)).view(m, -1, group)
    scale = padded.abs().amax(dim=2).clamp(min=_MIN_AMAX) * INV_FP8_MAX  # [M, KB]
    q = (padded / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, -1)[:, :k].contiguous(), scale


def fp8_blockwise_matmul_ref(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                             out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                             block: tuple[int, int] = (BLOCK, BLOCK)) -> torch.Tensor:
    """The kernel's sum in torch: per K block, the float32 dot of the e4m3 values times both scales,
    blocks added in K order, bias added, one rounding to out_dtype."""
    m, k = x_q.shape
    n = w_q.shape[0]
    scale_n, scale_k = block
    w_scale_rows = w_scale.repeat_interleave(scale_n, 0)[:n]  # [N, KB]
    acc = torch.zeros((m, n), dtype=torch.float32, device=x_q.device)
    for kb in range(-(-k // scale_k)):
        ks = slice(kb * scale_k, min(k, (kb + 1) * scale_k))
        acc += (x_q[:, ks].float() @ w_q[:, ks].float().t()) * x_scale[:, kb, None] * w_scale_rows[None, :, kb]
    if bias is not None:
        acc += bias.float()
    return acc.to(out_dtype)
