"""Hybrid linear-attention models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) against HF transformers' torch fallback
(CPU, float32): greedy tokens exact, logprobs to 1e-4, through chunked prefill (state carried across
steps), n samples forking one prompt snapshot, preemption, and the cache-split start-up checks."""

from __future__ import annotations

import pytest
import torch

from rollout_cli import SamplingParams
from rollout_cli.errors import RolloutError

from parity import TOL, assert_matches_hf, make_engine, prompts_of

GREEDY = dict(temperature=0.0, ignore_eos=True)
HYBRID_ARCHS = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]


@pytest.fixture(params=HYBRID_ARCHS)
def hybrid_arch(request, tiny_hybrid_checkpoints) -> tuple[str, str]:
    return request.param, tiny_hybrid_checkpoints[request.param]


def test_layer_structure_and_pools_follow_config(tiny_hybrid_checkpoints):
    from rollout_cli.models.gated_deltanet import GatedDeltaNet
    from rollout_cli.models.moe import SparseMoeBlock

    expected = {  # arch: (linear layers, full layers, sparse layers)
        "qwen3_next": ([0, 2], [1], [0, 2]),
        "qwen3_5": ([0], [1], []),
        "qwen3_5_moe": ([0], [1], [0, 1]),
    }
    for name, (linear, full, sparse) in expected.items():
        engine = make_engine(tiny_hybrid_checkpoints[name])
        layers = engine.model.model.layers
        assert [i for i, layer in enumerate(layers) if isinstance(layer.linear_attn, GatedDeltaNet)] == linear
        assert [i for i, layer in enumerate(layers) if layer.self_attn is not None] == full
        assert [i for i, layer in enumerate(layers) if isinstance(layer.mlp, SparseMoeBlock)] == sparse
        assert engine.model.moe_layers == sparse
        assert engine.kv.k.shape[0] == len(full)  # KV only for full-attention layers
        states = engine.linear_states
        # [layers, slots, conv channels 2 * (2 key heads * 16) + 4 value heads * 16, kernel 4 - 1 inputs]
        conv = states.conv
        assert (conv.shape[0], conv.shape[2], conv.shape[3]) == (len(linear), 128, 3) and conv.dtype == torch.float32
        assert states.ssm.shape[0] == len(linear) and states.ssm.shape[2:] == (4, 16, 16)
        assert states.num_slots == engine.scheduler.linear.num_slots == 2 * 16 + 1  # max_running 16


def test_chunked_prefill_matches_hf(hybrid_arch, hf_ref):
    _, model_dir = hybrid_arch
    prompts = prompts_of([1, 9, 17, 40], seed=2)  # 17 and 40 > max_batch_tokens: prefill over several steps
    engine = make_engine(model_dir, max_batch_tokens=16)
    results = engine.generate(prompts, SamplingParams(max_new_tokens=16, **GREEDY))
    assert_matches_hf(hf_ref, model_dir, results, prompts, 16)
    assert len(set(results[3].response_token_ids)) >= 6  # random weights give varied text


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_n_samples_fork_the_prompt_state(tiny_hybrid_checkpoints, hf_ref, name):
    model_dir = tiny_hybrid_checkpoints[name]
    system = prompts_of([20], seed=4)[0]
    prompts = [system + tail for tail in prompts_of([3, 7, 1, 12], seed=5)]
    params = SamplingParams(n=4, max_new_tokens=10, **GREEDY)
    engine = make_engine(model_dir, max_batch_tokens=16)
    with_cache = engine.generate(prompts, params)
    stats = engine.scheduler.stats
    # 3 of 4 samples per prompt fork the state after len(prompt) - 1 tokens: 3 * 4 * (len - 1) of 16 * len
    assert stats.cached_prompt_tokens == sum(3 * (len(p) - 1) for p in prompts)
    assert stats.prefix_hit_rate > 0.6
    assert_matches_hf(hf_ref, model_dir, with_cache, prompts, 10, n=4)
    plain = make_engine(model_dir, max_batch_tokens=16, enable_prefix_cache=False)
    without = plain.generate(prompts, params)
    for a, b in zip(with_cache, without):
        assert a.response_token_ids == b.response_token_ids
        assert a.response_logprobs == pytest.approx(b.response_logprobs, abs=TOL)



