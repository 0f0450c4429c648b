"""The state pool of linear-attention (Gated DeltaNet) layers and each step's view of it.

Beside the KV pool (one slot per token), hybrid models keep a fixed-size
recurrent state per sequence: one state slot per running request (and per
prefix snapshot, see engine/scheduling/state_slots.py), slot 0 reserved as padding:

    conv [num_linear_layers, num_slots, conv_dim, conv_kernel - 1]   float32
    ssm  [num_linear_layers, num_slots, num_v_heads, k_dim, v_dim]   float32

A request's state is valid after its first `num_computed_tokens` tokens. A
step first applies the scheduler's ordered state copies (prefix snapshots
taken, snapshots forked into samples) and zeroes the slots of entries starting
at position 0 (`prepare_step`), then runs the forward, whose linear layers read
and update their slots through `LinearBatch` (decodes: one recurrent step each,
batched; prefill chunks: chunked delta rule per sequence; a step verifying
speculative drafts: each sequence's tokens in order with the decode step, keeping the state
after each draft in a fork slot, one launch per layer). The torch references
run by default; `triton_kernels=True` (the model runner sets it on the Triton
backend: CUDA, or the interpreter on the CPU) runs the Triton kernels of
rollout_kernels instead, same arguments.

CUDA graphs (engine/execution/cuda_graphs.py) capture decode steps with a `LinearBatch`
whose decode slots are a view of a static device buffer that DecodeGraphs fills
before each replay (padding rows: slot 0); copies and zeroing run before the
replay, outside the graph, and nothing inside reads a tensor on the host.
"""

from __future__ import annotations

import torch

from rollout_cli.models.gated_deltanet import LinearStateShape
from rollout_kernels.host_to_device import to_device


