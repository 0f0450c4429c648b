"""rollout_cli.training on the Triton kernels (the GPU's trainer forward), under the interpreter on
the CPU: its logprobs equal a --deterministic rollout's on the Triton backend bit for bit, and the
straight-through gradient (torch's forward of the same sequence) reaches every layer."""

from __future__ import annotations

import random

import pytest
import torch

from backends import interpreter_only
from rollout_cli import Engine, PromptInput, SamplingParams
from rollout_cli.errors import RolloutError
from rollout_cli.training import Policy

_rng = random.Random(12)
PROMPTS = [[_rng.randrange(300) for _ in range(n)] for n in (5, 11)]

pytestmark = [interpreter_only, pytest.mark.usefixtures("module_row_invariant_dot")]


def _rollout(model_dir, params):
    engine = Engine(model=model_dir, device="cpu", dtype="float32", attention_backend="triton", max_model_len=64,
                    max_batch_tokens=6, deterministic=True)  # chunked prefill, batched decode
    inputs = [PromptInput(i, p) for i, p in enumerate(PROMPTS)]
    return sorted(engine.stream(inputs, params), key=lambda t: (t.prompt_index, t.sample_index))


@pytest.mark.parametrize("params", [SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=4),
                                    SamplingParams(n=1, max_new_tokens=6, temperature=0.9, top_p=0.8, top_k=15,
                                                   seed=4)], ids=["t1", "filtered"])
def test_trainer_logprobs_equal_the_triton_rollout_bit_for_bit(sampling_checkpoint, params):
    policy = Policy(sampling_checkpoint, dtype="float32", kernels="triton")
    trajectories = _rollout(sampling_checkpoint, params)
    responses = [t.response_token_ids for t in trajectories if t.prompt_index == 0]
    group = policy.group_logprobs(PROMPTS[0], responses, params.temperature, top_k=params.top_k,
                                  top_p=params.top_p, min_p=params.min_p)
    for t in trajectories:
        if t.prompt_index == 0:
            got = group[t.sample_index]
        else:
            got = policy.response_logprobs(t.prompt_token_ids, t.response_token_ids, params.temperature,
                                           top_k=params.top_k, top_p=params.top_p, min_p=params.min_p)
        assert got.requires_grad
        assert got.tolist() == t.response_logprobs, (t.prompt_index, t.sample_index)


def test_the_straight_through_gradient_reaches_every_layer(sampling_checkpoint):
    policy = Policy(sampling_checkpoint, dtype="float32", kernels="triton")
    exact = policy.response_logprobs(PROMPTS[0], [7, 8, 9])
    exact.sum().backward()
    named = dict(policy.model.named_parameters())
    assert sum(1 for p in named.values() if p.grad is not None and float(p.grad.abs().sum()) > 0) >= len(named) - 1
    # the gradient is the torch forward's, whose values agree with the kernels' to float32 noise
    torch_values = Policy(sampling_checkpoint, dtype="float32", kernels="torch").response_logprobs(PROMPTS[0], [7, 8, 9])
    torch.testing.assert_close(exact.detach(), torch_values.detach(), atol=1e-4, rtol=0)


def test_hybrid_trainer_logprobs_equal_the_triton_rollout(tiny_hybrid_checkpoints):
    """Gated DeltaNet layers: the values from the recurrent prefill over a private state pool, the
    gradient from the functional torch forward (SequenceLinear), which agrees to float32 noise."""
    model_dir = tiny_hybrid_checkpoints["qwen3_next"]
    params = SamplingParams(n=2, max_new_tokens=5, temperature=1.0, seed=3)
    policy = Policy(model_dir, dtype="float32", kernels="triton")
    trajectories = _rollout(model_dir, params)
    for t in trajectories:
        got = policy.response_logprobs(t.prompt_token_ids, t.response_token_ids, params.temperature)
        assert got.tolist() == t.response_logprobs, (t.prompt_index, t.sample_index)
    # a group's responses packed in one forward (each from its own state slot): the same bits
    group = [t for t in trajectories if t.prompt_index == 1]
    packed = policy.group_logprobs(PROMPTS[1], [t.response_token_ids for t in group], params.temperature)
    assert [p.tolist() for p in packed] == [t.response_logprobs for t in group]
    # the gradient path's own values: the same model to float32 noise (a misaligned conv would not be)
    tokens = t.prompt_token_ids + t.response_token_ids
    n, start = len(tokens) - 1, len(t.prompt_token_ids) - 1
    settings = policy._settings(len(t.response_token_ids), dict(temperature=1.0, raw=False, top_k=0, top_p=1.0,
                                                                 min_p=0.0))
    torch_values = policy.torch_logprobs(torch.tensor(tokens[:n]), torch.arange(n), torch.arange(start, n),
                                         torch.tensor(t.response_token_ids), settings)
    torch.testing.assert_close(torch_values.detach(), got.detach(), atol=1e-4, rtol=0)
    got.sum().backward()
    gdn = dict(policy.model.named_parameters())
    moved = [name for name, p in gdn.items() if "linear_attn" in name and p.grad is not None and p.grad.abs().sum() > 0]
    assert any("conv1d" in name for name in moved) and any("A_log" in name for name in moved)


def test_hybrid_models_need_the_triton_kernels(tiny_hybrid_checkpoints):
    with pytest.raises(RolloutError, match="hybrid"):
        Policy(tiny_hybrid_checkpoints["qwen3_next"], kernels="torch")


def test_a_group_too_big_for_one_pack_is_split_and_keeps_its_bits(sampling_checkpoint, monkeypatch):
    """Packs hold at most PACKED_ROWS scored rows (the logits' memory): a group split over several
    packs (and a response longer than a pack, alone in its own) gives each response the same values, in
    the order given, and a gradient to every one."""
    import rollout_cli.training as training

    policy = Policy(sampling_checkpoint, dtype="float32", kernels="triton")
    responses = [[7, 8, 9, 10], [11], [12, 13, 14, 15, 16, 17, 18], [19, 20]]
    whole = [v.tolist() for v in policy.group_logprobs(PROMPTS[0], responses)]
    monkeypatch.setattr(training, "PACKED_ROWS", 5)
    split = policy.group_logprobs(PROMPTS[0], responses)
    assert [v.tolist() for v in split] == whole and [len(v) for v in split] == [4, 1, 7, 2]
    torch.stack([v.sum() for v in split]).sum().backward()
    assert any(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in policy.model.parameters())
