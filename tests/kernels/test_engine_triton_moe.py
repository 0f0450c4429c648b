"""MoE models with the Triton kernels in the forward (fused MoE included), under the interpreter on the CPU.

Same greedy tokens, logprobs and captured expert ids as the torch path, through chunked prefill,
prefix sharing and decode. (The GPU variant, with CUDA graphs, is in tests/e2e/test_gpu_engine.py.)
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from rollout_cli import Engine, SamplingParams
from rollout_cli.models.moe import FusedExperts, TopKRouter


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU interpreter variant; the GPU variant lives in tests/e2e/test_gpu_engine.py")
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_triton_moe_matches_torch_path_with_routing(tiny_moe_checkpoints, name):
    model_dir = tiny_moe_checkpoints[name]
    rng = random.Random(1)
    shared = [rng.randrange(300) for _ in range(12)]
    prompts = [shared + [rng.randrange(300) for _ in range(rng.randint(1, 9))] for _ in range(2)]
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=4)
    runs = {}
    for backend in ("torch", "triton"):
        engine = Engine(model_dir, device="cpu", attention_backend=backend, max_model_len=64, max_batch_tokens=16)
        engine.enable_routing_capture()
        runs[backend] = engine.generate(prompts, params)
    experts = [m for m in engine.model.modules() if isinstance(m, (TopKRouter, FusedExperts))]
    assert experts and all(m.use_triton for m in experts)
    assert engine.scheduler.stats.prefix_hit_rate > 0
    for a, b in zip(runs["torch"], runs["triton"]):
        assert a.response_token_ids == b.response_token_ids
        assert max(abs(x - y) for x, y in zip(a.response_logprobs, b.response_logprobs)) < 1e-4
        assert a.routed_experts.shape == b.routed_experts.shape
        assert np.array_equal(a.routed_experts, b.routed_experts)
