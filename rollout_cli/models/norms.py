"""The RMSNorm variants of the hybrid (Qwen3-Next / Qwen3.5) models.

ZeroCentredRMSNorm scales by (1 + w), w stored zero-centred in the checkpoint,
and multiplies in float32 before casting back (HF: `(x * (1 + w)).to(dtype)`,
unlike Llama's `w * x.to(dtype)`). GatedRMSNorm is the output norm of the
Gated DeltaNet layers: per value head, norm(x) * w * silu(z).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rollout_cli.models.layers import default_weight_loader


class ZeroCentredRMSNorm(nn.Module):
    """forward(x) -> normed; forward(x, residual) -> (normed, x + residual), like layers.RMSNorm."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.weight.dummy_fill = 0.0  # random-weight runs: scale 1, as HF initialises it
        self.eps = eps
        self.use_triton = False  # kernels/rmsnorm.py with zero_centred=True, same rounding

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.use_triton:
            from rollout_kernels.rmsnorm import fused_add_rms_norm, rms_norm  # Triton: optional on the CPU

            if residual is None:
                return rms_norm(x, self.weight, self.eps, zero_centred=True)
            # in place: x and residual are the layer's temporaries, as in layers.RMSNorm
            return fused_add_rms_norm(x, residual, self.weight, self.eps, zero_centred=True)
        if residual is None:
            return self._norm(x)
        x = x + residual  # in the activation dtype, as HF's `residual + hidden_states`
        return self._norm(x), x


class GatedRMSNorm(nn.Module):
    """x, z [N, head_dim] or [T, heads, head_dim] (z may be a strided view) -> (w * rmsnorm(x).to(dtype))
    * silu(z) in float32, cast to x's dtype."""

    def __init__(self, head_dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.eps = eps
        self.use_triton = False  # one launch, same rounding steps (kernels/gdn_gating_norm.py)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if self.use_triton and self.weight.dtype == x.dtype:
            from rollout_kernels.gdn_gating_norm import gated_rms_norm  # Triton: optional on the CPU

            return gated_rms_norm(x, z, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32.to(dtype) * F.silu(z.float())).to(dtype)
