"""The OpenAI-compatible API of the daemon: /v1/models, /v1/completions, /v1/chat/completions.

Agent frameworks and RL environment libraries drive an engine through the official `openai` client;
these routes take its requests unchanged, with the extensions RL needs (vLLM's names where it has
them): `return_token_ids` (the prompt's and each choice's token ids, and the weight version of every
token), token ids as the completions prompt, `stop_token_ids`, `include_stop_str_in_output`, `top_k`, `min_p`,
`ignore_eos`, `request_id` (abort it with POST /abort_request {"request_id": ...}), `session_id` (one turn of a
multi-turn conversation whose KV stays pinned for the next turn, engine/scheduling/sessions.py),
`return_sampling_mask` (SGLang's name: each choice's `sampling_mask`, per token the ids top_k / top_p /
min_p kept; whole responses only) and `chat_template_kwargs`. Vision-language checkpoints take image parts in chat messages (openai_images.py).

The request bodies and their translation are in openai_requests.py. Each request becomes an OnlineRequest (server/online.py) served by the engine thread together with
every other request in flight. A sample's random stream is keyed as in `rollout run`: with the same
`seed`, prompt i of a request draws what row i of a prompt file draws. Without a seed each request
draws a fresh one, as OpenAI's API does.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from rollout_cli.engine.tokenizer import load_tokenizer
from rollout_cli.errors import Conflict, RolloutError
from rollout_cli.io.image_prompts import VisionPromptEncoder
from rollout_cli.io.prompt_encoding import InvalidPrompt, encode_prompt
from rollout_cli.server.http_errors import OPENAI_PREFIX, engine_error
from rollout_cli.server.online import Choice, OnlineRequest
from rollout_cli.server.openai_images import encode_chat
from rollout_cli.server.tool_calls import ToolCallStream, parse_tool_calls, template_takes_tools
from rollout_cli.server.openai_requests import (COMPLETIONS_DEFAULT_MAX_TOKENS, ChatCompletionRequest, CompletionRequest,
                                                SamplingKeys, chat_messages, check_samples, refuse_unsupported,
                                                sampling_params, stop_strings)
from rollout_cli.server.worker import EngineWorker

DISCONNECT_POLL_SECONDS = 1.0  # how often a non-streaming request checks that its client is still there


class OpenAIRoutes:
    """The routes' state: the worker, the served model name, and a tokenizer of the HTTP side's own (a
    tokenizer object is not shared between threads; the engine thread has its own)."""

    def __init__(self, worker: EngineWorker, served_model_name: str):
        self.worker = worker
        self.served_model_name = served_model_name
        self.created = int(time.time())
        self._tokenizer = None
        self._tokenizer_loaded = False
        self._vision: VisionPromptEncoder | None = None
        self._vision_loaded = False

    @property
    def tokenizer(self):
        if not self._tokenizer_loaded:
            self._tokenizer = load_tokenizer(self.worker.engine.config.model)
            self._tokenizer_loaded = True
        return self._tokenizer

    @property
    def vision(self) -> VisionPromptEncoder | None:
        """A vision-language checkpoint's prompt encoder (on this side's tokenizer); None for a text-only one."""
        if not self._vision_loaded:
            self._vision = VisionPromptEncoder.from_checkpoint(self.worker.engine.config.model, self.tokenizer)
            if self._vision is not None:
                self._vision.pin_rows = self.worker.engine.device.type == "cuda"
            self._vision_loaded = True
        return self._vision

    def check_model(self, name: str) -> None:
        if name not in (self.served_model_name, self.worker.engine_config.model):
            raise LookupError(f"model {name!r} is not served here; this engine serves {self.served_model_name!r} "
                              "(GET /v1/models)")

    def models(self) -> dict:
        engine = self.worker.engine
        return {"object": "list", "data": [{
            "id": self.served_model_name, "object": "model", "created": self.created, "owned_by": "rollout",
            "root": self.worker.engine_config.model,
            "max_model_len": engine.max_model_len if engine is not None else None,
        }]}

    def encode(self, prompt, template_kwargs: dict | None = None) -> list[int]:
        try:
            return encode_prompt(self.tokenizer, prompt, template_kwargs)
        except InvalidPrompt as err:
            raise RolloutError(f"invalid prompt: {err}") from err

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each token's own text (OpenAI's logprobs.tokens)."""
        if self.tokenizer is None:
            return [f"token_id:{t}" for t in token_ids]
        return [self.tokenizer.decode([t]) for t in token_ids]


