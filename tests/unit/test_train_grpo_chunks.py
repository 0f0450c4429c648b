"""The recipe trainer's scoring chunks (recipes/train_grpo.py): which samples are scored and
back-propagated together. One prompt's samples per chunk, at most CHUNK_TOKENS response tokens."""

from __future__ import annotations

import importlib.util
from pathlib import Path

PATH = Path(__file__).resolve().parents[2] / "recipes" / "train_grpo.py"
spec = importlib.util.spec_from_file_location("train_grpo", PATH)
train_grpo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train_grpo)


def _rows(groups: list[list[int]]) -> list[dict]:
    """Rows of prompts 0, 1, ... with responses of the given lengths, groups interleaved as a run writes them."""
    rows = [{"prompt_index": p, "response_token_ids": [1] * n} for p, lengths in enumerate(groups) for n in lengths]
    return rows[::2] + rows[1::2]


def test_every_sample_is_scored_once_with_its_own_prompts_samples():
    rows = _rows([[3, 4, 5], [2, 2], [9]])
    chunks = train_grpo.scoring_chunks(rows, max_tokens=100)
    assert sorted(i for chunk in chunks for i in chunk) == list(range(len(rows)))
    assert len(chunks) == 3  # one a prompt: under the limit a group is never split
    for chunk in chunks:
        assert len({rows[i]["prompt_index"] for i in chunk}) == 1


def test_a_group_over_the_token_limit_is_split_and_a_long_sample_stands_alone():
    rows = _rows([[4, 4, 4, 4, 12]])
    chunks = train_grpo.scoring_chunks(rows, max_tokens=8)
    assert sorted(i for chunk in chunks for i in chunk) == list(range(5))
    for chunk in chunks:
        tokens = sum(len(rows[i]["response_token_ids"]) for i in chunk)
        assert tokens <= 8 or len(chunk) == 1  # the 12-token sample cannot be split
    assert [sorted(len(rows[i]["response_token_ids"]) for i in c) for c in chunks].count([12]) == 1
