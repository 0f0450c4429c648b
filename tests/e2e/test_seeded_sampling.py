"""Same seed -> same tokens and logprobs, whatever the batch sizes, cache and batch companions."""

from __future__ import annotations

import random

import pytest

from rollout_cli import Engine, PromptInput, SamplingParams

LP_TOL = 1e-5

PARAMS = {
    "plain": SamplingParams(n=3, max_new_tokens=14, temperature=1.0, seed=1234),
    "filtered": SamplingParams(n=3, max_new_tokens=14, temperature=1.0, top_p=0.9, top_k=20, min_p=0.05,
                               seed=1234),
}

# (max_batch_tokens, max_running, enable_prefix_cache)
LAYOUTS = [
    (4096, 64, True),
    (8, 64, True),
    (64, 4, True),
    (4096, 1, True),
    (8, 1, False),
    (64, 64, False),
]


def _prompts(lengths, seed):
    rng = random.Random(seed)
    return [[rng.randrange(300) for _ in range(n)] for n in lengths]


PROMPTS = _prompts([7, 19, 2, 11], seed=10)


def _run(model_dir, inputs, params, max_batch_tokens=4096, max_running=64, enable_prefix_cache=True):
    engine = Engine(model=model_dir, device="cpu", dtype="float32", max_model_len=64,
                    max_batch_tokens=max_batch_tokens, max_running=max_running,
                    enable_prefix_cache=enable_prefix_cache)
    results = list(engine.stream(inputs, params))
    return {(t.prompt_index, t.sample_index): t for t in results}


@pytest.fixture(scope="module")
def model_dir(sampling_checkpoint):
    return sampling_checkpoint


@pytest.fixture(scope="module", params=sorted(PARAMS))
def baseline(request, model_dir):
    params = PARAMS[request.param]
    inputs = [PromptInput(i, p) for i, p in enumerate(PROMPTS)]
    return params, _run(model_dir, inputs, params)


def _assert_same(got, want, keys=None):
    for key in keys or want:
        assert got[key].response_token_ids == want[key].response_token_ids, key
        assert got[key].response_logprobs == pytest.approx(want[key].response_logprobs, abs=LP_TOL), key


def test_samples_differ_and_match_hf_logprobs(baseline, model_dir, hf_ref):
    """The baseline is a real sample: samples of one prompt differ, logprobs are the model's."""
    params, results = baseline
    assert len(results) == len(PROMPTS) * params.n
    for i, prompt in enumerate(PROMPTS):
        responses = [tuple(results[i, s].response_token_ids) for s in range(params.n)]
        assert len(set(responses)) == params.n, responses
        for s in range(params.n):
            traj = results[i, s]
            assert len(traj.response_token_ids) == params.max_new_tokens
            # temperature 1: processed logprobs are log_softmax of the logits, renormalised over the
            # tokens the filters keep (the distribution each token was drawn from)
            ref = _hf_reported_logprobs(hf_ref, model_dir, prompt, traj.response_token_ids, params)
            assert traj.response_logprobs == pytest.approx(ref, abs=1e-4)


def _hf_reported_logprobs(hf_ref, model_dir, prompt, response, params) -> list[float]:
    """HF's logits for each response token, reported as the sampler reports them (sampling_ref)."""
    import torch

    from rollout_kernels.sampling_ref import reported_logprobs_ref

    with torch.no_grad():
        logits = hf_ref.model(model_dir)(torch.tensor([prompt + response])).logits[0].float()
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(response)]  # [R, V]
    n = rows.shape[0]
    reported = reported_logprobs_ref(
        rows, torch.full((n,), params.temperature), torch.zeros(n, dtype=torch.bool),
        torch.full((n,), params.top_k, dtype=torch.int64), torch.full((n,), params.top_p),
        torch.full((n,), params.min_p))
    return reported.gather(-1, torch.tensor(response)[:, None]).squeeze(-1).tolist()


def test_filters_restrict_choices(model_dir, hf_ref):
    """Every token sampled under top-k 20 / top-p 0.9 / min-p 0.05 passes all three filters."""
    import torch

    params = PARAMS["filtered"]
    results = _run(model_dir, [PromptInput(i, p) for i, p in enumerate(PROMPTS)], params)
    ranks = []

    model = hf_ref.model(model_dir)
    for (i, _), traj in results.items():
        ids = torch.tensor([PROMPTS[i] + traj.response_token_ids])
        with torch.no_grad():
            probs = torch.softmax(model(ids).logits[0].float(), dim=-1)
        for j, token in enumerate(traj.response_token_ids):
            row = probs[len(PROMPTS[i]) - 1 + j]
            sorted_probs = row.sort(descending=True).values
            rank = int((row > row[token]).sum())
            ranks.append(rank)
            assert rank < params.top_k
            assert row[token] >= params.min_p * row.max() - 1e-6
            assert float(sorted_probs[:rank].sum()) < params.top_p + 1e-5
    assert max(ranks) > 0  # not greedy in disguise


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"mbt{x[0]}-run{x[1]}-cache{int(x[2])}")
def test_same_seed_same_tokens_across_layouts(baseline, model_dir, layout):
    params, want = baseline
    inputs = [PromptInput(i, p) for i, p in enumerate(PROMPTS)]
    got = _run(model_dir, inputs, params, *layout)
    assert set(got) == set(want)
    _assert_same(got, want)


