"""The OpenAI API's request bodies (pydantic, unknown keys refused) and their translation into the
engine's terms: sampling settings, stop rules, chat messages; keys the engine cannot honour are refused
by name (server/openai_api.py serves them)."""

from __future__ import annotations

import secrets
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.errors import RolloutError
from rollout_cli.server.openai_images import IMAGE_PART_TYPES, ImagePart

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class OpenAIBody(BaseModel):
    """Unknown keys are refused (with the nearest valid one), as on every route of the daemon."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(OpenAIBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingKeys(OpenAIBody):
    """The keys both generation routes share: OpenAI's, then the extensions."""

    model: str
    n: int = 1
    temperature: Optional[float] = None  # None: OpenAI's default, 1
    top_p: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # extensions (vLLM's names)
    top_k: int = 0
    min_p: float = 0.0
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    include_stop_str_in_output: bool = False  # the stop string (or stop token's text) stays in the text
    return_token_ids: bool = False
    request_id: Optional[str] = Field(None, max_length=256)
    session_id: Optional[str] = Field(None, max_length=256)
    logprobs_mode: Literal["processed", "raw"] = "processed"
    return_sampling_mask: bool = False  # SGLang's name: each choice's sampling_mask (whole responses only)


class CompletionRequest(SamplingKeys):
    prompt: Union[list[int], list[list[int]], str, list[str]]
    max_tokens: Optional[int] = COMPLETIONS_DEFAULT_MAX_TOKENS
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class ChatMessage(BaseModel):
    """A chat message as the template reads it; keys beyond role and content (tool_calls, name,
    reasoning_content, ...) go to the chat template as they are."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None


class ChatCompletionRequest(SamplingKeys):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = None  # None: up to --max-model-len
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    response_format: Optional[dict[str, Any]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


def refuse_unsupported(body: SamplingKeys) -> None:
    """Keys the engine cannot honour are refused by name rather than ignored."""
    if body.presence_penalty or body.frequency_penalty:
        raise RolloutError("presence_penalty and frequency_penalty are not supported; leave them at 0")
    if body.logit_bias:
        raise RolloutError("logit_bias is not supported; leave it out")
    if isinstance(body, CompletionRequest):
        if body.echo:
            raise RolloutError("echo is not supported; with return_token_ids the response carries prompt_token_ids")
        if body.suffix:
            raise RolloutError("suffix is not supported; leave it out")
        if body.best_of not in (None, body.n):
            raise RolloutError("best_of is not supported; use n and pick among the choices")
    if body.return_sampling_mask and body.stream:
        raise RolloutError("return_sampling_mask comes with whole responses only; send stream false")
    if not 0 <= top_logprobs_of(body) <= MAX_TOP_LOGPROBS:
        raise RolloutError(f"{'top_logprobs' if isinstance(body, ChatCompletionRequest) else 'logprobs'} must be in "
                           f"[0, {MAX_TOP_LOGPROBS}]: the number of most likely tokens returned per position")
    if not isinstance(body, CompletionRequest):
        if body.top_logprobs and not body.logprobs:
            raise RolloutError("top_logprobs needs logprobs true")
        if body.tool_choice not in (None, "none", "auto"):
            raise RolloutError(f"tool_choice {body.tool_choice!r} would need constrained decoding, which this engine "
                               "does not do; pass auto (the model decides) or none")
        if body.response_format and body.response_format.get("type") not in (None, "text"):
            raise RolloutError("response_format other than text is not supported; leave it out")


# Samples one HTTP request may ask for (prompts x n): each holds its text stream and, unless streamed,
# its whole answer until the response goes out, so an unbounded n could take the daemon's memory and
# every request in flight with it. 65,536 is far above any GRPO group (vLLM's and SGLang's RL users
# send n <= 512); a larger rollout is a `rollout run` job or several requests.
MAX_SAMPLES_PER_REQUEST = 65536


def check_samples(body: SamplingKeys, prompts: list[list[int]]) -> None:
    """n is at least 1 and the request's samples within MAX_SAMPLES_PER_REQUEST; one session turn is one sample."""
    if body.n < 1:
        raise RolloutError(f"n must be at least 1, got {body.n}")
    if body.n * len(prompts) > MAX_SAMPLES_PER_REQUEST:
        raise RolloutError(f"n {body.n} x {len(prompts)} prompt(s) asks for {body.n * len(prompts):,} samples; one "
                           f"request takes at most {MAX_SAMPLES_PER_REQUEST:,}: split it into several requests")
    if body.session_id is not None and (body.n != 1 or len(prompts) != 1):
        raise RolloutError("a session_id request is one turn of one conversation: pass one prompt and n 1 "
                           "(several samples of a turn branch the conversation; send them without session_id)")


MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs


def top_logprobs_of(body: SamplingKeys) -> int:
    """How many most likely tokens per position the body asks for: completions' integer logprobs,
    chat's top_logprobs."""
    if isinstance(body, CompletionRequest):
        return body.logprobs or 0
    return body.top_logprobs or 0


def sampling_params(body: SamplingKeys, max_tokens: int) -> SamplingParams:
    return SamplingParams(
        n=body.n, max_new_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k, min_p=body.min_p,
        seed=secrets.randbelow(2**31) if body.seed is None else body.seed,
        ignore_eos=body.ignore_eos, logprobs_mode=body.logprobs_mode, top_logprobs=top_logprobs_of(body),
        return_sampling_mask=body.return_sampling_mask,
        # the engine ends a sample at its stop rules itself (no token past them is generated) and names the
        # rule; the text is cut there as `rollout run`'s rows are (scheduling/stop_text.py, text_stream.py)
        stop=stop_strings(body), stop_token_ids=tuple(body.stop_token_ids),
        include_stop_str_in_output=body.include_stop_str_in_output,
    )


def stop_strings(body: SamplingKeys) -> tuple[str, ...]:
    """The body's stop strings; an empty one (which ends nothing in OpenAI's API) is dropped."""
    if body.stop is None:
        return ()
    return tuple(s for s in ((body.stop,) if isinstance(body.stop, str) else body.stop) if s)


def chat_messages(messages: list[ChatMessage]) -> tuple[list[dict[str, Any]], list[ImagePart]]:
    """Messages for the chat template, and the image parts they hold in order (openai_images.py reads
    them). A message's text parts are joined into one string; a message with image parts keeps its parts
    in order, text as {type: text} and each image as {type: image}, which the template places. Other
    part types are refused."""
    out, images = [], []
    for k, message in enumerate(messages):
        item = message.model_dump(exclude_none=True)
        content = item.get("content")
        if isinstance(content, list):
            kinds = [part.get("type") for part in content]
            unknown = sorted(set(kinds) - {"text"} - IMAGE_PART_TYPES, key=str)
            if unknown:
                raise RolloutError(f"message {k} has content parts of type {unknown}; this engine takes text and "
                                   "image parts (image_url, image)")
            if IMAGE_PART_TYPES.intersection(kinds):
                parts = []
                for j, part in enumerate(content):
                    if part["type"] == "text":
                        parts.append({"type": "text", "text": part.get("text")})
                    else:
                        images.append(ImagePart(k, j, part))
                        parts.append({"type": "image"})
                item["content"] = parts
            else:
                item["content"] = "".join(part.get("text", "") for part in content)
        item.setdefault("content", "")
        out.append(item)
    return out, images
