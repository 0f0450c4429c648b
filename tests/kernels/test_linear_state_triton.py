"""The engine's linear-state batch with triton_kernels=True (the Triton conv and delta-rule kernels,
decode and prefill) == the torch references it runs by default: one mixed step of decodes and prefill
chunks over a pooled state, outputs and every slot of the pool after the step."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from rollout_cli.engine.execution.linear_state import LinearBatch, LinearStatePool
from rollout_cli.models.gated_deltanet import LinearStateShape

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HEADS = (1, 2, 16, 16, 4)  # key heads, value heads, key dim, value dim, conv width


def _two_equal_pools(seed: int) -> tuple[list[LinearStatePool], torch.Generator]:
    """Two state pools of 8 slots (2 layers) holding the same random states, and the generator after them."""
    hk, hv, dk, dv, width = HEADS
    conv_dim = 2 * hk * dk + hv * dv
    pools = [LinearStatePool(LinearStateShape(2, conv_dim, width, hv, dk, dv), 8, DEV) for _ in range(2)]
    gen = torch.Generator(device=DEV).manual_seed(seed)
    init_conv = torch.randn(pools[0].conv.shape, generator=gen, device=DEV)
    init_ssm = torch.randn(pools[0].ssm.shape, generator=gen, device=DEV)
    for pool in pools:
        pool.conv.copy_(init_conv)
        pool.ssm.copy_(init_ssm)
    return pools, gen


def test_triton_linear_batch_matches_reference_step():
    hk, hv, dk, dv, width = HEADS
    conv_dim = 2 * hk * dk + hv * dv
    pools, gen = _two_equal_pools(0)
    init_ssm = pools[0].ssm.clone()
    # decodes first (slots 3, 6), then prefill chunks of 5 and 70 tokens (slots 1, 7)
    entries = [SimpleNamespace(num_new_tokens=n, num_draft=0, request=SimpleNamespace(state_slot=s))
               for n, s in ((1, 3), (1, 6), (5, 1), (70, 7))]
    T = sum(e.num_new_tokens for e in entries)
    x = torch.randn(T, conv_dim + 3, generator=gen, device=DEV)[:, :conv_dim]  # a view of a fused projection
    weight = torch.randn(conv_dim, width, generator=gen, device=DEV)
    g = -0.3 * torch.rand(T, hv, generator=gen, device=DEV)
    beta = torch.rand(T, hv, generator=gen, device=DEV)
    outs = []
    for pool, triton_kernels in zip(pools, (False, True)):
        batch = LinearBatch.from_entries(pool, entries, DEV, triton_kernels=triton_kernels)
        mixed = batch.conv(1, x, weight, None, "silu")  # [T, conv_dim]
        q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
        out = batch.delta_rule(1, q.reshape(T, hk, dk), k.reshape(T, hk, dk), v.reshape(T, hv, dv), g, beta)
        outs.append((mixed, out))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[1][1], outs[0][1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pools[1].conv, pools[0].conv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pools[1].ssm, pools[0].ssm, atol=1e-4, rtol=1e-4)
    assert not torch.equal(pools[0].ssm, init_ssm)  # the step did advance the states


def _decode_inputs(batch: int, hk: int, hv: int, dk: int, dv: int, gen):
    conv_dim = 2 * hk * dk + hv * dv
    x = torch.randn(batch, conv_dim, generator=gen, device=DEV)
    g = -0.3 * torch.rand(batch, hv, generator=gen, device=DEV)
    beta = torch.rand(batch, hv, generator=gen, device=DEV)
    return x, g, beta


def _run_layer(batch: LinearBatch, x, weight, g, beta, hk, hv, dk, dv):
    T = x.shape[0]
    mixed = batch.conv(0, x, weight, None, "silu")
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    return mixed, batch.delta_rule(0, q.reshape(T, hk, dk), k.reshape(T, hk, dk), v.reshape(T, hv, dv), g, beta)


def test_graph_decode_batch_reads_slots_from_its_static_buffer(monkeypatch):
    # What DecodeGraphs captures: one LinearBatch over a view of a static slot buffer, built once;
    # each "replay" refills the buffer (real rows, then padding rows on slot 0) and runs the layer
    # again. Real rows must equal an eager batch of those requests; only slot 0 may differ.
    hk, hv, dk, dv, width, bucket = 1, 2, 16, 16, 4, 4
    conv_dim = 2 * hk * dk + hv * dv
    shape = LinearStateShape(1, conv_dim, width, hv, dk, dv)
    graph_pool, eager_pool = LinearStatePool(shape, 8, DEV), LinearStatePool(shape, 8, DEV)
    gen = torch.Generator(device=DEV).manual_seed(1)
    for name in ("conv", "ssm"):
        init = torch.randn(getattr(graph_pool, name).shape, generator=gen, device=DEV)
        getattr(graph_pool, name).copy_(init)
        getattr(eager_pool, name).copy_(init)
    weight = torch.randn(conv_dim, width, generator=gen, device=DEV)
    static_slots = torch.zeros(8, dtype=torch.int64, device=DEV)  # a row of DecodeGraphs.ints
    captured = LinearBatch(graph_pool, static_slots[:bucket], triton_kernels=True)
    assert captured.num_decodes == bucket and captured.prefill_slots is None

    def no_host_data(*args, **kwargs):
        raise AssertionError("a graph step must not build tensors from host data or read tensors on the host")

    for step_slots in ([3, 6], [5, 2, 7]):  # two replays of the same batch object
        batch = len(step_slots)
        static_slots[:bucket].copy_(torch.tensor(step_slots + [0] * (bucket - batch)))  # padding: slot 0
        x, g, beta = _decode_inputs(bucket, hk, hv, dk, dv, gen)
        with monkeypatch.context() as m:
            for owner, attr in ((torch, "tensor"), (torch.Tensor, "tolist"), (torch.Tensor, "item")):
                m.setattr(owner, attr, no_host_data)
            mixed, out = _run_layer(captured, x, weight, g, beta, hk, hv, dk, dv)
        entries = [SimpleNamespace(num_new_tokens=1, num_draft=0, request=SimpleNamespace(state_slot=s)) for s in step_slots]
        eager = LinearBatch.from_entries(eager_pool, entries, DEV)  # torch references
        want_mixed, want_out = _run_layer(eager, x[:batch], weight, g[:batch], beta[:batch], hk, hv, dk, dv)
        torch.testing.assert_close(mixed[:batch], want_mixed, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[:batch], want_out, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(graph_pool.conv[:, 1:], eager_pool.conv[:, 1:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(graph_pool.ssm[:, 1:], eager_pool.ssm[:, 1:], atol=1e-4, rtol=1e-4)
    assert not torch.equal(graph_pool.ssm[:, 0], eager_pool.ssm[:, 0])  # the padding rows wrote slot 0 only


def test_a_verify_step_on_a_graph_layout_equals_its_host_layout():
    """LinearBatch with verify_cu on the device (the layout a CUDA graph of verify steps replays: real entries,
    then one-row padding entries on the padding slot 0, then empty ones on slot -1) gives the real rows and
    the pool the host layout gives, bit for bit; no prefill part."""
    hk, hv, dk, dv, width = HEADS
    conv_dim = 2 * hk * dk + hv * dv
    pools, gen = _two_equal_pools(1)
    cu, own, forks = [0, 3, 4], [3, 6], [[1, 2], [-1, -1]]  # entry 0: 2 drafts (forks 1, 2); entry 1: none
    rows, T = 6, cu[-1]
    long = dict(dtype=torch.long, device=DEV)
    host = LinearBatch(pools[0], torch.tensor(own, **long), triton_kernels=True,
                       verify=(cu, torch.tensor(forks, **long)))
    on_device = LinearBatch(pools[1], torch.tensor(own + [0, 0, -1], **long), triton_kernels=True,
                            verify=(torch.tensor(cu + [5, 6, 6], **long), torch.tensor(forks + [[-1, -1]] * 3, **long)))
    assert host.num_decodes == T and on_device.verify_on_device
    x = torch.randn(rows, conv_dim, generator=gen, device=DEV)
    weight = torch.randn(conv_dim, width, generator=gen, device=DEV)
    g, beta = -0.3 * torch.rand(rows, hv, generator=gen, device=DEV), torch.rand(rows, hv, generator=gen, device=DEV)
    outs = []
    for batch, n in ((host, T), (on_device, rows)):
        mixed = batch.conv(1, x[:n], weight, None, "silu")
        q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
        out = batch.delta_rule(1, q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv), g[:n], beta[:n])
        outs.append((mixed[:T], out[:T]))
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    kept = [1, 2, 3, 4, 5, 6, 7]  # every slot but the padding slot 0
    assert torch.equal(pools[0].conv[1][kept], pools[1].conv[1][kept])
    assert torch.equal(pools[0].ssm[1][kept], pools[1].ssm[1][kept])
