"""Teacher forcing on the fused sampler (sampling_score.score_tokens): the logprob of a given token has
the bits `sample` reported when it drew it, and agrees with the torch reference (token_logprobs_ref)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rollout_kernels.sampling import sample
from rollout_kernels.sampling_ref import as_int64_key, token_logprobs_ref
from rollout_kernels.sampling_score import score_tokens

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# the interpreter runs each program serially: larger blocks mean fewer interpreted steps
BLOCKS = {} if CUDA else dict(block_v=1024, block_s=1024, cap=128)
# many chunks per row (V 3001 in 12 chunks of 256): the merge of launch 2 is exercised too
CHUNKED = dict(block_v=256, block_s=512, chunk=256, cap=128)
# half-precision logits: bf16 only compiled (the interpreter's bf16 is unreliable)
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
LOGPROB_TOL = 1e-5


def _dtype_id(dtype):
    return str(dtype).removeprefix("torch.")

# (temperature, top_k, top_p, min_p); temperature 0 is greedy (its filters are ignored)
SETTINGS = [
    (0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.0, 5, 1.0, 0.0), (0.7, 40, 1.0, 0.0),
    (1.0, 0, 0.8, 0.0), (0.7, 0, 0.5, 0.0), (1.0, 0, 1.0, 0.1), (0.7, 0, 1.0, 0.02), (1.0, 10, 0.8, 0.02),
    (0.7, 3, 0.3, 0.5), (0.0, 5, 0.5, 0.1), (1.0, 1, 1.0, 0.0),
]
# every setting reported both ways: processed (False), then raw (True)
ROWS = [(s, raw) for s in SETTINGS for raw in (False, True)]


def _params(rows, device=DEV):
    """rows: [((temperature, top_k, top_p, min_p), raw)] -> the five per-row tensors of `sample`."""
    settings, raw = zip(*rows)
    temperature, top_k, top_p, min_p = zip(*settings)
    return (torch.tensor(temperature, dtype=torch.float32, device=device),
            torch.tensor(top_k, dtype=torch.int64, device=device),
            torch.tensor(top_p, dtype=torch.float32, device=device),
            torch.tensor(min_p, dtype=torch.float32, device=device),
            torch.tensor(raw, dtype=torch.bool, device=device))


def _logits(batch, vocab, seed, dtype=torch.float32, device=DEV):
    """Rows of varied sharpness (scale 1..6 times standard normal), every third with its last 3 logits -inf."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen) * torch.linspace(1.0, 6.0, batch)[:, None]
    logits[::3, -3:] = float("-inf")
    return logits.to(dtype).to(device)


def _keys(batch, position, device=DEV):
    """The four int64 RNG keys [B] of the engine: (seed, prompt_index, sample_index, position)."""
    rows = [(2**40 + 7 * b, b, b % 3, position + b) for b in range(batch)]
    return tuple(torch.tensor([as_int64_key(r[i]) for r in rows], dtype=torch.int64, device=device)
                 for i in range(4))


def _check_against_reference(got, want):
    """-inf exactly where the reference has -inf, else within LOGPROB_TOL."""
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), (got, want)
    finite = ~torch.isneginf(want)
    torch.testing.assert_close(got[finite], want[finite], atol=LOGPROB_TOL, rtol=0)


# ---- the sampler's bits ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("vocab, knobs", [(769, BLOCKS), (3001, CHUNKED)], ids=["one-chunk", "chunked"])
def test_scored_logprobs_equal_the_sampled_bits(dtype, vocab, knobs):
    """Sample with keys, then score the sampled tokens with the same settings and knobs: bitwise equal."""
    params = _params(ROWS)
    batch = len(ROWS)
    logits = _logits(batch, vocab, seed=vocab, dtype=dtype)
    for position in (0, 1000):  # two draws per row: more tokens, other kept-set positions
        tokens, logprobs = sample(logits, *params, keys=_keys(batch, position), **knobs)
        scored = score_tokens(logits, tokens, *params, **knobs)
        assert scored.dtype == torch.float32 and scored.shape == (batch,)
        assert torch.equal(scored, logprobs), (scored - logprobs).abs().max()
        _check_against_reference(scored, token_logprobs_ref(logits, tokens, params[0], params[4], *params[1:4]))


