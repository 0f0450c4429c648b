"""Greedy tokens equal HF `generate` exactly and logprobs match HF's log_softmax to 1e-4 (CPU, float32)."""

from __future__ import annotations


import pytest

from rollout_cli import PromptInput, SamplingParams

from parity import TOL, assert_matches_hf, make_engine, prompts_of

GREEDY = dict(temperature=0.0)


def test_greedy_outputs_vary(arch, hf_ref):
    """Sanity of the fixtures: random weights give varied greedy text, or parity would be trivial."""
    _, model_dir = arch
    for prompt in prompts_of([5, 12], seed=1):
        out = hf_ref.greedy(model_dir, prompt, 24)
        assert len(out) == 24
        assert len(set(out)) >= 6, out


def test_batch_of_mixed_lengths_with_chunked_prefill(arch, hf_ref):
    _, model_dir = arch
    prompts = prompts_of([1, 3, 9, 16, 17, 50], seed=2)  # 50 > max_batch_tokens: chunked prefill
    engine = make_engine(model_dir, max_batch_tokens=16)
    results = engine.generate(prompts, SamplingParams(max_new_tokens=20, **GREEDY))
    assert_matches_hf(hf_ref, model_dir, results, prompts, 20)
    assert engine.scheduler.stats.preemptions == 0


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_preemption_keeps_outputs_exact(arch, hf_ref, prefix_cache):
    _, model_dir = arch
    prompts = prompts_of([20, 14, 25, 18, 11], seed=3)
    # each request needs ~45 slots; 64 slots cannot hold them all: the scheduler must preempt.
    engine = make_engine(model_dir, max_model_len=64, kv_cache_tokens=65, max_batch_tokens=32,
                         enable_prefix_cache=prefix_cache)
    results = engine.generate(prompts, SamplingParams(max_new_tokens=24, **GREEDY))
    assert engine.scheduler.stats.preemptions > 0
    assert_matches_hf(hf_ref, model_dir, results, prompts, 24)
    sched = engine.scheduler
    cached = sched.cache.total_size if sched.cache else 0
    assert sched.allocator.num_free + cached == engine.num_kv_slots - 1


def test_shared_prefixes_hit_cache_and_match(arch, hf_ref):
    _, model_dir = arch
    system = prompts_of([20], seed=4)[0]
    tails = prompts_of([3, 7, 1, 12], seed=5)
    prompts = [system + t for t in tails]
    params = SamplingParams(n=4, max_new_tokens=12, **GREEDY)
    cached = make_engine(model_dir, max_batch_tokens=64, enable_prefix_cache=True)
    with_cache = cached.generate(prompts, params)
    assert cached.scheduler.stats.prefix_hit_rate > 0.5  # 15 of 16 samples reuse >= 20 prompt tokens
    assert_matches_hf(hf_ref, model_dir, with_cache, prompts, 12, n=4)
    assert [t.sample_index for t in with_cache[:4]] == [0, 1, 2, 3]
    plain = make_engine(model_dir, max_batch_tokens=64, enable_prefix_cache=False)
    without = plain.generate(prompts, params)
    assert plain.scheduler.stats.prefix_hit_rate == 0
    for a, b in zip(with_cache, without, strict=True):
        assert (a.prompt_index, a.sample_index) == (b.prompt_index, b.sample_index)
        assert a.response_token_ids == b.response_token_ids
        assert a.response_logprobs == pytest.approx(b.response_logprobs, abs=TOL)


def test_prefix_cache_reused_across_generate_calls(arch, hf_ref):
    """A second call hits what the first left in the tree (finished sequences, not just prompts)."""
    _, model_dir = arch
    prompt = prompts_of([15], seed=6)[0]
    engine = make_engine(model_dir, max_batch_tokens=8)
    first = engine.generate([prompt], SamplingParams(max_new_tokens=10, **GREEDY))[0]
    # continue the first response: prompt + response is already cached
    longer = prompt + first.response_token_ids
    second = engine.generate([longer], SamplingParams(max_new_tokens=10, **GREEDY))[0]
    stats = engine.scheduler.stats
    assert stats.cached_prompt_tokens >= len(longer) - 2
    assert_matches_hf(hf_ref, model_dir, [first], [prompt], 10)
    assert_matches_hf(hf_ref, model_dir, [second], [longer], 10)


def test_eos_stops_and_ignore_eos_continues(arch, hf_ref, with_eos):
    _, model_dir = arch
    prompt = prompts_of([8], seed=7)[0]
    full = hf_ref.greedy(model_dir, prompt, 20)
    # an eos the greedy output hits for the first time at index k >= 2
    k = next(i for i in range(2, len(full)) if full[i] not in full[:i])
    eos = full[k]
    eos_dir = with_eos(model_dir, eos)
    engine = make_engine(eos_dir)
    assert eos in engine.eos_token_ids
    stopped = engine.generate([prompt], SamplingParams(max_new_tokens=20, **GREEDY))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.response_token_ids == full[: k + 1]
    assert stopped.response_token_ids[-1] == eos
    assert hf_ref.greedy(eos_dir, prompt, 20, eos_token_id=eos) == full[: k + 1]
    assert stopped.response_logprobs == pytest.approx(hf_ref.logprobs(model_dir, prompt, full[: k + 1]), abs=TOL)

    kept = engine.generate([prompt], SamplingParams(max_new_tokens=20, ignore_eos=True, **GREEDY))[0]
    assert kept.finish_reason == "length"
    assert kept.response_token_ids == full
    assert kept.response_logprobs == pytest.approx(hf_ref.logprobs(model_dir, prompt, full), abs=TOL)


