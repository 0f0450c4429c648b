"""How many episodes are open at once: a new one starts only while every open episode's KV, projected
to its last turn, fits the KV pool.

An episode's KV grows each turn (its response, then the environment's answer) and stays in the prefix
cache between turns (engine/scheduling/sessions.py), so a later turn prefills only its new tokens. Starting
every episode the queue allows at once lets the open episodes outgrow the pool by their later turns: then
pins are dropped, prefixes evicted, running turns preempted, and later turns re-prefill their whole
conversation. On an H100, 256 ten-turn episodes of the Qwen3-0.6B shape (512 + 10 x (256 + 32) tokens
each, 868k in all against a 606k-token pool) read 55.8% of their prompts from the cache and re-prefilled
831 tokens per later turn for 33 new ones. Holding new episodes back until the open ones' projection
leaves room keeps each conversation's KV resident for its whole life; the batch is then as large as the
pool can serve without recomputing.

An open episode's projection: its tokens so far (its share of the prompt its group shares) plus, for each
turn it may still run, the mean tokens a turn has added so far (before any turn ended: its
max_new_tokens, the environment's answers unknown), capped at --max-model-len. The turns it may still
run: --max-turns, or, once MIN_ENDED episodes have ended, the mean over those (environments that end
episodes early free their room sooner than --max-turns says).
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout_cli.engine.trajectory import PartialSample

FILL = 0.9  # of the pool: the rest absorbs the projection's error and chunked prefills' slots
MIN_ENDED = 4  # ended episodes before their mean turn count replaces --max-turns


@dataclass
class _Open:
    tokens: float  # its KV so far: its prompt share plus its response and observations
    turns: int  # model turns finished
    max_new_tokens: int


class EpisodeRoom:
    """The open episodes' projected KV against the pool (the EpisodeRunner's thread only)."""

    def __init__(self, pool_tokens: int, max_turns: int, max_len: int):
        self.capacity = FILL * pool_tokens
        self.max_turns = max_turns
        self.max_len = max_len  # --max-model-len: no projection past it
        self._open: dict[tuple[int, int], _Open] = {}
        self._added_tokens = 0  # over every turn that an environment answered and another followed
        self._continued_turns = 0
        self._ended = 0
        self._ended_turns = 0
        self.peak_open = 0
        self.held = 0  # prompt rows whose episodes waited for room at least once
        self._holding = False

    def fits(self, tokens: int, n: int, max_new_tokens: int, turns: int = 0) -> bool:
        """Whether n episodes of a row (a prompt of `tokens` shared by them, `turns` already run) may start:
        always when none is open, else when all projections together stay under the pool's FILL."""
        if not self._open:
            return True
        new = n * self._projection(_Open(tokens / n, turns, max_new_tokens))
        fits = sum(self._projection(e) for e in self._open.values()) + new <= self.capacity
        if not fits and not self._holding:
            self.held += 1
        self._holding = not fits
        return fits

    def fits_row(self, row, params) -> bool:
        """fits() for a prompt row (PromptInput: its n episodes, or its slice's) or an aborted episode to continue
        (PartialSample: one, its finished turns already run); `params`: the job's, where the row has none."""
        params = row.params or params
        if isinstance(row, PartialSample):
            turns = len(row.episode["model_turns"]) - 1 if row.episode else 0
            return self.fits(len(row.prompt_token_ids) + len(row.response_token_ids), 1, params.max_new_tokens, turns)
        return self.fits(len(row.prompt_token_ids), params.n if row.samples is None else len(row.samples),
                         params.max_new_tokens)

    def opened(self, key: tuple[int, int], tokens: float, max_new_tokens: int, turns: int = 0) -> None:
        self._open[key] = _Open(tokens, turns, max_new_tokens)
        self.peak_open = max(self.peak_open, len(self._open))

    def continued(self, key: tuple[int, int], added: int) -> None:
        """A model turn ended and another follows: `added` tokens (the response and the observation)."""
        episode = self._open[key]
        episode.tokens += added
        episode.turns += 1
        self._added_tokens += added
        self._continued_turns += 1

    def closed(self, key: tuple[int, int], turns: int) -> None:
        """An episode ended after `turns` model turns (or was dropped: its room is free either way)."""
        if self._open.pop(key, None) is not None:
            self._ended += 1
            self._ended_turns += turns

    def summary(self) -> dict:
        return {"peak_open_episodes": self.peak_open, "episode_rows_held_for_kv": self.held}

    def _projection(self, episode: _Open) -> float:
        per_turn = (self._added_tokens / self._continued_turns if self._continued_turns
                    else episode.max_new_tokens)
        turns = self._ended_turns / self._ended if self._ended >= MIN_ENDED else self.max_turns
        return min(self.max_len, episode.tokens + max(turns - episode.turns, 0) * per_turn)
