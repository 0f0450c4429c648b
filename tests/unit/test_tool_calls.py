"""Tool calls parsed out of a chat completion's text (server/tool_calls.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from rollout_cli.server.tool_calls import parse_tool_calls, template_takes_tools


def test_hermes_blocks_become_tool_calls_and_the_rest_stays_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>')
    parsed = parse_tool_calls(text)
    assert parsed.content == "Let me check."
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["get_weather", "add"]
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert parsed.tool_calls[1]["function"]["arguments"] == '{"a": 1}'  # a string stays as written
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in parsed.tool_calls)
    assert len({c["id"] for c in parsed.tool_calls}) == 2


def test_only_calls_leave_no_content_and_broken_blocks_stay_text():
    only = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert only.content is None and only.tool_calls[0]["function"]["arguments"] == "{}"
    broken = '<tool_call>{"name": "f", "arguments": </tool_call> and <tool_call>[1, 2]</tool_call>'
    assert parse_tool_calls(broken).content == broken and parse_tool_calls(broken).tool_calls == []
    assert parse_tool_calls("no calls here") .content == "no calls here"


def test_templates_that_render_tools_are_told_apart():
    assert template_takes_tools(SimpleNamespace(chat_template="{% if tools %}{{ tools | tojson }}{% endif %}"))
    assert not template_takes_tools(SimpleNamespace(chat_template="{% for m in messages %}{{ m.content }}{% endfor %}"))
    assert not template_takes_tools(None)


def _streamed(text: str, step: int):
    """Feed `text` in pieces of `step` characters -> (content, calls)."""
    from rollout_cli.server.tool_calls import ToolCallStream

    stream, content, calls = ToolCallStream(), [], []
    for i in range(0, len(text), step):
        delta, done = stream.feed(text[i:i + step])
        content.append(delta)
        calls.extend(done)
    content.append(stream.finish())
    assert stream.num_calls == len(calls)
    return "".join(content), calls


def _shape(calls):
    return [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_streamed_calls_equal_the_whole_parse_at_any_split():
    texts = [
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call> done',
        '<tool_call>{"name": "f", "arguments": </tool_call> then <tool_call>{"name": "g"}</tool_call>',  # broken, then a call
        "a < b and <tool_ca are not tags; <tool_call> never closed",
        "no calls here",
    ]
    for text in texts:
        whole = parse_tool_calls(text)
        for step in (1, 2, 5, 11, len(text)):
            content, calls = _streamed(text, step)
            assert _shape(calls) == _shape(whole.tool_calls), (text, step)
            assert content.strip() == (whole.content or "").strip() or (
                # whitespace around removed calls: the streamed content keeps it
                " ".join(content.split()) == " ".join((whole.content or "").split())), (text, step)
    assert _streamed(texts[2], 1)[0] == texts[2]  # nothing that is not a finished call is ever dropped


def test_a_streamed_chat_sends_each_call_once_whole_and_ends_with_tool_calls():
    """The streamed response's chunks (server/openai_api.py's _ResponseShape) for an answer that writes
    a call across several deltas: content before it, one tool_calls delta, finish_reason tool_calls."""
    from rollout_cli.server.online import Choice
    from rollout_cli.server.openai_api import _ResponseShape

    body = SimpleNamespace(model="m", logprobs=False, return_token_ids=False, stream_options=None,
                           tools=[{"type": "function"}], tool_choice="auto")
    request = SimpleNamespace(request_id="r", stream=True, params=SimpleNamespace(n=1), num_samples=1, prompts=[[1]])
    shape = _ResponseShape(SimpleNamespace(), body, request, chat=True)
    pieces = ["Sure. <tool", '_call>{"name": "add", ', '"arguments": {"a": 1}}</tool_', "call>"]
    deltas = [shape.chunk(0, [i], [0.0], piece, None, [None])["choices"][0] for i, piece in enumerate(pieces)]
    final = Choice(0, 0, list(range(5)), [0.0] * 5, "".join(pieces) + "\n", "stop")
    deltas.append(shape.chunk(0, [4], [0.0], "\n", final, [None])["choices"][0])
    assert "".join(d["delta"]["content"] for d in deltas) == "Sure. \n"
    calls = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["function"]["name"] == "add"
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1}
    assert deltas[-1]["finish_reason"] == "tool_calls" and all(d["finish_reason"] is None for d in deltas[:-1])
