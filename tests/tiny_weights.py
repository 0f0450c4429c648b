"""Random weights that make tiny test checkpoints worth loading (conftest.py's and vlm_fixtures.py's)."""

from __future__ import annotations

import torch


@torch.no_grad()
def perturb_for_loading(model, matrix_std: float | None = None) -> None:
    """HF initialises norms to 1 and biases to 0: perturb them so that loading each is tested too. A_log
    (linear attention) gets a slow decay (exp(-A * softplus(..)) per token with A in [0.05, 0.5]), so the
    state carries information across many tokens and a lost or stale state shows in the outputs.
    `matrix_std`: redraw every matrix from N(0, matrix_std) (large weights: greedy text varies)."""
    for name, param in model.named_parameters():
        if "norm" in name:
            param.copy_(1.0 + 0.2 * torch.randn_like(param))
        elif name.endswith(".bias"):
            param.copy_(0.2 * torch.randn_like(param))
        elif name.endswith(".A_log"):
            param.copy_(torch.empty_like(param).uniform_(0.05, 0.5).log())
        elif matrix_std is not None and param.dim() > 1:
            param.normal_(0.0, matrix_std)