def _error(status: int, message: str) -> JSONResponse:
    return engine_error(status, message, path=OPENAI_PREFIX)


def register_openai_routes(app: FastAPI, worker: EngineWorker, served_model_name: str) -> None:
    routes = OpenAIRoutes(worker, served_model_name)

    @app.get("/v1/models")
    async def list_models():
        return routes.models()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        return await _serve(routes, body, http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request):
        return await _serve(routes, body, http, chat=True)


async def _serve(routes: OpenAIRoutes, body: SamplingKeys, http: Request, chat: bool):
    worker = routes.worker
    if not worker.ready.is_set():
        return _error(503, "the engine is still loading; retry in a moment")
    if worker.load_error is not None:
        return _error(503, f"the engine failed to load: {worker.load_error}")
    try:
        routes.check_model(body.model)
    except LookupError as err:
        return _error(404, str(err))
    try:
        refuse_unsupported(body)
        if chat:
            template_kwargs = dict(body.chat_template_kwargs or {})
            if body.tools and body.tool_choice != "none":
                if not template_takes_tools(routes.tokenizer):
                    raise RolloutError("this model's chat template does not render tools, so the model would never "
                                       "see them; use a checkpoint whose template takes tools, or describe them in "
                                       "the messages")
                template_kwargs["tools"] = body.tools
            messages, image_parts = chat_messages(body.messages)
            ids, images = await encode_chat(routes, messages, image_parts, template_kwargs)
            prompts, prompt_images = [ids], [images]
            max_tokens = body.max_completion_tokens or body.max_tokens
            if max_tokens is None:  # up to the context length, as vLLM does
                max_tokens = max(1, worker.engine.max_model_len - len(prompts[0]))
        else:
            prompt = body.prompt
            many = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
            prompts = [routes.encode(p) for p in (prompt if many else [prompt])]
            prompt_images = None
            max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        check_samples(body, prompts)
        params = sampling_params(body, max_tokens)
        if stop_strings(body) and routes.tokenizer is None:
            raise RolloutError("stop strings need the model's tokenizer files; pass stop_token_ids instead")
        request_id = body.request_id or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        request = OnlineRequest(request_id, prompts, params, worker.engine.tokenizer, stream=body.stream,
                                session_id=body.session_id, images=prompt_images)
        await asyncio.wrap_future(worker.submit_online(request))
    except Conflict as err:
        return _error(409, str(err))
    except RolloutError as err:
        return _error(400, str(err))
    shape = _ResponseShape(routes, body, request, chat)
    if body.stream:
        return StreamingResponse(_stream_events(routes, request, shape), media_type="text/event-stream")
    return await _whole_response(routes, request, shape, http)


async def _whole_response(routes: OpenAIRoutes, request: OnlineRequest, shape: "_ResponseShape", http: Request):
    choices: list[Choice] = []
    try:
        while len(choices) < request.num_samples:
            try:
                event = await asyncio.wait_for(request.events.get(), DISCONNECT_POLL_SECONDS)
            except asyncio.TimeoutError:
                if await http.is_disconnected():  # nobody will read the answer: free the engine
                    routes.worker.submit("abort", request_id=request.request_id)
                    return JSONResponse({})
                continue
            if event[0] == "error":
                return _error(500, event[1])
            if event[0] == "finish":
                choices.append(event[1])
    except asyncio.CancelledError:
        routes.worker.submit("abort", request_id=request.request_id)
        raise
    return shape.whole(sorted(choices, key=lambda c: c.index))


