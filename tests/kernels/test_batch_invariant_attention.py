"""batch_invariant_attention: against its reference, and batch invariance: a query row's bits do not
depend on the step that computes it (decode, a prefill chunk of any length, the first or a later
chunk), the other requests in the batch, or how the splits are spread over programs."""

from __future__ import annotations

import pytest
import torch

from rollout_kernels.batch_invariant_attention import (batch_invariant_attention, batch_invariant_attention_ref,
                                                        block_rows, query_blocks)

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# the interpreter's tl.dot is wrong on bf16 operands (shared/DESIGN.md): float32 / float16 there
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
SPLIT = 64  # small splits: a few hundred keys cross several of them


def make_pool(lengths, num_kv_heads, head_dim, dtype, seed, max_len=512):
    """Requests of `lengths` keys each in scattered pool slots -> (k_pool, v_pool, req_to_token)."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = sum(lengths) + 1
    k_pool = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(DEV, dtype)
    v_pool = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(DEV, dtype)
    perm = torch.randperm(num_slots - 1, generator=gen) + 1
    req_to_token = torch.zeros(len(lengths) + 1, max_len, dtype=torch.int32)
    used = 0
    for r, n in enumerate(lengths):
        req_to_token[r, :n] = perm[used:used + n].int()
        used += n
    return k_pool, v_pool, req_to_token.to(DEV)


def run(q_all, pool, spans, num_heads, num_kv_heads, **kw):
    """spans: (table_row, first position, token count) with the queries taken from q_all[row] at
    those positions -> out [T, H, D] in span order, and the flat q."""
    _, tokens = block_rows(num_heads, num_kv_heads)
    qs, flat, offset = [], [], 0
    for row, position, count in spans:
        qs.append(q_all[row][position:position + count])
        flat.append((row, offset, position, count))
        offset += count
    q = torch.cat(qs)
    blocks = torch.tensor(query_blocks(flat, tokens), dtype=torch.int32, device=DEV).reshape(-1, 4)
    return batch_invariant_attention(q, *pool, blocks, 0.17, split=SPLIT, **kw), q, blocks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 32), (8, 1, 16), (6, 2, 16)])
def test_matches_the_reference(dtype, num_heads, num_kv_heads, head_dim):
    lengths = [150, 9, 70]
    pool = make_pool(lengths, num_kv_heads, head_dim, dtype, seed=num_heads)
    gen = torch.Generator().manual_seed(1)
    q_all = [torch.randn(n, num_heads, head_dim, generator=gen).to(DEV, dtype) for n in lengths]
    # a chunk at the end of a long context, a whole short prompt, one decode token
    spans = [(0, 100, 50), (1, 0, 9), (2, 69, 1)]
    for programs in (None, 1, 4):
        out, q, blocks = run(q_all, pool, spans, num_heads, num_kv_heads, programs=programs)
        want = batch_invariant_attention_ref(q, *pool, blocks, 0.17)
        torch.testing.assert_close(out.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_token_has_the_same_bits_however_it_is_computed(dtype, row_invariant_dot):
    """Every token of a 200-key request, computed in one prefill, in chunks of 37, one decode step at
    a time, beside other requests, and with the splits spread over 1, 2 or 4 programs: bit for bit."""
    num_heads, num_kv_heads, head_dim = 4, 2, 32
    lengths = [200, 120, 5]
    pool = make_pool(lengths, num_kv_heads, head_dim, dtype, seed=7)
    gen = torch.Generator().manual_seed(2)
    q_all = [torch.randn(n, num_heads, head_dim, generator=gen).to(DEV, dtype) for n in lengths]
    whole, _, _ = run(q_all, pool, [(0, 0, 200)], num_heads, num_kv_heads, programs=1)
    chunks = [run(q_all, pool, [(0, s, min(37, 200 - s))], num_heads, num_kv_heads)[0] for s in range(0, 200, 37)]
    assert torch.equal(torch.cat(chunks), whole)
    for position in (0, 63, 64, 65, 127, 199):  # split edges: SPLIT is 64
        for programs in (1, 2, 4):
            one, _, _ = run(q_all, pool, [(0, position, 1)], num_heads, num_kv_heads, programs=programs)
            assert torch.equal(one[0], whole[position]), (position, programs)
    # beside a prefill of another request and a decode of a third, in another order
    mixed, _, _ = run(q_all, pool, [(2, 4, 1), (1, 30, 90), (0, 150, 50)], num_heads, num_kv_heads, programs=2)
    assert torch.equal(mixed[91:], whole[150:])


def test_query_blocks_cut_requests_into_blocks():
    assert block_rows(16, 8) == (16, 8) and block_rows(32, 8) == (16, 4) and block_rows(64, 2) == (32, 1)
    assert block_rows(6, 2) == (16, 5)  # G = 3: 15 of 16 rows used
    assert query_blocks([(3, 0, 10, 5), (1, 5, 0, 1)], 2) == [(3, 0, 10, 2), (3, 2, 12, 2), (3, 4, 14, 1),
                                                              (1, 5, 0, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,num_kv_heads", [(16, 8), (32, 8)])
def test_gpu_bf16_invariance_at_model_shapes(num_heads, num_kv_heads):
    """The H200 claim at the Qwen3-0.6B / 8B head layouts, head_dim 128, default split: a 3000-key
    prefill equals its tokens decoded one at a time, with 1 and 8 programs per block."""
    from rollout_kernels.batch_invariant_attention import SPLIT as DEFAULT_SPLIT

    dtype, head_dim, n = torch.bfloat16, 128, 3000
    pool = make_pool([n], num_kv_heads, head_dim, dtype, seed=3, max_len=4096)
    q = torch.randn(n, num_heads, head_dim, generator=torch.Generator().manual_seed(4)).to(DEV, dtype)
    _, tokens = block_rows(num_heads, num_kv_heads)

    def attend(position, count, programs):
        blocks = torch.tensor(query_blocks([(0, 0, position, count)], tokens), dtype=torch.int32, device=DEV)
        return batch_invariant_attention(q[position:position + count], *pool, blocks, 0.088,
                                         split=DEFAULT_SPLIT, programs=programs)

    whole = attend(0, n, None)
    for position in (0, 1023, 1024, 2999):
        for programs in (1, 8):
            assert torch.equal(attend(position, 1, programs)[0], whole[position]), (position, programs)
