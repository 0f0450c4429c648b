"""The W8A8 fused MoE (kernels/fused_moe_fp8.py) against its torch reference (interpreter on the CPU,
compiled on a GPU), and its price against the unquantized experts."""

from __future__ import annotations

import pytest
import torch

from rollout_kernels.fp8_blockwise_ref import FP8_DTYPE, quantize_weight_blockwise
from rollout_kernels.fused_moe import fused_experts_ref
from rollout_kernels.fused_moe_config import get_config
from rollout_kernels.fused_moe_fp8 import fused_experts_fp8, fused_experts_fp8_ref
from rollout_kernels.moe_routing import topk_softmax

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
SMALL = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, GROUP_SIZE_M=4, num_warps=4, num_stages=2)


def quantize_experts(w: torch.Tensor, block_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> e4m3 [E, N, K] and scales [E, N / BN, ceil(K / 128)], expert by expert."""
    pairs = [quantize_weight_blockwise(w[e], (block_rows, 128)) for e in range(w.shape[0])]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def _problem(t, e, k, hidden, inter, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(t, hidden, generator=gen).to(DEV, dtype)
    w13 = (torch.randn(e, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(DEV)
    w2 = (torch.randn(e, hidden, inter, generator=gen) / inter ** 0.5).to(DEV)
    weights, ids = topk_softmax(torch.randn(t, e, generator=gen).to(DEV), k, renormalize=True)
    return h, w13, w2, weights, ids


# (tokens, experts, top_k, hidden, intermediate, block rows): K below, at and past one 128 block
CASES = [(1, 4, 1, 64, 32, 16), (5, 8, 2, 96, 64, 32), (17, 6, 3, 256, 128, 128), (33, 16, 4, 160, 96, 32)]


@pytest.mark.parametrize("t,e,k,hidden,inter,block_rows", CASES)
def test_w8a8_experts_match_the_reference(t, e, k, hidden, inter, block_rows):
    dtype = torch.bfloat16 if CUDA else torch.float32
    h, w13, w2, weights, ids = _problem(t, e, k, hidden, inter, dtype, seed=t + e)
    w13_q, w13_s = quantize_experts(w13, block_rows)
    w2_q, w2_s = quantize_experts(w2, block_rows)
    got = fused_experts_fp8(h, w13_q, w13_s, w2_q, w2_s, weights, ids, block_rows, (SMALL, SMALL))
    want = fused_experts_fp8_ref(h, w13_q, w13_s, w2_q, w2_s, weights, ids, block_rows)
    assert got.shape == (t, hidden) and got.dtype == dtype and not got.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    # the price of W8A8 against the unquantized experts: two e4m3 GEMMs (3 mantissa bits) on random data
    exact = fused_experts_ref(h.float(), w13, w2, weights, ids)
    assert ((got.float() - exact).norm() / exact.norm()).item() < 0.15


def test_blocks_must_not_span_gate_and_up():
    h, w13, w2, weights, ids = _problem(3, 4, 2, 64, 48, torch.float32, seed=1)
    w13_q, w13_s = quantize_experts(w13, 16)
    w2_q, w2_s = quantize_experts(w2, 16)
    with pytest.raises(AssertionError, match="must divide I 48"):
        fused_experts_fp8(h, w13_q, w13_s, w2_q, w2_s, weights, ids, 32, (SMALL, SMALL))


def test_default_launch_follows_the_rows_per_expert():
    """Without configs the W8A8 experts take fused_moe_config's choice for T tokens in e4m3: small M
    tiles for decode batches, and the same answer as explicit configs."""
    h, w13, w2, weights, ids = _problem(5, 8, 2, 96, 64, torch.float32, seed=2)
    w13_q, w13_s = quantize_experts(w13, 32)
    w2_q, w2_s = quantize_experts(w2, 32)
    chosen = get_config(5, 8, 2, 64, 96, FP8_DTYPE)
    assert chosen[0]["BLOCK_SIZE_M"] == 16  # 5 x 2 / 8 rows per expert
    assert torch.equal(fused_experts_fp8(h, w13_q, w13_s, w2_q, w2_s, weights, ids, 32),
                       fused_experts_fp8(h, w13_q, w13_s, w2_q, w2_s, weights, ids, 32, chosen))