def test_scored_greedy_rows_report_as_the_sampler():
    """Greedy rows (their filters ignored): the argmax gets the sampler's bits; any other token its
    log_softmax at T = 1 (processed) or raw, never -inf from the ignored filters."""
    rows = [((0.0, 0, 1.0, 0.0), False), ((0.0, 1, 0.1, 0.5), False), ((0.0, 3, 1.0, 0.0), True)]
    params = _params(rows)
    logits = _logits(3, 769, seed=2)
    tokens, logprobs = sample(logits, *params, uniform=torch.zeros(3, device=DEV), **BLOCKS)
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.equal(score_tokens(logits, tokens, *params, **BLOCKS), logprobs)
    others = (tokens + 1) % 769
    got = score_tokens(logits, others, *params, **BLOCKS)
    want = torch.log_softmax(logits, -1).gather(-1, others[:, None]).squeeze(-1)
    torch.testing.assert_close(got, want, atol=LOGPROB_TOL, rtol=0)


# ---- against the torch reference ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=_dtype_id)
def test_other_tokens_match_the_reference(dtype):
    """Tokens the sampler did not draw (random, argmax, least likely, a masked -inf logit): within
    LOGPROB_TOL of token_logprobs_ref, and -inf exactly where it gives -inf (outside the kept set)."""
    params = _params(ROWS)
    batch, vocab = len(ROWS), 769
    logits = _logits(batch, vocab, seed=5, dtype=dtype)
    gen = torch.Generator().manual_seed(6)
    finite = logits.float().masked_fill(torch.isneginf(logits), float("inf"))
    choices = [torch.randint(0, vocab, (batch,), generator=gen).to(DEV) for _ in range(3)]
    choices += [logits.float().argmax(-1), finite.argmin(-1), torch.full((batch,), vocab - 1, device=DEV)]
    n_inf = 0
    for targets in choices:
        got = score_tokens(logits, targets, *params, **BLOCKS)
        want = token_logprobs_ref(logits, targets, params[0], params[4], *params[1:4])
        _check_against_reference(got, want)
        n_inf += int(torch.isneginf(want).sum())
    assert n_inf > 0  # filtered-out tokens were among those checked


def test_filtered_out_token():
    """A token the filters cut: -inf for processed rows; raw rows report its raw logprob regardless."""
    vocab = 63
    logits = torch.zeros(6, vocab, device=DEV)
    logits[:, 10] = 5.0
    logits[:, 11] = 4.0
    logits[:, 12] = -4.0  # e = exp(-9 / T) ~ 1e-4: cut by min_p 0.01 and by top_k 2 and top_p 0.9
    rows = [((1.0, 2, 1.0, 0.0), False), ((1.0, 0, 0.9, 0.0), False), ((1.0, 0, 1.0, 0.01), False),
            ((1.0, 2, 1.0, 0.0), True), ((1.0, 0, 0.9, 0.0), True), ((1.0, 0, 1.0, 0.0), False)]
    params = _params(rows)
    targets = torch.full((6,), 12, dtype=torch.int64, device=DEV)
    got = score_tokens(logits, targets, *params)
    want = token_logprobs_ref(logits, targets, params[0], params[4], *params[1:4])
    assert torch.isneginf(got[:3]).all() and torch.isfinite(got[3:]).all()
    _check_against_reference(got, want)
    # the kept tokens of the same rows stay finite, and a target outside [0, V) reads as a -inf logit
    kept = score_tokens(logits, torch.full((6,), 10, dtype=torch.int64, device=DEV), *params)
    assert torch.isfinite(kept).all()
    for outside in (-1, vocab):
        got = score_tokens(logits, torch.full((6,), outside, dtype=torch.int64, device=DEV), *params)
        assert torch.isneginf(got).all()


