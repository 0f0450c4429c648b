"""Sampler: counter-based uniforms, top-k/top-p/min-p filtering, inverse-CDF sampling, logprob modes."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rollout_cli.engine.execution.sampler import SamplingRows, sample_rows
from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.errors import RolloutError
from rollout_kernels.sampling_ref import filter_probs_ref, sample_ref
from rollout_kernels.sampling_ref import uniform_from_keys as sample_uniform


def fake_request(params, prompt_index=0, sample_index=0):
    return SimpleNamespace(params=params, prompt_index=prompt_index, sample_index=sample_index)


def build(rows) -> SamplingRows:
    """rows: list of (SamplingParams, prompt_index, sample_index, position)."""
    return SamplingRows([fake_request(p, i, s) for p, i, s, _ in rows], [pos for *_, pos in rows])


def sample(logits, rows: SamplingRows):
    """The engine's torch path: the step's tables, then the reference sampler."""
    return sample_rows(logits, *rows.to_device("cpu"), use_triton=False)


def sample_with_uniform(logits, rows: SamplingRows, uniform):
    """The reference sampler on `rows`' settings with the given uniforms instead of the keyed ones."""
    ints, floats = rows.to_device("cpu")
    return sample_ref(logits, floats[0], ints[4], floats[1], floats[2], floats[3] > 0.5, uniform=uniform)


def sample_rows_uniforms(rows: SamplingRows) -> torch.Tensor:
    """The keyed uniforms of `rows` (what sample draws)."""
    ints, _ = rows.to_device("cpu")
    return torch.tensor([sample_uniform(*k) for k in zip(*ints[:4].tolist())])


def filter_probs(probs, rows: SamplingRows):
    ints, floats = rows.to_device("cpu")
    return filter_probs_ref(probs, ints[4], floats[1], floats[2])


# ---- uniforms ---------------------------------------------------------------


def test_sample_uniform_deterministic_and_in_range():
    keys = [(seed, p, s, pos) for seed in (0, 1, 2**40 + 3, -1) for p in (0, 7) for s in (0, 1) for pos in range(50)]
    values = [sample_uniform(*k) for k in keys]
    assert values == [sample_uniform(*k) for k in keys]
    assert all(0.0 <= v < 1.0 for v in values)
    assert all(float(torch.tensor(v, dtype=torch.float32)) == v for v in values)  # exact in float32
    assert len(set(values)) > 0.99 * len(values)  # every key gets its own number
    # each key component matters
    base = sample_uniform(5, 6, 7, 8)
    assert len({base, sample_uniform(6, 6, 7, 8), sample_uniform(5, 7, 7, 8),
                sample_uniform(5, 6, 8, 8), sample_uniform(5, 6, 7, 9)}) == 5
    # swapping keys is not the same key
    assert sample_uniform(0, 1, 2, 3) != sample_uniform(0, 2, 1, 3)


def test_sample_uniform_is_uniform():
    values = torch.tensor([sample_uniform(3, 0, s, pos) for s in range(20) for pos in range(1000)])
    assert abs(float(values.mean()) - 0.5) < 0.01
    hist = torch.histc(values, bins=10, min=0.0, max=1.0) / len(values)
    assert float((hist - 0.1).abs().max()) < 0.01


# ---- filtering ----------------------------------------------------------------


def reference_filter(probs: list[float], top_k: int, top_p: float, min_p: float) -> list[float]:
    """Straightforward per-row version of filter_probs: min-p, then top-k, then top-p on what is left."""
    vocab = len(probs)
    max_prob = max(probs)
    keep = [p >= min_p * max_prob for p in probs]
    order = sorted(range(vocab), key=lambda i: -probs[i])
    if top_k > 0:
        for rank, i in enumerate(order):
            if rank >= top_k:
                keep[i] = False
    kept_mass = sum(probs[i] for i in range(vocab) if keep[i])
    mass_before = 0.0
    for rank, i in enumerate(order):
        if not keep[i]:
            continue
        if rank > 0 and mass_before >= top_p * kept_mass:
            keep[i] = False
        mass_before += probs[i]
    keep[order[0]] = True
    return [p if k else 0.0 for p, k in zip(probs, keep)]


