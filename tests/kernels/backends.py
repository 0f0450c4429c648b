"""The engine on the torch path and on the Triton backend (the interpreter on the CPU), one workload."""

from __future__ import annotations

import os
import random

import pytest
import torch

from rollout_cli import Engine

# the engine-level interpreter tests; their GPU variants live in tests/e2e/test_gpu_*.py
interpreter_only = pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                                      reason="CPU interpreter variant; the GPU variant lives in tests/e2e/")


def prompts_with_shared_prefix(seed: int, prefix_len: int, count: int, longest_tail: int) -> list[list[int]]:
    """`count` prompts of one random prefix and a random tail of 1..longest_tail tokens (ids < 300)."""
    rng = random.Random(seed)
    shared = [rng.randrange(300) for _ in range(prefix_len)]
    return [shared + [rng.randrange(300) for _ in range(rng.randint(1, longest_tail))] for _ in range(count)]


def generate_on_both_backends(model_dir: str, prompts, params, prepare=None, **options):
    """-> ({"torch": trajectories, "triton": trajectories}, the Triton engine); prepare(engine) runs
    on each engine before it generates."""
    runs = {}
    for backend in ("torch", "triton"):
        engine = Engine(model_dir, device="cpu", attention_backend=backend, **options)
        if prepare is not None:
            prepare(engine)
        runs[backend] = engine.generate(prompts, params)
    assert engine.runner.attention_backend == "triton"
    return runs, engine


def assert_same_samples(runs: dict, logprob_tol: float = 1e-4) -> None:
    """Both backends gave the same tokens, and logprobs within logprob_tol."""
    assert len(runs["torch"]) == len(runs["triton"])
    for a, b in zip(runs["torch"], runs["triton"]):
        assert a.response_token_ids == b.response_token_ids
        assert max(abs(x - y) for x, y in zip(a.response_logprobs, b.response_logprobs)) < logprob_tol
