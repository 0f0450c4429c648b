"""SampleText: a sample's text built token by token, and the OpenAI stop rules (server/text_stream.py)."""

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
        text.finish()
        assert text.text == tokenizer.decode(ids, skip_special_tokens=True)
        for before, after in zip(seen, seen[1:] + [text.text]):
            assert after.startswith(before)  # streamed text is never taken back
    text = SampleText(tokenizer)
    _feed_one_by_one(text, multibyte)
    text.finish()
    assert text.text == "héllo wörld — ✓ 数学 🙂 done" and "\ufffd" not in text.text


def test_a_stop_string_ends_the_sample_at_the_token_that_completes_it(tokenizer):
    ids = tokenizer.encode("The answer is 42. Then more text follows here.")
    text = SampleText(tokenizer, stop=("42.", "absent"))
    taken = text.feed(ids, [-1.0] * len(ids))
    assert text.stopped and text.stop_reason == "42."
    assert text.text == "The answer is "
    assert taken == len(text.token_ids) < len(ids)
    assert "42." in tokenizer.decode(text.token_ids) and "42." not in tokenizer.decode(text.token_ids[:-1])
    assert text.feed(ids[taken:], [0.0] * (len(ids) - taken)) == 0  # nothing more is taken once stopped


def test_a_stop_string_split_over_tokens_is_never_streamed(tokenizer):
    """The characters that could begin a stop string are held back until it completes or cannot."""
    ids = tokenizer.encode("abc STOP here")
    text = SampleText(tokenizer, stop=("STOP",))
    seen = _feed_one_by_one(text, ids)
    assert all("STOP" not in s and "STO" not in s for s in seen)
    assert text.stopped and text.text == "abc "
    unstopped = SampleText(tokenizer, stop=("zzzz",))
    seen = _feed_one_by_one(unstopped, ids)
    assert seen[-1] == "abc STOP here"[:-3]  # three characters held back while running
    assert unstopped.visible_text(final=True) == "abc STOP here"


def test_a_stop_token_id_ends_the_sample_with_that_token(tokenizer):
    ids = tokenizer.encode("one two three four")
    stop = ids[2]
    text = SampleText(tokenizer, stop_token_ids=frozenset({stop}))
    text.feed(ids, [0.5] * len(ids))
    assert text.token_ids == ids[:3] and text.logprobs == [0.5] * 3 and text.stop_reason == stop


def test_without_a_tokenizer_ids_still_flow(tokenizer):
    text = SampleText(None, stop_token_ids=frozenset({7}))
    text.feed([1, 2, 7, 9], [0.0] * 4)
    text.finish()
    assert text.token_ids == [1, 2, 7] and text.text == ""
