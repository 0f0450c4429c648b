"""Helpers shared by the HF-parity test files (dense and MoE)."""

from __future__ import annotations

import random

import pytest

from rollout_cli import Engine

TOL = 1e-4  # logprob tolerance against HF in float32


def make_engine(model_dir: str, **options) -> Engine:
    options.setdefault("max_model_len", 128)
    options.setdefault("max_running", 16)
    return Engine(model=model_dir, device="cpu", dtype="float32", **options)


def prompts_of(lengths, seed=0, vocab=300):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def assert_matches_hf(hf_ref, model_dir, results, prompts, max_new_tokens, n=1):
    """Greedy tokens equal HF generate; logprobs within TOL of HF's teacher-forced log_softmax."""
    assert len(results) == len(prompts) * n
    for traj in results:
        prompt = prompts[traj.prompt_index]
        assert traj.prompt_token_ids == prompt
        want = hf_ref.greedy(model_dir, prompt, max_new_tokens)
        assert traj.response_token_ids == want, (traj.prompt_index, traj.sample_index)
        assert traj.finish_reason == "length"
        assert traj.response_logprobs == pytest.approx(hf_ref.logprobs(model_dir, prompt, want), abs=TOL)
