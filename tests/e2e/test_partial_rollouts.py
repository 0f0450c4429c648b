"""Partial rollouts across a weight update (issue 21), through the Engine API on the CPU in float32.

The daemon's `pause --mode keep` protocol, driven from on_step as the daemon's worker drives it: ask
the stream to hold (`hold_requested`), and on the next call, with no step in flight, retract the
running samples and load new weights. Correctness is HF transformers: the tokens sampled before the
update are the old weights' greedy tokens, and the rest are the new weights' greedy continuation of
prompt + those tokens (logprobs to 1e-4); every token carries the version that sampled it.
"""

from __future__ import annotations

import pytest

from parity import TOL, make_engine, prompts_of
from rollout_cli import PartialSample, PromptInput, SamplingParams
from rollout_cli.errors import RolloutError
from weight_trainers import perturbed_checkpoint

PROMPTS = prompts_of([7, 12, 4, 9], seed=5)
MAX_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True, n=2)


def _keep_and_update_at(engine, step: int, new_weights: str, seen: dict):
    """on_step: at call `step` ask the stream to hold; once it holds with nothing in flight, retract,
    reload `new_weights` as version "1" and let it go on."""
    calls = 0

    def on_step():
        nonlocal calls
        calls += 1
        if calls == step:
            with pytest.raises(RolloutError, match="in flight"):
                engine.reload_weights(new_weights, version="1")  # a step is on the device: refused
            engine.hold_requested = True
        elif engine.hold_requested:
            assert not engine.step_in_flight
            seen["retracted"] = engine.retract_running()
            engine.reload_weights(new_weights, version="1")
            engine.hold_requested = False

    return on_step


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_next"])
def test_keep_across_an_update_continues_on_the_new_weights(arch, tiny_checkpoints, tiny_hybrid_checkpoints,
                                                            hf_ref, tmp_path):
    base = {**tiny_checkpoints, **tiny_hybrid_checkpoints}[arch]
    new = perturbed_checkpoint(base, tmp_path / "new", seed=4)
    engine = make_engine(base, max_running=4)  # 8 samples, 4 at a time: some start after the update
    seen: dict = {}
    inputs = [PromptInput(i, p) for i, p in enumerate(PROMPTS)]
    results = list(engine.stream(inputs, GREEDY, on_step=_keep_and_update_at(engine, 4, new, seen)))
    assert len(results) == len(PROMPTS) * 2 and seen["retracted"] > 0
    assert engine.weight_version == "1"
    split_samples = 0
    for traj in results:
        prompt, response = PROMPTS[traj.prompt_index], traj.response_token_ids
        versions = traj.response_weight_versions
        assert len(versions) == len(response) == MAX_NEW and traj.weight_version == "1"
        k = versions.count("0")
        assert versions == ["0"] * k + ["1"] * (MAX_NEW - k)  # one switch, old first
        split_samples += 0 < k
        assert response[:k] == hf_ref.greedy(base, prompt, MAX_NEW)[:k]
        assert response[k:] == hf_ref.greedy(new, prompt + response[:k], MAX_NEW - k)
        want = (hf_ref.logprobs(base, prompt, response[:k]) if k else []) + \
            hf_ref.logprobs(new, prompt + response[:k], response[k:])
        assert traj.response_logprobs == pytest.approx(want, abs=TOL)
    assert split_samples == seen["retracted"]  # the hold came after their prefill: each had old tokens
    # the cache holds nothing from the old weights: a fresh call equals HF on the new weights
    again = list(engine.stream([inputs[0]], GREEDY))
    assert all(t.response_token_ids == hf_ref.greedy(new, PROMPTS[0], MAX_NEW) for t in again)
    assert all(t.response_weight_versions == ["1"] * MAX_NEW for t in again)


def test_retract_is_refused_with_a_step_in_flight(tiny_checkpoints):
    engine = make_engine(tiny_checkpoints["qwen3"])
    refused = []

    def on_step():
        if not refused:
            with pytest.raises(RolloutError, match="step is in flight"):
                engine.retract_running()
            refused.append(True)

    results = list(engine.stream([PromptInput(0, PROMPTS[0])], GREEDY, on_step=on_step))
    assert refused and all(t.response_weight_versions == ["0"] * MAX_NEW for t in results)


