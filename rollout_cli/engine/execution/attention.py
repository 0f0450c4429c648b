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

from rollout_kernels.kv_fp8_ref import KV_FP8_DTYPE, from_pool_ref, to_pool_ref


class KVCache:
    """k and v pools: [num_layers, num_slots, num_kv_heads, head_dim] each, in the model's dtype or in
    e4m3 (--kv-cache-dtype fp8) with one scale per layer for k and one for v: a pool row holds
    k / k_scale rounded to e4m3 (the codec: kernels/kv_fp8_ref.py). The scales are 1.0, as vLLM's and SGLang's
    without calibrated scales: k after RMSNorm and RoPE and v sit well inside e4m3's +-448."""

    storage_names = ("k", "v")  # the cache-memory tensors a memory release frees (engine.memory.memory_saver)

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype, device):
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.bytes_per_token_of_pool = 2 * self.k[:, 0].numel() * self.k.element_size()
        self.k_scales = [1.0] * num_layers  # host floats: the kernels take them as arguments (CUDA graphs too)
        self.v_scales = [1.0] * num_layers

    @property
    def is_fp8(self) -> bool:
        return self.k.dtype == KV_FP8_DTYPE

    def scales(self, layer_idx: int) -> dict:
        """The k_scale / v_scale keywords of the kernels that read or write this layer's pools."""
        return {"k_scale": self.k_scales[layer_idx], "v_scale": self.v_scales[layer_idx]}

    def write(self, layer_idx: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Plain torch: k/v [T, kv_heads, d] into slots [T] long (quantized for an e4m3 pool)."""
        self.k[layer_idx][slots] = to_pool_ref(self.k, k, self.k_scales[layer_idx])
        self.v[layer_idx][slots] = to_pool_ref(self.v, v, self.v_scales[layer_idx])

    def read(self, layer_idx: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Plain torch: the k and v rows of slots (any shape S) -> [*S, kv_heads, d] each in dtype."""
        return (from_pool_ref(self.k[layer_idx][slots], self.k_scales[layer_idx], dtype),
                from_pool_ref(self.v[layer_idx][slots], self.v_scales[layer_idx], dtype))

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
        self.kv.write(layer_idx, self.store_slots, k, v)
        out = torch.empty_like(q)
        for g in self.groups:
            query = q[g.token_index].transpose(1, 2)  # [B, heads, Q, d]
            keys, values = self.kv.read(layer_idx, g.context_slots, q.dtype)  # [B, C, kv_heads, d] each
            keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, kv_heads, C, d]
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

