"""shared_prefix_decode_attention (prefix once per group, then each request's own keys, merged)
against decode_attention_ref and its own reference.

Groups share their prefix slots as the prefix cache shares them between the n samples of a prompt.
The kernels run under the Triton interpreter on the CPU (float32 / float16 dots), bf16 on the GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from slot_pool import make_slot_pool
from rollout_kernels.decode_attention import decode_attention_ref
from rollout_kernels.kv_fp8_ref import KV_FP8_DTYPE
from rollout_kernels.shared_prefix_decode_attention import (grouped_case, shared_prefix_decode_attention,
                                                            shared_prefix_decode_attention_ref)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_groups(group_sizes, prefix_lens, suffix_lens, num_heads, num_kv_heads, head_dim, dtype, seed=0,
                poison_shared=False, empty_groups=0, shuffle=False):
    """A poisoned slot pool whose groups share their prefix slots: the first member's slots, copied
    into the other members' rows (or, with poison_shared, left pointing at the NaN slot there: only
    a kernel that reads the prefix from the first member's row stays finite). With shuffle the
    requests sit in the batch in random order and `order` lists them group by group."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + s for p, size, sufs in zip(prefix_lens, group_sizes, suffix_lens, strict=True)
                for s in sufs[:size]]
    k_pool, v_pool, req_to_token, rows = make_slot_pool(seq_lens, num_kv_heads, head_dim, dtype, "cpu", gen)
    poison = int(req_to_token[0, -1])  # past every seq_len: make_slot_pool's NaN slot
    first = 0
    for size, prefix in zip(group_sizes, prefix_lens, strict=True):
        for b in range(first + 1, first + size):
            req_to_token[rows[b], :prefix] = poison if poison_shared else req_to_token[rows[first], :prefix]
        first += size
    starts = torch.tensor([0] + list(group_sizes)).cumsum(0).to(torch.int32)
    starts = torch.cat([starts, starts[-1:].repeat(empty_groups)])  # padding groups, as a fixed-size graph has
    prefixes = torch.tensor(list(prefix_lens) + [0] * empty_groups, dtype=torch.int32)
    q = torch.randn((len(seq_lens), num_heads, head_dim), generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    case = dict(k_pool=k_pool.to(DEV), v_pool=v_pool.to(DEV), req_to_token=req_to_token.to(DEV),
                group_starts=starts.to(DEV), prefix_lens=prefixes.to(DEV), scale=1.0 / math.sqrt(head_dim))
    order = torch.randperm(len(seq_lens), generator=gen) if shuffle else torch.arange(len(seq_lens))
    for name, grouped in (("q", q), ("rows", rows), ("seq_lens", lens)):  # request j at batch position order[j]
        case[name] = torch.empty_like(grouped).index_put_((order,), grouped).to(DEV)
    if shuffle:
        case["order"] = order.to(DEV, torch.int32)
    return case


def plain_ref(case):
    return decode_attention_ref(case["q"], case["k_pool"], case["v_pool"], case["req_to_token"], case["rows"],
                                case["seq_lens"], case["scale"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prefix_splits,num_kv_splits,shuffle", [(1, 1, False), (4, 1, True), (2, 3, True)])
def test_matches_plain_decode_attention(dtype, prefix_splits, num_kv_splits, shuffle):
    # a group of 3 (one member with no keys past the prefix), a request alone, a group of 4
    case = make_groups([3, 1, 4], [37, 0, 64], [[5, 0, 19], [23], [1, 40, 2, 9]], 8, 2, 32, dtype, shuffle=shuffle)
    out = shared_prefix_decode_attention(**case, max_group_size=4, prefix_splits=prefix_splits,
                                         num_kv_splits=num_kv_splits)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), plain_ref(case).float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_reads_the_prefix_from_the_first_member_only():
    case = make_groups([4, 2], [48, 17], [[3, 8, 1, 30], [6, 2]], 4, 1, 16, torch.float32, seed=1,
                       poison_shared=True, shuffle=True)
    poisoned = case["order"][[1, 2, 3, 5]].long()  # every member but the first of each group
    assert plain_ref(case)[poisoned].isnan().all()  # their rows really are poisoned
    out = shared_prefix_decode_attention(**case, max_group_size=4, prefix_splits=2)
    ref = shared_prefix_decode_attention_ref(**case)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_padding_groups_and_more_splits_than_prefix_keys():
    # prefix 3 over 4 splits leaves a split empty; two empty group slots at the end
    case = make_groups([2, 3], [3, 9], [[4, 0], [1, 1, 7]], 6, 3, 16, torch.float16, seed=2, empty_groups=2)
    out = shared_prefix_decode_attention(**case, max_group_size=3, prefix_splits=4, num_kv_splits=2)
    torch.testing.assert_close(out.float(), plain_ref(case).float(), atol=2e-3, rtol=2e-3)


def test_over_an_fp8_pool():
    case = make_groups([3, 2], [20, 33], [[2, 9, 4], [0, 12]], 8, 2, 32, torch.float32, seed=3)
    k_scale, v_scale = 0.05, 0.5
    for name, scale in (("k_pool", k_scale), ("v_pool", v_scale)):
        case[name] = (case[name].float() / scale).clamp(-448, 448).to(KV_FP8_DTYPE)
    out = shared_prefix_decode_attention(**case, max_group_size=3, k_scale=k_scale, v_scale=v_scale)
    ref = shared_prefix_decode_attention_ref(**case, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("max_group_size", [1, 2])
def test_groups_larger_than_one_program_chunk(max_group_size):
    # a group of 5 walked in chunks, and the requests alone collected into one group of prefix 0
    case = make_groups([5, 4], [29, 0], [[3, 1, 0, 8, 2], [7, 1, 12, 30]], 4, 2, 16, torch.float32, seed=4,
                       shuffle=True)
    out = shared_prefix_decode_attention(**case, max_group_size=max_group_size, prefix_splits=3)
    torch.testing.assert_close(out, plain_ref(case), atol=1e-4, rtol=1e-4)


def test_the_benchmark_step_is_grouped_as_the_kernel_expects():
    """benchmark_shared_prefix's step (grouped_case), small: both kernels agree on it, and the members
    of a group really hold the same prefix slots."""
    case = grouped_case(3, 4, 40, 9, 8, 2, 32, torch.float32, torch.float32, DEV)
    table = case["req_to_token"]
    assert torch.equal(table[4, :40], table[7, :40]) and not torch.equal(table[3, :40], table[4, :40])
    out = shared_prefix_decode_attention(**case, max_group_size=4, prefix_splits=2)
    torch.testing.assert_close(out, plain_ref(case), atol=1e-4, rtol=1e-4)
