"""Online requests: generation requests that arrive over HTTP one at a time (the OpenAI API), served
together by one engine stream while any is in flight (continuous batching across clients).

The HTTP side builds an OnlineRequest (its prompts' token ids, sampling settings, stop rules) and hands
it to the engine thread (EngineWorker.submit_online). The engine thread keeps the requests in flight in
LiveRequests: their prompts wait in `inbox` until the stream's source takes them, every step feeds the
running samples of a streaming request to their SampleText, and every finished sample goes back to its
request. Stop strings and stop token ids end samples inside the engine (SamplingParams.stop,
stop_token_ids), which says which rule ended each (its stop_reason); SampleText cuts the text there by
the rule `rollout run`'s rows follow (engine/scheduling/stop_text.py) and, streaming, holds back what
could begin a stop string. Events reach the request's asyncio loop thread-safely:
    ("delta", index, token_ids, logprobs, text, tops)   new tokens of one sample (streaming requests only)
    ("finish", Choice)                            one sample ended; its whole response
    ("error", message)                            the engine cannot serve the request
Choice.index is prompt * n + sample, the order OpenAI numbers choices in.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.engine.trajectory import PromptInput
from rollout_cli.server.text_stream import SampleText

# The key of an engine request's payload that names its online request and prompt: (request id, prompt).
ONLINE_KEY = "_online_request"


@dataclass
class Choice:
    """One finished sample as the HTTP side receives it (copies: nothing shared with the engine thread)."""

    index: int
    prompt: int  # which of the request's prompts
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" (eos, stop string or stop token id), "length" or "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    weight_versions: list[str] = field(default_factory=list)  # one per token
    cached_prompt_tokens: int = 0  # prompt tokens the prefix cache served
    session: dict | None = None  # a session turn: the session's statistics after it (server/sessions.py)
    top_logprobs: list = field(default_factory=list)  # per token: (token id, logprob) pairs, or None (not asked)
    sampling_mask: list | None = None  # per token: the kept ids it was drawn from (return_sampling_mask), or None


class OnlineRequest:
    """One HTTP generation request: `params.n` samples of each prompt. Built on the HTTP side (inside
    its event loop); from submission on, only the engine thread changes it."""

    def __init__(self, request_id: str, prompts: list[list[int]], params: SamplingParams, tokenizer: Any,
                 stream: bool = False, session_id: str | None = None, images: list[tuple] | None = None):
        self.request_id = request_id
        self.session_id = session_id  # one turn of this conversation (one prompt, n = 1)
        self.conversation: int | None = None  # with a session: the previous turn's prompt length (set on admission)
        self.prompts = prompts
        self.images = images  # per prompt, its images (engine.multimodal.ImageInput); None: text only
        self.params = params
        self.stream = stream
        # fed after every step only to stream: the engine ends samples at the stop rules (params.stop,
        # params.stop_token_ids), and the whole response's text is cut at the end (finish)
        self.watch = stream
        self.samples = [[SampleText(tokenizer, params.stop, params.include_stop_str_in_output)
                         for _ in range(params.n)] for _ in prompts]
        self.num_finished = 0
        self.events: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._sent: dict[int, tuple[int, int]] = {}  # choice index -> (tokens, characters) streamed so far

    @property
    def num_samples(self) -> int:
        return len(self.prompts) * self.params.n

    @property
    def done(self) -> bool:
        return self.num_finished == self.num_samples

    def prompt_inputs(self) -> list[PromptInput]:
        # prompt i keys its samples' random streams like row i of a prompt file: the same seed gives
        # the same samples as `rollout run` over these prompts
        return [PromptInput(i, ids, {ONLINE_KEY: (self.request_id, i)}, self.params, self.conversation,
                            images=self.images[i] if self.images else ())
                for i, ids in enumerate(self.prompts)]

    # ---- engine thread -------------------------------------------------------------

    def progress(self, prompt: int, sample: int, token_ids: list[int], logprobs: list[float],
                 tops: list | None = None) -> None:
        """The running sample's tokens so far (the engine request's own lists, read, not kept); streams
        what is new."""
        text = self.samples[prompt][sample]
        start = len(text.token_ids)
        if len(token_ids) == start:
            return
        text.feed(token_ids[start:], logprobs[start:], tops[start:] if tops else None)
        if self.stream:
            self._send_delta(prompt * self.params.n + sample, text, final=False)

    def finish(self, prompt: int, sample: int, token_ids: list[int], logprobs: list[float], finish_reason: str,
               weight_versions: list[str], cached_prompt_tokens: int = 0, session_turn=None,
               tops: list | None = None, masks: list | None = None, stop_reason: str | int | None = None) -> None:
        """The sample ended (in the engine, by a stop rule, or aborted) with these tokens (`stop_reason`: the
        stop rule that ended it in the engine, if one did: the text is cut there). `session_turn(request,
        choice) -> statistics` records a session's turn before the answer goes out."""
        text = self.samples[prompt][sample]
        text.finish(token_ids, logprobs, tops, finish_reason, stop_reason)
        index = prompt * self.params.n + sample
        count = len(text.token_ids)
        choice = Choice(index, prompt, list(text.token_ids), list(text.logprobs), text.visible_text(final=True),
                        finish_reason, stop_reason, list(weight_versions[:count]),
                        cached_prompt_tokens, top_logprobs=list(text.tops),
                        sampling_mask=None if masks is None else masks[:count])
        if session_turn is not None and self.session_id is not None:
            choice.session = session_turn(self, choice)
        self._emit(("finish", choice))
        self.num_finished += 1

    def fail(self, message: str) -> None:
        self._emit(("error", message))

    def _send_delta(self, index: int, text: SampleText, final: bool) -> None:
        tokens_sent, chars_sent = self._sent.get(index, (0, 0))
        visible = text.visible_text(final)
        if len(text.token_ids) == tokens_sent and len(visible) == chars_sent:
            return
        self._sent[index] = (len(text.token_ids), len(visible))
        self._emit(("delta", index, text.token_ids[tokens_sent:], text.logprobs[tokens_sent:], visible[chars_sent:],
                    text.tops[tokens_sent:]))

    def _emit(self, event: tuple) -> None:
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the client's loop is gone (the daemon is stopping)
            pass


