"""Attention over the token-slot KV pool with the Triton kernels (CUDA).

The runner orders a step's entries decodes first, so the flat batch is
[decode tokens | prefill-chunk tokens]: decodes go to the split-KV decode
kernel, prefill chunks to the extend kernel; both read keys from the pool
through req_to_token, after this step's k/v were stored.

The on-policy mode (--deterministic) sends every token, decode or prefill, through one
batch-invariant kernel instead (InvariantAttentionBatch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout_cli.engine.execution.attention import KVCache
from rollout_cli.engine.execution.prefix_groups import group_shared_prefixes
from rollout_kernels.batch_invariant_attention import batch_invariant_attention, block_rows, query_blocks
from rollout_kernels.decode_attention import decode_attention
from rollout_kernels.extend_attention import extend_attention
from rollout_kernels.host_to_device import to_device
from rollout_kernels.kv_store import store_kv
from rollout_kernels.qk_norm_rope_store import qk_norm_rope_store
from rollout_kernels.shared_prefix_decode_attention import shared_prefix_decode_attention


# Decode programs wanted in flight: about four per SM of the H100/H200's 132. More KV splits only
# help when the batch alone cannot fill the GPU: on the H200 one split per request beat four at
# batch 64 x context 4096 (264 vs 287 us) and matched two at batch 256 x 512 (157 vs 152 us).
TARGET_DECODE_PROGRAMS = 512
MAX_KV_SPLITS = 16
# Split counts are powers of two: each count is a separate compile of the kernel (NUM_SPLITS is a
# constexpr), so a small fixed set is compiled once up front (warm_decode_splits) instead of a
# 0.5-1 s compile in the middle of a run whenever an eager step meets a new batch size.
DECODE_SPLIT_COUNTS = tuple(1 << i for i in range(MAX_KV_SPLITS.bit_length()))


def decode_kv_splits(batch: int, num_kv_heads: int) -> int:
    """KV splits of the decode kernel for a batch: a power of two in DECODE_SPLIT_COUNTS, fixed per
    batch size, so CUDA graphs can bake it in."""
    want = TARGET_DECODE_PROGRAMS // max(1, batch * num_kv_heads)
    return min(MAX_KV_SPLITS, 1 << max(0, want.bit_length() - 1))


# Shared-prefix decode attention (--shared-prefix-attention): query rows of one prefix program (members x
# query heads a kv head) and the prefix's KV splits; fixed per engine so each compiles once.
PREFIX_ROWS = 64
PREFIX_SPLITS = 4


@dataclass
class SharedPrefixMetadata:
    """The decode part's groups (engine/execution/prefix_groups.py) as the kernel takes them."""

    order: torch.Tensor  # [Bd] int32: decode indices, group by group
    group_starts: torch.Tensor  # [NG + 1] int32
    prefix_lens: torch.Tensor  # [NG] int32


