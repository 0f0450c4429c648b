"""store_kv against index assignment: strided k/v views, layer slices of a pool, padding slots."""

from __future__ import annotations

import pytest
import torch

from rollout_kernels.kv_store import store_kv, store_kv_ref

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
CPU_DTYPES = [torch.float32, torch.float16]


def _qkv_views(t, h, kvh, d, dtype):
    """k, v [t, kvh, d] as strided views of one fused qkv output."""
    qkv = torch.randn(t, (h + 2 * kvh) * d, device=DEV).to(dtype)
    k = qkv[:, h * d: (h + kvh) * d].view(t, kvh, d)
    v = qkv[:, (h + kvh) * d:].view(t, kvh, d)
    return k, v


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("t,kvh,d", [(1, 1, 1), (63, 2, 64), (127, 1, 127), (769, 4, 32), (5, 8, 128)])
def test_store_kv(t, kvh, d, dtype):
    torch.manual_seed(t + d)
    num_slots = t + 50
    # one layer of a [layers, slots, kvh, d] pool: a strided slice
    k_pools = torch.full((3, num_slots, kvh, d), float("nan"), dtype=dtype, device=DEV)
    v_pools = torch.full((3, num_slots, kvh, d), float("nan"), dtype=dtype, device=DEV)
    k_pool, v_pool = k_pools[1], v_pools[1]
    slots = torch.randperm(num_slots, device=DEV)[:t]
    k, v = _qkv_views(t, 2 * kvh, kvh, d, dtype)
    want_k, want_v = k_pool.clone(), v_pool.clone()
    store_kv_ref(want_k, want_v, slots, k, v)
    store_kv(k_pool, v_pool, slots, k, v)
    assert torch.equal(k_pool.nan_to_num(7.0), want_k.nan_to_num(7.0))  # untouched slots stay NaN
    assert torch.equal(v_pool.nan_to_num(7.0), want_v.nan_to_num(7.0))
    assert k_pools[0].isnan().all() and k_pools[2].isnan().all()  # other layers untouched
    assert not k_pool[slots].isnan().any()


def test_negative_slots_are_skipped():
    k_pool = torch.zeros(10, 2, 8, device=DEV)
    v_pool = torch.zeros(10, 2, 8, device=DEV)
    k, v = torch.randn(4, 2, 8, device=DEV), torch.randn(4, 2, 8, device=DEV)
    slots = torch.tensor([3, -1, 9, -1], device=DEV)
    store_kv(k_pool, v_pool, slots, k, v)
    assert torch.equal(k_pool[3], k[0]) and torch.equal(k_pool[9], k[2]) and torch.equal(v_pool[9], v[2])
    assert int((k_pool.abs().sum((1, 2)) > 0).sum()) == 2
    store_kv(k_pool, v_pool, slots[:0], k[:0], v[:0])  # empty batch is a no-op
    with pytest.raises(AssertionError):
        store_kv(k_pool, v_pool, slots.int(), k, v)
    with pytest.raises(AssertionError):
        store_kv(k_pool.half(), v_pool.half(), slots, k, v)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kvh,d", [(8, 128), (2, 64), (4, 256)])
def test_gpu_store_kv(kvh, d, dtype):
    torch.manual_seed(kvh * d)
    t, num_slots = 4097, 100_000
    k_pool = torch.full((num_slots, kvh, d), float("nan"), dtype=dtype, device=DEV)
    v_pool = torch.full((num_slots, kvh, d), float("nan"), dtype=dtype, device=DEV)
    slots = torch.randperm(num_slots, device=DEV)[:t]
    k, v = _qkv_views(t, 4 * kvh, kvh, d, dtype)
    want_k, want_v = k_pool.clone(), v_pool.clone()
    store_kv_ref(want_k, want_v, slots, k, v)
    store_kv(k_pool, v_pool, slots, k, v)
    assert torch.equal(k_pool.nan_to_num(7.0), want_k.nan_to_num(7.0))
    assert torch.equal(v_pool.nan_to_num(7.0), want_v.nan_to_num(7.0))


@pytest.mark.gpu
def test_gpu_store_kv_cuda_graph():
    k_pool = torch.zeros(1000, 2, 64, device=DEV, dtype=torch.bfloat16)
    v_pool = torch.zeros_like(k_pool)
    k, v = torch.randn(32, 2, 64, device=DEV, dtype=torch.bfloat16), torch.randn(32, 2, 64, device=DEV, dtype=torch.bfloat16)
    slots = torch.arange(32, device=DEV)
    store_kv(k_pool, v_pool, slots, k, v)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store_kv(k_pool, v_pool, slots, k, v)
    slots.copy_(torch.randperm(1000, device=DEV)[:32])
    k.copy_(torch.randn_like(k))
    graph.replay()
    assert torch.equal(k_pool[slots], k) and torch.equal(v_pool[slots], v)
