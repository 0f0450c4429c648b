"""rollout: a batch rollout engine for reinforcement learning on language models.

The public names load lazily, so `rollout --help` and flag errors do not wait for torch.
"""

from __future__ import annotations

__all__ = ["Engine", "PromptInput", "SamplingParams", "Trajectory"]


def __getattr__(name: str):
    if name in ("Engine", "PromptInput", "Trajectory"):
        from rollout_cli.engine import engine

        return getattr(engine, name)
    if name == "SamplingParams":
        from rollout_cli.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'rollout_cli' has no attribute {name!r}")
