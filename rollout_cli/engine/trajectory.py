"""What goes into the engine (a tokenized prompt) and what comes out (a finished sample)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollout_cli.engine.sampling_params import SamplingParams


# Trajectory fields that are not Parquet columns: metrics and the routing capture's side output.
METRIC_FIELDS = ("passthrough", "ttft_seconds", "cached_prompt_tokens", "routed_experts", "episode",
                 "response_top_logprobs")


@dataclass
class Trajectory:
    """One finished sample; the fields of a trajectory Parquet row."""

    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_logprobs: list[float]
    response_text: str
    finish_reason: str
    weight_version: str
    # one per response token: the weights that sampled it (one value unless an update came mid-sample)
    response_weight_versions: list[str] = field(default_factory=list)
    passthrough: dict[str, Any] = field(default_factory=dict)
    ttft_seconds: float = 0.0  # queueing to first token; a metric, not a Parquet column
    cached_prompt_tokens: int = 0  # prompt tokens the prefix cache served at admission; a metric too
    # With routing capture: expert ids [len(prompt) + len(response) - 1, num_moe_layers, top_k]
    # (numpy, uint8 or int16); written to OUT/routing/, not a trajectory column.
    routed_experts: Any = None
    # `rollout run --env`: the episode's columns (io.trajectories.EPISODE_FIELDS); None otherwise
    episode: dict[str, Any] | None = None
    # with SamplingParams.top_logprobs K: per response token, up to K (token id, logprob) pairs, the
    # most likely first (None for tokens carried over from a partial response); the Python API and the
    # daemon's OpenAI routes return them; `rollout run --top-logprobs` writes them as two columns (to_row)
    response_top_logprobs: list | None = None
    # a prompt with images: each image's [t, h, w] patch grid (the processor's image_grid_thw), in prompt
    # order, which a trainer needs to rebuild the vision inputs; None for a text prompt. A run over an image
    # column writes it as a column (io.trajectories.IMAGE_FIELDS; [] for its text rows), a text run has none
    image_grid_thw: list | None = None
    # with SamplingParams.return_sampling_mask: per response token, the ids (ascending) of the tokens the
    # filters kept, the set it was drawn from and its logprob renormalised over (None for tokens carried
    # over from a partial response; [] in the Parquet column); None otherwise (no column)
    response_sampling_mask: list | None = None
    # with finish_reason stop: the stop string (SamplingParams.stop) or stop token id that ended it; None
    # for eos and every other finish. A run with --stop or --stop-token-ids writes it as a column (as text)
    stop_reason: str | int | None = None

    def to_row(self) -> dict[str, Any]:
        row = {k: v for k, v in self.__dict__.items() if k not in METRIC_FIELDS}
        # columns of the runs that ask for them (io.trajectories' writer fills stop_reason's nulls)
        for optional in ("image_grid_thw", "response_sampling_mask", "stop_reason"):
            if row[optional] is None:
                del row[optional]
        if self.stop_reason is not None:  # io.trajectories.STOP_REASON_FIELDS: a token id as text
            row["stop_reason"] = str(self.stop_reason)
        if self.response_sampling_mask is not None:  # io.trajectories.SAMPLING_MASK_FIELDS
            row["response_sampling_mask"] = [ids if ids is not None else [] for ids in self.response_sampling_mask]
        row.update(self.episode or {})
        if self.response_top_logprobs is not None:  # io.trajectories.TOP_LOGPROB_FIELDS
            row["response_top_token_ids"] = [[t for t, _ in top] if top else [] for top in self.response_top_logprobs]
            row["response_top_logprobs"] = [[v for _, v in top] if top else [] for top in self.response_top_logprobs]
        row.update(self.passthrough)
        return row


@dataclass(frozen=True)
class PromptInput:
    """One tokenized prompt, ready to become `n` requests: what io.PromptSource yields for a row of the
    prompt file and what the Python API's callers build. It lives in the engine so the engine needs no io."""

    prompt_index: int
    """0-based row number in the input file (or the caller's numbering); it keys the output rows and resume."""
    prompt_token_ids: list[int]
    """The tokenized prompt, exactly what the model sees."""
    passthrough: dict[str, Any] = field(default_factory=dict)
    """Every input column except the prompt column, as Python values, copied to the output rows."""
    params: SamplingParams | None = None
    """Overrides the job's sampling settings for this prompt (bench: mixed lengths); None: the job's."""
    conversation: int | None = None
    """A turn of a multi-turn conversation (`rollout run --env`, a daemon session): the previous turn's
    prompt length (0 for the first turn); None: not a turn. Hybrid models snapshot a turn's prompt state
    for the next turn and resume from the previous turn's snapshot (engine/scheduling/prefix_reuse.py)."""
    images: tuple = ()
    """Vision-language models: the prompt's images (engine.multimodal.ImageInput), in the order of their
    placeholder runs in `prompt_token_ids`."""
    samples: range | None = None
    """The sample indices to make (a slice of a prompt of many samples: request_maker.sample_slices); None: 0 .. n-1."""


