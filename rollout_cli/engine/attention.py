"""Attention over the token-slot KV pool with plain torch ops.

Each step, `prepare` turns the batch into gather indices once; every layer
then stores its new k/v into the pool and runs SDPA over the gathered
context. Requests are padded into two groups, decodes (one query each) and
prefill chunks, so a long chunk never pads hundreds of decodes to its length.
The Triton kernels of the GPU speed work replace this module's role.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


class KVCache:
    """k and v pools: [num_layers, num_slots, num_kv_heads, head_dim] each."""

    storage_names = ("k", "v")  # the cache-memory tensors a memory release frees (engine.memory_saver)

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype, device):
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.bytes_per_token_of_pool = 2 * self.k[:, 0].numel() * self.k.element_size()

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass
class _Group:
    """Requests padded together: B requests, at most Q new tokens, at most C context tokens."""

    token_index: torch.Tensor  # [B, Q] long: row of q in the flat batch (0 where padded)
    valid: torch.Tensor  # [B, Q] bool: real query positions
    context_slots: torch.Tensor  # [B, C] long: KV slot of each context position (0 where padded)
    mask: torch.Tensor  # [B, 1, Q, C] bool: query i of request b may attend to key j


class TorchAttentionBatch:
    """What one forward step needs to attend; passed through the model as `attn`."""

    def __init__(self, kv: KVCache, store_slots: torch.Tensor, groups: list[_Group], scale: float):
        self.kv = kv
        self.store_slots = store_slots  # [T] long: slot each new token's k/v is written to
        self.groups = groups
        self.scale = scale

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, heads, d], k/v [T, kv_heads, d] -> [T, heads, d]."""
        k_pool, v_pool = self.kv.k[layer_idx], self.kv.v[layer_idx]
        k_pool[self.store_slots] = k.to(k_pool.dtype)
        v_pool[self.store_slots] = v.to(v_pool.dtype)
        out = torch.empty_like(q)
        for g in self.groups:
            query = q[g.token_index].transpose(1, 2)  # [B, heads, Q, d]
            keys = k_pool[g.context_slots].transpose(1, 2)  # [B, kv_heads, C, d]
            values = v_pool[g.context_slots].transpose(1, 2)
            attended = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=g.mask, scale=self.scale, enable_gqa=True
            )  # [B, heads, Q, d]
            out[g.token_index[g.valid]] = attended.transpose(1, 2)[g.valid]
        return out


def prepare_attention(entries, req_to_token: torch.Tensor, kv: KVCache, scale: float,
                      store_slots: torch.Tensor) -> TorchAttentionBatch:
    """Build gather indices for a batch of scheduler entries (see scheduler.BatchEntry);
    store_slots [T] long holds the KV slot of every new token, in entry order."""
    offsets, offset = [], 0
    for e in entries:
        offsets.append(offset)
        offset += e.num_new_tokens
    decode = [i for i, e in enumerate(entries) if e.num_new_tokens == 1]
    prefill = [i for i, e in enumerate(entries) if e.num_new_tokens > 1]
    groups = [_make_group([entries[i] for i in idx], [offsets[i] for i in idx], req_to_token)
              for idx in (decode, prefill) if idx]
    return TorchAttentionBatch(kv, store_slots, groups, scale)


def _make_group(entries, offsets: list[int], req_to_token: torch.Tensor) -> _Group:
    device = req_to_token.device
    q_lens = torch.tensor([e.num_new_tokens for e in entries], device=device)
    starts = torch.tensor([e.start for e in entries], device=device)
    ctx_lens = starts + q_lens
    rows = torch.tensor([e.table_row for e in entries], device=device)
    max_q, max_ctx = int(q_lens.max()), max(e.start + e.num_new_tokens for e in entries)
    q_pos = torch.arange(max_q, device=device)
    valid = q_pos[None, :] < q_lens[:, None]  # [B, Q]
    token_index = torch.tensor(offsets, device=device)[:, None] + q_pos[None, :]
    token_index = torch.where(valid, token_index, torch.zeros_like(token_index))
    context_slots = req_to_token[rows, :max_ctx].long()  # [B, C]
    k_pos = torch.arange(max_ctx, device=device)
    # causal: query i of request b sits at position starts[b] + i
    mask = k_pos[None, None, :] <= (starts[:, None, None] + q_pos[None, :, None])
    mask &= k_pos[None, None, :] < ctx_lens[:, None, None]
    mask |= ~valid[:, :, None]  # padded queries see everything: no all-masked rows, no NaN
    return _Group(token_index, valid, context_slots, mask[:, None])

