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
