"""Prompts and finished samples turned into scheduler requests, checked first."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator, Sequence

from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.engine.scheduling.request import Request
from rollout_cli.engine.scheduling.stop_strings import StopMatcher, TokenBytes
from rollout_cli.engine.scheduling.stop_text import stopped_text
from rollout_cli.engine.trajectory import PartialSample, PromptInput, ScoreInput
from rollout_cli.errors import RolloutError


def token_id_problem(ids: Sequence[int], vocab_size: int | None = None,
                     max_len: int | None = None) -> tuple[str, int] | None:
    """The first rule that token ids break, as (rule, the number that breaks it), or None.

    The one home of the checks a prompt's ids pass before the model sees them; each caller words a
    failure for its reader: RequestMaker for every prompt the engine admits (Python API callers included),
    io.PromptSource for a row of the prompt file before a job writes anything (or skips it), and
    io.encode_prompt for a token-id cell with no model at hand. The rules, in the order they are checked:
      "empty"  (0): no ids;
      "vocab"  (the id): an id < 0, or >= vocab_size (None: not checked);
      "length" (the id count): more than max_len ids (None: not checked).
    """
    if not ids:
        return "empty", 0
    low, high = min(ids), max(ids)
    if low < 0:
        return "vocab", low
    if vocab_size is not None and high >= vocab_size:
        return "vocab", high
    if max_len is not None and len(ids) > max_len:
        return "length", len(ids)
    return None


def sample_slices(prompts: Iterable, params: SamplingParams, most: int) -> Iterator:
    """`prompts`, each PromptInput of more than `most` samples cut into slices of `most` (PromptInput.samples):
    the step loop then makes a prompt's requests as its queue has room, not all n at once (`--n 10000000`
    built ten million requests before the first step). Each slice is a group of its own: its first sample
    computes the prompt, the others read it from the prefix cache and draft from each other's responses."""
    for prompt in prompts:
        n = (getattr(prompt, "params", None) or params).n
        if not isinstance(prompt, PromptInput) or prompt.samples is not None or n <= most:
            yield prompt
            continue
        for start in range(0, n, most):
            yield dataclasses.replace(prompt, samples=range(start, min(start + most, n)))


