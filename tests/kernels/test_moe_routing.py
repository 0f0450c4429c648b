"""topk_softmax against its torch reference and TopKRouter: odd token counts, top-k 1..8, ties, strided logits."""

from __future__ import annotations

import pytest
import torch

from rollout_cli.models.moe import TopKRouter
from rollout_kernels.moe_routing import topk_softmax, topk_softmax_ref

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# (tokens, experts, top_k): every token count, expert count and k from 1 to 8 appears
CASES = [(1, 4, 1), (3, 8, 2), (17, 16, 3), (33, 60, 4), (100, 60, 5), (17, 8, 6), (33, 16, 7), (100, 16, 8),
         (3, 60, 8), (100, 4, 4)]
# float32 weights: one exp ulp apart at most; rounded weights: one ulp of their dtype (a float32 ulp
# can cross a rounding boundary)
W_TOL = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def _run(logits, k, renorm, weight_dtype):
    t = logits.shape[0]
    out = (torch.full((t, k), float("nan"), device=logits.device), torch.full((t, k), -7, dtype=torch.int32,
                                                                             device=logits.device))
    got = topk_softmax(logits, k, renorm, weight_dtype, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    return got


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renorm", [False, True], ids=["plain", "renorm"])
@pytest.mark.parametrize("t,e,k", CASES)
def test_topk_softmax_matches_reference(t, e, k, renorm, weight_dtype):
    torch.manual_seed(t * 100 + e + k)
    logits = (2 * torch.randn(t, e + 3, device=DEV))[:, :e]  # strided rows
    weights, ids = _run(logits, k, renorm, weight_dtype)
    ref_w, ref_ids = topk_softmax_ref(logits, k, renorm, weight_dtype)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=W_TOL[weight_dtype], rtol=W_TOL[weight_dtype])
    # no ties in random float32 logits: the same experts torch.topk (HF's router) picks, in the same order
    assert torch.equal(ids.long(), torch.topk(logits.softmax(-1), k, dim=-1).indices)
    assert (ids >= 0).all() and (ids < e).all() and (ids.sort(-1).values.diff(dim=-1) > 0).all()
    if renorm:
        torch.testing.assert_close(weights.sum(-1), torch.ones(t, device=DEV), atol=2e-2, rtol=0)


@pytest.mark.parametrize("t,e,k", [(33, 8, 3), (17, 60, 8), (5, 16, 1)])
def test_ties_go_to_the_lower_expert_id(t, e, k):
    # integer logits in bfloat16: most tokens have several experts on the same value
    torch.manual_seed(e)
    logits = torch.randint(0, 3, (t, e), device=DEV).to(torch.bfloat16)
    weights, ids = _run(logits, k, True, torch.bfloat16)
    ref_w, ref_ids = topk_softmax_ref(logits, k, True, torch.bfloat16)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=8e-3, rtol=8e-3)
    for row, chosen in zip(logits.float().tolist(), ids.tolist()):  # the rule spelled out
        assert chosen == sorted(range(e), key=lambda x: (-row[x], x))[:k]


@pytest.mark.parametrize("weights_in_float32", [False, True])
@pytest.mark.parametrize("renorm", [False, True])
def test_router_module_paths_agree(renorm, weights_in_float32):
    torch.manual_seed(3)
    router = TopKRouter(32, 16, 4, renorm, weights_in_float32).to(DEV)
    router.weight.data = torch.randn(16, 32, device=DEV).to(torch.bfloat16)
    hidden = torch.randn(17, 32, device=DEV).to(torch.bfloat16)
    hidden[5] = 0.0  # all logits equal: every expert ties
    w_torch, ids_torch = router(hidden)
    router.use_triton = True
    w_triton, ids_triton = router(hidden)
    assert ids_triton.dtype == torch.int32 and w_triton.dtype == torch.float32
    assert w_torch.dtype == (torch.float32 if weights_in_float32 else torch.bfloat16)
    assert torch.equal(ids_triton.long(), ids_torch)
    assert ids_torch[5].tolist() == [0, 1, 2, 3]
    torch.testing.assert_close(w_triton, w_torch.float(), atol=8e-3, rtol=8e-3)


def test_shape_checks_and_empty_batch():
    weights, ids = topk_softmax(torch.empty(0, 8, device=DEV), 2, True)
    assert weights.shape == (0, 2) and ids.shape == (0, 2)
    with pytest.raises(AssertionError):
        topk_softmax(torch.randn(3, 4, device=DEV), 5, True)  # k > E
    with pytest.raises(AssertionError):
        topk_softmax(torch.randn(3, 8, device=DEV).t(), 2, True)  # expert dim not contiguous
    with pytest.raises(AssertionError):
        topk_softmax(torch.randn(3, 8, device=DEV), 2, True, out=(torch.empty(3, 2, device=DEV),
                                                                   torch.empty(3, 2, device=DEV)))  # float ids


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 256, 4099])
@pytest.mark.parametrize("e,k", [(128, 8), (60, 4), (8, 2), (256, 8)])
def test_gpu_topk_softmax_bf16(t, e, k):
    torch.manual_seed(t + e)
    logits = torch.randn(t, e, device=DEV).to(torch.bfloat16)  # bf16 logits: ties happen
    weights, ids = _run(logits, k, True, torch.bfloat16)
    ref_w, ref_ids = topk_softmax_ref(logits, k, True, torch.bfloat16)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=8e-3, rtol=8e-3)
