"""The fused sampler's chunked path (vocabularies split over several programs) against its torch
reference: the chunk layout, draws that land in late chunks and at chunk edges, mass in one chunk,
rounding past the end, ties across chunks, batch invariance, the workspace check."""

from __future__ import annotations

import math

import pytest
import torch

from rollout_kernels.sampling import sample
from rollout_kernels.sampling_layout import chunk_layout, sample_workspace, workspace_columns
from test_sampling import (BOUNDARY, CHUNKED, DEV, LOGPROB_TOL, SETTINGS, _boundary_distance, _check_against_reference,
                           _logits, _params)

def test_chunk_layout():
    assert chunk_layout(3001, 256, 256) == (256, 256, 12)
    assert chunk_layout(151936, 4096, 8192) == (4096, 8192, 19)
    block, length, n = chunk_layout(10**7, 4096, 8192)  # capped: longer chunks, still cover V
    assert n <= 64 and length % block == 0 and (n - 1) * length < 10**7 <= n * length
    assert chunk_layout(5, 4096, 8192) == (8, 8, 1)
    assert workspace_columns(3001, 256, 256, 128) == 4 * 12 + 128


def test_chunked_matches_reference():
    """Many chunks, strided logits, every setting: the chunked draw agrees with the torch sampler."""
    gen = torch.Generator().manual_seed(17)
    rows = SETTINGS * 2
    batch, vocab = len(rows), 3001
    logits = _logits(batch, vocab + 3, gen)[:, :vocab]
    temperature, top_k, top_p, min_p = _params(rows)
    raw = (torch.arange(batch) % 2 == 0).to(DEV)
    uniform = torch.rand(batch, generator=gen).to(DEV)
    out = (torch.full((batch,), -7, dtype=torch.int64, device=DEV),
           torch.full((batch,), float("nan"), device=DEV))
    ws = sample_workspace(batch + 2, vocab, DEV, block_v=256, chunk=256, cap=128).fill_(float("nan"))
    tokens, logprobs = sample(logits, temperature, top_k, top_p, min_p, raw, uniform=uniform, out=out,
                              workspace=ws, **CHUNKED)
    _check_against_reference(logits, temperature, top_k, top_p, min_p, raw, uniform, tokens, logprobs)
    # and the same as one chunk per row, up to float rounding of the sums
    one = sample(logits, temperature, top_k, top_p, min_p, raw, uniform=uniform, block_v=256, block_s=512,
                 chunk=vocab, cap=128)
    dist = _boundary_distance(logits, temperature, top_k, top_p, min_p, uniform)
    differ = tokens != one[0]
    assert bool((dist[differ] < BOUNDARY).all())
    torch.testing.assert_close(logprobs[~differ], one[1][~differ], atol=LOGPROB_TOL, rtol=0)


def test_chunked_draw_lands_in_later_chunks_and_at_edges():
    """Equal logits (every e = 1, all sums exact): u = k / V draws token k exactly, also where the
    running mass ends exactly on a chunk edge (k a multiple of 256: the draw is in the next chunk)."""
    vocab = 4096  # 16 chunks of 256
    ks = [0, 1, 255, 256, 257, 511, 512, 1000, 2047, 2048, 3839, 3840, 4094, 4095]
    n = len(ks)
    logits = torch.zeros(n, vocab, device=DEV)
    temperature, top_k, top_p, min_p = _params([(1.0, 0, 1.0, 0.0)] * n)
    raw = torch.zeros(n, dtype=torch.bool, device=DEV)
    uniform = torch.tensor([k / vocab for k in ks], dtype=torch.float32, device=DEV)
    tokens, logprobs = sample(logits, temperature, top_k, top_p, min_p, raw, uniform=uniform, **CHUNKED)
    assert tokens.tolist() == ks
    torch.testing.assert_close(logprobs, torch.full((n,), -math.log(vocab), device=DEV), atol=1e-5, rtol=0)
    # an uneven last chunk (V 3001): mid-token uniforms
    vocab = 3001
    ks = [0, 255, 256, 767, 768, 2815, 2816, 2999, 3000]
    n = len(ks)
    logits = torch.zeros(n, vocab, device=DEV)
    temperature, top_k, top_p, min_p = _params([(0.9, 0, 1.0, 0.0)] * n)
    raw = torch.zeros(n, dtype=torch.bool, device=DEV)
    uniform = torch.tensor([(k + 0.5) / vocab for k in ks], dtype=torch.float32, device=DEV)
    tokens, _ = sample(logits, temperature, top_k, top_p, min_p, raw, uniform=uniform, **CHUNKED)
    assert tokens.tolist() == ks


