"""The engine with every Triton kernel in the forward, under the interpreter on the CPU.

Same greedy tokens and logprobs as the torch path, through chunked prefill,
prefix sharing and decode (CUDA graphs are covered by tests/e2e/test_gpu_engine.py).
"""

from __future__ import annotations

import random

import pytest

from backends import assert_same_samples, generate_on_both_backends, interpreter_only
from rollout_cli import SamplingParams


@interpreter_only
@pytest.mark.parametrize("params", [
    SamplingParams(n=2, temperature=0.0, max_new_tokens=5),
    # seeded sampling: the Triton sampler draws the same uniforms on the device as the host does
    SamplingParams(n=2, temperature=0.8, top_p=0.9, top_k=50, seed=11, max_new_tokens=5),
], ids=["greedy", "sampled"])
def test_triton_backend_matches_torch_backend(tiny_checkpoints, params):
    model_dir = tiny_checkpoints["qwen2"]
    rng = random.Random(0)
    prompts = [[rng.randrange(400) for _ in range(rng.randint(3, 40))] for _ in range(3)]
    runs, _ = generate_on_both_backends(model_dir, prompts, params, max_model_len=128, max_batch_tokens=16)
    assert_same_samples(runs)
