"""PromptSource and encode_prompt on small Parquet files and a tokenizer built in the test."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollout_cli.engine.trajectory import PromptInput
from rollout_cli.errors import RolloutError
from rollout_cli.io.prompt_encoding import InvalidPrompt, encode_prompt
from rollout_cli.io.prompts import PromptSource, SkippedRow

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SENTENCES = [
    "hello world what is two plus two",
    "the answer is four and the sky is blue",
    "user assistant system say something nice",
]


def make_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    """A word-level fast tokenizer trained on SENTENCES; prepends <s> like Llama. No download."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<unk>", "<s>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", chat_template=chat_template
    )


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def write_parquet(path, columns: dict, **kwargs):
    pq.write_table(pa.table(columns), path, **kwargs)
    return path


# ---- encode_prompt ---------------------------------------------------------


def test_encode_string_uses_encode_with_special_tokens(tokenizer):
    ids = encode_prompt(tokenizer, "hello world")
    assert ids == tokenizer.encode("hello world")
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 3


def test_encode_chat_messages_appends_generation_prompt(tokenizer):
    messages = [{"role": "user", "content": "what is two plus two"}]
    ids = encode_prompt(tokenizer, messages)
    start, assistant = tokenizer.convert_tokens_to_ids(["<|im_start|>", "assistant"])
    assert ids[0] == start
    assert ids[-2:] == [start, assistant]
    assert ids == tokenizer("<|im_start|> user what is two plus two <|im_end|> <|im_start|> assistant",
                            add_special_tokens=False)["input_ids"]


def test_encode_chat_drops_null_keys_that_pyarrow_adds():
    # list<struct> gives every message the union of keys; a template testing
    # `is defined` must not see name=None as a name.
    seen = []

    class RecordingTokenizer:
        chat_template = "x"

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            seen.append(messages)
            return {"input_ids": [[1, 2]]}  # batched BatchEncoding layout

    ids = encode_prompt(RecordingTokenizer(), [{"role": "user", "content": "hi", "name": None}])
    assert ids == [1, 2]
    assert seen == [[{"role": "user", "content": "hi"}]]


def test_encode_chat_accepts_plain_list_from_older_transformers():
    class OldTokenizer:
        chat_template = "x"

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            assert add_generation_prompt and tokenize
            return [5, 6, 7]

    assert encode_prompt(OldTokenizer(), [{"role": "user", "content": "hi"}]) == [5, 6, 7]


def test_encode_token_ids_lists_and_numpy():
    assert encode_prompt(None, [3, 1, 2]) == [3, 1, 2]
    ids = encode_prompt(None, np.array([7, 8], dtype=np.int64))
    assert ids == [7, 8] and all(type(t) is int for t in ids)


@pytest.mark.parametrize(
    "value, reason",
    [
        (None, "null"),
        (3, "prompt is an int;"),
        (3.5, "prompt is a float;"),
        ("", "empty prompt"),
        ([], "empty prompt"),
        ([1, "a"], "mixes types"),
        ([1, True], "mixes types"),
        ([4, -1], "negative"),
        ([{"role": "user"}], "'content'"),
        ([{"content": "hi"}], "'role'"),
        (np.array([[1, 2]]), "prompt is a 2-d array"),
        (np.array([1.5]), "mixes types"),
    ],
)
def test_encode_rejects_bad_cells(tokenizer, value, reason):
    with pytest.raises(InvalidPrompt, match=reason):
        encode_prompt(tokenizer, value)


def test_chat_prompts_without_template_fail_for_the_whole_run(tmp_path):
    tok = make_tokenizer(chat_template=None)
    with pytest.raises(RolloutError, match="no chat template"):
        encode_prompt(tok, [{"role": "user", "content": "hi"}])
    path = write_parquet(tmp_path / "p.parquet", {"prompt": [[{"role": "user", "content": "hi"}]]})
    # Not a per-row problem: --skip-invalid must not swallow it.
    with pytest.raises(RolloutError, match="no chat template"):
        PromptSource(path, tok, skip_invalid=True).validate()


# ---- PromptSource: opening -------------------------------------------------


def test_missing_file(tmp_path, tokenizer):
    with pytest.raises(RolloutError, match="does not exist.*--data"):
        PromptSource(tmp_path / "nope.parquet", tokenizer)


def test_unreadable_file(tmp_path, tokenizer):
    bad = tmp_path / "bad.parquet"
    bad.write_text("this is not parquet at all")
    with pytest.raises(RolloutError, match="not a readable Parquet file") as info:
        PromptSource(bad, tokenizer)
    assert "\n" not in str(info.value)


