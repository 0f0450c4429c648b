"""--deterministic on the Triton backend (the batch-invariant kernels: matmul, attention, fused MoE
with one launch config, Gated DeltaNet prefilled token by token; the sampler's rows were already
independent), under the interpreter on the
CPU: a sample's tokens and logprobs are bit for bit the same alone or inside the batch, through
chunked prefill at other boundaries, one request at a time, and from a prefix-cache hit; MoE
routing ids too. The batched forward runs (not one token per forward, as the torch path does).

The interpreter's dot is swapped for one whose rows do not depend on their neighbours, as a GPU's
MMA (interpreter_dot.py): OpenBLAS's would move bits with the batch by itself. The GPU variant with
CUDA graphs: tests/e2e/test_gpu_deterministic.py."""

from __future__ import annotations

import random

import pytest

from backends import interpreter_only
from same_bits import assert_same_bits
from rollout_cli import Engine, PromptInput, SamplingParams
from rollout_cli.engine.trajectory import ScoreInput
from rollout_cli.models.layers import Linear

PARAMS = SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=77)
FILTERED = SamplingParams(n=2, max_new_tokens=6, temperature=0.8, top_p=0.9, top_k=20, seed=5)
_rng = random.Random(3)
PROMPTS = [[_rng.randrange(300) for _ in range(n)] for n in (7, 19, 2, 11)]
# (max_batch_tokens, max_running, enable_prefix_cache)
DEFAULT, CHUNKED, ONE_AT_A_TIME = (4096, 64, True), (8, 64, True), (5, 1, False)

pytestmark = [interpreter_only, pytest.mark.usefixtures("module_row_invariant_dot")]


def _engine(model_dir, layout=DEFAULT, dtype="float32"):
    max_batch_tokens, max_running, cache = layout
    return Engine(model=model_dir, device="cpu", dtype=dtype, attention_backend="triton", max_model_len=64,
                  max_batch_tokens=max_batch_tokens, max_running=max_running, enable_prefix_cache=cache,
                  deterministic=True)


def _samples(engine, params, indices=None):
    indices = range(len(PROMPTS)) if indices is None else indices
    return {(t.prompt_index, t.sample_index): t
            for t in engine.stream([PromptInput(i, PROMPTS[i]) for i in indices], params)}


def test_dense_samples_have_the_same_bits_in_every_layout(sampling_checkpoint):
    engine = _engine(sampling_checkpoint)
    assert not engine.runner.per_token  # the batched forward, on the batch-invariant kernels
    linears = [m for m in engine.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.batch_invariant for m in linears) and engine.model.batch_invariant
    baseline = {name: _samples(engine, params) for name, params in (("plain", PARAMS), ("filtered", FILTERED))}
    assert engine.scheduler.stats.cached_prompt_tokens > 0  # the second pass read its prompts from the cache
    chunked = _engine(sampling_checkpoint, CHUNKED)
    for name, params in (("plain", PARAMS), ("filtered", FILTERED)):
        assert_same_bits(_samples(chunked, params), baseline[name])
    assert_same_bits(_samples(_engine(sampling_checkpoint, ONE_AT_A_TIME), PARAMS), baseline["plain"])
    assert_same_bits(_samples(_engine(sampling_checkpoint), PARAMS, indices=[1]), baseline["plain"])
    # teacher forcing (`rollout score`): prompt and response in one prefill, chunked differently,
    # scored on the sampler's kernel: the run's logprobs bit for bit, the filtered ones too
    for name, params in (("plain", PARAMS), ("filtered", FILTERED)):
        samples = [ScoreInput(t.prompt_index, t.sample_index, t.prompt_token_ids, t.response_token_ids)
                   for t in baseline[name].values()]
        for score in chunked.score(samples, params):
            assert score.response_logprobs == baseline[name][(score.prompt_index, score.sample_index)].response_logprobs


def test_half_precision_samples_have_the_same_bits(sampling_checkpoint):
    """float16 (the interpreter's dot cannot take bfloat16): chunked, served from the prefix cache, and
    after the mode was switched off and on."""
    engine = _engine(sampling_checkpoint, dtype="float16")
    baseline = _samples(engine, PARAMS)
    assert_same_bits(_samples(engine, PARAMS), baseline)  # every prompt a cache hit now
    assert_same_bits(_samples(_engine(sampling_checkpoint, CHUNKED, "float16"), PARAMS), baseline)
    # the mode switched off and on again on the same engine (rollout bench --deterministic)
    engine.set_deterministic(False)
    assert not engine.model.batch_invariant and not engine.runner.deterministic
    assert _samples(engine, PARAMS).keys() == baseline.keys()
    engine.set_deterministic(True)
    assert_same_bits(_samples(engine, PARAMS), baseline)


def test_moe_samples_and_routing_ids_have_the_same_bits(tiny_moe_checkpoints):
    model_dir = tiny_moe_checkpoints["qwen3_moe"]
    results = []
    for layout, indices in ((DEFAULT, None), (ONE_AT_A_TIME, None), (CHUNKED, [3])):
        engine = _engine(model_dir, layout)
        engine.enable_routing_capture()
        results.append(_samples(engine, PARAMS, indices))
    for got in results[1:]:
        assert_same_bits(got, results[0])
        for key in got:
            assert (got[key].routed_experts == results[0][key].routed_experts).all(), key


def test_hybrid_samples_have_the_same_bits(tiny_hybrid_checkpoints):
    """Gated DeltaNet layers: prefilled token by token with the decode kernel's step (chunked or not),
    their states forked for the n samples or recomputed: the same bits."""
    model_dir = tiny_hybrid_checkpoints["qwen3_next"]
    baseline = _samples(_engine(model_dir), PARAMS)
    for layout, indices in ((CHUNKED, None), (ONE_AT_A_TIME, [2])):
        assert_same_bits(_samples(_engine(model_dir, layout), PARAMS, indices), baseline)
