"""Hybrid linear-attention models on the Triton backend under the interpreter on the CPU: gated attention
over the Triton attention batch, the Triton conv and delta-rule kernels (decode and chunked prefill), the
gating, gated RMSNorm and zero-centred RMSNorm kernels, the fused MoE; same greedy tokens and logprobs
as the torch path, through chunked prefill, n samples forking the prompt's state snapshot, and decode.
(CUDA graphs: tests/e2e/test_gpu_hybrid.py.)"""

from __future__ import annotations

import pytest

from backends import assert_same_samples, generate_on_both_backends, interpreter_only, prompts_with_shared_prefix
from rollout_cli import Engine, SamplingParams
from rollout_cli.models.gated_deltanet import GatedDeltaNet
from rollout_cli.models.layers import RotaryEmbedding
from rollout_cli.models.norms import GatedRMSNorm, ZeroCentredRMSNorm


@interpreter_only
@pytest.mark.parametrize("name, kv_cache_dtype", [("qwen3_next", "auto"), ("qwen3_5", "auto"), ("qwen3_next", "fp8")])
def test_triton_backend_matches_torch_backend_on_hybrids(tiny_hybrid_checkpoints, name, kv_cache_dtype):
    """fp8: the gated full-attention layers' e4m3 pool written and read by the Triton kernels as the
    torch path does."""
    model_dir = tiny_hybrid_checkpoints[name]
    # 10 + up to 11 tokens > max_batch_tokens 8: prefill chunks carry the state across steps
    prompts = prompts_with_shared_prefix(seed=2, prefix_len=10, count=2, longest_tail=11) + [[7]]
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=4)
    runs, engine = generate_on_both_backends(model_dir, prompts, params, dtype="float32", max_model_len=64,
                                             max_batch_tokens=8, max_running=8, kv_cache_dtype=kv_cache_dtype)
    assert engine.kv.is_fp8 == (kv_cache_dtype == "fp8")
    assert all(m.use_triton for m in engine.model.modules() if isinstance(m, RotaryEmbedding))
    # the gating and the output norm (kernels/gdn_gating_norm.py), the (1 + w) norms (kernels/rmsnorm.py)
    hybrid_parts = [m for m in engine.model.modules() if isinstance(m, (GatedDeltaNet, GatedRMSNorm, ZeroCentredRMSNorm))]
    assert hybrid_parts and all(m.use_triton for m in hybrid_parts)
    assert engine.scheduler.stats.prefix_hit_rate > 0  # the second samples forked the prompt snapshot
    assert_same_samples(runs)


def test_auto_backend_keeps_hybrids_on_torch_on_the_cpu(tiny_hybrid_checkpoints):
    engine = Engine(tiny_hybrid_checkpoints["qwen3_5"], device="cpu", max_model_len=64, max_running=4)
    assert engine.attention_backend == "torch" and engine.runner.graphs is None
