"""The Triton decode step of the gated delta rule against its torch reference: odd head dims, grouped
key heads, strided q/k/v views of one fused projection, pooled states with padding rows, NaN-poisoned
slots that must stay untouched (interpreter on the CPU, compiled on a GPU)."""

from __future__ import annotations

import pytest
import torch

from rollout_kernels.gated_delta_rule import recurrent_gated_delta_rule_update, recurrent_gated_delta_rule_update_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _step(batch, hk, hv, dk, dv, dtype, seed):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    # q|k|v as strided views of one fused projection output [B, 2 * hk * dk + hv * dv + 3]
    width = 2 * hk * dk + hv * dv + 3
    fused = torch.randn(batch, width, generator=gen, device=DEV).to(dtype)
    q = fused[:, : hk * dk].view(batch, hk, dk)
    k = fused[:, hk * dk: 2 * hk * dk].view(batch, hk, dk)
    v = fused[:, 2 * hk * dk: 2 * hk * dk + hv * dv].view(batch, hv, dv)
    g = -torch.rand(batch, hv, generator=gen, device=DEV)
    beta = torch.rand(batch, hv, generator=gen, device=DEV).to(dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,hk,hv,dk,dv", [(1, 1, 1, 16, 16), (3, 2, 4, 24, 40), (17, 2, 2, 64, 33),
                                               (5, 1, 3, 128, 128)])
def test_decode_step_matches_reference(batch, hk, hv, dk, dv, dtype):
    num_slots = batch + 4
    states = torch.full((2, num_slots, hv, dk, dv), float("nan"), device=DEV)  # [layers, S, ...]: a layer slice
    pool = states[1]
    index = torch.randperm(num_slots, device=DEV)[:batch]
    pool[index] = torch.randn(batch, hv, dk, dv, device=DEV)
    step = _step(batch, hk, hv, dk, dv, dtype, seed=batch + dk)
    want_pool = pool.clone()
    want = recurrent_gated_delta_rule_update_ref(*step, want_pool, index)
    got = recurrent_gated_delta_rule_update(*step, pool, index)
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(pool[index], want_pool[index], atol=2e-5, rtol=2e-5)
    untouched = torch.ones(num_slots, dtype=torch.bool, device=DEV)
    untouched[index] = False
    assert pool[untouched].isnan().all() and states[0].isnan().all()


def test_negative_index_skips_the_row():
    step = _step(3, 2, 4, 16, 16, torch.float32, seed=1)
    pool = torch.randn(4, 4, 16, 16, device=DEV)
    before = pool.clone()
    index = torch.tensor([2, -1, 0], device=DEV)
    got = recurrent_gated_delta_rule_update(*step, pool, index)
    want_pool = before.clone()
    keep = torch.tensor([0, 2], device=DEV)
    want = recurrent_gated_delta_rule_update_ref(*(t[keep] for t in step), want_pool, index[keep])
    torch.testing.assert_close(got[keep], want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(pool, want_pool, atol=2e-5, rtol=2e-5)  # slots 1 and 3 unchanged