def test_same_prompt_with_other_companions(baseline, model_dir):
    params, want = baseline
    target = 1
    alone = _run(model_dir, [PromptInput(target, PROMPTS[target])], params)
    others = _prompts([30, 4, 9], seed=11)
    crowd = [PromptInput(100 + k, p) for k, p in enumerate(others)]
    mixed = _run(model_dir, crowd[:2] + [PromptInput(target, PROMPTS[target])] + crowd[2:], params,
                 max_batch_tokens=16, max_running=5)
    keys = [(target, s) for s in range(params.n)]
    _assert_same(alone, want, keys)
    _assert_same(mixed, want, keys)


def test_preempted_samples_draw_the_same_numbers(baseline, model_dir):
    params, want = baseline
    inputs = [PromptInput(i, p) for i, p in enumerate(PROMPTS)]
    engine = Engine(model=model_dir, device="cpu", dtype="float32", max_model_len=40, kv_cache_tokens=48,
                    max_batch_tokens=16, max_running=8)
    got = {(t.prompt_index, t.sample_index): t for t in engine.stream(inputs, params)}
    assert engine.scheduler.stats.preemptions > 0
    _assert_same(got, want)


def test_different_seed_different_tokens(baseline, model_dir):
    params, want = baseline
    from dataclasses import replace

    inputs = [PromptInput(i, p) for i, p in enumerate(PROMPTS)]
    other = _run(model_dir, inputs, replace(params, seed=params.seed + 1))
    differing = sum(other[k].response_token_ids != want[k].response_token_ids for k in want)
    assert differing >= len(want) - 1


def test_logprobs_modes_at_temperature(model_dir, hf_ref):
    """processed = log_softmax(logits / T), raw = log_softmax(logits); the mode never changes the tokens."""
    from dataclasses import replace

    params = SamplingParams(n=2, max_new_tokens=8, temperature=0.7, seed=3)
    inputs = [PromptInput(i, p) for i, p in enumerate(PROMPTS[:2])]
    processed = _run(model_dir, inputs, params)
    raw = _run(model_dir, inputs, replace(params, logprobs_mode="raw"))
    for key, traj in processed.items():
        prompt = PROMPTS[key[0]]
        assert raw[key].response_token_ids == traj.response_token_ids
        want_p = hf_ref.logprobs(model_dir, prompt, traj.response_token_ids, temperature=0.7)
        want_r = hf_ref.logprobs(model_dir, prompt, traj.response_token_ids)
        assert traj.response_logprobs == pytest.approx(want_p, abs=1e-4)
        assert raw[key].response_logprobs == pytest.approx(want_r, abs=1e-4)
        assert max(abs(a - b) for a, b in zip(want_p, want_r)) > 1e-2  # the two modes differ here


@pytest.mark.parametrize("layout", [(4096, 64, 2000), (16, 3, 2000), (16, 8, 48)],
                         ids=["roomy", "queued", "preempting"])
def test_overlap_schedule_changes_no_token(model_dir, layout):
    """Decode steps scheduled ahead of their inputs (the default) give the tokens, logprobs and finish
    reasons of one-step-at-a-time scheduling, also when samples stop on eos mid-batch (their step
    ahead is computed and dropped), requests queue for rows, or the KV pool preempts."""
    max_batch_tokens, max_running, kv_tokens = layout
    inputs = [PromptInput(i, p) for i, p in enumerate(PROMPTS + _prompts([5, 13, 3], seed=12))]
    params = SamplingParams(n=3, max_new_tokens=14, temperature=1.0, seed=77)
    runs = {}
    for overlap in (False, True):
        engine = Engine(model=model_dir, device="cpu", dtype="float32", max_model_len=40, kv_cache_tokens=kv_tokens,
                        max_batch_tokens=max_batch_tokens, max_running=max_running, overlap_schedule=overlap)
        engine.eos_token_ids = frozenset(range(3, 300, 9))  # about one token in nine ends a sample
        steps_ahead = []
        real = engine.scheduler.schedule_ahead
        engine.scheduler.schedule_ahead = lambda prev: steps_ahead.append(real(prev)) or steps_ahead[-1]
        runs[overlap] = {(t.prompt_index, t.sample_index): t for t in engine.stream(inputs, params)}
        scheduled_ahead = [out for out in steps_ahead if out is not None]
        if overlap:
            assert scheduled_ahead, "no step was scheduled ahead"
            assert any(e.ghost for out in scheduled_ahead for e in out.entries), "no sample stopped mid-batch"
        else:
            assert not steps_ahead
        sched = engine.scheduler
        assert sched.allocator.num_free + sched.cache.total_size == engine.num_kv_slots - 1
        assert (sched.stats.preemptions > 0) == (kv_tokens == 48)
    sequential, overlapped = runs[False], runs[True]
    assert set(overlapped) == set(sequential)
    assert {t.finish_reason for t in sequential.values()} == {"stop", "length"}
    for key, want in sequential.items():
        got = overlapped[key]
        assert (got.response_token_ids, got.finish_reason) == (want.response_token_ids, want.finish_reason), key
        assert got.response_logprobs == pytest.approx(want.response_logprobs, abs=LP_TOL), key