def test_max_model_len_stops_with_length(arch, hf_ref):
    _, model_dir = arch
    prompts = prompts_of([10, 3], seed=8)
    engine = make_engine(model_dir, max_model_len=16)
    results = engine.generate(prompts, SamplingParams(max_new_tokens=100, **GREEDY))
    for traj, prompt in zip(results, prompts, strict=True):
        assert traj.finish_reason == "length"
        assert len(prompt) + len(traj.response_token_ids) == 16
        want = hf_ref.greedy(model_dir, prompt, 16 - len(prompt))
        assert traj.response_token_ids == want
        assert traj.response_logprobs == pytest.approx(hf_ref.logprobs(model_dir, prompt, want), abs=TOL)


def test_stream_keeps_prompt_index_and_passthrough(tiny_checkpoints, hf_ref):
    model_dir = tiny_checkpoints["qwen3"]
    prompt = prompts_of([6], seed=9)[0]
    engine = make_engine(model_dir)
    inputs = [PromptInput(41, prompt, {"id": "row-41"})]
    [traj] = list(engine.stream(inputs, SamplingParams(max_new_tokens=5, **GREEDY)))
    assert (traj.prompt_index, traj.sample_index, traj.passthrough) == (41, 0, {"id": "row-41"})
    assert traj.response_token_ids == hf_ref.greedy(model_dir, prompt, 5)


def test_example_model_matches_hf(example_model_dir, hf_ref):
    engine = make_engine(example_model_dir)
    assert engine.eos_token_ids == {0, 2}  # config.json and generation_config.json
    prompts = [[5, 17, 99, 230, 7, 64], [2, 2]]  # greedy continues the second with eos 2
    kept = engine.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True, **GREEDY))
    stopped = engine.generate(prompts, SamplingParams(max_new_tokens=10, **GREEDY))
    for prompt, k, s in zip(prompts, kept, stopped, strict=True):
        want = hf_ref.greedy(example_model_dir, prompt, 10)  # no eos
        assert k.response_token_ids == want and k.finish_reason == "length"
        assert k.response_logprobs == pytest.approx(hf_ref.logprobs(example_model_dir, prompt, want), abs=TOL)
        assert s.response_token_ids == hf_ref.greedy(example_model_dir, prompt, 10, eos_token_id=[0, 2])
    assert stopped[1].response_token_ids == [2] and stopped[1].finish_reason == "stop"


@pytest.mark.parametrize("bad", [[], [1, 2, 10_000], [3, -1]], ids=["empty", "past-vocab", "negative"])
def test_bad_prompt_ids_are_one_line_errors(tiny_checkpoints, bad):
    from rollout_cli.errors import RolloutError

    engine = make_engine(tiny_checkpoints["qwen3"])
    with pytest.raises(RolloutError, match="prompt 3 "):
        list(engine.stream([PromptInput(3, bad)], SamplingParams(max_new_tokens=2, **GREEDY)))
    # the engine is still usable afterwards
    ok = list(engine.stream([PromptInput(0, [1, 2, 3])], SamplingParams(max_new_tokens=2, **GREEDY)))
    assert len(ok) == 1 and len(ok[0].response_token_ids) == 2


def test_interrupted_stream_leaks_nothing_into_the_next_job(tiny_checkpoints, hf_ref):
    model_dir = tiny_checkpoints["qwen2"]
    engine = make_engine(model_dir, max_running=4, max_batch_tokens=8)
    params = SamplingParams(max_new_tokens=6, **GREEDY)
    jobs = [PromptInput(i, p) for i, p in enumerate(prompts_of([5, 9, 13, 4, 7, 11], seed=12))]
    # 1. the consumer stops after the first trajectory
    stream = engine.stream(jobs, params)
    next(stream)
    stream.close()
    # 2. a bad prompt part-way through the job
    from rollout_cli.errors import RolloutError

    with pytest.raises(RolloutError):
        list(engine.stream(jobs[:3] + [PromptInput(3, [])], params))
    # 3. the forward itself fails mid-step
    real_run, calls = engine.runner._run_eager, []

    def failing_run(out):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("simulated device failure")
        return real_run(out)

    engine.runner._run_eager = failing_run
    with pytest.raises(RuntimeError, match="simulated"):
        list(engine.stream(jobs, params))
    engine.runner._run_eager = real_run
    sched = engine.scheduler
    assert not sched.has_work()
    assert sched.allocator.num_free + sched.cache.total_size == engine.num_kv_slots - 1
    assert sched.cache.protected_size == 0
    prompt = prompts_of([6], seed=13)[0]
    results = engine.generate([prompt], params)
    assert [(t.prompt_index, t.prompt_token_ids) for t in results] == [(0, prompt)]
    assert results[0].response_token_ids == hf_ref.greedy(model_dir, prompt, 6)
