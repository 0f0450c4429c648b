"""Stop strings matched in the engine on token bytes (engine/scheduling/stop_strings.py): the byte table
against tokenizer.decode, the matcher's windows, and a request ending with the token that completes a string."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.engine.scheduling.request_maker import RequestMaker
from rollout_cli.engine.scheduling.stop_strings import TokenBytes, token_bytes_table
from rollout_cli.engine.trajectory import PartialSample, PromptInput, Trajectory
from rollout_cli.errors import RolloutError
from rollout_cli.io.trajectories import TrajectoryWriter, shards_have_column

MODEL = Path(__file__).resolve().parents[2] / "recipes" / "example_model"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(MODEL))


def _special(tokenizer) -> set[int]:
    return set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}


def test_the_byte_table_equals_decode_for_every_id_of_the_example_tokenizer(tokenizer):
    """Qwen-style byte-level BPE: each id's bytes are its decode (bytes that end inside a character
    decode to U+FFFD alone), special tokens are no bytes, ids past the tokenizer none either."""
    size = len(tokenizer) + 5  # config.json's vocab_size may pad past the tokenizer
    table = token_bytes_table(tokenizer, size)
    special = _special(tokenizer)
    assert special and len(table) == size and table[len(tokenizer):] == [b""] * 5
    partial = 0
    for i in range(len(tokenizer)):
        text = tokenizer.decode([i], skip_special_tokens=True)
        if i in special:
            assert table[i] == b"" and text == "", i
            continue
        assert table[i], i
        assert table[i].decode("utf-8", errors="replace") == text, i
        if "\ufffd" not in text:
            assert table[i] == text.encode("utf-8"), i
        else:
            partial += 1
    assert partial > 0  # the table holds bytes that are no whole character, which decode cannot show alone


def test_a_sequence_of_token_bytes_decodes_to_the_text_of_the_sequence(tokenizer):
    table = token_bytes_table(tokenizer, len(tokenizer))
    rng = random.Random(0)
    sequences = [tokenizer.encode("héllo wörld — ✓ 数学 🙂 </answer>")]
    sequences += [[rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))] for _ in range(500)]
    for ids in sequences:
        spelled = b"".join(table[i] for i in ids).decode("utf-8", errors="replace")
        assert spelled == tokenizer.decode(ids, skip_special_tokens=True), ids


def test_a_non_special_added_token_is_its_text(tokenizer):
    """Qwen's </tool_call> is an added token that is not special: decode writes it, so the table does
    (one with a space, outside the byte map, as the `tokenizers` ByteLevel decoder writes it: its UTF-8)."""
    added = AutoTokenizer.from_pretrained(str(MODEL))
    added.add_tokens(["</tool call>", "<answer>"])
    table = token_bytes_table(added, len(added))
    for token in ("</tool call>", "<answer>"):
        i = added.convert_tokens_to_ids(token)
        assert table[i] == token.encode() and added.decode([i]) == token


def test_sentencepiece_pieces_spell_spaces_and_byte_fallback():
    """A SentencePiece-style tokenizer (Llama 2, Mistral): '▁' is a space, <0xNN> a byte; decode after
    a token without a leading space is the first token's text + the others' bytes."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<0x0A>": 3, "<0xC3>": 4, "<0xA9>": 5, "▁": 6, "a": 7, "b": 8,
             "▁ab": 9, "▁a": 10, "▁b": 11, "ab": 12}
    model = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b"), ("▁", "a"), ("▁", "b"), ("▁a", "b")],
                                 byte_fallback=True, unk_token="<unk>"))
    model.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    model.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    table = token_bytes_table(tokenizer, 13)
    assert table[:7] == [b"", b"", b"", b"\n", b"\xc3", b"\xa9", b" "] and table[9] == b" ab"
    rng = random.Random(1)
    # <0xC3><0xA9> only as the pair "é": ByteFallback writes the valid bytes of a broken group as U+FFFD
    # too, where the table keeps them
    pieces = [[4, 5]] + [[i] for i in range(13) if i not in (4, 5)]
    for _ in range(200):
        ids = [t for _ in range(rng.randrange(1, 12)) for t in rng.choice(pieces)]
        spelled = b"".join(table[i] for i in ids).decode("utf-8", errors="replace")
        assert tokenizer.decode([7] + ids, skip_special_tokens=True) == "a" + spelled, ids


