"""Fused sampler against its torch reference (sampling_ref): device RNG bit-exact, tokens, logprobs, filter sets."""

from __future__ import annotations

import random

import pytest
import torch

from rollout_kernels.sampling import sample
from rollout_kernels.sampling_ref import (as_int64_key, filter_probs_ref, reported_logprobs_ref, sample_ref,
                                          sample_uniform_ref)
from rollout_kernels.sampling_ref import uniform_from_keys as py_uniform
from rollout_kernels.sampling_rng import sample_uniform

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# the interpreter runs each program serially: larger blocks mean fewer interpreted steps
BLOCKS = {} if CUDA else dict(block_v=1024, block_s=1024, cap=128)
BOUNDARY = 1e-4  # a token may differ only where u lies this close (relative to the total mass) to a CDF step
LOGPROB_TOL = 1e-5

# (temperature, top_k, top_p, min_p); temperature 0 is greedy
SETTINGS = [
    (0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.3, 0, 1.0, 0.0),
    (1.0, 1, 1.0, 0.0), (0.8, 5, 1.0, 0.0), (1.0, 50, 1.0, 0.0), (1.0, 0, 0.5, 0.0), (0.9, 0, 0.9, 0.0),
    (1.0, 0, 0.05, 0.0), (1.0, 0, 1.0, 0.1), (0.6, 0, 1.0, 0.02), (1.0, 10, 0.8, 0.02), (1.2, 3, 0.3, 0.5),
    (0.5, 7, 0.95, 0.2), (1.0, 20, 0.7, 0.0), (0.0, 5, 0.5, 0.1),
]


def _params(rows, device=DEV):
    temperature, top_k, top_p, min_p = zip(*rows)
    return (torch.tensor(temperature, dtype=torch.float32, device=device),
            torch.tensor(top_k, dtype=torch.int64, device=device),
            torch.tensor(top_p, dtype=torch.float32, device=device),
            torch.tensor(min_p, dtype=torch.float32, device=device))


def _logits(batch, vocab, gen, device=DEV):
    """Rows of varied sharpness: scale 1..8 times standard normal, some with a few -inf (masked vocab)."""
    scale = torch.linspace(1.0, 8.0, batch)[:, None]
    logits = torch.randn(batch, vocab, generator=gen) * scale
    if vocab > 8:
        logits[::3, -3:] = float("-inf")
    return logits.to(device)


def _boundary_distance(logits, temperature, top_k, top_p, min_p, uniform):
    """Per row: how far u lies from the nearest step of the reference's normalised CDF (float64)."""
    t = torch.where(temperature == 0, torch.ones_like(temperature), temperature)
    probs = torch.log_softmax(logits / t[:, None], dim=-1).exp()
    probs = filter_probs_ref(probs, top_k, top_p, min_p).double()
    cdf = probs.cumsum(-1) / probs.sum(-1, keepdim=True)
    return (cdf - uniform.double()[:, None]).abs().min(-1).values


