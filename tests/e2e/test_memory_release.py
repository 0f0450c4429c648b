"""release_memory / resume_memory on the CPU (the reallocate mechanism; torch_memory_saver is CUDA's,
tested in tests/e2e/test_gpu_memory.py): the state machine, refusals, and that outputs after
resume equal outputs before."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_cli import Engine, SamplingParams
from rollout_cli.engine.engine import PromptInput
from rollout_cli.errors import RolloutError

MODEL = str(Path(__file__).resolve().parents[2] / "recipes" / "example_model")
PROMPTS = [[5, 17, 99, 3, 250], [7, 7, 8, 100, 42, 11, 12]]
PARAMS = SamplingParams(n=2, temperature=1.0, seed=3, max_new_tokens=10, ignore_eos=True)


def _outputs(engine: Engine):
    return [(r.response_token_ids, r.response_logprobs) for r in engine.generate(PROMPTS, PARAMS)]


@pytest.fixture(scope="module")
def reference():
    return _outputs(Engine(MODEL, device="cpu", kv_cache_tokens=512, max_model_len=256))


def test_release_without_backup_needs_a_reload(reference):
    engine = Engine(MODEL, device="cpu", kv_cache_tokens=512, max_model_len=256)
    held = engine.control.memory_held()
    assert held["weights_bytes"] > 0 and held["kv_cache_bytes"] > 0
    result = engine.release_memory()
    assert result["released"] == ["weights", "kv_cache", "cuda_graph"]
    held = engine.control.memory_held()
    assert held["weights_bytes"] == 0 and held["kv_cache_bytes"] == 0 and held["released"]
    assert all(p.numel() == 0 for p in engine.model.parameters())  # the storage really went
    assert engine.kv.k.numel() == 0
    with pytest.raises(RolloutError, match="resume-memory"):
        engine.generate(PROMPTS, PARAMS)
    with pytest.raises(RolloutError, match="resume-memory"):
        engine.reload_weights(MODEL)
    assert engine.release_memory()["released"] == []  # a second release is a no-op
    resumed = engine.resume_memory()
    assert resumed["resumed"] == ["weights", "kv_cache", "cuda_graph"] and resumed["weights_stale"]
    with pytest.raises(RolloutError, match="reload-weights"):
        engine.generate(PROMPTS, PARAMS)
    assert engine.reload_weights(MODEL) == "1"
    assert _outputs(engine) == reference


def test_release_with_cpu_backup_restores_the_weights(reference):
    engine = Engine(MODEL, device="cpu", kv_cache_tokens=512, max_model_len=256, weights_cpu_backup=True)
    _outputs(engine)  # fills the prefix cache, which the KV release must flush
    engine.release_memory()
    assert engine.scheduler.cache.evictable_size == 0
    assert not engine.resume_memory()["weights_stale"]
    assert _outputs(engine) == reference


def test_kv_only_release_keeps_weights(reference):
    engine = Engine(MODEL, device="cpu", kv_cache_tokens=512, max_model_len=256)
    result = engine.release_memory("kv_cache")
    assert result["released"] == ["kv_cache"]
    assert all(p.numel() > 0 for p in engine.model.parameters())
    with pytest.raises(RolloutError, match="kv_cache"):
        engine.generate(PROMPTS, PARAMS)
    assert engine.resume_memory(["kv_cache"])["resumed"] == ["kv_cache"]
    assert _outputs(engine) == reference


def test_bad_tags_and_release_during_a_job_are_refused():
    engine = Engine(MODEL, device="cpu", kv_cache_tokens=512, max_model_len=256)
    with pytest.raises(RolloutError, match="unknown memory tag.*gpu_stuff"):
        engine.release_memory("weights,gpu_stuff")
    prompts = [PromptInput(0, PROMPTS[0], params=SamplingParams(max_new_tokens=2, ignore_eos=True)),
               PromptInput(1, PROMPTS[1], params=SamplingParams(max_new_tokens=40, ignore_eos=True))]
    stream = engine.stream(prompts, SamplingParams())
    assert next(stream).prompt_index == 0  # prompt 1 is still decoding
    assert engine.scheduler.has_work()
    with pytest.raises(RolloutError, match="in flight"):
        engine.release_memory()
    stream.close()  # an abandoned stream aborts its requests
    assert not engine.scheduler.has_work()
    assert engine.release_memory()["released"]


def test_hybrid_model_release_drops_and_restores_the_state_pool(tiny_hybrid_checkpoints):
    model_dir = next(iter(tiny_hybrid_checkpoints.values()))
    engine = Engine(model_dir, device="cpu", kv_cache_tokens=512, max_model_len=256, weights_cpu_backup=True)
    prompts = [[3, 5, 7, 9, 11, 13], [4, 6, 8]]
    params = SamplingParams(n=3, temperature=1.0, seed=2, max_new_tokens=8, ignore_eos=True)

    def outputs():
        return [(r.response_token_ids, r.response_logprobs) for r in engine.generate(prompts, params)]

    before = outputs()  # n=3 leaves prompt-state snapshots behind; the release must drop them too
    engine.release_memory()
    assert engine.linear_states.conv.numel() == 0 and engine.linear_states.ssm.numel() == 0
    engine.resume_memory()
    assert engine.linear_states.ssm.numel() > 0
    assert outputs() == before
