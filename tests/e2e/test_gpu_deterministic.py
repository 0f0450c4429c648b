"""--deterministic on the GPU (GPU only): the batch-invariant Triton path in bfloat16, CUDA graphs
on and off, gives a sample the same bits alone or in a batch, chunked or not, from the prefix cache
or recomputed; `Engine.score` and the trainer's forward equal the run. (CPU variants under the
interpreter: tests/kernels/test_engine_triton_deterministic.py, test_training_triton.py.)"""

from __future__ import annotations

import random

import pytest

from same_bits import assert_same_bits
from rollout_cli import Engine, PromptInput, SamplingParams
from rollout_cli.engine.trajectory import ScoreInput
from rollout_cli.training import Policy

pytestmark = pytest.mark.gpu

PARAMS = SamplingParams(n=4, max_new_tokens=48, temperature=1.0, seed=11, ignore_eos=True)


def _prompts(vocab: int, count: int = 24, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(3, 150))] for _ in range(count)]


def _samples(model_dir, prompts, indices=None, **options):
    options = {"max_model_len": 256, "dtype": "bfloat16", **options}
    engine = Engine(model_dir, device="cuda", deterministic=True, **options)
    assert engine.attention_backend == "triton" and not engine.runner.per_token
    indices = range(len(prompts)) if indices is None else indices
    out = {(t.prompt_index, t.sample_index): t for t in engine.stream([PromptInput(i, prompts[i]) for i in indices],
                                                                        PARAMS)}
    return out, engine


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_every_layout_gives_the_same_bits(tiny_checkpoints, tiny_moe_checkpoints, name):
    model_dir = {**tiny_checkpoints, **tiny_moe_checkpoints}[name]
    prompts = _prompts(300)
    baseline, engine = _samples(model_dir, prompts)
    assert engine.runner.graphs is not None and engine.runner.graphs.replays > 0
    for options, indices in (({"cuda_graphs": False}, None), ({"max_batch_tokens": 40}, None),
                             ({"max_running": 3}, None), ({}, [5]), ({"enable_prefix_cache": False}, None)):
        assert_same_bits(_samples(model_dir, prompts, indices, **options)[0], baseline)
    rerun = {(t.prompt_index, t.sample_index): t for t in engine.stream(
        [PromptInput(i, p) for i, p in enumerate(prompts)], PARAMS)}
    assert_same_bits(rerun, baseline)  # every prompt from the prefix cache
    samples = [ScoreInput(t.prompt_index, t.sample_index, t.prompt_token_ids, t.response_token_ids)
               for t in baseline.values()]
    for score in engine.score(samples, PARAMS):
        assert score.response_logprobs == baseline[(score.prompt_index, score.sample_index)].response_logprobs


def test_the_trainer_forward_equals_the_run(tiny_checkpoints):
    model_dir = tiny_checkpoints["qwen3"]
    baseline, _ = _samples(model_dir, _prompts(300, count=4))
    policy = Policy(model_dir, device="cuda", dtype="bfloat16")
    assert policy.kernels == "triton"
    for t in baseline.values():
        got = policy.response_logprobs(t.prompt_token_ids, t.response_token_ids, PARAMS.temperature)
        assert got.tolist() == t.response_logprobs, (t.prompt_index, t.sample_index)
