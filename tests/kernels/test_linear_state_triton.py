"""The engine's linear-state batch with triton_kernels=True (the Triton conv and delta-rule kernels,
decode and prefill) == the torch references it runs by default: one mixed step of decodes and prefill
chunks over a pooled state, outputs and every slot of the pool after the step."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from rollout_cli.engine.linear_state import LinearBatch, LinearStatePool
from rollout_cli.models.gated_deltanet import LinearStateShape

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_triton_linear_batch_matches_reference_step():
    hk, hv, dk, dv, width = 1, 2, 16, 16, 4
    conv_dim = 2 * hk * dk + hv * dv
    pools = [LinearStatePool(LinearStateShape(2, conv_dim, width, hv, dk, dv), 8, DEV) for _ in range(2)]
    gen = torch.Generator(device=DEV).manual_seed(0)
    init_conv = torch.randn(pools[0].conv.shape, generator=gen, device=DEV)
    init_ssm = torch.randn(pools[0].ssm.shape, generator=gen, device=DEV)
    for pool in pools:
        pool.conv.copy_(init_conv)
        pool.ssm.copy_(init_ssm)
    # decodes first (slots 3, 6), then prefill chunks of 5 and 70 tokens (slots 1, 7)
    entries = [SimpleNamespace(num_new_tokens=n, request=SimpleNamespace(state_slot=s))
               for n, s in ((1, 3), (1, 6), (5, 1), (70, 7))]
    T = sum(e.num_new_tokens for e in entries)
    x = torch.randn(T, conv_dim + 3, generator=gen, device=DEV)[:, :conv_dim]  # a view of a fused projection
    weight = torch.randn(conv_dim, width, generator=gen, device=DEV)
    g = -0.3 * torch.rand(T, hv, generator=gen, device=DEV)
    beta = torch.rand(T, hv, generator=gen, device=DEV)
    outs = []
    for pool, triton_kernels in zip(pools, (False, True)):
        batch = LinearBatch(pool, entries, DEV, triton_kernels=triton_kernels)
        mixed = batch.conv(1, x, weight, None, "silu")  # [T, conv_dim]
        q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
        out = batch.delta_rule(1, q.reshape(T, hk, dk), k.reshape(T, hk, dk), v.reshape(T, hv, dv), g, beta)
        outs.append((mixed, out))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[1][1], outs[0][1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pools[1].conv, pools[0].conv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pools[1].ssm, pools[0].ssm, atol=1e-4, rtol=1e-4)
    assert not torch.equal(pools[0].ssm, init_ssm)  # the step did advance the states
