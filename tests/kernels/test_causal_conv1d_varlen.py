"""The Triton varlen conv1d prefill against its torch reference: several sequences per call with lengths
around the token block (1, 2, 63, 64, 65, 130) and shorter than the conv's left context, an empty one,
widths 2-4, odd channel counts, strided x, bias or not, pooled states whose other slots are NaN and
must stay so, and a prompt prefilled over two calls."""

from __future__ import annotations

import pytest
import torch

from rollout_kernels.causal_conv1d import causal_conv1d_varlen, causal_conv1d_varlen_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lengths,channels,width,bias", [([1, 2, 63, 64, 65, 130], 37, 4, True),
                                                         ([5, 0, 1], 129, 3, False), ([70], 8, 2, True)])
def test_conv_varlen_matches_reference(lengths, channels, width, bias, dtype):
    gen = torch.Generator(device=DEV).manual_seed(channels + width)
    cu, B = _cu(lengths), len(lengths)
    num_slots = B + 3
    states = torch.full((2, num_slots, channels, width - 1), float("nan"), device=DEV)  # a layer slice of a pool
    pool = states[0]
    index = torch.randperm(num_slots, device=DEV)[:B]
    pool[index] = torch.randn(B, channels, width - 1, generator=gen, device=DEV).to(dtype).float()
    x = torch.randn(cu[-1], channels + 5, generator=gen, device=DEV).to(dtype)[:, 2:2 + channels]  # strided view
    weight = torch.randn(channels, width, generator=gen, device=DEV).to(dtype)
    b = torch.randn(channels, generator=gen, device=DEV).to(dtype) if bias else None
    want_pool = pool.clone()
    want = causal_conv1d_varlen_ref(x, weight, b, want_pool, index, cu)
    got = causal_conv1d_varlen(x, weight, b, pool, index, cu)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(pool[index], want_pool[index])  # the state keeps the raw inputs
    untouched = torch.ones(num_slots, dtype=torch.bool, device=DEV)
    untouched[index] = False
    assert pool[untouched].isnan().all() and states[1].isnan().all()


def test_conv_varlen_split_prefill_and_no_activation():
    """Two calls over a prompt cut at 2 (shorter than the context) and 40 == one call."""
    x, weight = torch.randn(50, 24, device=DEV), torch.randn(24, 4, device=DEV)
    pool = torch.randn(2, 24, 3, device=DEV)
    split_pool = pool.clone()
    index = torch.tensor([1], device=DEV)
    whole = causal_conv1d_varlen(x, weight, None, pool, index, [0, 50], activation=None)
    want = causal_conv1d_varlen_ref(x, weight, None, pool.clone().copy_(split_pool), index, [0, 50], activation=None)
    pieces = [causal_conv1d_varlen(x[a:e], weight, None, split_pool, index, [0, e - a], activation=None)
              for a, e in ((0, 2), (2, 40), (40, 50))]
    torch.testing.assert_close(whole, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(pieces), whole, atol=1e-5, rtol=1e-5)
    assert torch.equal(split_pool, pool)
