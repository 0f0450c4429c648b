"""MoE models on CUDA with the Triton backend: fused MoE kernels inside CUDA graphs, routing capture
from graph replays, against HF and against eager steps (GPU only)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from rollout_cli import Engine, SamplingParams

pytestmark = pytest.mark.gpu


def _prompts(vocab: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(3, 40))] for _ in range(count)]


def _engine(model_dir: str, **options) -> Engine:
    options.setdefault("max_model_len", 128)
    options.setdefault("max_running", 16)
    return Engine(model_dir, device="cuda", attention_backend="triton", **options)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])  # qwen2_moe: shared expert, as in test_engine_triton_moe.py
def test_moe_graphs_match_hf_tokens_and_router_in_float32(tiny_moe_checkpoints, hf_ref, name):
    model_dir = tiny_moe_checkpoints[name]
    engine = _engine(model_dir, dtype="float32", max_batch_tokens=32)
    assert engine.runner.graphs is not None and engine.runner.graphs.routing is not None
    engine.enable_routing_capture()
    prompts = _prompts(engine.hf_config.vocab_size, 4, seed=1)
    results = engine.generate(prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=8))
    hf = hf_ref.model(model_dir)
    top_k = engine.model.top_k
    for traj in results:
        prompt = prompts[traj.prompt_index]
        assert traj.response_token_ids == hf_ref.greedy(model_dir, prompt, 8), name
        seq = traj.prompt_token_ids + traj.response_token_ids[:-1]
        with torch.no_grad():
            router_logits = hf(torch.tensor([seq]), output_router_logits=True).router_logits
        for layer, logits in enumerate(router_logits):
            want = torch.topk(logits.float().softmax(-1), top_k, dim=-1).indices
            have = torch.from_numpy(traj.routed_experts[:, layer].astype(np.int64))
            assert torch.equal(have, want), (name, traj.prompt_index, layer)  # decode rows came from graphs


def test_moe_graph_replay_equals_eager_with_routing_bfloat16(tiny_moe_checkpoints):
    # 8 prompts, equal output lengths: every decode step has batch 8, a graph bucket, so eager and
    # replayed steps run the same kernels on the same shapes
    model_dir = tiny_moe_checkpoints["qwen3_moe"]
    params = SamplingParams(n=1, temperature=1.0, seed=5, max_new_tokens=16, ignore_eos=True)
    outputs = []
    for graphs, capture in ((True, True), (False, True), (True, False)):
        engine = _engine(model_dir, dtype="bfloat16", cuda_graphs=graphs)
        assert (engine.runner.graphs is not None) == graphs
        if capture:
            engine.enable_routing_capture()
        prompts = _prompts(engine.hf_config.vocab_size, 8, seed=2)
        outputs.append(engine.generate(prompts, params))
    replayed, eager, no_capture = outputs
    for a, b, c in zip(replayed, eager, no_capture):
        assert a.response_token_ids == b.response_token_ids == c.response_token_ids
        assert a.response_logprobs == b.response_logprobs
        assert np.array_equal(a.routed_experts, b.routed_experts)
        assert a.routed_experts.shape[0] == len(a.prompt_token_ids) + len(a.response_token_ids) - 1