SETTINGS = [  # (top_k, top_p, min_p)
    (0, 1.0, 0.0), (1, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.5, 0.0), (0, 0.9, 0.0), (0, 1.0, 0.1),
    (10, 0.8, 0.02), (3, 0.3, 0.5), (0, 0.05, 0.0), (50, 1.0, 0.0), (7, 0.95, 0.2),
]


@pytest.mark.parametrize("vocab", [2, 17, 64])
def test_filter_probs_matches_reference(vocab):
    gen = torch.Generator().manual_seed(vocab)
    rows = len(SETTINGS) * 3
    logits = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * torch.linspace(0.3, 4.0, rows)[:, None]
    probs = torch.softmax(logits, dim=-1)
    settings = SETTINGS * 3
    params = [SamplingParams(top_k=k, top_p=p, min_p=m) for k, p, m in settings]
    batch = build([(p, 0, 0, 0) for p in params])
    got = filter_probs(probs, batch)
    assert got.shape == probs.shape
    for row, (k, p, m) in enumerate(settings):
        want = reference_filter(probs[row].tolist(), k, p, m)
        assert got[row].tolist() == pytest.approx(want, abs=1e-12), (row, k, p, m)
        kept = sum(1 for w in want if w > 0)
        if k:
            assert kept <= k
    # the filters do something on these settings
    assert int((got == 0).sum()) > 0


def test_filter_probs_exact_cases():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    cases = {
        (0, 0.5, 0.0): [0.5, 0, 0, 0],  # mass before token 2 is 0.5 >= 0.5
        (0, 0.51, 0.0): [0.5, 0.3, 0, 0],
        (0, 0.81, 0.0): [0.5, 0.3, 0.15, 0],
        (2, 1.0, 0.0): [0.5, 0.3, 0, 0],
        (0, 1.0, 0.2): [0.5, 0.3, 0.15, 0],  # 0.05 < 0.2 * 0.5
        (0, 1.0, 0.7): [0.5, 0, 0, 0],
        (1, 0.01, 0.9): [0.5, 0, 0, 0],
    }
    for (k, p, m), want in cases.items():
        got = filter_probs(probs, build([(SamplingParams(top_k=k, top_p=p, min_p=m), 0, 0, 0)]))
        assert got[0].tolist() == pytest.approx(want), (k, p, m)


# ---- sampling ----------------------------------------------------------------


def _empirical(logits_row: torch.Tensor, params: SamplingParams, draws: int) -> torch.Tensor:
    rows = [(params, 0, s, pos) for s in range(draws // 500) for pos in range(500)]
    batch = build(rows)
    tokens, _ = sample(logits_row.expand(len(rows), -1).clone(), batch)
    return torch.bincount(tokens, minlength=logits_row.numel()).double() / len(rows)


def test_sampling_frequencies_follow_probabilities():
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0])
    draws = 20000
    freq = _empirical(logits, SamplingParams(temperature=1.0, seed=9), draws)
    probs = torch.softmax(logits.double(), dim=-1)
    assert float((freq - probs).abs().max()) < 0.015  # ~4 sigma for 20000 draws

    freq = _empirical(logits, SamplingParams(temperature=0.5, seed=9), draws)
    probs = torch.softmax(logits.double() / 0.5, dim=-1)
    assert float((freq - probs).abs().max()) < 0.015

    freq = _empirical(logits, SamplingParams(temperature=1.0, top_k=2, seed=9), draws)
    top2 = torch.softmax(logits.double(), dim=-1) * torch.tensor([1.0, 0, 0, 1, 0], dtype=torch.float64)
    assert float((freq - top2 / top2.sum()).abs().max()) < 0.015
    assert freq[1] == freq[2] == freq[4] == 0


