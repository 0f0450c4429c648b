"""Tool calls in a chat completion: the model's text turned into OpenAI's `tool_calls`.

Qwen2.5, Qwen3 and the other Hermes-style chat templates describe the request's `tools` in the prompt
and have the model answer a call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

(several blocks for several calls). `parse_tool_calls` finds those blocks; a block that is not a JSON
object with a string `name` stays in the text, as the model wrote it. The trainer keeps the token ids
either way: parsing only shapes the answer an agent framework reads.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@dataclass(frozen=True)
class ParsedTurn:
    content: str | None  # the text around the calls (None when only calls were written)
    tool_calls: list[dict]  # OpenAI's shape: {"id", "type": "function", "function": {"name", "arguments": str}}


def parse_tool_calls(text: str) -> ParsedTurn:
    calls, kept, last = [], [], 0
    for match in BLOCK.finditer(text):
        call = _call_of(match.group(1))
        if call is None:
            continue  # not a call: the block stays in the content
        calls.append(call)
        kept.append(text[last:match.start()])
        last = match.end()
    if not calls:
        return ParsedTurn(text, [])
    kept.append(text[last:])
    return ParsedTurn("".join(kept).strip() or None, calls)


class ToolCallStream:
    """The same parse for a streamed answer: text deltas in, (content delta, finished calls) out. Text
    that could begin `<tool_call>` waits until it cannot; a block waits for its `</tool_call>`, then
    becomes a call or, if it is not one, goes out as text. Unlike the whole answer's content, streamed
    content keeps the whitespace around the calls (it went out before the calls were known)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self):
        self.pending = ""  # text not sent yet: a possible start of OPEN, or an unfinished block
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.pending += text
        content, calls = [], []
        while True:
            start = self.pending.find(self.OPEN)
            if start < 0:
                keep = _partial_prefix(self.pending, self.OPEN)
                content.append(self.pending[:len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
                break
            end = self.pending.find(self.CLOSE, start + len(self.OPEN))
            if end < 0:  # the block is still being written
                content.append(self.pending[:start])
                self.pending = self.pending[start:]
                break
            call = _call_of(self.pending[start + len(self.OPEN):end].strip())
            if call is None:  # not a call: the block stays text, as the model wrote it
                content.append(self.pending[:end + len(self.CLOSE)])
            else:
                content.append(self.pending[:start])
                calls.append(call)
            self.pending = self.pending[end + len(self.CLOSE):]
        self.num_calls += len(calls)
        return "".join(content), calls

    def finish(self) -> str:
        """The answer ended: what was held back (an unfinished block included) is text."""
        rest, self.pending = self.pending, ""
        return rest


def _partial_prefix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def _call_of(body: str) -> dict | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"],
                         "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}


def template_takes_tools(tokenizer) -> bool:
    """Whether the chat template renders a request's `tools` (a template without them would drop them
    silently, and the model would never see its tools)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # several named templates
        template = " ".join(template.values())
    return "tools" in template