def shared_prefix_decode(q, k_pool, v_pool, req_to_token, rows, seq_lens, groups: SharedPrefixMetadata, scale: float,
                         num_kv_splits: int, out: torch.Tensor, **scales) -> torch.Tensor:
    """Shared-prefix decode attention with the engine's fixed knobs (PREFIX_ROWS, PREFIX_SPLITS)."""
    members = max(1, PREFIX_ROWS // (q.shape[1] // k_pool.shape[1]))  # a prefix program's members at once
    return shared_prefix_decode_attention(q, k_pool, v_pool, req_to_token, rows, seq_lens, groups.group_starts,
                                          groups.prefix_lens, scale, max_group_size=members, order=groups.order,
                                          prefix_splits=PREFIX_SPLITS, num_kv_splits=num_kv_splits, out=out,
                                          **scales)


def warm_decode_splits(kv: KVCache, req_to_token: torch.Tensor, pad_row: int, scale: float, dtype: torch.dtype,
                       num_heads: int, shared_prefix: bool = False) -> None:
    """Compile the decode kernel (and with shared_prefix the shared-prefix kernels) for every split count
    now, on one padding request (row pad_row, one key in slot 0), so no step compiles later."""
    device = req_to_token.device
    q = torch.zeros((1, num_heads, kv.k.shape[-1]), dtype=dtype, device=device)
    rows = torch.full((1,), pad_row, dtype=torch.int64, device=device)
    seq_lens = torch.ones(1, dtype=torch.int32, device=device)
    alone = SharedPrefixMetadata(torch.zeros(1, dtype=torch.int32, device=device),
                                 torch.tensor([0, 1], dtype=torch.int32, device=device),
                                 torch.zeros(1, dtype=torch.int32, device=device))
    for splits in DECODE_SPLIT_COUNTS:
        decode_attention(q, kv.k[0], kv.v[0], req_to_token, rows, seq_lens, scale, num_kv_splits=splits,
                         **kv.scales(0))
        if shared_prefix:
            shared_prefix_decode(q, kv.k[0], kv.v[0], req_to_token, rows, seq_lens, alone, scale, splits,
                                 torch.empty_like(q), **kv.scales(0))


@dataclass
class ExtendMetadata:
    rows: torch.Tensor  # [P] int64: table rows of the prefill requests
    q_starts: torch.Tensor  # [P + 1] int32: offsets of each request's tokens in the prefill part
    prefix_lens: torch.Tensor  # [P] int32: positions already in the pool before this step
    seq_lens: torch.Tensor  # [P] int32: prefix + new tokens
    max_q_len: int


class _PoolAttention:
    """Passed through the model as `attn`: stores each layer's new k/v in the pool, then attends
    (`_attend`, the subclass's kernels) over it."""

    # DecoderAttention hands this batch its pre-norm, pre-RoPE q/k (forward_prologue_fused)
    fuses_qk_norm_rope_store = True

    def __init__(self, kv: KVCache, req_to_token: torch.Tensor, store_slots: torch.Tensor, scale: float):
        self.kv = kv
        self.req_to_token = req_to_token
        self.store_slots = store_slots  # [T] int64
        self.scale = scale

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, heads, d], k/v [T, kv_heads, d] -> [T, heads, d]."""
        k_pool, v_pool = self.kv.k[layer_idx], self.kv.v[layer_idx]
        store_kv(k_pool, v_pool, self.store_slots, k, v, **self.kv.scales(layer_idx))
        return self._attend(layer_idx, q)

    def forward_prologue_fused(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                               q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                               eps: float) -> torch.Tensor:
        """forward() for q/k not yet normed (per-head RMSNorm with q_weight/k_weight [d], or none
        when both are None) nor rotated (positions [T], float32 cos/sin [max_pos, rotary_dim]): one
        kernel norms and rotates q in place and writes the normed, rotated k and v into the pool."""
        k_pool, v_pool = self.kv.k[layer_idx], self.kv.v[layer_idx]
        qk_norm_rope_store(q, k, v, positions, cos, sin, k_pool, v_pool, self.store_slots, q_weight, k_weight, eps,
                           **self.kv.scales(layer_idx))
        return self._attend(layer_idx, q)

    def _attend(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class TritonAttentionBatch(_PoolAttention):
    """The default kernels: split-KV decode for the decode tokens, extend for the prefill chunks.
    Also what CUDA graphs capture (decode only)."""

    def __init__(self, kv: KVCache, req_to_token: torch.Tensor, store_slots: torch.Tensor,
                 decode_rows: torch.Tensor, decode_seq_lens: torch.Tensor, extend: ExtendMetadata | None,
                 scale: float, shared_prefix: SharedPrefixMetadata | None = None):
        super().__init__(kv, req_to_token, store_slots, scale)
        self.shared_prefix = shared_prefix  # None: every decode reads its whole context itself
        self.decode_rows = decode_rows  # [Bd] int64
        self.decode_seq_lens = decode_seq_lens  # [Bd] int32
        self.num_decode = decode_rows.shape[0]
        self.num_kv_splits = decode_kv_splits(self.num_decode, kv.k.shape[2])
        self.extend = extend

    def _attend(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        """q [T, heads, d] over the pool, this step's k/v already in it -> [T, heads, d]."""
        k_pool, v_pool = self.kv.k[layer_idx], self.kv.v[layer_idx]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd, scales = self.num_decode, self.kv.scales(layer_idx)
        if nd and self.shared_prefix is not None:
            shared_prefix_decode(q[:nd], k_pool, v_pool, self.req_to_token, self.decode_rows, self.decode_seq_lens,
                                 self.shared_prefix, self.scale, self.num_kv_splits, out[:nd], **scales)
        elif nd:
            decode_attention(q[:nd], k_pool, v_pool, self.req_to_token, self.decode_rows, self.decode_seq_lens,
                             self.scale, num_kv_splits=self.num_kv_splits, out=out[:nd], **scales)
        if self.extend is not None:
            e = self.extend
            extend_attention(q[nd:], k_pool, v_pool, self.req_to_token, e.rows, e.q_starts, e.prefix_lens,
                             e.seq_lens, self.scale, e.max_q_len, out=out[nd:], **scales)
        return out


