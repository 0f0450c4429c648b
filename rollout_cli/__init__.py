"""rollout: a batch rollout engine for reinforcement learning on language models."""

from rollout_cli.engine.engine import Engine, PromptInput, Trajectory
from rollout_cli.engine.sampling_params import SamplingParams

__all__ = ["Engine", "PromptInput", "SamplingParams", "Trajectory"]