@pytest.fixture(scope="module")
def token_bytes(tokenizer):
    return TokenBytes(tokenizer, len(tokenizer))


def _first_stop(tokenizer, ids: list[int], stop: str) -> int | None:
    """The index of the token after which decode first contains `stop` (the test's own rule), or None."""
    return next((i for i in range(len(ids)) if stop in tokenizer.decode(ids[: i + 1], skip_special_tokens=True)),
                None)


def test_the_matcher_ends_at_the_token_where_the_text_first_holds_the_stop(tokenizer, token_bytes):
    rng = random.Random(2)
    text = "The answer is <answer>42</answer> and then more </answer> text, é and 数学."
    ids = tokenizer.encode(text)
    stops = ["</answer>", "42</", "é", "数", "more </answer> t", "nowhere"]
    assert any(len(tokenizer.encode(s)) > 2 for s in stops)  # several stops span tokens
    for stop in stops:
        matcher = token_bytes.matcher((stop,))
        ended = next((i for i, t in enumerate(ids) if matcher.push(t) is not None), None)
        assert ended == _first_stop(tokenizer, ids, stop), stop
    for _ in range(300):  # random ids: bytes that are no character, special tokens between the others
        ids = [rng.randrange(len(tokenizer)) for _ in range(30)]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        start = rng.randrange(len(text) - 3) if len(text) > 4 else 0
        stop = text[start:start + rng.randrange(1, 4)].replace("\ufffd", "") or "x"
        matcher = token_bytes.matcher((stop,))
        ended = next((i for i, t in enumerate(ids) if matcher.push(t) is not None), None)
        assert ended == _first_stop(tokenizer, ids, stop), (ids, stop)


def test_the_stop_that_ends_first_is_reported_and_the_first_given_on_a_tie(tokenizer, token_bytes):
    ids = tokenizer.encode("xy</answer>")
    last = len(ids) - 1
    assert next(r for r in _pushes(token_bytes, ("</answer>", "y</an"), ids) if r) == "y</an"  # it ends first
    results = _pushes(token_bytes, ("r>", "</answer>"), ids)  # both end in the last token: the first given
    assert results[last] == "r>" and not any(results[:last])
    assert _pushes(token_bytes, ("absent",), ids) == [None] * len(ids)


def _pushes(token_bytes, stops: tuple[str, ...], ids: list[int]) -> list:
    """One matcher for `stops` fed `ids` in order (past a match too); -> what each push returned."""
    matcher = token_bytes.matcher(stops)
    return [matcher.push(t) for t in ids]


def test_a_continued_sample_reads_its_response_as_context_only(tokenizer, token_bytes):
    ids = tokenizer.encode("abc </answer> def </ans") + tokenizer.encode("wer>")
    cut = len(tokenizer.encode("abc </answer> def </ans"))
    matcher = token_bytes.matcher(("</answer>",), ids[:cut])  # the first </answer> ended nothing: context
    assert [matcher.push(t) for t in ids[cut:]][-1] == "</answer>"


