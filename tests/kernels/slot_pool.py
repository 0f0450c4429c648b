"""A KV slot pool for attention kernel tests, built to expose indexing mistakes."""

from __future__ import annotations

import torch


def make_slot_pool(seq_lens, num_kv_heads, head_dim, dtype, device, gen):
    """(k_pool, v_pool, req_to_token, rows) for requests of `seq_lens` keys.

    Pools are shaped like one layer of a [L, S, KVH, D] cache; slots are a random
    permutation; one slot holds NaN and every unused req_to_token entry points at
    it, so a read past seq_len poisons the result; rows are out of order.
    """
    batch, total = len(seq_lens), sum(seq_lens)
    num_slots = total + 5
    perm = torch.randperm(num_slots, generator=gen)
    poison_slot = int(perm[-1])
    kv = torch.randn((2, 2, num_slots, num_kv_heads, head_dim), generator=gen)
    kv[:, :, poison_slot] = float("nan")
    kv = kv.to(dtype=dtype, device=device)
    k_pool, v_pool = kv[0, 1], kv[1, 1]  # layer 1 of [L, S, KVH, D]
    max_rows, max_len = batch + 3, max(seq_lens) + 7
    req_to_token = torch.full((max_rows, max_len), poison_slot, dtype=torch.int32)
    rows = torch.randperm(max_rows, generator=gen)[:batch]
    offset = 0
    for b, seq_len in enumerate(seq_lens):
        req_to_token[rows[b], :seq_len] = perm[offset:offset + seq_len].to(torch.int32)
        offset += seq_len
    return k_pool, v_pool, req_to_token.to(device), rows.to(device)
