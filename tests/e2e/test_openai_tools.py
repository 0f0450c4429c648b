"""Tools over the daemon's OpenAI chat API: a template that renders them is required, the request's
tools and a conversation's tool turns reach the prompt, and a streamed answer with tools equals the
whole one (the call parse itself, at every split of the text: tests/unit/test_tool_calls.py)."""

from __future__ import annotations

import httpx
import openai
import pytest

from test_daemon import MODEL, Daemon, _free_port
from test_openai_api import TOKEN, _decode, server  # noqa: F401 - server: the module's daemon fixture

TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "tool" %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% elif message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def test_tools_need_a_template_that_renders_them(server):  # noqa: F811
    with pytest.raises(openai.BadRequestError, match="chat template does not render tools"):
        server["client"].chat.completions.create(model="example", messages=[{"role": "user", "content": "hi"}],
                                                 tools=[WEATHER])
    with pytest.raises(openai.BadRequestError, match="tool_choice 'required'"):
        server["client"].chat.completions.create(model="example", messages=[{"role": "user", "content": "hi"}],
                                                 tools=[WEATHER], tool_choice="required")


def test_tools_reach_the_prompt_and_tool_turns_render(tmp_path):
    """A checkpoint whose template takes tools: the request's tools are in the prompt, and a conversation
    with an assistant tool call and the tool's answer renders into the next turn's prompt."""
    import shutil

    model = tmp_path / "with_tools"
    shutil.copytree(MODEL, model)
    (model / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    port = _free_port()
    proc = Daemon(["--host", "127.0.0.1", "--port", str(port), "--token-file", token_file], tmp_path / "daemon.log",
                  model=model)
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=TOKEN, max_retries=0, timeout=120)
    try:
        proc.wait_ready(http)
        messages = [{"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
        answer = client.chat.completions.create(model=str(model), messages=messages, tools=[WEATHER], max_tokens=4,
                                                temperature=0.0, extra_body={"return_token_ids": True})
        prompt = _decode(answer.model_extra["prompt_token_ids"])
        assert '"name": "get_weather"' in prompt and "<tool_response>sunny</tool_response>" in prompt
        assert prompt.count("<tool_call>") == 1
        # the untrained model writes no call: its text is the content, the finish reason the engine's
        assert answer.choices[0].finish_reason == "length" and answer.choices[0].message.tool_calls is None
        # streamed with tools (the parse itself, at every split: tests/unit/test_tool_calls.py): the same answer
        chunks = [c.choices[0] for c in client.chat.completions.create(
            model=str(model), messages=messages, tools=[WEATHER], max_tokens=4, temperature=0.0, stream=True)
            if c.choices]
        assert "".join(c.delta.content or "" for c in chunks) == answer.choices[0].message.content
        assert all(not c.delta.tool_calls for c in chunks) and chunks[-1].finish_reason == "length"
        plain = client.chat.completions.create(model=str(model), messages=messages[:1], max_tokens=4,
                                               extra_body={"return_token_ids": True})
        assert "<tools>" not in _decode(plain.model_extra["prompt_token_ids"])  # no tools, none rendered
    finally:
        client.close()
        http.close()
        proc.kill()
