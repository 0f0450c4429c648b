"""rollout_cli.training: the trainer's forward gives a --deterministic rollout's logprobs bit for bit,
is differentiable, and saves checkpoints the engine loads as they were."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file

from rollout_cli import Engine, PromptInput, SamplingParams
from rollout_cli.training import Policy


def _prompts(lengths, seed=12):
    rng = random.Random(seed)
    return [[rng.randrange(300) for _ in range(n)] for n in lengths]


PROMPTS = _prompts([5, 11, 3])


def _rollout(model_dir, dtype, params, **options):
    engine = Engine(model=model_dir, device="cpu", dtype=dtype, max_model_len=64, deterministic=True, **options)
    inputs = [PromptInput(i, p) for i, p in enumerate(PROMPTS)]
    return sorted(engine.stream(inputs, params), key=lambda t: (t.prompt_index, t.sample_index))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("params", [SamplingParams(n=2, max_new_tokens=8, temperature=1.0, seed=4),
                                    SamplingParams(n=2, max_new_tokens=8, temperature=0.7, logprobs_mode="raw",
                                                   seed=4),
                                    SamplingParams(n=2, max_new_tokens=8, temperature=0.9, top_p=0.8, top_k=15,
                                                   min_p=0.01, seed=4)], ids=["t1", "t0.7-raw", "filtered"])
def test_trainer_logprobs_equal_the_rollout_bit_for_bit(sampling_checkpoint, dtype, params):
    trajectories = _rollout(sampling_checkpoint, dtype, params, max_batch_tokens=6)  # chunked, batched
    policy = Policy(sampling_checkpoint, dtype=dtype)
    for t in trajectories:
        got = policy.response_logprobs(t.prompt_token_ids, t.response_token_ids, params.temperature,
                                       params.logprobs_mode, top_k=params.top_k, top_p=params.top_p,
                                       min_p=params.min_p)
        assert got.requires_grad
        assert got.tolist() == t.response_logprobs, t.prompt_index


def test_moe_trainer_logprobs_equal_the_rollout(tiny_moe_checkpoints):
    model_dir = tiny_moe_checkpoints["qwen3_moe"]
    params = SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=1)
    policy = Policy(model_dir, dtype="bfloat16")
    for t in _rollout(model_dir, "bfloat16", params):
        assert policy.response_logprobs(t.prompt_token_ids, t.response_token_ids).tolist() == t.response_logprobs


def test_gradients_reach_every_layer(sampling_checkpoint):
    policy = Policy(sampling_checkpoint)
    logprobs = policy.response_logprobs(PROMPTS[0], [7, 8, 9])
    logprobs.sum().backward()
    named = dict(policy.model.named_parameters())
    assert all(p.grad is not None for p in named.values())
    assert sum(1 for p in named.values() if float(p.grad.abs().sum()) > 0) >= len(named) - 1


@pytest.mark.parametrize("kind,name", [("dense", "qwen3"), ("dense", "qwen2"), ("dense", "llama_bias"), ("moe", "qwen3_moe"),
                                       ("moe", "mixtral")])
def test_saved_checkpoint_holds_the_source_tensors(tiny_checkpoints, tiny_moe_checkpoints, tmp_path, kind, name):
    """Untrained, the exported tensors are the checkpoint's own, name for name and bit for bit."""
    model_dir = (tiny_checkpoints if kind == "dense" else tiny_moe_checkpoints)[name]
    policy = Policy(model_dir)
    policy.save_pretrained(str(tmp_path / "ckpt"))
    want = load_file(f"{model_dir}/model.safetensors")
    got = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


def test_a_trained_checkpoint_reloads_into_the_engine(sampling_checkpoint, tmp_path):
    """After an optimizer step, the engine on the saved checkpoint and the trainer agree bit for bit again."""
    policy = Policy(sampling_checkpoint)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)
    (-policy.response_logprobs(PROMPTS[1], [3, 4, 5, 6]).sum()).backward()
    optimizer.step()
    policy.save_pretrained(str(tmp_path / "ckpt_1"))
    params = SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=9)
    engine = Engine(model=sampling_checkpoint, device="cpu", dtype="float32", max_model_len=64, deterministic=True)
    before = sorted(engine.stream([PromptInput(0, PROMPTS[0])], params), key=lambda t: t.sample_index)
    assert engine.reload_weights(str(tmp_path / "ckpt_1")) == "1"
    after = sorted(engine.stream([PromptInput(0, PROMPTS[0])], params), key=lambda t: t.sample_index)
    assert [t.response_logprobs for t in after] != [t.response_logprobs for t in before]  # the step changed the policy
    for t in after:
        got = policy.response_logprobs(t.prompt_token_ids, t.response_token_ids, params.temperature)
        assert got.tolist() == t.response_logprobs


def test_a_group_shares_its_prompt_and_gives_the_same_bits(sampling_checkpoint):
    policy = Policy(sampling_checkpoint, dtype="bfloat16")
    responses = [[4, 5, 6], [4, 9], [11]]
    grouped = policy.group_logprobs(PROMPTS[1], responses, temperature=0.9)
    for response, got in zip(responses, grouped, strict=True):
        assert got.tolist() == policy.response_logprobs(PROMPTS[1], response, temperature=0.9).tolist()
