"""moe_align_block_size against its torch reference: odd token counts, empty experts, k 1..8, several chunks."""

from __future__ import annotations

import pytest
import torch

from rollout_kernels.moe_align import max_blocks_for, moe_align_block_size, moe_align_block_size_ref

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _routing(t, e, k, used, seed):
    """[t, k] int32: k distinct experts per token, drawn from the first `used` experts only."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(used, generator=gen)[:k] for _ in range(t)]).to(torch.int32).to(DEV)


def _check_layout(ids, e, block_m, layout):
    sorted_ids, expert_ids, num_post_padded = (x.cpu() for x in layout)
    flat = ids.reshape(-1).cpu().long()
    numel = flat.numel()
    n = int(num_post_padded)
    assert n % block_m == 0 and sorted_ids.numel() == expert_ids.numel() * block_m
    real = sorted_ids[:n][sorted_ids[:n] < numel].long()
    assert sorted(real.tolist()) == list(range(numel))  # every slot exactly once
    assert (sorted_ids[n:] == numel).all() and (expert_ids[n // block_m:] == -1).all()
    for b in range(n // block_m):
        block = sorted_ids[b * block_m:(b + 1) * block_m].long()
        block = block[block < numel]
        assert block.numel() > 0  # no block is all padding: empty experts get none
        assert (flat[block] == expert_ids[b]).all()


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("t,e,k,used", [
    (1, 4, 1, 4), (3, 8, 2, 3), (17, 16, 3, 9), (33, 60, 4, 11), (100, 60, 8, 60), (17, 8, 6, 8),
    (33, 16, 7, 7), (100, 16, 5, 6), (3, 60, 8, 8), (100, 4, 4, 4),
])
@pytest.mark.parametrize("single", [True, False], ids=["one-launch", "four-launch"])
def test_align_matches_reference(t, e, k, used, block_m, single):
    ids = _routing(t, e, k, used, seed=t + e + k)
    layout = moe_align_block_size(ids, e, block_m, single_program=single)
    want = moe_align_block_size_ref(ids, e, block_m)
    for got, ref in zip(layout, want):
        assert torch.equal(got, ref)
    _check_layout(ids, e, block_m, layout)


@pytest.mark.parametrize("t,e,k", [(700, 4, 2), (300, 128, 8), (129, 256, 3)])
def test_align_across_many_chunks(t, e, k):
    # numel > one chunk (1024 slots for E=4, 64 for E=128, 32 for E=256): the cross-chunk offsets matter
    ids = _routing(t, e, k, e, seed=e)
    layout = moe_align_block_size(ids, e, 16)
    for got, ref in zip(layout, moe_align_block_size_ref(ids, e, 16)):
        assert torch.equal(got, ref)


def test_worst_case_size_and_empty_input():
    assert max_blocks_for(8, 128, 16) == 8  # one token, top-8: at most 8 experts, one block each
    assert max_blocks_for(1024, 4, 64) == 20  # 1024 slots + 4 experts * 63 padding
    sorted_ids, expert_ids, num_post_padded = moe_align_block_size(torch.empty(0, 2, dtype=torch.int32, device=DEV),
                                                                   8, 16)
    assert sorted_ids.numel() == 0 and expert_ids.numel() == 0 and int(num_post_padded) == 0
    with pytest.raises(AssertionError):
        moe_align_block_size(torch.zeros(3, 2, dtype=torch.int64, device=DEV), 8, 16)  # int64 ids


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 33, 256, 8192])
def test_gpu_align_qwen3_30b_shape(t):
    ids = _routing(t, 128, 8, 128, seed=t)
    layout = moe_align_block_size(ids, 128, 64)
    for got, ref in zip(layout, moe_align_block_size_ref(ids, 128, 64)):
        assert torch.equal(got, ref)
