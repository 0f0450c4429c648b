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
