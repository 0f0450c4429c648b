"""Verifiable rewards for the GRPO recipe: each maps one trajectory row (a dict) to a float.

Rows are what `rollout run` writes: response_text, response_token_ids, finish_reason and the
passthrough columns of the prompt file (verl layout: reward_model.ground_truth).
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+")


def answer_match(row: dict) -> float:
    """1.0 when the first number in the response equals reward_model.ground_truth (verl layout)."""
    truth = str((row.get("reward_model") or {}).get("ground_truth", "")).strip()
    found = _NUMBER.search(row.get("response_text") or "")
    return float(bool(truth) and found is not None and found.group(0) == truth)


def digit_fraction(row: dict) -> float:
    """Share of the response's characters that are digits: a dense reward that the tiny random
    example model learns within a few iterations on the CPU (its tokenizer has many digit tokens)."""
    text = row.get("response_text") or ""
    return sum(ch.isdigit() for ch in text) / len(text) if text else 0.0


def env(row: dict) -> float:
    """The environment's reward of a `rollout run --env` episode (its episode_reward column)."""
    if "episode_reward" not in row:
        raise SystemExit("error: --reward env reads episode_reward, which only rollout run --env writes")
    return float(row["episode_reward"])


REWARDS = {"answer_match": answer_match, "digit_fraction": digit_fraction, "env": env}


def reward_function(name: str):
    if name not in REWARDS:
        raise SystemExit(f"error: unknown reward {name!r}; choose one of {', '.join(sorted(REWARDS))}")
    return REWARDS[name]
