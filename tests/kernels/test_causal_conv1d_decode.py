"""The Triton conv1d decode step against its torch reference: odd channel counts, widths 2-4, strided
x, bias or not, pooled states with NaN-poisoned slots that must stay untouched, padding rows."""

from __future__ import annotations

import pytest
import torch

from rollout_kernels.causal_conv1d import causal_conv1d_update, causal_conv1d_update_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,channels,width,bias", [(1, 1, 2, False), (3, 63, 4, True), (17, 127, 3, False),
                                                       (5, 769, 4, True)])
def test_conv_update_matches_reference(batch, channels, width, bias, dtype):
    gen = torch.Generator(device=DEV).manual_seed(channels + width)
    num_slots = batch + 3
    states = torch.full((2, num_slots, channels, width - 1), float("nan"), device=DEV)  # a layer slice of a pool
    pool = states[0]
    index = torch.randperm(num_slots, device=DEV)[:batch]
    pool[index] = torch.randn(batch, channels, width - 1, generator=gen, device=DEV).to(dtype).float()
    x = torch.randn(batch, channels + 5, generator=gen, device=DEV).to(dtype)[:, 2:2 + channels]  # strided view
    weight = torch.randn(channels, width, generator=gen, device=DEV).to(dtype)
    b = torch.randn(channels, generator=gen, device=DEV).to(dtype) if bias else None
    want_pool = pool.clone()
    want = causal_conv1d_update_ref(x, weight, b, want_pool, index)
    got = causal_conv1d_update(x, weight, b, pool, index)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(pool[index], want_pool[index])  # the state keeps the raw inputs
    untouched = torch.ones(num_slots, dtype=torch.bool, device=DEV)
    untouched[index] = False
    assert pool[untouched].isnan().all() and states[1].isnan().all()


def test_negative_index_skips_the_row_and_steps_chain():
    pool = torch.randn(4, 10, 3, device=DEV)
    weight, x = torch.randn(10, 4, device=DEV), torch.randn(3, 10, device=DEV)
    before = pool.clone()
    index = torch.tensor([3, -1, 1], device=DEV)
    got = causal_conv1d_update(x, weight, None, pool, index)
    want_pool = before.clone()
    keep = torch.tensor([0, 2], device=DEV)
    want = causal_conv1d_update_ref(x[keep], weight, None, want_pool, index[keep])
    torch.testing.assert_close(got[keep], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool, want_pool)  # slots 0 and 2 untouched
    got2 = causal_conv1d_update(x, weight, None, pool, index)  # a second step reads the first one's state
    want2 = causal_conv1d_update_ref(x[keep], weight, None, want_pool, index[keep])
    torch.testing.assert_close(got2[keep], want2, atol=1e-5, rtol=1e-5)