class LinearStatePool:
    storage_names = ("conv", "ssm")  # the cache-memory tensors a memory release frees (engine.memory.memory_saver)

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
    """Which state slot each sequence of the flat batch uses. Rows come decodes first (one token
    each, the first `num_decodes` rows), then prefill chunks at rows cu_seqlens[b]:cu_seqlens[b+1]
    of the prefill part.

    decode_slots [D] int64 on the device (a CUDA graph passes a view of its static buffer: the
    layers then build no tensor and read nothing on the host); prefill_slots [P] int64 with
    cu_seqlens (P + 1 host ints from 0), or None for a decode-only step.

    A step verifying speculative drafts (engine/scheduling/speculation.py) has 1 + d rows per decode
    entry (its last token and d drafts): `verify` = (verify_cu, fork_slots) gives entry b's rows
    verify_cu[b]:verify_cu[b+1] and the state slots [D, F] (-1: none) that receive its state after each
    draft position j < d, so the scheduler can put back the state after the last accepted token. The
    verify kernels run each entry's tokens in order with the decode step (a verified token has a
    decode's bits) in one launch per layer. verify_cu may be a device tensor [B + 1] (the static layout a
    CUDA graph of verify steps would replay, with decode_slots [B]: entries of no rows on slot -1, leftover
    rows of the bucket one-row entries on the padding slot); then there is no prefill part."""

    def __init__(self, pool: LinearStatePool, decode_slots: torch.Tensor, prefill_slots: torch.Tensor | None = None,
                 cu_seqlens: list[int] | None = None, triton_kernels: bool = False, invariant: bool = False,
                 verify: tuple[list[int] | torch.Tensor, torch.Tensor] | None = None):
        from rollout_kernels import causal_conv1d, gated_delta_rule  # Triton: optional on the CPU

        self._conv_ops, self._delta_ops = causal_conv1d, gated_delta_rule
        if triton_kernels:
            # Triton: optional on the CPU
            from rollout_kernels.chunk_gated_delta_rule import chunk_gated_delta_rule_varlen

            # the on-policy mode prefills token by token with the decode kernel's step, so a token's
            # bits do not depend on the chunks its prompt was cut into (the chunked form reduces otherwise)
            self._chunk_delta_rule = (gated_delta_rule.recurrent_gated_delta_rule_varlen if invariant
                                      else chunk_gated_delta_rule_varlen)
        self.triton_kernels = triton_kernels
        self.pool = pool
        self.verify = verify
        # a CUDA graph's verify step passes its layout on the device (verify_cu a tensor [B + 1]): every
        # row is then a decode part's row, and nothing of it is read on the host
        self.verify_on_device = verify is not None and isinstance(verify[0], torch.Tensor)
        assert not (self.verify_on_device and prefill_slots is not None), "a graph's verify step has no prefill"
        # rows of the decode part: one per decode, or 1 + num_draft per entry of a step verifying drafts
        self.num_decodes = (decode_slots.shape[0] if verify is None
                            else None if self.verify_on_device else verify[0][-1])
        self.decode_slots = decode_slots
        self.prefill_slots = prefill_slots
        self.cu_seqlens = cu_seqlens if prefill_slots is not None else [0]
        assert prefill_slots is None or len(self.cu_seqlens) == prefill_slots.shape[0] + 1

    @classmethod
    def from_entries(cls, pool: LinearStatePool, entries, device, triton_kernels: bool = False,
                     invariant: bool = False) -> "LinearBatch":
        """An eager step's batch from its entries (sorted decodes first, as ModelRunner.run does)."""
        verify = None
        if any(e.num_draft for e in entries):  # drafts come in steps of all decodes (+ new requests' prefills)
            decodes = [e for e in entries if e.num_draft or e.num_new_tokens == 1]
            verify = _verify_layout(decodes, device)
        else:
            decodes = [e for e in entries if e.num_new_tokens == 1]
        prefills = entries[len(decodes):]
        assert entries[:len(decodes)] == decodes, "entries must come decodes first (ModelRunner.run sorts them)"
        cu_seqlens = [0]
        for e in prefills:
            cu_seqlens.append(cu_seqlens[-1] + e.num_new_tokens)

        def slots(group):
            return to_device([e.request.state_slot for e in group], torch.long, device)

        return cls(pool, slots(decodes), slots(prefills) if prefills else None, cu_seqlens, triton_kernels, invariant,
                   verify)

    def conv(self, layer: int, x: torch.Tensor, weight: torch.Tensor, bias, activation: str) -> torch.Tensor:
        """x [T, C] -> causal conv + activation [T, C], each sequence continuing from its conv state."""
        D, states = self.num_decodes, self.pool.conv[layer]  # states [S, C, K-1], updated in place
        ops = self._conv_ops
        update, varlen, verify = ((ops.causal_conv1d_update, ops.causal_conv1d_varlen, ops.causal_conv1d_verify)
                                  if self.triton_kernels else (ops.causal_conv1d_update_ref, ops.causal_conv1d_varlen_ref,
                                                               ops.causal_conv1d_verify_ref))
        if self.prefill_slots is None and self.verify is None:  # decodes only (every graph step)
            return update(x, weight, bias, states, self.decode_slots, activation)
        if self.verify_on_device:
            return verify(x, weight, bias, states, self.decode_slots, *self.verify, activation)
        out = torch.empty_like(x)
        if self.verify is not None:
            out[:D] = verify(x[:D], weight, bias, states, self.decode_slots, *self.verify, activation)
        elif D:
            out[:D] = update(x[:D], weight, bias, states, self.decode_slots, activation)
        if self.prefill_slots is None:
            return out
        out[D:] = varlen(x[D:], weight, bias, states, self.prefill_slots, self.cu_seqlens, activation)
        return out

    def delta_rule(self, layer: int, q, k, v, g, beta) -> torch.Tensor:
        """q/k [T, Hk, dk], v [T, Hv, dv], g/beta [T, Hv] -> o [T, Hv, dv], states advanced in place."""
        D, states = self.num_decodes, self.pool.ssm[layer]  # [S, Hv, dk, dv]
        ops = self._delta_ops
        if self.triton_kernels:
            update, varlen, verify = (ops.recurrent_gated_delta_rule_update, self._chunk_delta_rule,
                                      ops.recurrent_gated_delta_rule_verify)
        else:
            update, varlen = ops.recurrent_gated_delta_rule_update_ref, ops.chunk_gated_delta_rule_varlen_ref
            verify = ops.recurrent_gated_delta_rule_verify_ref
        if self.prefill_slots is None and self.verify is None:
            return update(q, k, v, g, beta, states, self.decode_slots)
        if self.verify_on_device:
            return verify(q, k, v, g, beta, states, self.decode_slots, *self.verify)
        out = torch.empty_like(v)
        if self.verify is not None:
            out[:D] = verify(q[:D], k[:D], v[:D], g[:D], beta[:D], states, self.decode_slots, *self.verify)
        elif D:
            out[:D] = update(q[:D], k[:D], v[:D], g[:D], beta[:D], states, self.decode_slots)
        if self.prefill_slots is None:
            return out
        out[D:] = varlen(q[D:], k[D:], v[D:], g[D:], beta[D:], states, self.prefill_slots, self.cu_seqlens)
        return out


def _verify_layout(entries, device) -> tuple[list[int], torch.Tensor]:
    """The decode part of a step verifying drafts -> (row offsets [D + 1] host ints: entry b's 1 + d rows,
    fork slots [D, F] int64 on the device: entry b's state after its token j goes to [b, j] (-1: none))."""
    cu = [0]
    for e in entries:
        cu.append(cu[-1] + e.num_new_tokens)
    width = max(e.num_draft for e in entries)
    forks = [(list(e.state_forks) if e.state_forks is not None else []) for e in entries]
    return cu, to_device([f + [-1] * (width - len(f)) for f in forks], torch.long, device)


class HybridBatch:
    """The `attn` a hybrid model's forward receives: full-attention layers call `forward`
    (the KV attention batch), linear layers use `linear`."""

    def __init__(self, attn, linear: LinearBatch):
        self.attn = attn
        self.linear = linear

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.attn.forward(layer_idx, q, k, v)


def prepare_step(pool: LinearStatePool, out) -> None:
    """Before a step's forward (eager, or a graph replay): apply its state copies in order, then
    zero the states of sequences starting at position 0."""
    pool.copy(out.state_copies)
    pool.zero([e.request.state_slot for e in out.entries if e.start == 0])


def begin_step(pool: LinearStatePool, out, device, triton_kernels: bool = False, invariant: bool = False) -> LinearBatch:
    """prepare_step, then describe the eager batch (entries already sorted decodes first); `invariant`:
    the on-policy mode's prefill (LinearBatch)."""
    prepare_step(pool, out)
    return LinearBatch.from_entries(pool, out.entries, device, triton_kernels, invariant)
