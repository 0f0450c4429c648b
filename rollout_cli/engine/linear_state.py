"""The state pool of linear-attention (Gated DeltaNet) layers and each step's view of it.

Beside the KV pool (one slot per token), hybrid models keep a fixed-size
recurrent state per sequence: one state slot per running request (and per
prefix snapshot, see engine/state_slots.py), slot 0 reserved as padding:

    conv [num_linear_layers, num_slots, conv_dim, conv_kernel - 1]   float32
    ssm  [num_linear_layers, num_slots, num_v_heads, k_dim, v_dim]   float32

A request's state is valid after its first `num_computed_tokens` tokens. A
step first applies the scheduler's ordered state copies (prefix snapshots
taken, snapshots forked into samples), zeroes the slots of entries starting
at position 0, then runs the forward, whose linear layers read and update
their slots through `LinearBatch` (decodes: one recurrent step each, batched;
prefill chunks: chunked delta rule per sequence). The torch references run by
default; `triton_kernels=True` (the model runner sets it on the Triton backend
on CUDA only, and the engine still keeps hybrid models off that backend) runs
the Triton kernels of rollout_kernels instead, same arguments.
"""

from __future__ import annotations

import torch

from rollout_cli.models.gated_deltanet import LinearStateShape


class LinearStatePool:
    def __init__(self, shape: LinearStateShape, num_slots: int, device):
        self.shape = shape
        self.num_slots = num_slots
        L, S = shape.num_layers, num_slots
        self.conv = torch.zeros((L, S, shape.conv_dim, shape.conv_kernel - 1), dtype=torch.float32, device=device)
        self.ssm = torch.zeros((L, S, shape.num_v_heads, shape.k_dim, shape.v_dim), dtype=torch.float32,
                               device=device)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy slot src -> dst over all layers, pairs in order (a snapshot may be taken, then forked)."""
        for src, dst in pairs:
            self.conv[:, dst].copy_(self.conv[:, src])
            self.ssm[:, dst].copy_(self.ssm[:, src])

    def zero(self, slots: list[int]) -> None:
        if slots:
            index = torch.tensor(slots, dtype=torch.long, device=self.conv.device)
            self.conv[:, index] = 0.0
            self.ssm[:, index] = 0.0


class LinearBatch:
    """Which state slot each sequence of the flat batch uses. Entries come decodes first (one token
    each, the first `num_decodes` rows), then prefill chunks at rows cu_seqlens[b]:cu_seqlens[b+1]
    of the prefill part."""

    def __init__(self, pool: LinearStatePool, entries, device, triton_kernels: bool = False):
        from rollout_kernels import causal_conv1d, gated_delta_rule

        self._conv_ops, self._delta_ops = causal_conv1d, gated_delta_rule
        self.triton_kernels = triton_kernels
        self.pool = pool
        decodes = [e for e in entries if e.num_new_tokens == 1]
        prefills = [e for e in entries if e.num_new_tokens > 1]
        assert entries[:len(decodes)] == decodes, "entries must come decodes first (ModelRunner.run sorts them)"
        self.num_decodes = len(decodes)
        self.decode_slots = torch.tensor([e.request.state_slot for e in decodes], dtype=torch.long, device=device)
        self.prefill_slots = torch.tensor([e.request.state_slot for e in prefills], dtype=torch.long, device=device)
        self.cu_seqlens = [0]
        for e in prefills:
            self.cu_seqlens.append(self.cu_seqlens[-1] + e.num_new_tokens)

    def conv(self, layer: int, x: torch.Tensor, weight: torch.Tensor, bias, activation: str) -> torch.Tensor:
        """x [T, C] -> causal conv + activation [T, C], each sequence continuing from its conv state."""
        D, states = self.num_decodes, self.pool.conv[layer]  # states [S, C, K-1], updated in place
        out = torch.empty_like(x)
        ops = self._conv_ops
        update, varlen = ((ops.causal_conv1d_update, ops.causal_conv1d_varlen) if self.triton_kernels
                          else (ops.causal_conv1d_update_ref, ops.causal_conv1d_varlen_ref))
        if D:
            out[:D] = update(x[:D], weight, bias, states, self.decode_slots, activation)
        if len(self.cu_seqlens) > 1:
            out[D:] = varlen(x[D:], weight, bias, states, self.prefill_slots, self.cu_seqlens, activation)
        return out

    def delta_rule(self, layer: int, q, k, v, g, beta) -> torch.Tensor:
        """q/k [T, Hk, dk], v [T, Hv, dv], g/beta [T, Hv] -> o [T, Hv, dv], states advanced in place."""
        D, states = self.num_decodes, self.pool.ssm[layer]  # [S, Hv, dk, dv]
        out = torch.empty_like(v)
        if self.triton_kernels:
            from rollout_kernels.chunk_gated_delta_rule import chunk_gated_delta_rule_varlen

            update, varlen = self._delta_ops.recurrent_gated_delta_rule_update, chunk_gated_delta_rule_varlen
        else:
            update = self._delta_ops.recurrent_gated_delta_rule_update_ref
            varlen = self._delta_ops.chunk_gated_delta_rule_varlen_ref
        if D:
            out[:D] = update(q[:D], k[:D], v[:D], g[:D], beta[:D], states, self.decode_slots)
        if len(self.cu_seqlens) > 1:
            out[D:] = varlen(q[D:], k[D:], v[D:], g[D:], beta[D:], states, self.prefill_slots, self.cu_seqlens)
        return out


class HybridBatch:
    """The `attn` a hybrid model's forward receives: full-attention layers call `forward`
    (the KV attention batch), linear layers use `linear`."""

    def __init__(self, attn, linear: LinearBatch):
        self.attn = attn
        self.linear = linear

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.attn.forward(layer_idx, q, k, v)


def begin_step(pool: LinearStatePool, out, device, triton_kernels: bool = False) -> LinearBatch:
    """Apply the step's state copies, zero the states of sequences starting at position 0, and
    describe the batch (entries already sorted decodes first)."""
    pool.copy(out.state_copies)
    pool.zero([e.request.state_slot for e in out.entries if e.start == 0])
    return LinearBatch(pool, out.entries, device, triton_kernels)