class RequestMaker:
    """Numbers requests and refuses token ids the model cannot run: an empty prompt never gets admitted
    (it would stall the queue), an id past the vocabulary crashes the embedding (on CUDA a device
    assert that kills the whole engine), a sequence past --max-model-len has no KV row to live in."""

    def __init__(self, vocab_size: int, eos_token_ids: frozenset[int], max_model_len: int,
                 model_positions: int | None = None, tokenizer=None):
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.model_positions = model_positions  # how far --max-model-len may go (None: unknown)
        # each token's bytes, for stop strings (built on the first request that has some); None: no tokenizer
        self.token_bytes = None if tokenizer is None else TokenBytes(tokenizer, vocab_size)
        self._ids = itertools.count()

    @property
    def max_prompt_len(self) -> int:
        """The longest prompt admitted: one position under --max-model-len is kept for a generated token."""
        return self.max_model_len - 1

    def samples(self, prompt: PromptInput, params: SamplingParams, skip) -> list[Request]:
        """The n samples of a prompt (its own params if it carries them; its slice of them if it is one), but
        those in `skip`; the first one computes the prompt, the others wait for it and read its KV from the
        prefix cache."""
        self._check(prompt.prompt_index, prompt.prompt_token_ids)
        params = getattr(prompt, "params", None) or params
        requests, leader = [], None
        for sample_index in range(params.n) if prompt.samples is None else prompt.samples:
            if (prompt.prompt_index, sample_index) in skip:
                continue
            request = Request(request_id=next(self._ids), prompt_index=prompt.prompt_index, sample_index=sample_index,
                              prompt_token_ids=list(prompt.prompt_token_ids), params=params,
                              eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len,
                              group_leader=leader, payload=prompt.passthrough, conversation=prompt.conversation,
                              stop_matcher=self.stop_matcher(params))
            leader = leader or request
            requests.append(request)
        return requests

    def partial(self, sample: PartialSample, params: SamplingParams) -> Request:
        """A request that starts with the sample's response so far: its first step prefills prompt +
        response, then it samples as if it had never stopped."""
        params = sample.params or params
        response = list(sample.response_token_ids)
        where = f"sample ({sample.prompt_index}, {sample.sample_index})"
        if len(sample.response_logprobs) != len(response) or len(sample.response_weight_versions) != len(response):
            raise RolloutError(f"{where}: response_logprobs and response_weight_versions must hold one entry per "
                               f"response token ({len(response)}); pass an aborted trajectory's columns as they are")
        if len(response) >= params.max_new_tokens:
            raise RolloutError(f"{where} already has {len(response)} response tokens, max_new_tokens is "
                               f"{params.max_new_tokens}: nothing to continue; raise max_new_tokens or drop it")
        self._check(sample.prompt_index, list(sample.prompt_token_ids) + response)
        request = Request(request_id=next(self._ids), prompt_index=sample.prompt_index,
                          sample_index=sample.sample_index, prompt_token_ids=list(sample.prompt_token_ids),
                          params=params, eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len,
                          payload=sample.passthrough, conversation=sample.conversation, output_token_ids=response,
                          output_logprobs=list(sample.response_logprobs),
                          output_top_logprobs=[None] * len(response) if params.top_logprobs else [],
                          output_sampling_mask=self._carried_masks(sample, params, where),
                          stop_matcher=self.stop_matcher(params, response))
        for i, version in enumerate(sample.response_weight_versions):
            if not request.version_spans or request.version_spans[-1][1] != version:
                request.version_spans.append((i, version))
        return request

    def stop_matcher(self, params: SamplingParams, response: Sequence[int] = ()) -> StopMatcher | None:
        """A new sample's stop-string matcher (None without params.stop), having read `response` (a
        continued sample's tokens so far) as context."""
        if not params.stop:
            return None
        if self.token_bytes is None:
            raise RolloutError("stop strings (--stop) are matched on the tokens' text, and this checkpoint has no "
                               "tokenizer files; add them, or pass --stop-token-ids")
        return self.token_bytes.matcher(params.stop, response)

    def finish_of(self, token_ids: Sequence[int], params: SamplingParams) -> str:
        """How a sample with these response tokens ended if it ended at its last token: "stop" where that token
        meets a stop rule (eos unless ignore_eos, a stop token id, the completion of a stop string: append_token's
        rules), else "length". Replaying a finished model turn of an episode (episodes.py) needs it."""
        return self.ending_of(token_ids, params)[0]

    def replayed_turn(self, token_ids: Sequence[int], params: SamplingParams, decode) -> tuple[str, str]:
        """(finish_reason, text) of a finished model turn replayed (episodes.py): finish_of's, and the text the
        turn had (`decode`: ids -> text), cut by the stop rule that ended it (stop_text.py)."""
        finish, reason = self.ending_of(token_ids, params)
        return finish, stopped_text(decode, token_ids, finish, reason, params.include_stop_str_in_output)

    def ending_of(self, token_ids: Sequence[int], params: SamplingParams) -> tuple[str, str | int | None]:
        """finish_of's (finish_reason, stop_reason): the stop string or stop token id, as Request.stop_reason."""
        last = token_ids[-1] if token_ids else None
        if last is None:
            return "length", None
        if not params.ignore_eos and last in self.eos_token_ids:
            return "stop", None
        if last in params.stop_token_ids:
            return "stop", last
        matcher = self.stop_matcher(params, token_ids[:-1])
        matched = matcher.push(last) if matcher is not None else None
        return ("length", None) if matched is None else ("stop", matched)

    @staticmethod
    def _carried_masks(sample: PartialSample, params: SamplingParams, where: str) -> list:
        """With params.return_sampling_mask, the continued request's masks so far: the sample's own (an
        aborted row's column), else None per carried token; [] otherwise."""
        length = len(sample.response_token_ids)
        if not params.return_sampling_mask:
            return []
        if sample.response_sampling_mask is None:
            return [None] * length
        if len(sample.response_sampling_mask) != length:
            raise RolloutError(f"{where}: response_sampling_mask must hold one entry per response token ({length}); "
                               "pass an aborted trajectory's column as it is")
        return [list(ids) if ids else None for ids in sample.response_sampling_mask]

    def scoring(self, sample: ScoreInput, params: SamplingParams, top_logprobs: int = 0) -> Request:
        """A request that runs prompt + response through the model and scores the response tokens."""
        if not sample.prompt_token_ids:  # the first response token would be scored after nothing: a null logprob
            raise RolloutError(f"sample ({sample.prompt_index}, {sample.sample_index}) has no prompt tokens; the "
                               "first response token has no position to be scored from: pass the prompt it was "
                               "sampled after")
        ids = list(sample.prompt_token_ids) + list(sample.response_token_ids)
        self._check(sample.prompt_index, ids, "prompt + response")
        masks = sample.sampling_mask
        if masks is not None and (len(masks) != len(sample.response_token_ids) or not all(masks)):
            raise RolloutError(f"sample ({sample.prompt_index}, {sample.sample_index}): the sampling mask must hold "
                               f"a non-empty list per response token ({len(sample.response_token_ids)}); a run "
                               "without --sampling-mask (or a token carried over from one) has none to score over")
        return Request(request_id=next(self._ids), prompt_index=sample.prompt_index,
                       sample_index=sample.sample_index, prompt_token_ids=ids, params=params,
                       max_model_len=self.max_model_len, payload=dict(sample.passthrough),
                       score_from=len(sample.prompt_token_ids),
                       scored_logprobs=[None] * len(sample.response_token_ids), score_top_k=top_logprobs,
                       scored_top=[None] * len(sample.response_token_ids) if top_logprobs else None,
                       score_masks=None if masks is None else [list(m) for m in masks])

    def check_prompt(self, prompt_index: int, ids: list[int]) -> None:
        """Refuse (RolloutError) a prompt the engine could not admit, before it is queued."""
        self._check(prompt_index, ids)

    def _check(self, prompt_index: int, ids: list[int], what: str = "prompt") -> None:
        # a prompt needs room for a generated token; a scored prompt + response only for itself
        max_len = self.max_prompt_len if what == "prompt" else self.max_model_len
        problem = token_id_problem(ids, self.vocab_size, max_len)
        if problem is None:
            return
        rule, count = problem
        if rule != "length":
            detail = "is empty" if rule == "empty" else f"holds token ids outside [0, {self.vocab_size})"
            raise RolloutError(f"{what} {prompt_index} {detail}; pass 1-d token ids of this model's tokenizer")
        if what == "prompt":
            raise RolloutError(f"prompt {prompt_index} has {count} tokens, leaving no room to generate under "
                               f"--max-model-len {self.max_model_len}; {self._fix()}")
        raise RolloutError(f"{what} {prompt_index} has {count} tokens, more than --max-model-len "
                           f"{self.max_model_len}; {self._fix()}")

    def _fix(self) -> str:
        if self.model_positions is not None and self.max_model_len >= self.model_positions:
            return "that is all the positions the model has: filter long prompts"
        limit = f" (the model allows up to {self.model_positions})" if self.model_positions else ""
        return f"raise --max-model-len{limit} or filter long prompts"