def _check_against_reference(logits, temperature, top_k, top_p, min_p, raw, uniform, tokens, logprobs):
    want_tokens, want_logprobs = sample_ref(logits, temperature, top_k, top_p, min_p, raw, uniform)
    mismatch = tokens != want_tokens
    greedy = temperature == 0
    assert not mismatch[greedy].any(), "greedy rows must be exact"
    if mismatch.any():
        dist = _boundary_distance(logits, temperature, top_k, top_p, min_p, uniform)
        assert bool((dist[mismatch] < BOUNDARY).all()), (
            f"rows {mismatch.nonzero().flatten().tolist()} differ away from a CDF boundary: {dist[mismatch]}")
    assert int(mismatch.sum()) <= max(1, len(tokens) // 100), f"{int(mismatch.sum())} of {len(tokens)} differ"
    same = ~mismatch
    torch.testing.assert_close(logprobs[same], want_logprobs[same], atol=LOGPROB_TOL, rtol=0)
    # the logprob is of the token actually chosen, whichever it is (processed: over the kept set)
    lp_all = reported_logprobs_ref(logits, temperature, raw, top_k, top_p, min_p)
    torch.testing.assert_close(logprobs, lp_all.gather(-1, tokens[:, None]).squeeze(-1), atol=LOGPROB_TOL, rtol=0)


# ---- device RNG ------------------------------------------------------------------------


def test_sample_uniform_bit_exact():
    rng = random.Random(0)
    keys = []
    for _ in range(1500):
        seed = rng.choice([rng.randrange(2**16), rng.randrange(2**32, 2**40), rng.randrange(2**63, 2**64),
                           -rng.randrange(1, 2**62), rng.randrange(2**64)])
        keys.append((seed, rng.randrange(10**6), rng.randrange(64), rng.randrange(2**17)))
    keys += [(0, 0, 0, 0), (2**64 - 1, 0, 0, 0), (-1, 2**63 - 1, 1, 1), (2**63, 0, 1, 2**31)]
    cols = [torch.tensor([as_int64_key(k[i]) for k in keys], dtype=torch.int64, device=DEV) for i in range(4)]
    got = sample_uniform(*cols).cpu()
    want = torch.tensor([py_uniform(*k) for k in keys], dtype=torch.float32)
    assert torch.equal(got, want)
    assert torch.equal(sample_uniform_ref(*[c.cpu() for c in cols]), want)  # int64 reinterpretation is exact
    assert float(got.min()) >= 0.0 and float(got.max()) < 1.0


def test_as_int64_key():
    assert as_int64_key(5) == 5 and as_int64_key(-5) == -5
    assert as_int64_key(2**63) == -(2**63) and as_int64_key(2**64 - 1) == -1 and as_int64_key(2**64 + 3) == 3


# ---- against the torch sampler ---------------------------------------------------------


@pytest.mark.parametrize("vocab", [1, 63, 127, 769])
def test_matches_reference(vocab):
    gen = torch.Generator().manual_seed(vocab)
    rows = SETTINGS * (8 if CUDA else 1)
    batch = len(rows)
    logits = _logits(batch, vocab, gen)
    temperature, top_k, top_p, min_p = _params(rows)
    raw = (torch.arange(batch) % 2 == 1).to(DEV)
    uniform = torch.rand(batch, generator=gen).to(DEV)
    tokens, logprobs = sample(logits, temperature, top_k, top_p, min_p, raw, uniform=uniform, **BLOCKS)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    _check_against_reference(logits, temperature, top_k, top_p, min_p, raw, uniform, tokens, logprobs)


def test_matches_reference_many_blocks():
    """V over several blocks (small blocks) and a strided logits row: the running CDF crosses block edges."""
    gen = torch.Generator().manual_seed(7)
    rows = SETTINGS
    batch, vocab = len(rows), 3001
    wide = _logits(batch, vocab + 5, gen)
    logits = wide[:, :vocab]
    temperature, top_k, top_p, min_p = _params(rows)
    raw = (torch.arange(batch) % 3 == 0).to(DEV)
    uniform = torch.rand(batch, generator=gen).to(DEV)
    out = (torch.full((batch,), -7, dtype=torch.int64, device=DEV),
           torch.full((batch,), float("nan"), device=DEV))
    tokens, logprobs = sample(logits, temperature, top_k, top_p, min_p, raw, uniform=uniform, out=out,
                              block_v=256, block_s=512)
    assert tokens is out[0] and logprobs is out[1]
    _check_against_reference(logits, temperature, top_k, top_p, min_p, raw, uniform, tokens, logprobs)


def test_keyed_equals_uniform():
    """Drawing u in the kernel from the four keys is the same as passing sample_uniform's value."""
    gen = torch.Generator().manual_seed(3)
    rows = SETTINGS
    batch, vocab = len(rows), 127
    logits = _logits(batch, vocab, gen)
    temperature, top_k, top_p, min_p = _params(rows)
    raw = torch.zeros(batch, dtype=torch.bool, device=DEV)
    keys = [(2**40 + 11 * b, b, b % 4, 1000 + b) for b in range(batch)]
    key_tensors = tuple(torch.tensor([as_int64_key(k[i]) for k in keys], device=DEV) for i in range(4))
    uniform = torch.tensor([py_uniform(*k) for k in keys], dtype=torch.float32, device=DEV)
    a = sample(logits, temperature, top_k, top_p, min_p, raw, keys=key_tensors, **BLOCKS)
    b = sample(logits, temperature, top_k, top_p, min_p, raw, uniform=uniform, **BLOCKS)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    _check_against_reference(logits, temperature, top_k, top_p, min_p, raw, uniform, *a)


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if CUDA else []))
def test_half_logits_equal_their_float32_copy(dtype):
    """The kernel upcasts half-precision logits as it loads them: the same tokens and logprobs as
    sampling from logits.float(), with no cast kernel in between."""
    gen = torch.Generator().manual_seed(5)
    rows = SETTINGS
    batch, vocab = len(rows), 769
    logits = _logits(batch, vocab, gen).to(dtype)
    temperature, top_k, top_p, min_p = _params(rows)
    raw = torch.tensor([b % 2 == 0 for b in range(batch)], device=DEV)
    uniform = torch.rand(batch, generator=gen).to(DEV)
    half = sample(logits, temperature, top_k, top_p, min_p, raw, uniform=uniform, **BLOCKS)
    full = sample(logits.float(), temperature, top_k, top_p, min_p, raw, uniform=uniform, **BLOCKS)
    assert torch.equal(half[0], full[0]) and torch.equal(half[1], full[1])


