"""MoE models with the Triton kernels in the forward (fused MoE included), under the interpreter on the CPU.

Same greedy tokens, logprobs and captured expert ids as the torch path, through chunked prefill,
prefix sharing and decode. (The GPU variant, with CUDA graphs, is in tests/e2e/test_gpu_engine.py.)
"""

from __future__ import annotations

import numpy as np
import pytest

from backends import assert_same_samples, generate_on_both_backends, interpreter_only, prompts_with_shared_prefix
from rollout_cli import Engine, SamplingParams
from rollout_cli.models.moe import FusedExperts, TopKRouter


@interpreter_only
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_triton_moe_matches_torch_path_with_routing(tiny_moe_checkpoints, name):
    model_dir = tiny_moe_checkpoints[name]
    prompts = prompts_with_shared_prefix(seed=1, prefix_len=12, count=2, longest_tail=9)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=4)
    runs, engine = generate_on_both_backends(model_dir, prompts, params, prepare=Engine.enable_routing_capture,
                                             max_model_len=64, max_batch_tokens=16)
    experts = [m for m in engine.model.modules() if isinstance(m, (TopKRouter, FusedExperts))]
    assert experts and all(m.use_triton for m in experts)
    assert engine.scheduler.stats.prefix_hit_rate > 0
    assert_same_samples(runs)
    for a, b in zip(runs["torch"], runs["triton"]):
        assert a.routed_experts.shape == b.routed_experts.shape
        assert np.array_equal(a.routed_experts, b.routed_experts)


@interpreter_only
def test_triton_fp8_moe_matches_the_torch_fp8_path(tiny_moe_checkpoints):
    """--quantization fp8 on the Triton backend: the W8A8 fused MoE kernel and the blockwise FP8
    GEMMs give the torch references' tokens and logprobs."""
    prompts = prompts_with_shared_prefix(seed=2, prefix_len=10, count=2, longest_tail=7)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=4)
    runs, engine = generate_on_both_backends(tiny_moe_checkpoints["qwen3_moe"], prompts, params,
                                             quantization="fp8", max_model_len=64, max_batch_tokens=16)
    experts = [m for m in engine.model.modules() if isinstance(m, FusedExperts)]
    assert experts and all(m.use_triton and m.fp8_block_rows for m in experts)
    assert_same_samples(runs)
