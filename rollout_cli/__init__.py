"""rollout: a batch rollout engine for reinforcement learning on language models.

The public names load lazily, so `rollout --help` and flag errors do not wait for torch.
"""

from __future__ import annotations

__all__ = ["Engine", "PartialSample", "PromptInput", "SamplingParams", "Trajectory"]


def __getattr__(name: str):
    if name == "Engine":
        from rollout_cli.engine.engine import Engine  # lazy: torch and the model code

        return Engine
    if name in ("PartialSample", "PromptInput", "Trajectory"):  # plain dataclasses: no torch to wait for
        from rollout_cli.engine import trajectory  # lazy, as the others

        return getattr(trajectory, name)
    if name == "SamplingParams":
        from rollout_cli.engine.sampling_params import SamplingParams  # lazy, as the others

        return SamplingParams
    raise AttributeError(f"module 'rollout_cli' has no attribute {name!r}")
