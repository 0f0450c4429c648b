"""decode_attention (Triton, split-KV) against decode_attention_ref, and the ref against a float64 loop.

On the CPU the kernels run under the Triton interpreter (float32/float16 only:
tl.dot on bf16 is garbage there); bf16 and long contexts run on the GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from slot_pool import make_slot_pool
from rollout_kernels.decode_attention import decode_attention, decode_attention_ref

TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_decode_case(seq_lens, num_heads, num_kv_heads, head_dim, dtype, device=DEVICE, seed=0):
    """A poisoned slot pool (see slot_pool.make_slot_pool) and q as a strided slice of qkv."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    k_pool, v_pool, req_to_token, rows = make_slot_pool(seq_lens, num_kv_heads, head_dim, dtype, device, gen)
    # q is the first num_heads heads of a fused [B, H + 2 * KVH, D] qkv tensor: strided rows
    qkv = torch.randn((batch, num_heads + 2 * num_kv_heads, head_dim), generator=gen).to(dtype=dtype, device=device)
    q = qkv[:, :num_heads]
    return dict(q=q, k_pool=k_pool, v_pool=v_pool, req_to_token=req_to_token,
                rows=rows, seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
                scale=1.0 / math.sqrt(head_dim))


def naive_decode_float64(q, k_pool, v_pool, req_to_token, rows, seq_lens, scale):
    """softmax(q K^T) V for each request and head, float64, no batching tricks."""
    batch, num_heads, head_dim = q.shape
    group = num_heads // k_pool.shape[1]
    out = torch.zeros((batch, num_heads, head_dim), dtype=torch.float64)
    for b in range(batch):
        slots = [int(s) for s in req_to_token[int(rows[b]), :int(seq_lens[b])]]
        for h in range(num_heads):
            keys = torch.stack([k_pool[s, h // group].double().cpu() for s in slots])  # [L, D]
            values = torch.stack([v_pool[s, h // group].double().cpu() for s in slots])
            weights = torch.softmax(keys @ q[b, h].double().cpu() * scale, dim=0)  # [L]
            out[b, h] = weights @ values
    return out


def check_decode(case, dtype, num_kv_splits):
    out = torch.full_like(case["q"], float("nan"))
    result = decode_attention(**case, num_kv_splits=num_kv_splits, out=out)
    assert result is out
    ref = decode_attention_ref(**case)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_ref_matches_naive_float64():
    case = make_decode_case([1, 5, 63], num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, device="cpu")
    ref = decode_attention_ref(**case)
    torch.testing.assert_close(ref.double(), naive_decode_float64(**case), atol=1e-5, rtol=1e-5)


# (seq_lens, num_heads, num_kv_heads, head_dim, dtype, num_kv_splits): small enough for the interpreter
CPU_CASES = [
    ([1], 4, 4, 64, torch.float32, 16),  # one key, more splits than keys, MHA
    ([63, 127, 1], 8, 4, 128, torch.float16, 4),  # G = 2
    ([769, 1, 63], 8, 2, 64, torch.float32, 16),  # G = 4, 49-key splits
    ([127, 2, 40], 16, 2, 128, torch.float16, 1),  # G = 8, one split
    ([63, 5, 3], 4, 4, 16, torch.float32, 32),  # splits > keys everywhere, D = 16
    ([3, 70, 1, 9, 33, 2, 17, 64, 65, 1, 8, 31, 100, 4, 6, 7, 127], 4, 2, 64, torch.float16, 3),  # B = 17
]


@pytest.mark.parametrize("seq_lens,num_heads,num_kv_heads,head_dim,dtype,num_kv_splits", CPU_CASES)
def test_decode_matches_ref(seq_lens, num_heads, num_kv_heads, head_dim, dtype, num_kv_splits):
    case = make_decode_case(seq_lens, num_heads, num_kv_heads, head_dim, dtype)
    check_decode(case, dtype, num_kv_splits)


def test_decode_allocates_contiguous_out_and_takes_int64_rows():
    case = make_decode_case([10, 3], 4, 2, 32, torch.float32)
    case["rows"] = case["rows"].long()
    result = decode_attention(**case, num_kv_splits=2)
    assert result.is_contiguous() and result.shape == case["q"].shape
    torch.testing.assert_close(result, decode_attention_ref(**case), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("stage1_config", [(16, 2, 1), (32, 4, 2)])
def test_decode_with_other_stage1_knobs(stage1_config):
    """The knobs a benchmark sweeps change tiling only: keys past a BLOCK_N boundary, a group of 4."""
    case = make_decode_case([37, 5, 70], 8, 2, 32, torch.float32)
    for splits in (1, 3):
        out = decode_attention(**case, num_kv_splits=splits, stage1_config=stage1_config)
        torch.testing.assert_close(out, decode_attention_ref(**case), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_kv_splits", [4, 1])  # 1: stage 1 writes the output itself
def test_decode_zero_length_gives_zeros(num_kv_splits):
    """seq_len 0 (a padded CUDA-graph entry) must not produce NaN."""
    case = make_decode_case([4, 1], 4, 2, 16, torch.float32)
    case["seq_lens"][1] = 0
    out = decode_attention(**case, num_kv_splits=num_kv_splits)
    assert (out[1] == 0).all()
    torch.testing.assert_close(out[:1], decode_attention_ref(**case)[:1], atol=1e-4, rtol=1e-4)


def test_decode_rejects_bad_inputs():
    case = make_decode_case([4], 6, 4, 16, torch.float32)
    with pytest.raises(AssertionError, match="multiple"):
        decode_attention(**case)
    case = make_decode_case([4], 4, 2, 24, torch.float32)
    with pytest.raises(AssertionError, match="power of 2"):
        decode_attention(**case)
    case = make_decode_case([4], 4, 2, 16, torch.float32)
    with pytest.raises(AssertionError, match="dtypes differ"):
        decode_attention(**{**case, "k_pool": case["k_pool"].half()})


GPU_CASES = [
    ([2000, 1, 63, 127, 769], 16, 8, 128, 16),  # Qwen3-0.6B shape, one long context
    ([2000, 1, 63, 127, 769], 16, 8, 128, 1),  # one split: no stage 2
    ([2000, 769, 1], 32, 4, 128, 64),  # G = 8, more splits than the short requests have keys
    ([1, 63, 127, 769, 2000, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 4095], 8, 8, 64, 7),  # B = 17, MHA
    ([127, 2000, 300], 16, 4, 64, 16),  # G = 4, D = 64
    ([33, 1000], 4, 2, 32, 8),  # tiny-model head dims
    ([33, 1000], 4, 2, 16, 8),
    ([33, 1000], 4, 2, 256, 8),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("seq_lens,num_heads,num_kv_heads,head_dim,num_kv_splits", GPU_CASES)
def test_decode_matches_ref_gpu(seq_lens, num_heads, num_kv_heads, head_dim, num_kv_splits, dtype):
    case = make_decode_case(seq_lens, num_heads, num_kv_heads, head_dim, dtype)
    check_decode(case, dtype, num_kv_splits)


@pytest.mark.gpu
def test_decode_cuda_graph_replay_after_seq_lens_change():
    dtype = torch.bfloat16
    case = make_decode_case([2000] * 4, 16, 8, 128, dtype)  # slots for 2000 keys each; seq_lens vary below
    out = torch.full_like(case["q"], float("nan"))

    def step():
        decode_attention(**case, num_kv_splits=16, out=out)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for seq_lens in ([50, 700, 1, 2000], [51, 1, 2000, 3], [1, 1, 1, 1]):
        case["seq_lens"].copy_(torch.tensor(seq_lens, dtype=torch.int32))
        case["q"].copy_(torch.randn_like(case["q"]))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not torch.isnan(out).any()
        torch.testing.assert_close(out.float(), decode_attention_ref(**case).float(), atol=TOL[dtype], rtol=TOL[dtype])