def test_missing_prompt_column_lists_columns(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "p.parquet", {"question": ["a"], "answer": ["b"]})
    with pytest.raises(RolloutError) as info:
        PromptSource(path, tokenizer)
    msg = str(info.value)
    assert "'prompt'" in msg and "question, answer" in msg and "--prompt-key NAME" in msg
    assert PromptSource(path, tokenizer, prompt_key="question").num_rows == 1


def test_limit_below_one_is_refused(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "p.parquet", {"prompt": ["hello"]})
    with pytest.raises(RolloutError, match="--limit"):
        PromptSource(path, tokenizer, limit=0)


# ---- PromptSource: reading -------------------------------------------------


def test_string_prompts_with_passthrough(tmp_path, tokenizer):
    path = write_parquet(
        tmp_path / "p.parquet",
        {"data_source": ["a", "b"], "prompt": ["hello world", "the sky is blue"], "id": [10, 11]},
    )
    src = PromptSource(path, tokenizer)
    assert src.passthrough_schema.names == ["data_source", "id"]
    rows = list(src)
    assert rows == [
        PromptInput(0, tokenizer.encode("hello world"), {"data_source": "a", "id": 10}),
        PromptInput(1, tokenizer.encode("the sky is blue"), {"data_source": "b", "id": 11}),
    ]
    assert src.num_rows == 2 and src.num_valid == 2


def test_chat_prompts_and_nested_passthrough(tmp_path, tokenizer):
    messages = [
        [{"role": "system", "content": "say something nice"}, {"role": "user", "content": "hello"}],
        [{"role": "user", "content": "what is two plus two"}],
    ]
    path = write_parquet(
        tmp_path / "p.parquet",
        {
            "prompt": messages,
            "reward_model": [{"ground_truth": "x", "style": "rule"}, {"ground_truth": "4", "style": "rule"}],
            "extra_info": [{"index": 0, "tags": ["a"]}, {"index": 1, "tags": []}],
        },
    )
    src = PromptSource(path, tokenizer)
    assert pa.types.is_struct(src.passthrough_schema.field("reward_model").type)
    rows = list(src)
    assert [r.prompt_token_ids for r in rows] == [encode_prompt(tokenizer, m) for m in messages]
    assert rows[1].passthrough == {
        "reward_model": {"ground_truth": "4", "style": "rule"},
        "extra_info": {"index": 1, "tags": []},
    }


def test_token_id_prompts_need_no_tokenizer(tmp_path):
    path = write_parquet(tmp_path / "p.parquet", {"prompt": pa.array([[5, 6], [7]], pa.list_(pa.int64()))})
    assert [r.prompt_token_ids for r in PromptSource(path, None)] == [[5, 6], [7]]


def test_limit_takes_the_first_rows(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "p.parquet", {"prompt": [[i + 1] for i in range(10)]})
    src = PromptSource(path, tokenizer, limit=4, batch_rows=3)
    assert src.num_rows == 4
    assert [(r.prompt_index, r.prompt_token_ids) for r in src] == [(i, [i + 1]) for i in range(4)]
    assert PromptSource(path, tokenizer, limit=100).num_rows == 10


def test_streams_over_row_groups_in_order(tmp_path, tokenizer):
    n = 50
    prompts = [SENTENCES[i % 3] for i in range(n)]
    path = write_parquet(tmp_path / "p.parquet", {"prompt": prompts, "row": list(range(n))}, row_group_size=7)
    assert pq.ParquetFile(path).num_row_groups == 8
    src = PromptSource(path, tokenizer, batch_rows=5)
    seen_columns = []
    real_iter = src._file.iter_batches

    def spy(**kwargs):
        seen_columns.append(kwargs.get("columns"))
        for batch in real_iter(**kwargs):
            assert batch.num_rows <= 5  # one small batch in memory at a time
            yield batch

    src._file.iter_batches = spy
    rows = list(src)
    assert seen_columns == [["prompt"], None]  # the pre-pass reads the prompt column only
    assert [r.prompt_index for r in rows] == list(range(n))
    assert [r.passthrough["row"] for r in rows] == list(range(n))
    assert [r.prompt_token_ids for r in rows] == [tokenizer.encode(p) for p in prompts]


def test_empty_prompt_fails_with_row_index(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "p.parquet", {"prompt": ["hello", "world", ""]})
    src = PromptSource(path, tokenizer)
    with pytest.raises(RolloutError, match=r"row 2 .*empty prompt.*--skip-invalid"):
        src.validate()
    # Iterating validates first, so nothing is yielded before the bad row fails the run.
    with pytest.raises(RolloutError, match="row 2"):
        next(iter(PromptSource(path, tokenizer)))


