"""extend_attention (Triton) against extend_attention_ref, and the ref against a float64 loop.

On the CPU the kernel runs under the Triton interpreter (float32/float16 only:
tl.dot on bf16 is garbage there); bf16 and long contexts run on the GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from slot_pool import make_slot_pool
from rollout_kernels.extend_attention import extend_attention, extend_attention_ref

TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_extend_case(prefix_lens, q_lens, num_heads, num_kv_heads, head_dim, dtype, device=DEVICE, seed=0):
    """A poisoned slot pool (see slot_pool.make_slot_pool) and q as a strided slice of qkv."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + n for p, n in zip(prefix_lens, q_lens)]
    k_pool, v_pool, req_to_token, rows = make_slot_pool(seq_lens, num_kv_heads, head_dim, dtype, device, gen)
    num_tokens = sum(q_lens)
    # q is the first num_heads heads of a fused [T, H + 2 * KVH, D] qkv tensor: strided rows
    qkv = torch.randn((num_tokens, num_heads + 2 * num_kv_heads, head_dim), generator=gen)
    q_starts = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    return dict(q=qkv.to(dtype=dtype, device=device)[:, :num_heads], k_pool=k_pool, v_pool=v_pool,
                req_to_token=req_to_token, rows=rows, q_starts=q_starts.to(device),
                prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32, device=device),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
                scale=1.0 / math.sqrt(head_dim), max_q_len=max(q_lens))


def naive_extend_float64(q, k_pool, v_pool, req_to_token, rows, q_starts, prefix_lens, seq_lens, scale, max_q_len):
    """softmax(q K^T) V per request, head and query over keys [0, position], float64."""
    num_heads = q.shape[1]
    group = num_heads // k_pool.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(rows.shape[0]):
        slots = [int(s) for s in req_to_token[int(rows[b]), :int(seq_lens[b])]]
        for i, t in enumerate(range(int(q_starts[b]), int(q_starts[b + 1]))):
            visible = slots[:int(prefix_lens[b]) + i + 1]
            for h in range(num_heads):
                keys = torch.stack([k_pool[s, h // group].double().cpu() for s in visible])  # [L, D]
                values = torch.stack([v_pool[s, h // group].double().cpu() for s in visible])
                out[t, h] = torch.softmax(keys @ q[t, h].double().cpu() * scale, dim=0) @ values
    return out


def check_extend(case, dtype):
    out = torch.full_like(case["q"], float("nan"))
    result = extend_attention(**case, out=out)
    assert result is out
    ref = extend_attention_ref(**case)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_ref_matches_naive_float64():
    case = make_extend_case([0, 5, 3], [4, 1, 6], num_heads=4, num_kv_heads=2, head_dim=16,
                            dtype=torch.float32, device="cpu")
    ref = extend_attention_ref(**case)
    torch.testing.assert_close(ref.double(), naive_extend_float64(**case), atol=1e-5, rtol=1e-5)


# (prefix_lens, q_lens, num_heads, num_kv_heads, head_dim, dtype): small enough for the interpreter.
# float32 runs BLOCK_M = BLOCK_N = 32, float16 BLOCK_M = 128, BLOCK_N = 64: q_lens cross block edges.
CPU_CASES = [
    ([0], [1], 2, 2, 64, torch.float32),  # a single token, MHA
    ([0], [63], 4, 2, 64, torch.float32),  # pure prefill, G = 2, two query blocks
    ([127, 0, 769], [1, 33, 5], 4, 1, 32, torch.float32),  # decode-like, prefill, extend; G = 4
    ([0, 64, 1], [129, 63, 2], 8, 1, 128, torch.float16),  # G = 8, two 128-query blocks
    ([5, 0, 100], [127, 17, 1], 2, 2, 128, torch.float16),
    ([3, 0, 1, 9, 33, 2, 17, 64, 65, 1, 8, 31, 0, 4, 6, 7, 40],
     [1, 2, 3, 1, 7, 1, 1, 2, 33, 1, 1, 5, 9, 1, 1, 1, 2], 2, 1, 16, torch.float32),  # B = 17, D = 16
]


@pytest.mark.parametrize("prefix_lens,q_lens,num_heads,num_kv_heads,head_dim,dtype", CPU_CASES)
def test_extend_matches_ref(prefix_lens, q_lens, num_heads, num_kv_heads, head_dim, dtype):
    check_extend(make_extend_case(prefix_lens, q_lens, num_heads, num_kv_heads, head_dim, dtype), dtype)


def test_extend_larger_max_q_len_and_int64_rows():
    """max_q_len above every q_len only adds programs that exit; the result is freshly allocated."""
    case = make_extend_case([7, 0], [3, 5], 4, 2, 32, torch.float32)
    case["rows"] = case["rows"].long()
    case["max_q_len"] = 100
    result = extend_attention(**case)
    assert result.is_contiguous() and result.shape == case["q"].shape
    torch.testing.assert_close(result, extend_attention_ref(**case), atol=1e-4, rtol=1e-4)


def test_extend_with_one_new_token_matches_decode():
    """q_len 1 over a prefix is a decode step: both kernels must agree."""
    from rollout_kernels.decode_attention import decode_attention

    case = make_extend_case([40, 0, 9], [1, 1, 1], 8, 2, 64, torch.float32)
    extended = extend_attention(**case)
    decoded = decode_attention(case["q"], case["k_pool"], case["v_pool"], case["req_to_token"], case["rows"],
                               case["seq_lens"], case["scale"], num_kv_splits=4)
    torch.testing.assert_close(extended, decoded, atol=1e-4, rtol=1e-4)


GPU_CASES = [
    ([0, 0], [2000, 769], 16, 8, 128),  # Qwen3-0.6B shape, long prefill
    ([1500, 0, 63, 127], [500, 127, 1, 769], 32, 4, 128),  # chunked prefill over a prefix, G = 8
    ([3, 0, 1, 9, 33, 2, 17, 64, 65, 1, 8, 31, 0, 4, 6, 7, 40],
     [1, 2, 3, 1, 7, 1, 1, 2, 33, 1, 1, 5, 9, 1, 1, 1, 260], 8, 8, 64),  # B = 17, MHA
    ([100, 0], [300, 129], 16, 4, 64),  # G = 4, D = 64
    ([33, 0], [17, 300], 4, 2, 32),  # tiny-model head dims
    ([33, 0], [17, 300], 4, 2, 16),
    ([33, 0], [17, 300], 4, 2, 256),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("prefix_lens,q_lens,num_heads,num_kv_heads,head_dim", GPU_CASES)
def test_extend_matches_ref_gpu(prefix_lens, q_lens, num_heads, num_kv_heads, head_dim, dtype):
    check_extend(make_extend_case(prefix_lens, q_lens, num_heads, num_kv_heads, head_dim, dtype), dtype)