async def _stream_events(routes: OpenAIRoutes, request: OnlineRequest, shape: "_ResponseShape"):
    finished = 0
    try:
        if shape.chat:
            yield from_chunk(shape.first_chunk())
        while finished < request.num_samples:
            event = await request.events.get()
            if event[0] == "error":
                yield from_chunk({"error": {"message": event[1], "type": "InternalServerError", "code": 500}})
                return
            if event[0] == "delta":
                _, index, token_ids, logprobs, text, tops = event
                yield from_chunk(shape.chunk(index, token_ids, logprobs, text, None, tops))
            else:
                choice = event[1]
                token_ids, logprobs, text, tops = shape.rest_of(choice)
                yield from_chunk(shape.chunk(choice.index, token_ids, logprobs, text, choice, tops))
                finished += 1
        if shape.include_usage or shape.session is not None:
            yield from_chunk(shape.usage_chunk())
        yield "data: [DONE]\n\n"
    finally:
        if finished < request.num_samples:  # the client went away mid-stream: free the engine
            routes.worker.submit("abort", request_id=request.request_id)


def from_chunk(payload: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(payload)}\n\n"


class _ResponseShape:
    """Builds OpenAI's response objects (whole, or streamed chunks) for one request."""

    def __init__(self, routes: OpenAIRoutes, body: SamplingKeys, request: OnlineRequest, chat: bool):
        self.routes = routes
        self.request = request
        self.chat = chat
        self.model = body.model
        self.want_logprobs = body.logprobs is not None if not chat else bool(body.logprobs)
        self.return_token_ids = body.return_token_ids
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        # chat with tools: Hermes-style <tool_call> blocks become tool_calls (server/tool_calls.py)
        self.parse_tools = chat and bool(body.tools) and body.tool_choice != "none"
        self.created = int(time.time())
        self._sent: dict[int, tuple[int, int]] = {}  # choice index -> (tokens, characters) streamed
        self._tool_streams: dict[int, ToolCallStream] = {}  # streamed chat with tools: each choice's parse
        self._completion_tokens = 0
        self._cached_tokens = 0  # prompt tokens the prefix cache served (each prompt's first sample)
        self.session: dict | None = None  # a session turn: the session's statistics after it

    @property
    def object_name(self) -> str:
        if self.chat:
            return "chat.completion.chunk" if self.request.stream else "chat.completion"
        return "text_completion"

    def _head(self) -> dict:
        return {"id": self.request.request_id, "object": self.object_name, "created": self.created,
                "model": self.model}

    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.request.prompts)
        return {"prompt_tokens": prompt, "completion_tokens": self._completion_tokens,
                "total_tokens": prompt + self._completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self._cached_tokens}}

    def _finished(self, choice: Choice) -> None:
        """Counts a finished choice adds to usage, and a session turn's statistics."""
        if choice.index % self.request.params.n == 0:
            self._cached_tokens += choice.cached_prompt_tokens
        if choice.session is not None:
            self.session = choice.session

    def _logprobs(self, token_ids: list[int], logprobs: list[float], offset: int, tops: list) -> dict | None:
        """OpenAI's logprobs object for these tokens; `tops` per token: its (token id, logprob) pairs
        (top_logprobs asked), or None."""
        if not self.want_logprobs:
            return None
        strings = self.routes.token_strings(token_ids)
        alternatives = [self.routes.token_strings([t for t, _ in top]) if top else [] for top in tops]
        if self.chat:
            return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")),
                                 "top_logprobs": [{"token": a, "logprob": v, "bytes": list(a.encode("utf-8"))}
                                                  for a, (_, v) in zip(names, top or ())]}
                                for s, lp, top, names in zip(strings, logprobs, tops, alternatives, strict=True)]}
        offsets, at = [], offset
        for s in strings:
            offsets.append(at)
            at += len(s)
        top_maps = None
        if any(top is not None for top in tops):  # legacy completions: one {token: logprob} map per position
            top_maps = [{a: v for a, (_, v) in zip(names, top or ())} for top, names in zip(tops, alternatives)]
        return {"tokens": strings, "token_logprobs": logprobs, "top_logprobs": top_maps, "text_offset": offsets}

    def _ids(self, choice_out: dict, choice: Choice | None, token_ids: list[int]) -> None:
        """return_token_ids: the choice's token ids (new ones when streaming), its prompt's, the versions."""
        if not self.return_token_ids:
            return
        choice_out["token_ids"] = token_ids
        if choice is not None:
            choice_out["prompt_token_ids"] = self.request.prompts[choice.prompt]
            choice_out["weight_versions"] = choice.weight_versions
            choice_out["stop_reason"] = choice.stop_reason

    # ---- a whole response ------------------------------------------------------------

    def whole(self, choices: list[Choice]) -> dict:
        out = []
        for c in choices:
            self._completion_tokens += len(c.token_ids)
            self._finished(c)
            item: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                                    "logprobs": self._logprobs(c.token_ids, c.logprobs, 0, c.top_logprobs)}
            if self.chat:
                item["message"] = {"role": "assistant", "content": c.text}
                if self.parse_tools:
                    parsed = parse_tool_calls(c.text)
                    if parsed.tool_calls:
                        item["message"] = {"role": "assistant", "content": parsed.content,
                                           "tool_calls": parsed.tool_calls}
                        item["finish_reason"] = "tool_calls"
            else:
                item["text"] = c.text
            self._ids(item, c, c.token_ids)
            if c.sampling_mask is not None:  # per returned token, the ids top_k / top_p / min_p kept
                item["sampling_mask"] = c.sampling_mask
            out.append(item)
        response = {**self._head(), "choices": out, "usage": self.usage()}
        if self.chat and self.return_token_ids:
            response["prompt_token_ids"] = self.request.prompts[0]
        if self.session is not None:
            response["session"] = self.session
        return response

    # ---- streamed chunks ---------------------------------------------------------------

    def first_chunk(self) -> dict:
        """Chat: the assistant role of every choice, before any content (as OpenAI streams it)."""
        return {**self._head(), "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}
                                            for i in range(self.request.num_samples)]}

    def rest_of(self, choice: Choice) -> tuple[list[int], list[float], str, list]:
        """What a finished choice holds beyond what was streamed of it."""
        tokens, chars = self._sent.get(choice.index, (0, 0))
        return choice.token_ids[tokens:], choice.logprobs[tokens:], choice.text[chars:], choice.top_logprobs[tokens:]

    def chunk(self, index: int, token_ids: list[int], logprobs: list[float], text: str,
              finished: Choice | None, tops: list) -> dict:
        tokens, chars = self._sent.get(index, (0, 0))
        self._sent[index] = (tokens + len(token_ids), chars + len(text))
        self._completion_tokens += len(token_ids)
        if finished is not None:
            self._finished(finished)
        item: dict[str, Any] = {"index": index, "logprobs": self._logprobs(token_ids, logprobs, chars, tops),
                                "finish_reason": finished.finish_reason if finished else None,
                                "stop_reason": finished.stop_reason if finished else None}
        if self.chat and self.parse_tools:
            item["delta"] = self._tool_delta(index, text, finished is not None)
            if finished is not None and self._tool_streams[index].num_calls:
                item["finish_reason"] = "tool_calls"
        elif self.chat:
            item["delta"] = {"content": text}
        else:
            item["text"] = text
        self._ids(item, finished, token_ids)
        return {**self._head(), "choices": [item]}

    def _tool_delta(self, index: int, text: str, last: bool) -> dict:
        """A streamed choice's delta with tools: the text outside calls as content, each call once whole."""
        stream = self._tool_streams.setdefault(index, ToolCallStream())
        first = stream.num_calls
        content, calls = stream.feed(text)
        if last:
            content += stream.finish()
        delta: dict[str, Any] = {"content": content}
        if calls:
            delta["tool_calls"] = [{"index": first + i, **call} for i, call in enumerate(calls)]
        return delta

    def usage_chunk(self) -> dict:
        """After the last choice: usage (stream_options.include_usage) and a session turn's statistics."""
        chunk = {**self._head(), "choices": [], "usage": self.usage() if self.include_usage else None}
        if self.session is not None:
            chunk["session"] = self.session
        return chunk