def test_sampling_is_deterministic_per_key_and_seed():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(1))
    rows = [(SamplingParams(seed=4), i, i % 3, 10 + i) for i in range(64)]
    a, la = sample(logits, build(rows))
    b, lb = sample(logits, build(rows))
    assert torch.equal(a, b) and torch.equal(la, lb)
    other = [(SamplingParams(seed=5), i, i % 3, 10 + i) for i in range(64)]
    c, _ = sample(logits, build(other))
    assert int((a != c).sum()) > 16


def test_processed_vs_raw_logprobs():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(2)) * 3
    for temperature in (0.3, 1.0, 1.7):
        processed = SamplingParams(temperature=temperature, seed=1)
        raw = SamplingParams(temperature=temperature, seed=1, logprobs_mode="raw")
        tok_p, lp_p = sample(logits, build([(processed, i, 0, 3) for i in range(6)]))
        tok_r, lp_r = sample(logits, build([(raw, i, 0, 3) for i in range(6)]))
        assert torch.equal(tok_p, tok_r)  # the mode changes the report, never the choice
        want_p = torch.log_softmax(logits / temperature, dim=-1).gather(-1, tok_p[:, None]).squeeze(-1)
        want_r = torch.log_softmax(logits, dim=-1).gather(-1, tok_r[:, None]).squeeze(-1)
        assert torch.allclose(lp_p, want_p, atol=1e-5)
        assert torch.allclose(lp_r, want_r, atol=1e-5)
        if temperature != 1.0:
            assert not torch.allclose(lp_p, lp_r, atol=1e-3)
    # processed logprobs are over the kept set: the distribution the token was drawn from (top-k 3 here),
    # so a trainer's importance weights see the truncation; raw ones are not
    filtered = SamplingParams(temperature=0.5, top_k=3, seed=1)
    tok, lp = sample(logits, build([(filtered, i, 0, 3) for i in range(6)]))
    scaled = torch.log_softmax(logits / 0.5, dim=-1)
    kept = scaled.topk(3, dim=-1).values.logsumexp(dim=-1)  # log of the top-3 mass
    assert torch.allclose(lp, scaled.gather(-1, tok[:, None]).squeeze(-1) - kept, atol=1e-5)
    assert bool((lp > scaled.gather(-1, tok[:, None]).squeeze(-1)).all())  # renormalised: larger
    raw_filtered = SamplingParams(temperature=0.5, top_k=3, seed=1, logprobs_mode="raw")
    tok_r, lp_r = sample(logits, build([(raw_filtered, i, 0, 3) for i in range(6)]))
    assert torch.equal(tok_r, tok)
    assert torch.allclose(lp_r, torch.log_softmax(logits, dim=-1).gather(-1, tok[:, None]).squeeze(-1), atol=1e-5)


def test_greedy_rows_mixed_with_sampled_rows():
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(3)) * 2
    greedy = SamplingParams(temperature=0.0)
    greedy_raw = SamplingParams(temperature=0.0, logprobs_mode="raw")
    hot = SamplingParams(temperature=1.3, seed=7)
    filtered = SamplingParams(temperature=0.8, top_p=0.7, seed=7)
    rows = [(greedy, 0, 0, 5), (hot, 1, 0, 5), (greedy_raw, 2, 0, 5), (filtered, 3, 1, 5),
            (greedy, 4, 0, 5), (hot, 5, 2, 5)]
    tokens, logprobs = sample(logits, build(rows))
    raw = torch.log_softmax(logits, dim=-1)
    for i, (params, *_rest) in enumerate(rows):
        alone_tok, alone_lp = sample(logits[i : i + 1], build([rows[i]]))
        assert int(tokens[i]) == int(alone_tok[0]), i
        assert float(logprobs[i]) == pytest.approx(float(alone_lp[0]), abs=1e-6), i
        if params.temperature == 0.0:
            assert int(tokens[i]) == int(logits[i].argmax())
            assert float(logprobs[i]) == pytest.approx(float(raw[i, tokens[i]]), abs=1e-6)
    # the all-greedy fast path agrees with the mixed path
    g_tokens, g_lp = sample(logits, build([(greedy, i, 0, 5) for i in range(6)]))
    assert torch.equal(g_tokens, logits.argmax(dim=-1))
    assert torch.allclose(g_lp, raw.gather(-1, g_tokens[:, None]).squeeze(-1), atol=1e-6)


