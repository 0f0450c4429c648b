"""The text of a sample a stop rule ended (engine/scheduling/stop_text.py: vLLM's include_stop_str_in_output rule),
as the engine's rows (Request.text, a replayed episode turn) and the OpenAI routes (SampleText) give it:
one rule, so the two paths agree token for token. The expectations are written with tokenizer.decode."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.engine.scheduling.request_maker import RequestMaker
from rollout_cli.engine.scheduling.stop_text import stopped_text, text_end
from rollout_cli.engine.trajectory import PartialSample, PromptInput
from rollout_cli.server.text_stream import SampleText

MODEL = Path(__file__).resolve().parents[2] / "recipes" / "example_model"
EOS = 2  # the example model's <|im_end|>, a special token


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(MODEL))


def _decode(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def _run(maker: RequestMaker, ids: list[int], params: SamplingParams, prompt=(5,)):
    """A request fed `ids` until a rule ends it; -> the request."""
    request = maker.samples(PromptInput(0, list(prompt)), params, set())[0]
    for t in ids:
        request.append_token(t, -0.5)
        if request.finish_reason:
            break
    return request


def _api_text(tokenizer, request, one_by_one: bool) -> str:
    """The OpenAI routes' text of the same sample: SampleText fed as a streaming request (token by token
    while it runs, the rest at its end) or as a whole one (everything at the end)."""
    params = request.params
    text = SampleText(tokenizer, params.stop, params.include_stop_str_in_output)
    ids, logprobs = request.output_token_ids, request.output_logprobs
    streamed = []
    if one_by_one:  # a stopped sample's last token reaches SampleText only with its end (the engine finished it)
        for t, lp in zip(ids[:-1], logprobs[:-1]):
            text.feed([t], [lp])
            streamed.append(text.visible_text(final=False))
    text.finish(ids, logprobs, None, request.finish_reason, request.stop_reason)
    final = text.visible_text(final=True)
    assert all(final.startswith(s) for s in streamed)  # nothing streamed is taken back by the cut
    assert text.token_ids == ids and text.logprobs == logprobs  # the ids keep every token
    return final


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_cuts_the_text_and_never_the_tokens(tokenizer, include):
    maker = RequestMaker(len(tokenizer), frozenset({EOS}), 256, tokenizer=tokenizer)
    ids = tokenizer.encode("The answer is 42. Then more text follows here.")
    params = SamplingParams(stop=("42.", "absent"), include_stop_str_in_output=include, max_new_tokens=64)
    request = _run(maker, ids, params)
    assert request.stop_reason == "42." and request.output_token_ids == ids[: len(request.output_token_ids)]
    full = tokenizer.decode(request.output_token_ids)
    want = "The answer is 42." if include else "The answer is "
    assert full.startswith(want)
    assert request.text(_decode(tokenizer)) == want
    for one_by_one in (False, True):
        assert _api_text(tokenizer, request, one_by_one) == want


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_id_or_eos_leaves_its_text_out_unless_the_flag_keeps_it(tokenizer, include):
    """vLLM skips the last token of a stop-terminated sample (stop token id or eos) in its detokenizer
    unless include_stop_str_in_output; a special token (eos here) has no text either way."""
    maker = RequestMaker(len(tokenizer), frozenset({EOS}), 256, tokenizer=tokenizer)
    ids = tokenizer.encode("one two three four")
    params = SamplingParams(stop_token_ids=(ids[2],), include_stop_str_in_output=include, max_new_tokens=64)
    request = _run(maker, ids, params)
    assert request.stop_reason == ids[2] and request.output_token_ids == ids[:3]
    want = tokenizer.decode(ids[:3] if include else ids[:2])
    assert request.text(_decode(tokenizer)) == want and _api_text(tokenizer, request, True) == want
    ended = _run(maker, ids[:2] + [EOS], SamplingParams(include_stop_str_in_output=include, max_new_tokens=64))
    assert (ended.finish_reason, ended.stop_reason) == ("stop", None)
    assert ended.text(_decode(tokenizer)) == tokenizer.decode(ids[:2]) == _api_text(tokenizer, ended, False)


def test_other_endings_keep_the_whole_text(tokenizer):
    maker = RequestMaker(len(tokenizer), frozenset({EOS}), 256, tokenizer=tokenizer)
    ids = tokenizer.encode("no stop string here at all")
    request = _run(maker, ids, SamplingParams(stop=("zzz",), stop_token_ids=(EOS,), max_new_tokens=len(ids)))
    assert request.finish_reason == "length" and request.text(_decode(tokenizer)) == tokenizer.decode(ids)
    for reason in ("abort", "length"):
        assert stopped_text(_decode(tokenizer), ids, reason, None, False) == tokenizer.decode(ids)
    assert stopped_text(_decode(tokenizer), [], "stop", "x", False) == ""


def test_a_continued_sample_is_cut_where_its_last_token_completed_the_string(tokenizer):
    """A response carried over (PartialSample) may hold the stop string already (it ended nothing then:
    stop_strings.py); the text is cut at the occurrence the last token completed, not that one."""
    maker = RequestMaker(len(tokenizer), frozenset({EOS}), 256, tokenizer=tokenizer)
    head, tail = tokenizer.encode("a </answer> b </ans"), tokenizer.encode("wer> c")
    params = SamplingParams(stop=("</answer>",), max_new_tokens=64)
    request = maker.partial(PartialSample(0, 0, [5], head, [0.0] * len(head), [""] * len(head)), params)
    for t in tail:
        request.append_token(t, 0.0)
        if request.finish_reason:
            break
    assert request.stop_reason == "</answer>"
    assert request.text(_decode(tokenizer)) == "a </answer> b "
    assert _api_text(tokenizer, request, False) == "a </answer> b "


def test_text_end_reads_the_window_of_the_last_token():
    assert text_end("ab STOP cd", "STOP", 4, False) == 3 and text_end("ab STOP cd", "STOP", 4, True) == 7
    assert text_end("STOP ab STOP", "STOP", 10, False) == 8  # the earlier one ended nothing
    assert text_end("abc", "STOP", 2, False) == 3  # a string decode does not show: the whole text


def test_rows_and_the_api_agree_on_random_responses(tokenizer):
    """Random responses of the example vocabulary (multi-byte characters included) with stop strings
    taken from their own text: the row's text (Request.text), the replayed episode turn's
    (RequestMaker.replayed_turn) and the API's (streamed or whole) are one text, vLLM's."""
    rng = random.Random(0)
    maker = RequestMaker(len(tokenizer), frozenset({EOS}), 512, tokenizer=tokenizer)
    decode = _decode(tokenizer)
    stops_seen = 0
    for trial in range(60):
        ids = tokenizer.encode("héllo wörld — ✓ 数学 🙂 done " * 2) if trial % 4 == 0 else []
        ids += [rng.randrange(3, len(tokenizer)) for _ in range(rng.randrange(4, 40))]
        text = decode(ids)
        start = rng.randrange(0, max(1, len(text) - 3))
        stop = text[start: start + rng.randrange(1, 4)].replace("\ufffd", "") or "x"
        params = SamplingParams(stop=(stop,), include_stop_str_in_output=trial % 2 == 1, max_new_tokens=len(ids))
        request = _run(maker, ids, params)
        row = request.text(decode)
        if request.finish_reason == "stop":
            stops_seen += 1
            whole = decode(request.output_token_ids)
            assert row == whole[: whole.find(stop) + (len(stop) if params.include_stop_str_in_output else 0)]
        assert maker.replayed_turn(request.output_token_ids, params, decode) == (request.finish_reason, row)
        assert _api_text(tokenizer, request, True) == row == _api_text(tokenizer, request, False)
    assert stops_seen > 30