def test_too_long_prompt_fails_with_row_index(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "p.parquet", {"prompt": ["hello", "the answer is four and the sky is blue"]})
    with pytest.raises(RolloutError) as info:
        PromptSource(path, tokenizer, max_prompt_len=5).validate()
    msg = str(info.value)
    assert "row 1 " in msg and "prompt of 10 tokens exceeds the limit of 5" in msg
    assert "--max-model-len" in msg and "--skip-invalid" in msg
    assert PromptSource(path, tokenizer, max_prompt_len=10).validate() == []


def test_skip_invalid_reports_and_skips(tmp_path, tokenizer):
    path = write_parquet(
        tmp_path / "p.parquet",
        {"prompt": ["hello", "", "the answer is four and the sky is blue", None, "world"], "k": list("abcde")},
    )
    src = PromptSource(path, tokenizer, max_prompt_len=5, skip_invalid=True, batch_rows=2)
    skipped = src.validate()
    assert [s.prompt_index for s in skipped] == [1, 2, 3]
    assert isinstance(skipped[0], SkippedRow) and skipped[0].reason == "empty prompt"
    assert "exceeds the limit of 5" in skipped[1].reason and "null" in skipped[2].reason
    assert src.num_valid == 2
    rows = list(src)
    assert [(r.prompt_index, r.passthrough["k"]) for r in rows] == [(0, "a"), (4, "e")]


def _with_invalid_utf8(values: list[str], bad_row: int) -> pa.Array:
    """A string array whose row `bad_row` starts with the byte 0xff: Parquet stores it without a check."""
    good = pa.array(values, pa.string())
    offsets, data = good.buffers()[1], bytearray(good.buffers()[2].to_pybytes())
    data[sum(len(v.encode()) for v in values[:bad_row])] = 0xFF
    return pa.Array.from_buffers(pa.string(), len(values), [None, offsets, pa.py_buffer(bytes(data))])


def test_invalid_utf8_prompt_names_the_row(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "p.parquet", {"prompt": _with_invalid_utf8(["hello", "world", "hello"], 1)})
    with pytest.raises(RolloutError, match=r"row 1 .*not valid UTF-8 \(byte 0xff at offset 0\).*--skip-invalid"):
        PromptSource(path, tokenizer).validate()


def test_invalid_utf8_prompt_is_skipped_with_skip_invalid(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "p.parquet",
                         {"prompt": _with_invalid_utf8(["hello", "world", "hello"], 1), "k": ["a", "b", "c"]})
    src = PromptSource(path, tokenizer, skip_invalid=True)
    reason = "prompt is not valid UTF-8 (byte 0xff at offset 0)"
    assert [(s.prompt_index, s.reason) for s in src.validate()] == [(1, reason)]
    assert [(r.prompt_index, r.passthrough["k"]) for r in src] == [(0, "a"), (2, "c")]


def test_invalid_utf8_passthrough_of_a_skipped_row_is_not_read(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "p.parquet", {"prompt": ["hello", "", "world"],
                                                  "k": _with_invalid_utf8(["a", "b", "c"], 1)})
    src = PromptSource(path, tokenizer, skip_invalid=True)
    assert [s.prompt_index for s in src.validate()] == [1]
    assert [(r.prompt_index, r.passthrough["k"]) for r in src] == [(0, "a"), (2, "c")]


def test_invalid_utf8_passthrough_of_a_kept_row_names_row_and_column(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "p.parquet", {"prompt": ["hello", "world"], "k": _with_invalid_utf8(["a", "b"], 1)})
    rows = iter(PromptSource(path, tokenizer))
    with pytest.raises(RolloutError, match=r"row 1 .*column 'k' is not valid UTF-8"):
        list(rows)


def test_long_prompts_leave_no_tokenizer_warning(tmp_path):
    """transformers warns past the tokenizer's model_max_length; the length check is ours (--max-model-len)."""
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    library_logger = logging.getLogger("transformers")  # where transformers' own handler sits
    library_logger.addHandler(handler)
    try:
        for prompt in ("hello world what is two plus two", [{"role": "user", "content": "hello world what is two"}]):
            tok = make_tokenizer()  # a fresh one each time: transformers warns once per tokenizer
            tok.model_max_length = 4
            path = write_parquet(tmp_path / "p.parquet", {"prompt": [prompt]})
            with pytest.raises(RolloutError, match="exceeds the limit of 3"):
                PromptSource(path, tok, max_prompt_len=3).validate()
            assert len(encode_prompt(make_tokenizer(), prompt)) > 4  # encode_prompt alone, on a fresh one too
    finally:
        library_logger.removeHandler(handler)
    assert not [r for r in records if "Token indices sequence length" in r.getMessage()]


# ---- PromptSource: each row tokenized once ----------------------------------
