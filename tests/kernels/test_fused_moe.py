"""The fused MoE GEMMs against their torch references and the model's expert loop.

Odd token counts, experts without tokens, top-k 1..8, E in {4, 8, 16, 60}, K not a multiple of
BLOCK_K; intermediates poisoned with NaN to catch rows the kernels should (or should not) write.
"""

from __future__ import annotations

import pytest
import torch

from rollout_cli.models.moe import fused_moe_ref
from rollout_kernels.fused_moe import (fused_experts, fused_experts_ref, moe_down, moe_down_ref, moe_gate_up,
                                       moe_gate_up_ref, moe_sum, moe_sum_ref)
from rollout_kernels.fused_moe_config import get_config
from rollout_kernels.moe_align import moe_align_block_size
from rollout_kernels.moe_routing import topk_softmax

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
SMALL = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=4, num_warps=4, num_stages=2)


def _problem(t, e, k, hidden, inter, dtype, used=None, seed=0):
    """hidden [t, H], w13 [e, 2I, H], w2 [e, H, I], routing over the first `used` experts."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(t, hidden, generator=gen).to(DEV, dtype)
    w13 = (torch.randn(e, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(DEV, dtype)
    w2 = (torch.randn(e, hidden, inter, generator=gen) / inter ** 0.5).to(DEV, dtype)
    logits = torch.randn(t, e, generator=gen).to(DEV)
    if used is not None:
        logits[:, used:] = float("-inf")  # experts >= used get no token
    weights, ids = topk_softmax(logits, k, renormalize=True)
    return h, w13, w2, weights, ids


def _close(a, b, dtype):
    torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


# (tokens, experts, top_k, experts used, hidden, intermediate): K = 48 is not a multiple of BLOCK_K 32
CASES = [(1, 4, 1, 4, 64, 32), (3, 8, 2, 3, 48, 40), (17, 60, 7, 12, 64, 32), (33, 16, 8, 16, 32, 48),
         (100, 8, 3, 5, 64, 32), (17, 16, 5, 16, 48, 16), (3, 60, 6, 60, 32, 32), (33, 4, 4, 4, 64, 48)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,e,k,used,hidden,inter", CASES)
def test_each_step_matches_its_reference(t, e, k, used, hidden, inter, dtype):
    h, w13, w2, weights, ids = _problem(t, e, k, hidden, inter, dtype, used, seed=t + e + k)
    layout = moe_align_block_size(ids, e, SMALL["BLOCK_SIZE_M"])
    nan = float("nan")
    mid = moe_gate_up(h, w13, k, layout, SMALL, out=torch.full((t * k, inter), nan, dtype=dtype, device=DEV))
    _close(mid, moe_gate_up_ref(h, w13, ids), dtype)  # also: no NaN left, every slot row written
    down = moe_down(mid, w2, weights, layout, SMALL, out=torch.full((t * k, hidden), nan, dtype=dtype, device=DEV))
    _close(down, moe_down_ref(mid, w2, weights, ids), dtype)
    out = moe_sum(down.view(t, k, hidden))
    _close(out, moe_sum_ref(down.view(t, k, hidden)), dtype)


@pytest.mark.parametrize("t,e,k,used,hidden,inter", CASES[::2])
def test_fused_experts_matches_model_expert_loop(t, e, k, used, hidden, inter):
    h, w13, w2, weights, ids = _problem(t, e, k, hidden, inter, torch.float32, used, seed=7 * t + e)
    got = fused_experts(h, w13, w2, weights, ids)  # default config, fitted to the tiny shape
    _close(got, fused_experts_ref(h, w13, w2, weights, ids), torch.float32)
    _close(got, fused_moe_ref(h, w13, w2, weights, ids.long()), torch.float32)


def _rank_slices(w13, w2, size, rank):
    """Rank `rank` of `size`'s share of every expert (tensor parallel): w13 [E, 2I/size, H] (its gate rows,
    then its up rows), w2 [E, H, I/size] (the matching input columns)."""
    inter = w2.shape[2]
    rows = slice(rank * inter // size, (rank + 1) * inter // size)
    gate, up = w13[:, :inter], w13[:, inter:]
    return torch.cat([gate[:, rows], up[:, rows]], dim=1).contiguous(), w2[:, :, rows].contiguous()


# (tokens, experts, top_k, hidden, intermediate, tp): per-rank widths 20, 10, 24, 8 (below one BLOCK_N tile)
TP_CASES = [(17, 8, 2, 64, 40, 2), (5, 4, 2, 48, 40, 4), (33, 16, 4, 32, 96, 4), (3, 8, 3, 64, 64, 8)]


@pytest.mark.parametrize("t,e,k,hidden,inter,size", TP_CASES)
def test_per_rank_intermediate_slices_sum_to_the_full_experts(t, e, k, hidden, inter, size):
    # --tp N: each rank runs the fused kernels on its [E, 2I/N, H] / [E, H, I/N] slices; the all-reduce
    # of the partial outputs equals the unsplit experts
    h, w13, w2, weights, ids = _problem(t, e, k, hidden, inter, torch.float32, seed=t + size)
    parts = []
    for rank in range(size):
        w13_r, w2_r = _rank_slices(w13, w2, size, rank)
        got = fused_experts(h, w13_r, w2_r, weights, ids)  # default config for the per-rank width
        _close(got, fused_experts_ref(h, w13_r, w2_r, weights, ids), torch.float32)
        parts.append(got)
    _close(torch.stack(parts).sum(0), fused_experts_ref(h, w13, w2, weights, ids), torch.float32)


def test_padding_rows_are_never_written():
    # 3 tokens, top-2 over 8 experts with BLOCK_M 16: almost every block row is padding; a padding
    # slot id (numel) must not write row numel of a larger output buffer
    t, e, k, hidden, inter = 3, 8, 2, 32, 32
    h, w13, w2, weights, ids = _problem(t, e, k, hidden, inter, torch.float32, seed=1)
    layout = moe_align_block_size(ids, e, 16)
    big = torch.full((t * k + 4, inter), float("nan"), device=DEV)
    moe_gate_up(h, w13, k, layout, SMALL, out=big[: t * k])
    assert not big[: t * k].isnan().any() and big[t * k:].isnan().all()


def test_launchers_check_arguments():
    h, w13, w2, weights, ids = _problem(3, 8, 2, 32, 32, torch.float32, seed=2)
    layout = moe_align_block_size(ids, 8, 16)
    with pytest.raises(AssertionError):
        moe_gate_up(h.half(), w13, 2, layout, SMALL)  # dtype mismatch
    with pytest.raises(AssertionError):
        moe_gate_up(h, w13.transpose(1, 2), 2, layout, SMALL)  # hidden dim not contiguous / wrong shape
    with pytest.raises(AssertionError):
        moe_down(torch.empty(6, 32, device=DEV), w2, weights.half(), layout, SMALL)  # weights not float32
    with pytest.raises(AssertionError):
        moe_gate_up(h, w13, 2, layout, dict(SMALL, BLOCK_SIZE_M=32))  # layout built for BLOCK_M 16
    with pytest.raises(AssertionError):
        fused_experts(h, w13, w2, weights, ids[:2])  # routing for 2 of 3 tokens
    assert fused_experts(h[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 32)


def test_default_config_fits_tiny_shapes():
    w13_cfg, w2_cfg = get_config(1, 8, 2, 32, 64, torch.float32, config_dir="/nonexistent")
    assert w13_cfg["BLOCK_SIZE_N"] == 32 and w13_cfg["BLOCK_SIZE_K"] == 32  # clamped to N = I, K = H
    assert w2_cfg["BLOCK_SIZE_N"] == 64 and w2_cfg["BLOCK_SIZE_K"] == 32  # N = H, K = I (float32: K tile 32)
    big = get_config(4096, 128, 8, 768, 2048, torch.bfloat16, config_dir="/nonexistent")[0]
    small = get_config(1, 128, 8, 768, 2048, torch.bfloat16, config_dir="/nonexistent")[0]
    assert small["BLOCK_SIZE_M"] == 16 and big["BLOCK_SIZE_M"] == 64


def _qwen3_30b(t, seed, dtype=torch.bfloat16):
    return _problem(t, 128, 8, 2048, 768, dtype, seed=seed)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 3, 17, 100, 256, 1000])
def test_gpu_fused_experts_bf16_qwen3_30b_shape(t):
    h, w13, w2, weights, ids = _qwen3_30b(t, seed=t)
    got = fused_experts(h, w13, w2, weights, ids)
    want = fused_experts_ref(h, w13, w2, weights, ids)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    loop = fused_moe_ref(h, w13, w2, weights.to(torch.bfloat16), ids.long())  # the model's torch path
    assert (got.float() - loop.float()).abs().max() < 0.1 * loop.float().abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("t,e,k", [(1, 4, 1), (33, 60, 4), (100, 16, 8), (17, 8, 2)])
def test_gpu_small_shapes_bf16(t, e, k):
    h, w13, w2, weights, ids = _problem(t, e, k, 256, 96, torch.bfloat16, used=max(k, e // 2), seed=t)
    got = fused_experts(h, w13, w2, weights, ids)
    torch.testing.assert_close(got.float(), fused_experts_ref(h, w13, w2, weights, ids).float(),
                               atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("size", [2, 4, 8])
def test_gpu_qwen3_30b_shape_split_over_tp_ranks(size):
    h, w13, w2, weights, ids = _qwen3_30b(64, seed=size)
    parts = [fused_experts(h, *_rank_slices(w13, w2, size, rank), weights, ids).float() for rank in range(size)]
    want = fused_experts_ref(h, w13, w2, weights, ids).float()
    torch.testing.assert_close(torch.stack(parts).sum(0), want, atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
def test_gpu_batch_invariant_and_deterministic():
    # a token's output bits do not depend on the other tokens of the batch (same launch config)
    h, w13, w2, weights, ids = _qwen3_30b(64, seed=5)
    configs = get_config(64, 128, 8, 768, 2048, torch.bfloat16)
    full = fused_experts(h, w13, w2, weights, ids, configs=configs)
    assert torch.equal(full, fused_experts(h, w13, w2, weights, ids, configs=configs))
    for rows in (slice(0, 1), slice(5, 22), slice(63, 64)):
        part = fused_experts(h[rows], w13, w2, weights[rows], ids[rows], configs=configs)
        assert torch.equal(part, full[rows])


@pytest.mark.gpu
def test_gpu_routing_and_experts_replay_in_a_cuda_graph():
    t = 24
    h, w13, w2, _, _ = _qwen3_30b(t, seed=9)
    logits = torch.randn(t, 128, device=DEV).to(torch.bfloat16)

    def step():
        weights, ids = topk_softmax(logits, 8, True, torch.bfloat16)
        return fused_experts(h, w13, w2, weights, ids), ids

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, ids = step()
    h.copy_(torch.randn_like(h))
    logits.copy_(torch.randn_like(logits))
    graph.replay()
    want, want_ids = step()
    assert torch.equal(ids, want_ids)
    assert torch.equal(out, want)