def test_engine_sampling_rows_on_the_kernel():
    """The engine's tables (engine.execution.sampler.SamplingRows) through sample_rows: the kernel's draw agrees
    with the reference on the same keys."""
    from types import SimpleNamespace

    from rollout_cli.engine.execution.sampler import SamplingRows, sample_rows
    from rollout_cli.engine.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9, seed=5),
              SamplingParams(temperature=1.0, top_k=4, logprobs_mode="raw", seed=2**50)]
    rows = SamplingRows([SimpleNamespace(params=p, prompt_index=i, sample_index=1) for i, p in enumerate(params)],
                        [17, 18, 19])
    ints, floats = rows.to_device(DEV)
    gen = torch.Generator().manual_seed(4)
    logits = _logits(3, 63, gen)
    tokens, logprobs = sample_rows(logits, ints, floats, use_triton=True)
    uniform = sample_uniform_ref(*ints[:4])
    _check_against_reference(logits, floats[0], ints[4], floats[1], floats[2], floats[3] > 0.5, uniform,
                             tokens, logprobs)


# ---- filter sets: many u for one row ------------------------------------------------------


@pytest.mark.parametrize("setting", [(1.0, 1, 1.0, 0.0), (0.8, 5, 1.0, 0.0), (1.0, 0, 0.6, 0.0),
                                     (1.0, 0, 1.0, 0.15), (1.1, 12, 0.85, 0.01)])
def test_sampled_tokens_stay_in_the_reference_set(setting):
    n, vocab = (256 if CUDA else 12), 769
    gen = torch.Generator().manual_seed(11)
    row = (torch.randn(vocab, generator=gen) * 3).to(DEV)
    logits = row.expand(n, vocab)  # row stride 0: every row the same logits
    temperature, top_k, top_p, min_p = _params([setting] * n)
    raw = torch.zeros(n, dtype=torch.bool, device=DEV)
    uniform = ((torch.arange(n, dtype=torch.float32) + 0.5) / n).to(DEV)  # spread over [0, 1)
    tokens, _ = sample(logits, temperature, top_k, top_p, min_p, raw, uniform=uniform, **BLOCKS)
    allowed = _allowed(row, *setting)
    assert allowed[tokens].all(), f"tokens {tokens[~allowed[tokens]].tolist()} are outside the filtered set"
    if setting[1] == 1:
        assert bool((tokens == row.argmax()).all())
    # inverse CDF in vocab order: tokens never decrease as u grows
    assert bool((tokens[1:] >= tokens[:-1]).all())
    if int(allowed.sum()) > 1:
        assert len(set(tokens.tolist())) > 1


def _allowed(row, temperature, top_k, top_p, min_p):
    probs = torch.softmax(row[None, :] / temperature, dim=-1)
    t, k, p, m = _params([(temperature, top_k, top_p, min_p)], device=row.device)
    return filter_probs_ref(probs, k, p, m)[0] > 0