class LiveRequests:
    """The online requests in flight, as the engine thread sees them. `len()` may be read from any
    thread (status); everything else runs on the engine thread."""

    def __init__(self, session_turn=None):
        """session_turn(request, choice) -> statistics: called as a session's turn finishes (the worker's)."""
        self.session_turn = session_turn
        self.by_id: dict[str, OnlineRequest] = {}
        self.inbox: deque[PromptInput] = deque()  # prompts not yet taken by the stream
        self.num_watched = 0  # requests fed after every step (streaming ones)

    def __len__(self) -> int:
        return len(self.by_id)

    def add(self, request: OnlineRequest) -> None:
        self.by_id[request.request_id] = request
        self.num_watched += request.watch
        self.inbox.extend(request.prompt_inputs())

    def next_prompt(self) -> PromptInput | None:
        return self.inbox.popleft() if self.inbox else None

    def owner(self, payload) -> tuple[OnlineRequest, int] | None:
        """The online request and prompt an engine request (its payload) belongs to."""
        key = payload.get(ONLINE_KEY) if isinstance(payload, dict) else None
        request = self.by_id.get(key[0]) if key else None
        return None if request is None else (request, key[1])

    def after_step(self, running) -> None:
        """Between engine steps: feed the running samples of watched requests (the engine ends samples at
        their stop rules itself: a finished sample comes back through `finish`)."""
        if not self.num_watched:
            return
        for engine_request in running:
            found = self.owner(engine_request.payload)
            if found is None or not found[0].watch:
                continue
            request, prompt = found
            request.progress(prompt, engine_request.sample_index, engine_request.output_token_ids,
                             engine_request.output_logprobs, engine_request.output_top_logprobs)

    def abort(self, control, request_id: str | None = None) -> int:
        """End online requests now (one, or all): samples in the engine come back with their tokens so
        far, queued ones with none, all with finish_reason "abort". -> how many samples."""
        target = None if request_id is None else self.by_id.get(request_id)
        if request_id is not None and target is None:
            return 0  # finished already, or never was: nothing to abort

        def chosen(engine_request) -> bool:
            found = self.owner(engine_request.payload)
            return found is not None and (target is None or found[0] is target)

        trajectories = control.abort(chosen)
        for trajectory in trajectories:
            self.finish(trajectory)
        return len(trajectories) + self.abort_queued(request_id)

    def finish(self, trajectory) -> None:
        """A finished (or aborted) sample from the engine goes back to its request."""
        found = self.owner(trajectory.passthrough)
        if found is None:
            return
        request, prompt = found
        request.finish(prompt, trajectory.sample_index, trajectory.response_token_ids,
                       trajectory.response_logprobs, trajectory.finish_reason, trajectory.response_weight_versions,
                       trajectory.cached_prompt_tokens, self.session_turn, trajectory.response_top_logprobs,
                       trajectory.response_sampling_mask, trajectory.stop_reason)
        self._forget_if_done(request)

    def abort_queued(self, request_id: str | None = None) -> int:
        """Finish with "abort" (no tokens) the samples of queued prompts (of one request, or all);
        -> how many samples."""
        keep, aborted = deque(), 0
        for prompt in self.inbox:
            request, index = self.owner(prompt.passthrough)
            if request_id is not None and request.request_id != request_id:
                keep.append(prompt)
                continue
            for sample in range(request.params.n):
                request.finish(index, sample, [], [], "abort", [])
                aborted += 1
            self._forget_if_done(request)
        self.inbox = keep
        return aborted

    def fail_all(self, message: str) -> None:
        """The engine stream failed or the daemon stops: every request still in flight gets `message`."""
        for request in self.by_id.values():
            request.fail(message)
        self.by_id.clear()
        self.inbox.clear()
        self.num_watched = 0

    def _forget_if_done(self, request: OnlineRequest) -> None:
        if request.done and self.by_id.pop(request.request_id, None) is not None:
            self.num_watched -= request.watch