def test_closed_admission_drains_the_running_samples_then_holds(tiny_checkpoints, hf_ref, tmp_path):
    """The daemon's pause finish: with admission closed no sample starts, the running ones finish,
    and the stream calls on_step with nothing running; an update there needs no retraction, so every
    sample comes from one weight version: the first wave from the old, the rest from the new."""
    base = tiny_checkpoints["qwen3"]
    new = perturbed_checkpoint(base, tmp_path / "new", seed=6)
    engine = make_engine(base, max_running=4)
    calls, drained = 0, []

    def on_step():
        nonlocal calls
        calls += 1
        if calls == 2:
            engine.scheduler.admit_new = False
        elif not engine.scheduler.admit_new and not engine.scheduler.running:
            drained.append(engine.scheduler.num_unfinished)
            engine.reload_weights(new, version="1")
            engine.scheduler.admit_new = True

    inputs = [PromptInput(i, p) for i, p in enumerate(PROMPTS)]
    results = list(engine.stream(inputs, GREEDY, on_step=on_step))
    assert drained == [len(PROMPTS) * 2 - 4]  # the 4 running at the close finished; the rest waited
    assert len(results) == len(PROMPTS) * 2
    for traj in results:
        [version] = set(traj.response_weight_versions)
        model = base if version == "0" else new
        assert traj.response_token_ids == hf_ref.greedy(model, PROMPTS[traj.prompt_index], MAX_NEW)
    assert sum(t.weight_version == "0" for t in results) == 4


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_next"])
def test_aborted_samples_continued_equal_an_uninterrupted_run(arch, tiny_checkpoints, tiny_hybrid_checkpoints):
    """abort hands back each unfinished sample's tokens so far; PartialSample continues it (prompt +
    response in one prefill) under the same random stream: the whole run equals one never stopped,
    sampled at temperature 1 (tokens exact, logprobs to 1e-4: a prefill sums in another order than
    decode steps, 1e-5 apart in float32 on the hybrid model's delta rule)."""
    model = {**tiny_checkpoints, **tiny_hybrid_checkpoints}[arch]
    params = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, ignore_eos=True, n=2, seed=3)
    inputs = [PromptInput(i, p) for i, p in enumerate(PROMPTS)]
    engine = make_engine(model, max_running=4)
    want = {(t.prompt_index, t.sample_index): t for t in engine.stream(inputs, params)}
    calls, aborted = 0, []

    def on_step():
        nonlocal calls
        calls += 1
        if calls == 5:
            aborted.extend(engine.control.abort())

    first = [t for t in engine.stream(inputs, params, on_step=on_step)]
    assert aborted and all(t.finish_reason == "abort" for t in aborted)
    assert any(0 < len(t.response_token_ids) < MAX_NEW for t in aborted)
    got = {(t.prompt_index, t.sample_index): t for t in first}
    for t in aborted:
        assert t.response_token_ids == want[(t.prompt_index, t.sample_index)].response_token_ids[:len(t.response_token_ids)]
    continued = list(engine.stream([PartialSample.of(t) for t in aborted], params))
    assert len(continued) == len(aborted)
    got.update({(t.prompt_index, t.sample_index): t for t in continued})
    assert got.keys() == want.keys()
    for key, t in got.items():
        assert t.finish_reason == "length" and t.response_token_ids == want[key].response_token_ids, key
        assert t.response_logprobs == pytest.approx(want[key].response_logprobs, abs=TOL)
        assert t.response_weight_versions == ["0"] * MAX_NEW


def test_a_partial_sample_is_checked(tiny_checkpoints):
    engine = make_engine(tiny_checkpoints["qwen3"])
    params = SamplingParams(max_new_tokens=3)
    done = PartialSample(0, 0, [1, 2], [5, 6, 7], [-1.0] * 3, ["0"] * 3)
    with pytest.raises(RolloutError, match=r"sample \(0, 0\) already has 3 response tokens.*nothing to continue"):
        list(engine.stream([done], params))
    ragged = PartialSample(0, 1, [1, 2], [5], [-1.0], [])
    with pytest.raises(RolloutError, match="one entry per response token"):
        list(engine.stream([ragged], params))
