"""Causal depthwise conv1d of the Gated DeltaNet layers, over a pool of per-sequence conv states.

Each sequence keeps the last K-1 inputs of its conv (K = kernel width) in a
state slot: conv_states [num_slots, channels, K-1]. Prefill (varlen, several
sequences packed in one flat batch) reads each sequence's state as its left
context and writes the last K-1 inputs back; decode does the same for one
token per sequence. The state must hold zeros for a sequence starting at
position 0 (the engine zeroes fresh slots).

These are the plain-torch references; the Triton kernels will take the same
arguments (state slots by index, updated in place).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _activate(out: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return out
    if activation in ("silu", "swish"):
        return F.silu(out)
    raise ValueError(f"unsupported conv activation {activation!r}")


def causal_conv1d_varlen_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             conv_states: torch.Tensor, state_indices: torch.Tensor, cu_seqlens: list[int],
                             activation: str | None = "silu") -> torch.Tensor:
    """x [T, C] (sequence b is rows cu_seqlens[b]:cu_seqlens[b+1]); weight [C, K]; bias [C] or None;
    conv_states [S, C, K-1] updated in place at state_indices [B] -> out [T, C] in x's dtype.

    The conv runs in the weight's dtype as HF's torch fallback does; the state keeps the raw inputs.
    """
    channels, width = weight.shape
    out = torch.empty_like(x)
    for b, slot in enumerate(state_indices.tolist()):
        start, end = cu_seqlens[b], cu_seqlens[b + 1]
        if end == start:
            continue
        # [C, K-1 + L]: the stored left context, then this chunk's inputs
        window = torch.cat((conv_states[slot].to(weight.dtype), x[start:end].t().to(weight.dtype)), dim=-1)
        y = F.conv1d(window[None], weight[:, None, :], bias, groups=channels)[0]  # [C, L]
        out[start:end] = _activate(y, activation).t().to(x.dtype)
        conv_states[slot] = window[:, window.shape[1] - (width - 1):].to(conv_states.dtype)
    return out


def causal_conv1d_update_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             conv_states: torch.Tensor, state_indices: torch.Tensor,
                             activation: str | None = "silu") -> torch.Tensor:
    """One new token per sequence: x [B, C]; conv_states [S, C, K-1] updated in place at
    state_indices [B] -> out [B, C] in x's dtype."""
    states = conv_states[state_indices]  # [B, C, K-1]
    window = torch.cat((states.to(weight.dtype), x[:, :, None].to(weight.dtype)), dim=-1)  # [B, C, K]
    y = (window * weight[None]).sum(-1)  # [B, C]
    if bias is not None:
        y = y + bias
    conv_states[state_indices] = window[:, :, 1:].to(conv_states.dtype)
    return _activate(y, activation).to(x.dtype)