def test_sampling_never_picks_filtered_or_zero_mass_tokens():
    # uniforms close to 1 must not land past the last kept token
    logits = torch.tensor([[5.0, 4.0, -math.inf, 3.0, -20.0, -30.0]]).expand(2000, -1).clone()
    rows = [(SamplingParams(top_p=0.99, top_k=3, seed=s), 0, 0, 0) for s in range(2000)]
    batch = build(rows)
    uniform = sample_rows_uniforms(batch)
    uniform[:10] = torch.tensor([1.0 - 2.0**-24] * 10)
    tokens, logprobs = sample_with_uniform(logits, batch, uniform)
    assert set(tokens.tolist()) <= {0, 1, 3}
    assert torch.isfinite(logprobs).all()


def test_inverse_cdf_edges():
    """u = 0 picks the first token with mass; u just below 1 the last one; zero-mass tokens never."""
    logits = torch.tensor([[-math.inf, 1.0, -math.inf, 2.0, 0.5, -math.inf]]).expand(3, -1).clone()
    batch = build([(SamplingParams(seed=0), 0, s, 0) for s in range(3)])
    tokens, _ = sample_with_uniform(logits, batch, torch.tensor([0.0, 1.0 - 2.0**-24, 0.5]))
    assert tokens[:2].tolist() == [1, 4]
    assert int(tokens[2]) in (1, 3, 4)


# ---- the step's tables ----------------------------------------------------------


def test_sampling_rows_tables_and_padding():
    """One params object shared by every row and one object per row give the same tables; seeds are
    reduced to int64 bits; padding rows sample greedily without filters."""
    shared = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, seed=2**63 + 3, logprobs_mode="raw")
    copies = [SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, seed=2**63 + 3, logprobs_mode="raw")
              for _ in range(3)]
    positions = [4, 9, 2]
    a = SamplingRows([fake_request(shared, i, i + 1) for i in range(3)], positions)
    b = SamplingRows([fake_request(p, i, i + 1) for i, p in enumerate(copies)], positions)
    assert a.int_rows(pad=2) == b.int_rows(pad=2)
    assert a.float_rows(pad=2) == b.float_rows(pad=2)
    seeds, prompts, samples, keyed_positions, top_k = a.int_rows(pad=2)
    assert seeds == [3 - 2**63] * 3 + [0, 0] and prompts == [0, 1, 2, 0, 0] and samples == [1, 2, 3, 0, 0]
    assert keyed_positions == positions + [0, 0] and top_k == [5, 5, 5, 0, 0]
    temperature, top_p, min_p, raw = a.float_rows(pad=2)
    assert temperature[3:] == [0.0, 0.0] and top_p[3:] == [1.0, 1.0] and min_p[3:] == [0.0, 0.0]
    assert raw == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert SamplingRows([fake_request(SamplingParams(seed=2**64 - 1))], [0]).int_rows()[0] == [-1]


@pytest.mark.parametrize("seed", [-1, 2**64, 2**64 + 3, -(2**63)])
def test_a_seed_outside_64_bits_is_refused(seed):
    """The stream is keyed by the seed's 64 bits: -1 or 2^64 + 3 was taken modulo 2^64, silently the stream
    of 2^64 - 1 or 3."""
    with pytest.raises(RolloutError, match=r"--seed .* is out of range.*\[0, 2\^64 - 1\]"):
        SamplingParams(seed=seed)
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1  # the range's ends are seeds


def test_keyed_draw_equals_the_host_uniforms():
    """sample_rows draws each row's uniform from its keys: the same as passing the host's numbers."""
    logits = torch.randn(8, 33, generator=torch.Generator().manual_seed(5)) * 2
    rows = build([(SamplingParams(temperature=0.9, seed=11), i, i % 2, 3 + i) for i in range(8)])
    keyed = sample(logits, rows)
    given = sample_with_uniform(logits, rows, sample_rows_uniforms(rows))
    assert torch.equal(keyed[0], given[0]) and torch.equal(keyed[1], given[1])
