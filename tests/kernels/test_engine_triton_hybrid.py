"""Hybrid linear-attention models on the Triton backend under the interpreter on the CPU: gated attention
over the Triton attention batch, the Triton conv and delta-rule kernels (decode and chunked prefill), the
fused MoE; same greedy tokens and logprobs as the torch path, through chunked prefill, n samples forking
the prompt's state snapshot, and decode. (CUDA graphs: tests/e2e/test_gpu_hybrid.py.)"""

from __future__ import annotations

import os
import random

import pytest
import torch

from rollout_cli import Engine, SamplingParams
from rollout_cli.models.layers import RotaryEmbedding

pytestmark = pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU interpreter variant; the GPU variant is tests/e2e/test_gpu_hybrid.py")


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_triton_backend_matches_torch_backend_on_hybrids(tiny_hybrid_checkpoints, name):
    model_dir = tiny_hybrid_checkpoints[name]
    rng = random.Random(2)
    shared = [rng.randrange(300) for _ in range(10)]
    # 10 + up to 11 tokens > max_batch_tokens 8: prefill chunks carry the state across steps
    prompts = [shared + [rng.randrange(300) for _ in range(rng.randint(1, 11))] for _ in range(2)] + [[7]]
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=4)
    runs = {}
    for backend in ("torch", "triton"):
        engine = Engine(model_dir, device="cpu", dtype="float32", attention_backend=backend, max_model_len=64,
                        max_batch_tokens=8, max_running=8)
        runs[backend] = engine.generate(prompts, params)
    assert engine.runner.attention_backend == "triton"
    assert all(m.use_triton for m in engine.model.modules() if isinstance(m, RotaryEmbedding))
    assert engine.scheduler.stats.prefix_hit_rate > 0  # the second samples forked the prompt snapshot
    for a, b in zip(runs["torch"], runs["triton"]):
        assert a.response_token_ids == b.response_token_ids
        assert max(abs(x - y) for x, y in zip(a.response_logprobs, b.response_logprobs)) < 1e-4


def test_auto_backend_keeps_hybrids_on_torch_on_the_cpu(tiny_hybrid_checkpoints):
    engine = Engine(tiny_hybrid_checkpoints["qwen3_5"], device="cpu", max_model_len=64, max_running=4)
    assert engine.attention_backend == "torch" and engine.runner.graphs is None
