"""top_logprobs over the daemon's OpenAI API (chat's `logprobs` + `top_logprobs`, completions' integer
`logprobs`), the official client against a real daemon: the alternatives are the engine's
(Trajectory.response_top_logprobs), whole and streamed alike."""

from __future__ import annotations

import pytest

from rollout_cli import Engine, SamplingParams
from test_daemon import MODEL
from test_openai_api import server  # noqa: F401 - the module's daemon fixture

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


def test_chat_top_logprobs_are_the_engines_and_stream_alike(server):  # noqa: F811
    client = server["client"]
    kwargs = dict(model="example", messages=MESSAGES, max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=3,
                  extra_body={"return_token_ids": True, "ignore_eos": True})
    whole = client.chat.completions.create(**kwargs).choices[0]
    content = whole.logprobs.content
    assert len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob  # greedy
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
    # the engine's own lists for the same prompt ids
    engine = Engine(str(MODEL), device="cpu", max_model_len=256, max_running=2)
    prompt_ids = whole.model_extra["prompt_token_ids"]
    ours = engine.generate([prompt_ids], SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True,
                                                        top_logprobs=3))[0]
    assert whole.model_extra["token_ids"] == ours.response_token_ids
    for entry, top in zip(content, ours.response_top_logprobs, strict=True):
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([v for _, v in top], abs=1e-5)
    streamed = [c for chunk in client.chat.completions.create(**kwargs, stream=True) for c in chunk.choices
                if c.logprobs is not None and c.logprobs.content]
    entries = [e for c in streamed for e in c.logprobs.content]
    # the same tokens; logprobs within float32 noise: the streamed request's prompt comes from the prefix
    # cache, so its prefill runs other shapes, and CPU kernels may round those apart in the last bit
    assert [[t.token for t in e.top_logprobs] for e in entries] == [[t.token for t in e.top_logprobs] for e in content]
    for streamed_entry, entry in zip(entries, content, strict=True):
        assert [t.logprob for t in streamed_entry.top_logprobs] == \
            pytest.approx([t.logprob for t in entry.top_logprobs], abs=1e-5)


def test_completions_integer_logprobs_give_one_map_per_position(server):  # noqa: F811
    response = server["client"].completions.create(model="example", prompt="Count to five:", max_tokens=5,
                                                   temperature=0.0, logprobs=2, extra_body={"ignore_eos": True})
    logprobs = response.choices[0].logprobs
    assert len(logprobs.top_logprobs) == len(logprobs.tokens) == 5
    for token, logprob, alternatives in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs,
                                            strict=True):
        assert 1 <= len(alternatives) <= 2 and alternatives.get(token) == logprob
    plain = server["client"].completions.create(model="example", prompt="Count to five:", max_tokens=2, logprobs=0)
    assert plain.choices[0].logprobs.top_logprobs is None


def test_sampling_masks_come_with_whole_responses(server):  # noqa: F811
    """return_sampling_mask (an extension, SGLang's name): per returned token the ids the filters kept, the
    token among them, as many lists as tokens; a streamed request asking for them is one 400 line."""
    client = server["client"]
    kwargs = dict(model="example", messages=MESSAGES, max_tokens=5, temperature=0.9, seed=3,
                  extra_body={"return_token_ids": True, "ignore_eos": True, "top_k": 6, "return_sampling_mask": True})
    choice = client.chat.completions.create(**kwargs).choices[0]
    tokens, masks = choice.model_extra["token_ids"], choice.model_extra["sampling_mask"]
    assert len(tokens) == len(masks) == 5
    assert all(token in ids and len(ids) <= 6 for token, ids in zip(tokens, masks, strict=True))
    plain = client.chat.completions.create(**{**kwargs, "extra_body": {"top_k": 6}}).choices[0]
    assert "sampling_mask" not in plain.model_extra
    import openai

    with pytest.raises(openai.BadRequestError, match="whole responses only"):
        client.chat.completions.create(**kwargs, stream=True)
    with pytest.raises(openai.BadRequestError, match="set one of them"):
        client.chat.completions.create(**{**kwargs, "extra_body": {"return_sampling_mask": True}})
