"""Engine.score (`rollout score`): teacher-forced logprobs of finished samples, the trainer's way
(prompt and response in one prefill). Against HF transformers in float32; against the run itself,
bit for bit, under --deterministic (float32 and bfloat16; dense, MoE and hybrid models)."""

from __future__ import annotations

import random

import pytest

from rollout_cli import Engine, PromptInput, SamplingParams
from rollout_cli.engine.trajectory import ScoreInput
from rollout_cli.errors import RolloutError


def _prompts(lengths, seed=4):
    rng = random.Random(seed)
    return [[rng.randrange(300) for _ in range(n)] for n in lengths]


PROMPTS = _prompts([6, 15, 3, 9])


def _engine(model_dir, dtype="float32", **options):
    options = {"max_model_len": 64, "max_batch_tokens": 4096, "max_running": 64, **options}
    return Engine(model=model_dir, device="cpu", dtype=dtype, **options)


def _run(engine, params):
    inputs = [PromptInput(i, p) for i, p in enumerate(PROMPTS)]
    return sorted(engine.stream(inputs, params), key=lambda t: (t.prompt_index, t.sample_index))


def _score(engine, trajectories, params):
    samples = [ScoreInput(t.prompt_index, t.sample_index, t.prompt_token_ids, t.response_token_ids)
               for t in trajectories]
    scores = {(s.prompt_index, s.sample_index): s for s in engine.score(samples, params)}
    assert len(scores) == len(trajectories)
    return [scores[(t.prompt_index, t.sample_index)].response_logprobs for t in trajectories]


def test_scores_equal_hf_teacher_forcing(sampling_checkpoint, hf_ref):
    for temperature in (1.0, 0.7):
        params = SamplingParams(n=2, max_new_tokens=9, temperature=temperature, seed=3)
        engine = _engine(sampling_checkpoint)
        trajectories = _run(engine, params)
        for trajectory, scored in zip(trajectories, _score(engine, trajectories, params), strict=True):
            want = hf_ref.logprobs(sampling_checkpoint, trajectory.prompt_token_ids, trajectory.response_token_ids,
                                   temperature)
            assert len(scored) == len(trajectory.response_token_ids)
            assert scored == pytest.approx(want, abs=1e-4)
            assert scored == pytest.approx(trajectory.response_logprobs, abs=1e-4)  # the run's own view


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("params", [
    SamplingParams(n=3, max_new_tokens=10, temperature=1.0, seed=8),
    SamplingParams(n=2, max_new_tokens=10, temperature=0.6, logprobs_mode="raw", seed=8),
    SamplingParams(n=1, max_new_tokens=10, temperature=0.0),
    SamplingParams(n=2, max_new_tokens=10, temperature=0.9, top_p=0.8, top_k=12, min_p=0.02, seed=8),
], ids=["t1", "t0.6-raw", "greedy", "filtered"])
def test_deterministic_scores_equal_the_run_bit_for_bit(sampling_checkpoint, dtype, params):
    run_engine = _engine(sampling_checkpoint, dtype, deterministic=True)
    trajectories = _run(run_engine, params)
    # the scorer in other layouts: chunked prefill, one request at a time, no prefix cache, a new engine
    for options in ({}, {"max_batch_tokens": 5}, {"max_running": 1, "enable_prefix_cache": False}):
        scorer = _engine(sampling_checkpoint, dtype, deterministic=True, **options)
        for trajectory, scored in zip(trajectories, _score(scorer, trajectories, params), strict=True):
            assert scored == trajectory.response_logprobs, (options, trajectory.prompt_index)
    # and the run's own engine, whose prefix cache holds the prompts
    for trajectory, scored in zip(trajectories, _score(run_engine, trajectories, params), strict=True):
        assert scored == trajectory.response_logprobs