def test_chunked_mass_in_one_late_chunk():
    """All the mass in chunk 9 of 12 (the rest -inf or far below): draws stay in it, in vocab order."""
    vocab, n = 3001, 8
    logits = torch.full((n, vocab), float("-inf"), device=DEV)
    logits[:, 2304:2560] = torch.linspace(0.0, 3.0, 256, device=DEV)
    logits[: n // 2, :100] = -200.0  # e underflows to 0 at T = 1: mass 0 in chunk 0
    temperature, top_k, top_p, min_p = _params([(1.0, 0, 1.0, 0.0)] * n)
    raw = torch.zeros(n, dtype=torch.bool, device=DEV)
    uniform = ((torch.arange(n, dtype=torch.float32) + 0.5) / n).to(DEV)
    tokens, logprobs = sample(logits, temperature, top_k, top_p, min_p, raw, uniform=uniform, **CHUNKED)
    assert bool(((tokens >= 2304) & (tokens < 2560)).all())
    assert bool((tokens[1:] >= tokens[:-1]).all())
    _check_against_reference(logits, temperature, top_k, top_p, min_p, raw, uniform, tokens, logprobs)


def test_chunked_rounding_past_the_end_takes_the_last_kept_token():
    """u * total at or past the end of the CDF: the last index with probability > 0, chunked or not,
    filtered or not (kernel-only: uniforms >= 1 are outside what the reference accepts)."""
    vocab = 3001
    logits = torch.zeros(6, vocab, device=DEV)
    logits[:, 1700:] = float("-inf")  # the last finite token, 1699, is in chunk 6 of 12; chunks 7.. empty
    logits[:, 900] = 2.0
    rows = [(1.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.0, 0, 0.999, 0.0),
            (1.0, 3000, 1.0, 0.0), (1.0, 0, 1.0, 1e-3)]
    temperature, top_k, top_p, min_p = _params(rows)
    raw = torch.zeros(6, dtype=torch.bool, device=DEV)
    for u in (1.0, 1.5, 4.0):
        uniform = torch.full((6,), u, device=DEV)
        tokens, logprobs = sample(logits, temperature, top_k, top_p, min_p, raw, uniform=uniform, **CHUNKED)
        one, _ = sample(logits, temperature, top_k, top_p, min_p, raw, uniform=uniform, block_v=256,
                        block_s=512, chunk=vocab, cap=128)
        assert tokens.tolist() == [1699] * 6, u
        assert torch.equal(tokens, one)
        assert bool(torch.isfinite(logprobs).all())


def test_chunked_single_finite_token():
    """Every logit -inf but one, in the first, a middle or the last chunk: every setting draws it, logprob 0."""
    vocab = 3001
    rows = SETTINGS
    n = len(rows)
    temperature, top_k, top_p, min_p = _params(rows)
    raw = (torch.arange(n) % 2 == 0).to(DEV)
    for j in (0, 1300, 2815, 2816, 3000):
        logits = torch.full((n, vocab), float("-inf"), device=DEV)
        logits[:, j] = -3.5
        for u in (0.0, 0.5, 0.9999):
            uniform = torch.full((n,), u, device=DEV)
            tokens, logprobs = sample(logits, temperature, top_k, top_p, min_p, raw, uniform=uniform, **CHUNKED)
            assert tokens.tolist() == [j] * n, (j, u)
            torch.testing.assert_close(logprobs, torch.zeros(n, device=DEV), atol=1e-6, rtol=0)


def test_chunked_ties_across_chunks_first_argmax_wins():
    vocab = 3001
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(2)).to(DEV)
    for i, ties in enumerate(([300, 700, 2900], [2900, 2817, 2816], [5, 6, 2999])):
        logits[i, ties] = 10.0
    temperature, top_k, top_p, min_p = _params([(0.0, 0, 1.0, 0.0)] * 3)
    raw = torch.tensor([True, False, True], device=DEV)
    tokens, logprobs = sample(logits, temperature, top_k, top_p, min_p, raw, uniform=torch.zeros(3, device=DEV),
                              **CHUNKED)
    assert tokens.tolist() == [300, 2816, 5]
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1)[torch.arange(3), tokens], atol=1e-5, rtol=0)
    # top_k 1 at a tie keeps every tied token
    temperature, top_k, top_p, min_p = _params([(1.0, 1, 1.0, 0.0)] * 3)
    tokens, _ = sample(logits, temperature, top_k, top_p, min_p, raw, uniform=torch.full((3,), 0.99, device=DEV),
                       **CHUNKED)
    assert tokens.tolist() == [2900, 2900, 2999]


def test_chunked_batch_invariant():
    """The chunking depends on V only: a row sampled alone or in any slice of the batch gives the same bits."""
    gen = torch.Generator().manual_seed(23)
    rows = SETTINGS[:9]
    batch, vocab = len(rows), 3001
    logits = _logits(batch, vocab, gen)
    temperature, top_k, top_p, min_p = _params(rows)
    raw = (torch.arange(batch) % 2 == 1).to(DEV)
    uniform = torch.rand(batch, generator=gen).to(DEV)
    full = sample(logits, temperature, top_k, top_p, min_p, raw, uniform=uniform, **CHUNKED)
    for lo, hi in ((0, 1), (3, 7), (8, 9)):
        part = sample(logits[lo:hi], temperature[lo:hi], top_k[lo:hi], top_p[lo:hi], min_p[lo:hi], raw[lo:hi],
                      uniform=uniform[lo:hi], **CHUNKED)
        assert torch.equal(part[0], full[0][lo:hi]) and torch.equal(part[1], full[1][lo:hi])


def test_workspace_shape_is_checked():
    logits = torch.randn(2, 3001, device=DEV)
    params = _params([(1.0, 0, 1.0, 0.0)] * 2)
    raw = torch.zeros(2, dtype=torch.bool, device=DEV)
    with pytest.raises(AssertionError):
        sample(logits, *params, raw, uniform=torch.rand(2, device=DEV), workspace=torch.empty(2, 128, device=DEV),
               **CHUNKED)


# ---- GPU ---------------------------------------------------------------------------------------
