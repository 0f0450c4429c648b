"""--shared-prefix-attention under the interpreter on the CPU: the samples of a prompt read its KV once
per decode step (kernels/shared_prefix_decode_attention.py), and sample the same tokens with the same
logprobs (float32, up to summation order) as with the plain decode kernel. The GPU variant, with CUDA
graphs: tests/e2e/test_gpu_engine.py."""

from __future__ import annotations

import random

import pytest

from backends import interpreter_only
from rollout_cli import Engine, PromptInput, SamplingParams
import rollout_cli.engine.execution.triton_attention as triton_attention

pytestmark = [interpreter_only]

_rng = random.Random(8)
PROMPTS = [[_rng.randrange(300) for _ in range(n)] for n in (41, 5, 36)]  # 5 tokens: too short to share
PARAMS = SamplingParams(n=3, max_new_tokens=5, temperature=1.0, seed=21)


def _samples(model_dir, shared_prefix_attention):
    engine = Engine(model_dir, device="cpu", dtype="float32", attention_backend="triton", max_model_len=64,
                    shared_prefix_attention=shared_prefix_attention)
    out = engine.stream([PromptInput(i, p) for i, p in enumerate(PROMPTS)], PARAMS)
    return {(t.prompt_index, t.sample_index): t for t in out}


@pytest.mark.parametrize("model", ["qwen3", "qwen3_next"])
def test_samples_read_their_prompt_once_and_sample_the_same(model, sampling_checkpoint, tiny_hybrid_checkpoints,
                                                            monkeypatch):
    """Dense, and the hybrid (its attention layers take the groups; its linear layers' states are forked
    from the prompt's snapshot as before)."""
    model_dir = sampling_checkpoint if model == "qwen3" else tiny_hybrid_checkpoints[model]
    groups, real = [], triton_attention.shared_prefix_decode_attention

    def spy(*args, **kwargs):
        groups.append(args[7].tolist())  # prefix_lens of the step's groups
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_attention, "shared_prefix_decode_attention", spy)
    plain = _samples(model_dir, False)
    assert not groups  # off: the plain kernel only
    shared = _samples(model_dir, True)
    # both long prompts' samples grouped (prefix = the cached prompt), the short one's alone (prefix 0)
    assert any(len([p for p in step if p >= 32]) == 2 and step[-1] == 0 for step in groups), groups
    assert shared.keys() == plain.keys() and len(plain) == 9
    for key, trajectory in plain.items():
        assert shared[key].response_token_ids == trajectory.response_token_ids, key
        gaps = [abs(a - b) for a, b in zip(shared[key].response_logprobs, trajectory.response_logprobs, strict=True)]
        assert max(gaps) < 1e-4, (key, gaps)