@pytest.mark.parametrize("kind,name", [("moe", "qwen3_moe"), ("hybrid", "qwen3_next")])
def test_deterministic_scores_of_moe_and_hybrid_models(tiny_moe_checkpoints, tiny_hybrid_checkpoints, kind, name):
    model_dir = (tiny_moe_checkpoints if kind == "moe" else tiny_hybrid_checkpoints)[name]
    params = SamplingParams(n=3, max_new_tokens=8, temperature=1.0, seed=2)
    engine = _engine(model_dir, "bfloat16", deterministic=True)
    trajectories = _run(engine, params)
    for options in ({}, {"max_batch_tokens": 4, "enable_prefix_cache": False}):
        scorer = engine if not options else _engine(model_dir, "bfloat16", deterministic=True, **options)
        for trajectory, scored in zip(trajectories, _score(scorer, trajectories, params), strict=True):
            assert scored == trajectory.response_logprobs, (options, trajectory.prompt_index)


def test_a_kv_cache_smaller_than_the_batch_scores_the_same(sampling_checkpoint):
    """Scoring requests admitted chunk by chunk as slots free up (preemption: tests/unit/test_scheduler_scoring.py)."""
    params = SamplingParams(n=2, max_new_tokens=12, temperature=1.0, seed=6)
    trajectories = _run(_engine(sampling_checkpoint, deterministic=True), params)
    scorer = _engine(sampling_checkpoint, deterministic=True, kv_cache_tokens=30, max_model_len=29,
                     max_batch_tokens=8)
    for trajectory, scored in zip(trajectories, _score(scorer, trajectories, params), strict=True):
        assert scored == trajectory.response_logprobs


def test_empty_responses_score_to_empty_lists(sampling_checkpoint):
    engine = _engine(sampling_checkpoint)
    samples = [ScoreInput(0, 0, [5, 6, 7], []), ScoreInput(1, 0, [5, 6], [9, 10])]
    scores = list(engine.score(samples, SamplingParams()))
    assert sorted((s.prompt_index, len(s.response_logprobs)) for s in scores) == [(0, 0), (1, 2)]


def test_a_response_without_a_prompt_is_refused(sampling_checkpoint):
    """Its first token has no position to be scored from: it came back as a None logprob, and `rollout score`
    reported a NaN mean difference as complete."""
    engine = _engine(sampling_checkpoint)
    with pytest.raises(RolloutError, match=r"sample \(3, 1\) has no prompt tokens"):
        list(engine.score([ScoreInput(3, 1, [], [9, 10])], SamplingParams()))


def test_top_logprobs_are_the_k_most_likely_tokens(sampling_checkpoint, hf_ref):
    """--top-logprobs K: at each response position the K most likely tokens under the reported
    distribution (temperature applied), most likely first, with their logprobs: HF's within 1e-4."""
    import torch

    params = SamplingParams(n=2, max_new_tokens=6, temperature=0.8, seed=5)
    engine = _engine(sampling_checkpoint)
    trajectories = _run(engine, params)[:3]
    samples = [ScoreInput(t.prompt_index, t.sample_index, t.prompt_token_ids, t.response_token_ids)
               for t in trajectories]
    scores = {(s.prompt_index, s.sample_index): s for s in engine.score(samples, params, top_logprobs=4)}
    model = hf_ref.model(sampling_checkpoint)
    for t in trajectories:
        score = scores[(t.prompt_index, t.sample_index)]
        assert len(score.top_logprobs) == len(t.response_token_ids)
        with torch.no_grad():
            logits = model(torch.tensor([t.prompt_token_ids + t.response_token_ids])).logits[0].float()
        logp = torch.log_softmax(logits / 0.8, dim=-1)
        for i, top in enumerate(score.top_logprobs):
            want = logp[len(t.prompt_token_ids) - 1 + i].topk(4)
            assert [token for token, _ in top] == want.indices.tolist()
            assert [lp for _, lp in top] == pytest.approx(want.values.tolist(), abs=1e-4)
            assert top[0][1] >= score.response_logprobs[i]
    assert all(s.top_logprobs is None for s in engine.score(samples[:1], params))  # off by default
