"""SampleText: a sample's text built token by token, cut where the engine's stop rule ended it
(server/text_stream.py)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rollout_cli.server.text_stream import SampleText

MODEL = Path(__file__).resolve().parents[2] / "recipes" / "example_model"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(MODEL))


def _feed_one_by_one(text: SampleText, ids: list[int]) -> list[str]:
    """Feed ids one at a time; -> the visible text after each."""
    seen = []
    for t in ids:
        text.feed([t], [0.0])
        seen.append(text.visible_text(final=False))
    return seen


def test_incremental_text_equals_one_decode_of_the_whole(tokenizer):
    """Byte-level tokens that end inside a UTF-8 character appear once the character is whole; at the
    end the text is what one decode of all the ids gives."""
    rng = random.Random(0)
    multibyte = tokenizer.encode("héllo wörld — ✓ 数学 🙂 done")
    for trial in range(30):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
        if trial % 3 == 0:
            ids = multibyte + ids
        text = SampleText(tokenizer)
        seen = _feed_one_by_one(text, ids)
        text.finish(ids, [0.0] * len(ids), None, "length", None)
        assert text.text == tokenizer.decode(ids, skip_special_tokens=True)
        for before, after in zip(seen, seen[1:] + [text.text]):
            assert after.startswith(before)  # streamed text is never taken back
    text = SampleText(tokenizer)
    _feed_one_by_one(text, multibyte)
    text.finish(multibyte, [0.0] * len(multibyte), None, "length", None)
    assert text.text == "héllo wörld — ✓ 数学 🙂 done" and "\ufffd" not in text.text


def test_a_stop_string_is_cut_where_the_engine_says(tokenizer):
    """The engine ends the sample with the token that completes the stop string and names it
    (stop_reason); the text ends before it, the ids keep that token (engine/scheduling/stop_text.py)."""
    ids = tokenizer.encode("The answer is 42. Then more text follows here.")
    last = next(i for i in range(len(ids)) if "42." in tokenizer.decode(ids[: i + 1]))
    text = SampleText(tokenizer, stop=("42.", "absent"))
    text.finish(ids[: last + 1], [-1.0] * (last + 1), None, "stop", "42.")
    assert text.text == "The answer is " and text.token_ids == ids[: last + 1]
    kept = SampleText(tokenizer, stop=("42.", "absent"), include_stop_str=True)
    kept.finish(ids[: last + 1], [-1.0] * (last + 1), None, "stop", "42.")
    assert kept.text == "The answer is 42."


def test_a_stop_string_split_over_tokens_is_never_streamed(tokenizer):
    """The characters that could begin a stop string are held back until the sample ends (when the
    engine's stop_reason cuts them) or they cannot begin one."""
    ids = tokenizer.encode("abc STOP here")
    last = next(i for i in range(len(ids)) if "STOP" in tokenizer.decode(ids[: i + 1]))
    text = SampleText(tokenizer, stop=("STOP",))
    seen = _feed_one_by_one(text, ids[:last])  # the engine hands the completing token over with the end
    assert all("STOP" not in s and "STO" not in s for s in seen)
    text.finish(ids[: last + 1], [0.0] * (last + 1), None, "stop", "STOP")
    assert text.visible_text(final=True) == "abc "
    unstopped = SampleText(tokenizer, stop=("zzzz",))
    seen = _feed_one_by_one(unstopped, ids)
    assert seen[-1] == "abc STOP here"[:-3]  # three characters held back while running
    unstopped.finish(ids, [0.0] * len(ids), None, "length", None)
    assert unstopped.visible_text(final=True) == "abc STOP here"
    kept = SampleText(tokenizer, stop=("zzzz",), include_stop_str=True)  # cut only after a stop string
    assert _feed_one_by_one(kept, ids)[-1] == "abc STOP here"


def test_a_stop_token_id_ends_the_sample_with_that_token_and_without_its_text(tokenizer):
    ids = tokenizer.encode("one two three four")
    text = SampleText(tokenizer)
    text.finish(ids[:3], [0.5] * 3, None, "stop", ids[2])
    assert text.token_ids == ids[:3] and text.logprobs == [0.5] * 3 and text.text == tokenizer.decode(ids[:2])


def test_without_a_tokenizer_ids_still_flow(tokenizer):
    text = SampleText(None)
    text.feed([1, 2], [0.0] * 2)
    text.finish([1, 2, 7], [0.0] * 3, None, "stop", 7)
    assert text.token_ids == [1, 2, 7] and text.text == ""
