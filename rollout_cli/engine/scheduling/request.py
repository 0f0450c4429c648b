"""One sample being generated: its tokens, its KV slots and its progress.

Plain Python over ints and lists so the scheduler is testable on the CPU.
Prefill, chunked prefill, decode and recompute after preemption are the same
thing: `num_computed_tokens` catches up to `num_tokens`, and a token is
sampled whenever it has caught up.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.engine.scheduling.stop_text import stopped_text


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: int
    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 1 << 30
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    # with params.top_logprobs K: per response token, the K most likely (token id, logprob), most likely
    # first (None for tokens carried over from a partial response); [] otherwise
    output_top_logprobs: list = field(default_factory=list)
    # with params.return_sampling_mask: per response token, the ids the filters kept (ascending; None for
    # tokens carried over from a partial response); [] otherwise
    output_sampling_mask: list = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (None: eos, length)
    # with params.stop: stop_strings.StopMatcher, the response's last bytes (RequestMaker sets it)
    stop_matcher: object = None
    num_computed_tokens: int = 0
    # KV slot of every computed token, in order; the first `num_cached_tokens`
    # belong to the radix cache (locked through `cache_node`), the rest to us.
    slots: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    cache_node: object = None
    # Row of the runner's req_to_token table; how many of `slots` it already holds.
    table_row: int = -1
    num_slots_in_table: int = 0
    state_slot: int = -1  # hybrid models: the linear-state pool slot holding our recurrent state
    # verify steps planned ahead of the one in flight (engine/scheduling/verify_ahead_plan.py): how many are in
    # flight, and the position past every slot they may use (kept until they are post-processed)
    ahead_steps: int = 0
    reserved_end: int = 0
    num_preemptions: int = 0
    computed_before_preemption: int = 0  # num_computed_tokens when last preempted (SchedulerStats.recomputed_tokens)
    cached_prompt_tokens: int = 0  # prompt tokens the prefix cache served at the first admission
    # (index of the first response token it sampled, weight version), one span per version in
    # order: a sample that lived through a weight update (pause keep) has more than one
    version_spans: list[tuple[int, str]] = field(default_factory=list)
    final_slots: list[int] | None = None  # `slots` as they were when the request finished (routing capture)
    group_leader: "Request | None" = None  # the sample that computes a shared prompt first
    conversation: int | None = None  # a conversation turn: the previous turn's prompt length (PromptInput's)
    payload: object = None  # caller data carried to the result (passthrough columns)
    arrival_time: float = 0.0  # time.monotonic() when queued; with first_token_time gives TTFT
    first_token_time: float | None = None
    # Scoring (teacher forcing, Engine.score): `prompt_token_ids` holds prompt + response and the
    # tokens from position `score_from` on are scored, not sampled: scored_logprobs[i] is the logprob
    # of token score_from + i given the tokens before it (None until computed; a recompute after
    # preemption writes the same places again). None for generation requests.
    score_from: int | None = None
    scored_logprobs: list[float | None] | None = None
    score_top_k: int = 0  # also the k most likely tokens at each scored position (--top-logprobs)
    # per scored position, the kept ids to renormalise over (a run's response_sampling_mask, `score
    # --sampling-mask`) instead of the filters; None: the filters' set
    score_masks: list | None = None
    scored_top: list | None = None  # per scored position: (token ids [k], logprobs [k]), as scored_logprobs
    # A prompt with images (vision-language models): where they sit, the multimodal positions and the
    # prefix-cache key (models.vision_language.VisionLayout, shared by the prompt's samples); None: text
    vision: object = None
    # --speculative mtp: (position, token) the MTP head guessed for the position after the newest token
    # (engine/execution/mtp_step.py); None when it has none. mtp_hidden: the head's output [H] that
    # guessed it, where a longer draft continues from (MTPStep.extend_drafts)
    mtp_draft: tuple[int, int] | None = None
    mtp_hidden: object = None

    @property
    def is_scoring(self) -> bool:
        return self.score_from is not None

    def cacheable_prefix(self, limit: int) -> int:
        """How many leading tokens (of at most `limit`) may come from the prefix cache: a scoring
        request computes every position whose logits it scores, from score_from - 1 on."""
        return min(limit, self.score_from - 1) if self.score_from is not None else limit

    @property
    def images(self) -> tuple:
        """The prompt's images (engine.multimodal.ImageInput), as PromptInput.images; () for text."""
        return self.vision.images if self.vision is not None else ()

    @property
    def rope_delta(self) -> int:
        """What a position past the prompt adds to its index (multimodal positions compress images)."""
        return self.vision.delta if self.vision is not None else 0

    @property
    def prompt_key_ids(self) -> list[int]:
        """The prompt as the prefix cache keys it: its ids, but each image's placeholder tokens keyed by
        the image's pixels (engine.multimodal.cache_key_tokens)."""
        return self.vision.key_ids if self.vision is not None else self.prompt_token_ids

    @property
    def key_token_ids(self) -> list[int]:
        """prompt_key_ids + the response: what the prefix cache matches and stores."""
        return self.prompt_key_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def prompt_computed(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    def tokens_between(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) without concatenating prompt and output."""
        split = len(self.prompt_token_ids)
        if end <= split:
            return self.prompt_token_ids[start:end]
        if start >= split:
            return self.output_token_ids[start - split : end - split]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - split]

    def finishes_by_length_after_next_token(self) -> bool:
        """Whether the next appended token ends the sample by length, whatever the token (append_token's rule)."""
        return len(self.output_token_ids) + 1 >= self.params.max_new_tokens or self.num_tokens + 1 >= self.max_model_len

    def append_token(self, token_id: int, logprob: float, weight_version: str = "", extras=None) -> None:
        """Record one sampled token (sampled under `weight_version`; `extras` its position's (top list,
        sampling mask) when params ask for either: sampler.sample_extras) and set finish_reason if it
        ends the sample."""
        spans = self.version_spans
        if not spans or spans[-1][1] != weight_version:  # one compare per token: a new span only on a change
            spans.append((len(self.output_token_ids), weight_version))
        self.output_token_ids.append(token_id)
        self.output_logprobs.append(logprob)
        if extras is not None:
            top, mask = extras
            if self.params.top_logprobs:
                self.output_top_logprobs.append(top)
            if self.params.return_sampling_mask:
                self.output_sampling_mask.append(mask)
        if not self.params.ignore_eos and token_id in self.eos_token_ids:
            self.finish_reason = "stop"
        elif token_id in self.params.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", token_id
        elif self.stop_matcher is not None and (matched := self.stop_matcher.push(token_id)) is not None:
            self.finish_reason, self.stop_reason = "stop", matched
        elif len(self.output_token_ids) >= self.params.max_new_tokens or self.num_tokens >= self.max_model_len:
            self.finish_reason = "length"

    def text(self, decode) -> str:
        """The response's text (`decode`: ids -> text, special tokens skipped), cut where the stop rule that
        ended it says (vLLM's rule, shared with the OpenAI routes: stop_text.py)."""
        return stopped_text(decode, self.output_token_ids, self.finish_reason, self.stop_reason,
                            self.params.include_stop_str_in_output)

    def per_token_outputs(self) -> dict:
        """The per-token outputs its params ask for, as Trajectory fields (None where not asked)."""
        return dict(response_top_logprobs=self.output_top_logprobs if self.params.top_logprobs else None,
                    response_sampling_mask=self.output_sampling_mask if self.params.return_sampling_mask else None)

    def response_weight_versions(self, current: str) -> list[str]:
        """The weight version that sampled each response token ([] for an empty response; `current`
        where no version was recorded)."""
        versions: list[str] = []
        spans = self.version_spans or [(0, current)]
        for (start, version), (end, _) in zip(spans, spans[1:] + [(len(self.output_token_ids), "")]):
            versions.extend([version] * (end - start))
        return versions
