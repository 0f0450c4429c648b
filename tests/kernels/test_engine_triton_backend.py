"""The engine with every Triton kernel in the forward, under the interpreter on the CPU.

Same greedy tokens and logprobs as the torch path, through chunked prefill,
prefix sharing and decode (CUDA graphs are covered by tests/e2e/test_gpu_engine.py).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from rollout_cli import Engine, SamplingParams


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU interpreter variant; the GPU variant lives in tests/e2e/test_gpu_engine.py")
@pytest.mark.parametrize("params", [
    SamplingParams(n=2, temperature=0.0, max_new_tokens=5),
    # seeded sampling: the Triton sampler draws the same uniforms on the device as the host does
    SamplingParams(n=2, temperature=0.8, top_p=0.9, top_k=50, seed=11, max_new_tokens=5),
], ids=["greedy", "sampled"])
def test_triton_backend_matches_torch_backend(tiny_checkpoints, params):
    model_dir = tiny_checkpoints["qwen2"]
    rng = random.Random(0)
    prompts = [[rng.randrange(400) for _ in range(rng.randint(3, 40))] for _ in range(3)]
    runs = {}
    for backend in ("torch", "triton"):
        engine = Engine(model_dir, device="cpu", attention_backend=backend, max_model_len=128, max_batch_tokens=16)
        runs[backend] = engine.generate(prompts, params)
    assert engine.runner.attention_backend == "triton"
    for a, b in zip(runs["torch"], runs["triton"]):
        assert a.response_token_ids == b.response_token_ids
        assert max(abs(x - y) for x, y in zip(a.response_logprobs, b.response_logprobs)) < 1e-4