# ---- a row's bits do not depend on its batch ----------------------------------------------------


def test_row_invariance():
    """Scoring row i alone (a batch of 1, fresh buffers) equals scoring it in a batch of 7, bitwise."""
    rows = [ROWS[i] for i in (0, 3, 7, 10, 13, 18, 21)]  # greedy, top-k, top-p, min-p, mixed; raw and not
    params = _params(rows)
    logits = _logits(7, 3001, seed=9)
    tokens, _ = sample(logits, *params, keys=_keys(7, 50), **CHUNKED)
    targets = torch.stack([tokens[0], tokens[1], tokens[2] + 1, tokens[3], tokens[4] + 3, tokens[5], tokens[6]])
    targets = targets % 3001
    full = score_tokens(logits, targets, *params, **CHUNKED)
    for i in range(7):
        alone = score_tokens(logits[i : i + 1].clone(), targets[i : i + 1].clone(),
                             *(p[i : i + 1].clone() for p in params), **CHUNKED)
        assert torch.equal(alone, full[i : i + 1]), i


# ---- the engine's scoring on the kernel --------------------------------------------------------------


def _entries(params_list, targets_per_row, score_top_k=0):
    """BatchEntry-like objects: one scored row per (params, target), scored over the filters' set."""
    return [SimpleNamespace(request=SimpleNamespace(params=p, prompt_index=i, sample_index=0,
                                                    score_top_k=score_top_k, score_masks=None), score_targets=[t])
            for i, (p, t) in enumerate(zip(params_list, targets_per_row))]


@pytest.mark.parametrize("per_row", [False, True])
def test_teacher_logprobs_on_the_kernel(per_row):
    """engine.execution.sampler.teacher_logprobs(use_triton=True) gives the bits sample_rows(use_triton=True)
    reported for the same tokens; with score_top_k the top list is the reference's."""
    from rollout_cli.engine.execution.sampler import SamplingRows, sample_rows, teacher_logprobs
    from rollout_cli.engine.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9, seed=5),
              SamplingParams(temperature=1.0, top_k=4, logprobs_mode="raw", seed=2**50),
              SamplingParams(temperature=0.7, min_p=0.05, seed=3)]
    logits = _logits(4, 769, seed=4)
    sampling = SamplingRows([SimpleNamespace(params=p, prompt_index=i, sample_index=0) for i, p in enumerate(params)],
                            [17, 18, 19, 20])
    tokens, logprobs = sample_rows(logits, *sampling.to_device(DEV), use_triton=True)
    entries = _entries(params, tokens.tolist())
    scored = teacher_logprobs(logits, entries, per_row=per_row, use_triton=True)
    assert torch.equal(scored, logprobs)
    torch.testing.assert_close(scored, teacher_logprobs(logits, entries, per_row=per_row), atol=LOGPROB_TOL, rtol=0)
    # top-k lists too: the targets' logprobs still the kernel's, the lists the reference's
    entries = _entries(params, tokens.tolist(), score_top_k=3)
    chosen, ids, top = teacher_logprobs(logits, entries, per_row=per_row, use_triton=True)
    _, want_ids, want_top = teacher_logprobs(logits, entries, per_row=per_row)
    assert torch.equal(chosen, logprobs) and torch.equal(ids, want_ids) and torch.equal(top, want_top)


# ---- GPU -----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=_dtype_id)
def test_gpu_scored_bits_large_vocab(dtype):
    """The engine's shapes and default knobs (V 151936, 19 chunks): bitwise equal, also in a CUDA graph."""
    rows = (ROWS * 3)[:64]
    params = _params(rows)
    batch, vocab = len(rows), 151936
    logits = _logits(batch, vocab, seed=1, dtype=dtype)
    tokens, logprobs = sample(logits, *params, keys=_keys(batch, 7))
    assert torch.equal(score_tokens(logits, tokens, *params), logprobs)
    out = torch.empty(batch, device=DEV)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        score_tokens(logits, tokens, *params, out=out)
    graph.replay()
    assert torch.equal(out, logprobs)