def test_later_call_reuses_snapshots_and_a_flush_drops_them(tiny_hybrid_checkpoints, hf_ref):
    model_dir = tiny_hybrid_checkpoints["qwen3_next"]
    prompts = prompts_of([13, 22], seed=8)
    params = SamplingParams(n=3, max_new_tokens=8, **GREEDY)
    engine = make_engine(model_dir, max_batch_tokens=16)
    engine.generate(prompts, params)
    stats = engine.scheduler.stats
    before = stats.cached_prompt_tokens
    again = engine.generate(prompts, params)
    assert stats.cached_prompt_tokens - before == sum(3 * (len(p) - 1) for p in prompts)  # every sample forks
    assert_matches_hf(hf_ref, model_dir, again, prompts, 8, n=3)
    engine.flush_cache()  # rollout flush-cache / reload-weights: the KV goes, and the states with it
    assert not engine.scheduler.linear.snapshots
    before = stats.cached_prompt_tokens
    flushed = engine.generate(prompts, params)
    assert stats.cached_prompt_tokens - before == sum(2 * (len(p) - 1) for p in prompts)  # first sample recomputes
    assert_matches_hf(hf_ref, model_dir, flushed, prompts, 8, n=3)


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_preemption_recomputes_exactly(tiny_hybrid_checkpoints, hf_ref, prefix_cache):
    model_dir = tiny_hybrid_checkpoints["qwen3_next"]
    prompts = prompts_of([20, 14, 25, 11], seed=3)
    # each sample needs ~40 KV slots; 64 cannot hold the 8 samples: the scheduler must preempt
    engine = make_engine(model_dir, max_model_len=64, kv_cache_tokens=65, max_batch_tokens=32,
                         enable_prefix_cache=prefix_cache)
    results = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=20, **GREEDY))
    sched = engine.scheduler
    assert sched.stats.preemptions > 0
    assert_matches_hf(hf_ref, model_dir, results, prompts, 20, n=2)
    cached = sched.cache.total_size if sched.cache else 0
    assert sched.allocator.num_free + cached == engine.num_kv_slots - 1
    linear = sched.linear
    assert linear.allocator.num_free + len(linear.snapshots) == linear.num_slots - 1


def test_routing_capture_equals_hf_router(tiny_hybrid_checkpoints, hf_ref):
    model_dir = tiny_hybrid_checkpoints["qwen3_next"]
    prompt = prompts_of([13], seed=7)[0]
    engine = make_engine(model_dir, max_batch_tokens=8)
    engine.enable_routing_capture()
    traj = engine.generate([prompt], SamplingParams(max_new_tokens=6, **GREEDY))[0]
    ids = torch.tensor([prompt + traj.response_token_ids[:-1]])
    with torch.no_grad():
        router_logits = hf_ref.model(model_dir)(ids, output_router_logits=True).router_logits
    got = torch.as_tensor(traj.routed_experts).long()  # [positions, moe layers, top_k]
    assert got.shape == (ids.shape[1], 2, 2)
    for layer, logits in enumerate(router_logits):
        want = torch.topk(logits.float().softmax(-1), 2, dim=-1).indices
        assert torch.equal(got[:, layer].sort(-1).values, want.sort(-1).values), layer


def test_cache_split_refuses_pools_too_small_at_start(tiny_hybrid_checkpoints):
    model_dir = tiny_hybrid_checkpoints["qwen3_5"]
    with pytest.raises(RolloutError, match=r"linear-state pool gets .* MiB .*raise --linear-state-memory-ratio"):
        make_engine(model_dir, linear_state_memory_ratio=1e-9)
    with pytest.raises(RolloutError, match=r"KV cache holds 100 tokens .*--max-model-len 128"):
        make_engine(model_dir, kv_cache_tokens=101)
    with pytest.raises(RolloutError, match=r"--linear-state-memory-ratio must be in \(0, 1\)"):
        make_engine(model_dir, linear_state_memory_ratio=1.0)
