"""rollout bench's roofline: the matmul parameters a decode token goes through, and the least time
of the decode steps when each step's matmuls are bound by either bandwidth or FLOP/s."""

from __future__ import annotations

import pytest

from rollout_cli import Engine
from rollout_cli.bench_limits import active_matmul_params, roofline_seconds, speculation_bound


def _attention_params(c) -> int:
    heads, kv, hd, h = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size
    return h * heads * hd + 2 * h * kv * hd + heads * hd * h  # q, k, v, o


def test_dense_counts_every_matmul_and_the_tied_head(tiny_checkpoints):
    engine = Engine(tiny_checkpoints["qwen3"], device="cpu", max_model_len=64, kv_cache_tokens=256)
    c = engine.hf_config
    per_layer = _attention_params(c) + 3 * c.hidden_size * c.intermediate_size
    assert c.tie_word_embeddings
    assert active_matmul_params(engine.model) == c.num_hidden_layers * per_layer + c.vocab_size * c.hidden_size


def test_moe_counts_the_routed_share_of_the_experts(tiny_moe_checkpoints):
    engine = Engine(tiny_moe_checkpoints["qwen3_moe"], device="cpu", max_model_len=64, kv_cache_tokens=256)
    c = engine.hf_config  # 3 layers, layer 1 dense; 8 experts, top 2; tied head
    h = c.hidden_size
    sparse = _attention_params(c) + c.num_experts * h + c.num_experts_per_tok * 3 * h * c.moe_intermediate_size
    dense = _attention_params(c) + 3 * h * c.intermediate_size
    assert active_matmul_params(engine.model) == 2 * sparse + dense + c.vocab_size * h


def test_roofline_takes_the_slower_bound_of_each_steps_matmuls():
    common = dict(weight_bytes=10**9, matmul_params=10**8, other_bytes=10**9, hbm_bytes_per_s=1e12, flops_per_s=1e14)
    # 1 token a step: reading the weights (1 ms) beats 2e8 FLOP (2 us); plus 1 ms of KV reads
    assert roofline_seconds(steps=10, tokens=10, **common) == pytest.approx(10 * 1e-3 + 1e-3)
    # 1,000 tokens a step: 2e11 FLOP take 2 ms, longer than the 1 ms weight read
    assert roofline_seconds(steps=10, tokens=10_000, **common) == pytest.approx(10 * 2e-3 + 1e-3)


def test_fp8_weights_run_their_matmuls_at_the_e4m3_rate(tiny_checkpoints):
    """--quantization fp8: the e4m3 layers' share of the params is counted apart (the LM head / tied
    embedding stays in --dtype) and its FLOPs take the e4m3 rate."""
    import torch
    engine = Engine(tiny_checkpoints["qwen3"], device="cpu", max_model_len=64, kv_cache_tokens=256, quantization="fp8")
    c = engine.hf_config
    total = active_matmul_params(engine.model)
    fp8 = active_matmul_params(engine.model, torch.float8_e4m3fn)
    assert total - fp8 == c.vocab_size * c.hidden_size  # the tied head, in --dtype
    assert fp8 == c.num_hidden_layers * (_attention_params(c) + 3 * c.hidden_size * c.intermediate_size)
    common = dict(weight_bytes=10**6, matmul_params=3 * 10**8, other_bytes=0, hbm_bytes_per_s=1e12, flops_per_s=1e14)
    # 1,000 tokens a step, 10 steps: 1e8 params at 1e14 and 2e8 e4m3 params at 2e14 -> 2 ms + 2 ms a step
    assert roofline_seconds(steps=10, tokens=10_000, fp8_params=2 * 10**8, fp8_flops_per_s=2e14,
                            **common) == pytest.approx(10 * 4e-3)
    assert roofline_seconds(steps=10, tokens=10_000, **common) == pytest.approx(10 * 6e-3)


def test_a_prefix_shared_through_the_cache_counts_once_per_step():
    """distinct_context_tokens: the owner of a cached prompt and two samples reading 10 of its slots from
    the cache, a third sample that cached only 6 (the group's prefix is the least shared), a sample of
    the same prompt in other slots (recomputed), and a stranger: the groups shared-prefix attention reads."""
    from types import SimpleNamespace

    from rollout_cli.engine.execution.model_runner import distinct_context_tokens

    def decode(prompt, cached, context, first_slot=None):
        first = prompt * 1000 if first_slot is None else first_slot
        request = SimpleNamespace(prompt_index=prompt, slots=list(range(first, first + context)),
                                  num_cached_tokens=cached)
        return SimpleNamespace(request=request, start=context - 1)

    group = [decode(5, 0, 14), decode(5, 10, 12), decode(5, 10, 15)]
    assert distinct_context_tokens(group) == 14 + 12 + 15 - 2 * 10
    assert distinct_context_tokens(group + [decode(5, 6, 9)]) == 14 + 12 + 15 + 9 - 3 * 6
    assert distinct_context_tokens(group + [decode(99, 0, 7)]) == 14 + 12 + 15 - 2 * 10 + 7
    assert distinct_context_tokens(group + [decode(5, 0, 20, first_slot=77_000)]) == 14 + 12 + 15 - 2 * 10 + 20
    assert distinct_context_tokens([decode(5, 0, 14), decode(6, 0, 3)]) == 17  # nothing shared


def test_speculation_bound_is_amdahls_law_over_the_plain_run():
    """A plain run of 10 s with 6 s of decode steps, drafts accepting 3 tokens a step: 6 s -> 2 s, at most 10 / 6."""
    plain = {"seconds": 10.0, "decode_seconds": 6.0}
    assert speculation_bound(plain, 3.0) == pytest.approx(10.0 / 6.0)
    assert speculation_bound(plain, 1.0) == pytest.approx(1.0)  # nothing accepted: nothing to gain
    assert speculation_bound(plain, None) is None  # no verify step ran
    assert speculation_bound({"seconds": 10.0, "decode_seconds": 0.0}, 3.0) is None  # no graph-replayed decode step
