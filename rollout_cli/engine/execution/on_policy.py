"""The on-policy mode's forward (`--deterministic`): one token at a time, shared by the engine and
the trainer (`rollout_cli.training`), so the two compute every logprob with the same calls.

Why one token at a time: a reduction's rounding depends on the shapes it runs at (a matmul's split
of K chosen by the number of rows, attention padded to a batch's longest context, a vectorised
loop whose tail falls elsewhere). When every token runs in a forward of its own, every reduction of
that token has the same shape and the same inputs whether the token came in a prefill chunk, a
decode step, a batch of one or of 256, from the prefix cache or recomputed, in the engine or in
the trainer: its bits cannot depend on them. The price is one forward per token: this is the torch
path's way (the CPU, hybrid models); the Triton backend keeps the batch and gets the same property
from batch-invariant kernels (engine/triton_attention.InvariantAttentionBatch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rollout_cli.engine.execution.attention import KVCache


def attend_token(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token over its whole context, as the on-policy mode computes every token (the engine
    over its KV pool, the trainer's forward over its own keys: the same call on the same shapes).
    q [1, heads, d]; keys / values [C, kv_heads, d] (contiguous) -> [1, heads, d]."""
    attended = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None], scale=scale,
        enable_gqa=True)  # [1, heads, 1, d]: no mask, every key of the context is visible
    return attended[0].transpose(0, 1)


class PoolTokenAttention:
    """The `attn` of a one-token forward over the KV pool (the on-policy mode): the token's k/v go to
    its slot, then it attends to the slots of its whole context, positions 0 .. its own."""

    def __init__(self, kv: KVCache, slot: int, context_slots: torch.Tensor, scale: float):
        self.kv = kv
        self.slot = slot
        self.context_slots = context_slots  # [C] long
        self.scale = scale

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_pool, v_pool = self.kv.k[layer_idx], self.kv.v[layer_idx]
        k_pool[self.slot] = k[0].to(k_pool.dtype)
        v_pool[self.slot] = v[0].to(v_pool.dtype)
        return attend_token(q, k_pool[self.context_slots], v_pool[self.context_slots], self.scale)


def token_forward(model, token: int, position: int | torch.Tensor, attn, device, logits: bool = True,
                  vision=None, hidden_rows: list | None = None) -> torch.Tensor | None:
    """One token's forward (the model reads and writes its context through `attn`) -> its logits
    [1, vocab] float32, or None with logits=False (a position nobody samples or scores). `position`: an
    int, or the rotary positions tensor ([1], or [3, 1] for an image token) with its `vision` rows.
    hidden_rows: the final hidden state [1, hidden] is appended there (the MTP head's pass reads them)."""
    ids = torch.tensor([token], device=device)
    positions = torch.tensor([position], device=device) if isinstance(position, int) else position
    hidden = model(ids, positions, attn) if vision is None else model(ids, positions, attn, vision=vision)  # [1, hidden]
    if hidden_rows is not None:
        hidden_rows.append(hidden)
    return model.compute_logits(hidden) if logits else None