# Yielded by a live prompt source (Engine.stream) that has no prompt now but may have one at a later
# step; returning ends the source. A stream whose source yields it ends when it has no work left.
NO_PROMPT_YET = object()


@dataclass(frozen=True)
class PartialSample:
    """One sample to continue from a partial response (an aborted trajectory, a rollout carried over
    a weight update): the engine computes prompt + response in one prefill, reusing the prefix cache,
    and samples on up to the params' max_new_tokens counted over the whole response. Its random
    stream is the uninterrupted sample's (keyed by seed, prompt, sample and position), so on the same
    weights the continuation is the tokens the sample would have had."""

    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_logprobs: list[float]
    response_weight_versions: list[str]
    """One per response token, the weights that sampled it (a trajectory's column of that name)."""
    passthrough: dict[str, Any] = field(default_factory=dict)
    params: SamplingParams | None = None
    """Overrides the job's sampling settings for this sample; None: the job's (n is not used)."""
    conversation: int | None = None
    """A turn of a multi-turn conversation (`rollout run --env`, a daemon session): the previous turn's
    prompt length (0 for the first turn); None: not a turn. Hybrid models snapshot a turn's prompt state
    for the next turn and resume from the previous turn's snapshot (engine/scheduling/prefix_reuse.py)."""
    images: tuple = ()
    """Vision-language models: the prompt's images (PromptInput.images); an episode's later turns carry the
    first turn's."""
    episode: dict | None = None
    """An aborted episode to continue (`run --env --resume --continue-aborted`): its row's episode columns
    (response_loss_mask, model_turns, turn_cached_tokens); the response holds model and environment tokens."""
    response_sampling_mask: list | None = None
    """Per response token, the kept ids it was drawn from (a trajectory's response_sampling_mask), carried
    into the continued sample's; None: not recorded (the continued sample's mask lists None there)."""

    @classmethod
    def of(cls, trajectory: Trajectory, params: SamplingParams | None = None) -> PartialSample:
        return cls(trajectory.prompt_index, trajectory.sample_index, list(trajectory.prompt_token_ids),
                   list(trajectory.response_token_ids), list(trajectory.response_logprobs),
                   list(trajectory.response_weight_versions), dict(trajectory.passthrough), params,
                   response_sampling_mask=trajectory.response_sampling_mask)


@dataclass(frozen=True)
class ScoreInput:
    """A finished sample to score by teacher forcing: its prompt and response token ids."""

    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    passthrough: dict[str, Any] = field(default_factory=dict)
    images: tuple = ()
    """Vision-language models: the prompt's images (PromptInput.images)."""
    sampling_mask: list | None = None
    """Per response token, the kept ids to renormalise its processed logprob over (a run's
    response_sampling_mask: what a trainer replaying the masks computes); None: the params' filters."""


@dataclass
class Score:
    """A scored sample: the logprob of every response token given the tokens before it, reported as
    the sampler reports a drawn token (the params' temperature and logprobs mode)."""

    prompt_index: int
    sample_index: int
    response_logprobs: list[float]
    passthrough: dict[str, Any] = field(default_factory=dict)
    # with top_logprobs K: per response position, the K most likely (token id, logprob), most likely first
    top_logprobs: list[list[tuple[int, float]]] | None = None