class InvariantAttentionBatch(_PoolAttention):
    """The on-policy mode (--deterministic): every query token, decode or prefill, through the
    batch-invariant kernel (kernels/batch_invariant_attention.py), so its bits do not depend on the
    step, the chunk or the batch it runs in. Either `blocks` [NB, 4] int32 (its query blocks, on the
    device) or `spans` (table row, first q row, first position, token count) per request, cut into
    blocks at the first layer, when q's head count gives the block size."""

    def __init__(self, kv: KVCache, req_to_token: torch.Tensor, store_slots: torch.Tensor, scale: float,
                 blocks: torch.Tensor | None = None, spans: list | None = None):
        super().__init__(kv, req_to_token, store_slots, scale)
        self.blocks = blocks
        self.spans = spans

    def _attend(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        if self.blocks is None:
            _, tokens = block_rows(q.shape[1], self.kv.k.shape[2])
            blocks = torch.tensor(query_blocks(self.spans, tokens), dtype=torch.int32).reshape(-1, 4)
            self.blocks = blocks.to(q.device)
        return batch_invariant_attention(q, self.kv.k[layer_idx], self.kv.v[layer_idx], self.req_to_token,
                                         self.blocks, self.scale)


def prepare_triton_attention(entries, req_to_token: torch.Tensor, kv: KVCache, scale: float,
                             store_slots: torch.Tensor, shared_prefix: bool = False) -> TritonAttentionBatch:
    """Entries must be ordered decodes (one new token) first, then prefill chunks; store_slots
    [T] int64 holds the KV slot of every new token, in entry order. shared_prefix: decodes that share
    prefix slots read them once per group (when any do)."""
    device = req_to_token.device
    decodes = [e for e in entries if e.num_new_tokens == 1]
    prefills = entries[len(decodes):]
    assert all(e.num_new_tokens > 1 for e in prefills), "entries must be ordered decodes first"

    def ints(values, dtype):  # no host wait: an MTP head's pass prepares this behind a step in flight
        return to_device(values, dtype, device)

    extend = None
    if prefills:
        starts = [0]
        for e in prefills:
            starts.append(starts[-1] + e.num_new_tokens)
        extend = ExtendMetadata(
            rows=ints([e.table_row for e in prefills], torch.int64),
            q_starts=ints(starts, torch.int32),
            prefix_lens=ints([e.start for e in prefills], torch.int32),
            seq_lens=ints([e.start + e.num_new_tokens for e in prefills], torch.int32),
            max_q_len=max(e.num_new_tokens for e in prefills),
        )
    groups = group_shared_prefixes([e.request for e in decodes]) if shared_prefix and decodes else None
    return TritonAttentionBatch(
        kv, req_to_token, store_slots,
        decode_rows=ints([e.table_row for e in decodes], torch.int64),
        decode_seq_lens=ints([e.start + 1 for e in decodes], torch.int32),
        extend=extend, scale=scale,
        shared_prefix=None if groups is None else SharedPrefixMetadata(
            ints(groups.order, torch.int32), ints(groups.group_starts, torch.int32),
            ints(groups.prefix_lens, torch.int32)),
    )


def prepare_invariant_attention(entries, req_to_token: torch.Tensor, kv: KVCache, scale: float,
                                store_slots: torch.Tensor) -> InvariantAttentionBatch:
    """The on-policy mode's batch: entries in any order, store_slots [T] int64 as above."""
    spans, offset = [], 0
    for e in entries:
        spans.append((e.table_row, offset, e.start, e.num_new_tokens))
        offset += e.num_new_tokens
    return InvariantAttentionBatch(kv, req_to_token, store_slots, scale, spans=spans)


def invariant_decode_attention(kv: KVCache, req_to_token: torch.Tensor, store_slots: torch.Tensor,
                               rows: torch.Tensor, positions: torch.Tensor, scale: float) -> InvariantAttentionBatch:
    """The on-policy mode's decode batch from device tensors (CUDA graphs): one block per request,
    its one token at `positions` [B] in table row `rows` [B]."""
    batch = rows.shape[0]
    first_rows = torch.arange(batch, dtype=torch.int32, device=rows.device)
    blocks = torch.stack((rows.int(), first_rows, positions.int(), torch.ones_like(first_rows)), dim=1)
    return InvariantAttentionBatch(kv, req_to_token, store_slots, scale, blocks=blocks.contiguous())
