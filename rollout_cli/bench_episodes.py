"""`rollout bench --turns`: the synthetic environment that answers each model turn, and what the run's later
turns prefilled against what was new in them."""

from __future__ import annotations

import statistics

from rollout_cli.episodes import EnvStep, EpisodeRunner


class SyntheticEnv:
    """--turns: answers every model turn with the same observation tokens, never done."""

    def __init__(self, observation: list[int]):
        self.observation = observation

    def step(self, turn) -> EnvStep:
        return EnvStep(observation=self.observation)


def episode_report(runner: EpisodeRunner, results: list) -> dict:
    """How much each later turn (the second on) prefilled against what was new in it: the environment's
    tokens since the last model turn, plus that turn's last token (its KV is never computed)."""
    prefilled, new = [], []
    for r in results:
        spans, cached = r.episode["model_turns"], r.episode["turn_cached_tokens"]
        for k in range(1, len(spans)):
            prefilled.append(len(r.prompt_token_ids) + spans[k][0] - cached[k])
            new.append(spans[k][0] - spans[k - 1][1] + 1)
    return {**runner.summary(),
            "later_turn_prefill_tokens_mean": statistics.fmean(prefilled) if prefilled else 0.0,
            "later_turn_new_tokens_mean": statistics.fmean(new) if new else 0.0,
            "later_turns_prefilling_only_new_tokens": sum(p <= n for p, n in zip(prefilled, new)) / max(len(new), 1)}