def test_a_request_ends_with_the_token_that_completes_a_stop_string(tokenizer):
    maker = RequestMaker(len(tokenizer), frozenset({2}), 256, tokenizer=tokenizer)
    ids = tokenizer.encode("one two </answer> three")
    params = SamplingParams(stop=("</answer>",), max_new_tokens=len(ids))
    request = maker.samples(PromptInput(0, tokenizer.encode("</answer>")), params, set())[0]  # the prompt ends nothing
    for t in ids:
        request.append_token(t, 0.0)
        if request.finish_reason:
            break
    assert request.finish_reason == "stop" and request.stop_reason == "</answer>"
    assert request.output_token_ids == ids[: _first_stop(tokenizer, ids, "</answer>") + 1]
    # a stop token id ends first where both match; eos ends with no stop_reason; a stop beats length
    both = maker.samples(PromptInput(0, [5]), SamplingParams(stop=("</answer>",), stop_token_ids=(ids[-1],)), set())
    both[0].append_token(ids[-1], 0.0)
    assert both[0].stop_reason == ids[-1]
    eos = maker.samples(PromptInput(0, [5]), params, set())[0]
    eos.append_token(2, 0.0)
    assert (eos.finish_reason, eos.stop_reason) == ("stop", None)
    short = maker.samples(PromptInput(0, [5]), SamplingParams(stop=("a",), max_new_tokens=1), set())[0]
    short.append_token(tokenizer.encode("a")[0], 0.0)
    assert (short.finish_reason, short.stop_reason) == ("stop", "a")
    # a continued sample: its response so far is context for a stop string that completes now
    head, tail = tokenizer.encode("one two </ans"), tokenizer.encode("wer> three")
    rest = maker.partial(PartialSample(0, 0, [5], head, [0.0] * len(head), [""] * len(head)), params)
    for t in tail:
        rest.append_token(t, 0.0)
        if rest.finish_reason:
            break
    assert rest.stop_reason == "</answer>"
    assert rest.output_token_ids == (head + tail)[: _first_stop(tokenizer, head + tail, "</answer>") + 1]
    assert maker.finish_of(ids[: _first_stop(tokenizer, ids, "</answer>") + 1], params) == "stop"
    assert maker.finish_of(ids[:3], params) == "length" and maker.finish_of([2], params) == "stop"
    assert maker.finish_of([2], SamplingParams(ignore_eos=True)) == "length"


def test_stop_strings_need_a_tokenizer():
    maker = RequestMaker(100, frozenset(), 64)
    assert maker.samples(PromptInput(0, [5]), SamplingParams(), set())[0].stop_matcher is None
    with pytest.raises(RolloutError, match=r"stop strings \(--stop\) .* no tokenizer files"):
        maker.samples(PromptInput(0, [5]), SamplingParams(stop=("x",)), set())


def test_stop_lists_are_checked_in_one_line():
    assert SamplingParams(stop=["a", "</b>"]).stop == ("a", "</b>")  # a request body's or manifest's list
    assert SamplingParams(stop="</answer>").stop == ("</answer>",)  # vLLM takes one string too
    for bad, message in [([""], "non-empty strings"), (["x"] * 65, "at most 64 strings, got 65"),
                         (["y" * 257], "has 257 characters; a stop string has at most 256"),
                         ([3], "takes strings"), (5, "takes strings"), (["\ud800"], "not valid Unicode")]:
        with pytest.raises(RolloutError, match=message) as caught:
            SamplingParams(stop=bad)
        assert "\n" not in str(caught.value)


def test_the_stop_reason_column_is_written_by_runs_with_stop_rules(tmp_path):
    def row(index: int, reason):
        return Trajectory(index, 0, [1], [2, 3], [-0.5, -0.5], "", "stop" if reason is not None else "length", "0",
                          ["0", "0"], stop_reason=reason).to_row()

    assert "stop_reason" not in row(0, None) and row(1, 151645)["stop_reason"] == "151645"  # an id as text
    assert shards_have_column(tmp_path / "with", "stop_reason")  # no shards yet
    with TrajectoryWriter(tmp_path / "with", pa.schema([]), stop_reason=True) as writer:
        for index, reason in enumerate([None, 7, "</answer>"]):
            writer.add(row(index, reason))
    written = pq.read_table(tmp_path / "with" / "trajectories").column("stop_reason")
    assert written.to_pylist() == [None, "7", "</answer>"]
    with TrajectoryWriter(tmp_path / "without", pa.schema([])) as writer:  # a run without stop rules
        writer.add(row(0, None))
    assert shards_have_column(tmp_path / "with", "stop_reason")
    assert not shards_have_column(tmp_path / "without", "stop_reason")
