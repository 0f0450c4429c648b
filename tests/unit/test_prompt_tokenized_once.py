"""Every prompt row is tokenized once (issue 24): validation's ids are kept for the iteration within a
memory budget, chat rows and skipped rows included; past the budget rows are tokenized again."""

from __future__ import annotations

import pyarrow as pa
import pytest

from rollout_cli.io.prompt_encoding import encode_prompt
from rollout_cli.io.prompts import PromptSource
from test_io_prompts import SENTENCES, make_tokenizer, write_parquet


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


class CountingTokenizer:
    """The test tokenizer, counting the prompts it encodes (a batched call counts each of its strings)."""

    def __init__(self, inner):
        self.inner, self.encoded = inner, []

    def __call__(self, texts, **kwargs):
        self.encoded.extend(texts)
        return self.inner(texts, **kwargs)

    def apply_chat_template(self, messages, **kwargs):
        self.encoded.append(messages)
        return self.inner.apply_chat_template(messages, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_each_row_is_tokenized_once(tmp_path, tokenizer):
    prompts = [SENTENCES[i % 3] for i in range(23)]
    path = write_parquet(tmp_path / "p.parquet", {"prompt": prompts, "k": list(range(23))}, row_group_size=7)
    counting = CountingTokenizer(tokenizer)
    src = PromptSource(path, counting, batch_rows=5)
    src.validate()
    assert counting.encoded == prompts
    rows = list(src)
    assert counting.encoded == prompts  # iteration took validate()'s ids
    assert [(r.prompt_index, r.prompt_token_ids, r.passthrough["k"]) for r in rows] == [
        (i, tokenizer.encode(p), i) for i, p in enumerate(prompts)]
    assert all(type(t) is int for r in rows for t in r.prompt_token_ids)
    assert src._cache.nbytes == 0  # iteration freed what it handed out


def test_chat_rows_and_skipped_rows_are_tokenized_once(tmp_path, tokenizer):
    messages = [[{"role": "user", "content": SENTENCES[i % 3]}] for i in range(6)]
    messages[2] = [{"role": "user"}]  # no content: skipped
    path = write_parquet(tmp_path / "p.parquet", {"prompt": messages})
    counting = CountingTokenizer(tokenizer)
    src = PromptSource(path, counting, skip_invalid=True, batch_rows=4)
    assert [s.prompt_index for s in src.validate()] == [2]
    rows = list(src)
    assert len(counting.encoded) == 5  # the skipped row never reached the template
    assert [r.prompt_index for r in rows] == [0, 1, 3, 4, 5]
    assert [r.prompt_token_ids for r in rows] == [encode_prompt(tokenizer, messages[i]) for i in (0, 1, 3, 4, 5)]


def test_rows_past_the_cache_budget_are_tokenized_again(tmp_path, tokenizer):
    """The cache is bounded: a row past the budget costs a second tokenization, not memory."""
    prompts = [SENTENCES[i % 3] for i in range(12)]
    path = write_parquet(tmp_path / "p.parquet", {"prompt": prompts})
    # int64 offsets and int32 ids of each batch of 4 rows; room for the first two batches of three
    sizes = [8 * 5 + 4 * sum(len(tokenizer.encode(p)) for p in prompts[b:b + 4]) for b in (0, 4)]
    counting = CountingTokenizer(tokenizer)
    src = PromptSource(path, counting, batch_rows=4, cache_bytes=sum(sizes))
    src.validate()
    assert src._cache.full and src._cache.nbytes == sum(sizes)
    rows = list(src)
    assert counting.encoded == prompts + prompts[8:]
    assert [r.prompt_token_ids for r in rows] == [tokenizer.encode(p) for p in prompts]
    # a second iteration finds the cache spent and tokenizes every row
    assert [r.prompt_token_ids for r in src] == [tokenizer.encode(p) for p in prompts]
    assert counting.encoded == prompts + prompts[8:] + prompts


def test_token_ids_past_int32_survive_the_cache(tmp_path):
    path = write_parquet(tmp_path / "p.parquet", {"prompt": pa.array([[5, 2**40], [7]], pa.list_(pa.int64()))})
    assert [r.prompt_token_ids for r in PromptSource(path, None)] == [[5, 2**40], [7]]
