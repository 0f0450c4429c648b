"""Where the text of a sample that a stop rule ended stops: vLLM's rule, in one place.

The engine's rows (Engine.trajectory through Request.text, episode turns) and the OpenAI routes
(server/text_stream.py) both cut with these functions, so a row and an API answer over the same tokens
hold the same text. Token ids, logprobs and every other per-token column keep all the tokens: only
the text is cut (a trainer needs every sampled token; a reward function reads the text).

vLLM's rule (SamplingParams.include_stop_str_in_output, default False):
  - a stop string: the text ends just before the occurrence the last token completed; with the flag,
    just after it (characters of that token past the string are dropped either way: vLLM's
    check_stop_strings truncates to the string's end);
  - a stop token id or eos (vLLM's "stop_terminated" samples: its detokenizer skips the last token
    unless the flag is set): the text leaves that token out; with the flag it is decoded as the others
    are, so a special token still adds nothing (skip_special_tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def drops_last_token(finish_reason: str | None, stop_reason: str | int | None, include: bool) -> bool:
    """Whether the last token's text is left out: the sample ended on a stop token id or eos
    (finish_reason "stop" without a stop string) and the flag is off."""
    return finish_reason == "stop" and not isinstance(stop_reason, str) and not include


def text_end(text: str, stop: str, tail_start: int, include: bool) -> int:
    """Where `text` ends when the stop string `stop` ended its sample: `tail_start` is where the last
    token's characters begin (no earlier occurrence ended the sample, so the search starts within a
    stop string's length of it). An occurrence the text does not hold (a tokenizer whose decode
    differs from its tokens' bytes: engine/scheduling/stop_strings.py) leaves the text whole."""
    at = text.find(stop, max(0, tail_start - len(stop) + 1))
    if at < 0:
        return len(text)
    return at + len(stop) if include else at


def stopped_text(decode: Callable[[Sequence[int]], str], token_ids: Sequence[int], finish_reason: str | None,
                 stop_reason: str | int | None, include: bool) -> str:
    """The text of a whole response (`decode` gives the text of ids, special tokens skipped), cut by
    the stop rule that ended it (module docstring)."""
    if not token_ids:
        return ""
    if drops_last_token(finish_reason, stop_reason, include):
        return decode(token_ids[:-1])
    text = decode(token_ids)
    if finish_reason != "stop" or not isinstance(stop_reason, str):
        return text
    before = decode(token_ids[:-1])
    # the characters both decodes share come before the last token's (a character the last token
    # completes shows as U+FFFD in `before`, so it is not shared)
    shared = next((i for i, (a, b) in enumerate(zip(before, text)) if a != b), min(len(before), len(text)))
    return text[:text_end(text, stop_reason, shared, include)]