def test_ties_and_masked_vocab():
    """Tied maxima: greedy takes the first; top_k at a tie keeps every tied token; -inf never sampled."""
    logits = torch.full((4, 10), float("-inf"), device=DEV)
    logits[:, [2, 5, 7]] = 1.0
    logits[:, 8] = 0.5
    temperature, top_k, top_p, min_p = _params([(0.0, 0, 1.0, 0.0), (1.0, 2, 1.0, 0.0),
                                               (1.0, 0, 1.0, 0.0), (1.0, 0, 0.5, 0.0)])
    raw = torch.zeros(4, dtype=torch.bool, device=DEV)
    for u in (0.0, 0.3, 0.6, 0.999):
        uniform = torch.full((4,), u, device=DEV)
        tokens, logprobs = sample(logits, temperature, top_k, top_p, min_p, raw, uniform=uniform)
        assert int(tokens[0]) == 2
        assert int(tokens[1]) in (2, 5, 7) and int(tokens[2]) in (2, 5, 7, 8) and int(tokens[3]) in (2, 5, 7)
        assert bool(torch.isfinite(logprobs).all())


def test_bad_inputs():
    logits = torch.randn(2, 5, device=DEV)
    params = _params([(1.0, 0, 1.0, 0.0)] * 2)
    raw = torch.zeros(2, dtype=torch.bool, device=DEV)
    with pytest.raises(AssertionError):
        sample(logits, *params, raw)  # neither uniform nor keys
    with pytest.raises(AssertionError):
        sample(logits.double(), *params, raw, uniform=torch.rand(2, device=DEV))  # float64 logits
    with pytest.raises(AssertionError):
        sample(logits, params[0], params[1].int(), *params[2:], raw, uniform=torch.rand(2, device=DEV))


# ---- split vocab: chunk partials, merge, draw in one chunk ------------------------------------

# small chunks so that the interpreter sees many of them: V 3001 in 12 chunks of 256
CHUNKED = dict(block_v=256, block_s=512, chunk=256, cap=128)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [32000, 151936])
def test_gpu_matches_reference_large_vocab(vocab):
    gen = torch.Generator().manual_seed(vocab)
    rows = SETTINGS * 16
    batch = len(rows)
    logits = _logits(batch, vocab, gen)
    temperature, top_k, top_p, min_p = _params(rows)
    raw = (torch.arange(batch) % 2 == 1).to(DEV)
    uniform = torch.rand(batch, generator=gen).to(DEV)
    tokens, logprobs = sample(logits, temperature, top_k, top_p, min_p, raw, uniform=uniform)
    _check_against_reference(logits, temperature, top_k, top_p, min_p, raw, uniform, tokens, logprobs)


@pytest.mark.gpu
def test_gpu_batch_invariant_and_cuda_graph():
    """A row's result does not depend on the rest of the batch; the keyed sampler replays in a CUDA graph."""
    gen = torch.Generator().manual_seed(5)
    batch, vocab = 64, 151936
    rows = (SETTINGS * 4)[:batch]
    logits = _logits(batch, vocab, gen)
    temperature, top_k, top_p, min_p = _params(rows)
    raw = torch.zeros(batch, dtype=torch.bool, device=DEV)
    keys = tuple(torch.randint(-2**62, 2**62, (batch,), generator=gen).to(DEV) for _ in range(4))
    full = sample(logits, temperature, top_k, top_p, min_p, raw, keys=keys)
    for lo, hi in ((0, 1), (5, 17), (40, 64)):
        part = sample(logits[lo:hi], temperature[lo:hi], top_k[lo:hi], top_p[lo:hi], min_p[lo:hi], raw[lo:hi],
                      keys=tuple(k[lo:hi] for k in keys))
        assert torch.equal(part[0], full[0][lo:hi]) and torch.equal(part[1], full[1][lo:hi])
    out = (torch.empty(batch, dtype=torch.int64, device=DEV), torch.empty(batch, device=DEV))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sample(logits, temperature, top_k, top_p, min_p, raw, keys=keys, out=out)
    logits.copy_(_logits(batch, vocab, gen))
    keys[3].add_(1)
    graph.replay()
    want = sample(logits, temperature, top_k, top_p, min_p, raw, keys=keys)
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
