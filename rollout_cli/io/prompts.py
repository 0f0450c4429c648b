"""Streaming prompt input from one Parquet file.

The prompt file may hold a million rows, so nothing here loads it whole: a
`PromptSource` walks it with `ParquetFile.iter_batches`, one batch of
`batch_rows` rows in memory at a time. `validate()` is a pre-pass over the
prompt column alone, so a bad row fails the run before any GPU work or output;
iteration then reads all columns, batch by batch.

Each row is tokenized once: validate() keeps the ids it computed in a
`_TokenIdCache` and iteration hands them out. Keeping them all would cost
memory that grows with the file (1M prompts x 1k tokens is 4 GB even as int32,
and some 36 GB as Python ints), so the cache holds them compactly (int32, 4
bytes a token) up to a budget (`cache_bytes`, 256 MiB by default: 100k prompts
of 600 tokens) and iteration frees them as it passes; the rows past the budget
are tokenized again by iteration, as every row was before. The other designs
weighed: spilling the ids to a temporary file (tokenized once at any size, but
gigabytes of disk to manage and clean up), or checking rows during the run with
the output held back until the last row was seen (the writer would hold every
trajectory of the run: not streaming).

A prompt cell may be
  - a string                     -> `tokenizer.encode(s)` (special tokens on),
  - a list of chat messages      -> the tokenizer's chat template with the
    (dicts with role, content;      generation prompt appended (verl's and HF
    pyarrow gives list<struct>)     datasets' RL layout),
  - a list of token ids          -> used as is.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rollout_cli.engine.request_maker import token_id_problem
from rollout_cli.engine.trajectory import PromptInput
from rollout_cli.errors import RolloutError

# How many column names an error message lists before it elides the rest.
_MAX_LISTED_COLUMNS = 20
# How many bytes of token ids validate() keeps for iteration (see _TokenIdCache).
DEFAULT_CACHE_BYTES = 256 * 2**20


@dataclass(frozen=True)
class SkippedRow:
    """A row that `--skip-invalid` left out, and why."""

    prompt_index: int
    reason: str


class InvalidPrompt(ValueError):
    """A prompt cell that cannot be tokenized; the message is the reason."""


def encode_prompt(tokenizer: Any, value: Any) -> list[int]:
    """Token ids of one prompt cell (string, chat messages or token ids).

    Raises InvalidPrompt for a cell no model can take (null, number, mixed
    list, malformed messages, empty), and RolloutError when the cell is chat
    messages but the tokenizer has no chat template, since that is wrong for
    every row alike and skipping rows would not fix it.
    """
    value = _to_python(value)
    if isinstance(value, str):
        if not value:
            raise InvalidPrompt("empty prompt")
        _require_tokenizer(tokenizer)
        _silence_length_warning(tokenizer)
        return [int(t) for t in tokenizer.encode(value)]
    return _encode_non_string(tokenizer, value)


def _silence_length_warning(tokenizer: Any) -> None:
    """Keep transformers' "Token indices sequence length is longer than ..." warning off stderr.

    Long prompts are judged against --max-model-len by PromptSource (one clear line, or a
    skipped row); the tokenizer's model_max_length says nothing about this engine. transformers
    prints that warning once per tokenizer, tracked in `deprecation_warnings` (4.x and 5.x):
    marking it shown silences every path, chat templates included.
    """
    shown = getattr(tokenizer, "deprecation_warnings", None)
    if isinstance(shown, dict):
        shown["sequence-length-is-longer-than-the-specified-maximum"] = True


def _a(noun: str) -> str:
    """'an int', 'a float'."""
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _to_python(value: Any) -> Any:
    """numpy arrays (pandas-written cells, array columns) become lists; the rest is left as is."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise InvalidPrompt(f"prompt is {_a(f'{value.ndim}-d')} array; expected a 1-d list of token ids")
        return value.tolist()
    return value


def _encode_non_string(tokenizer: Any, value: Any) -> list[int]:
    if value is None:
        raise InvalidPrompt("prompt is null")
    if not isinstance(value, (list, tuple)):
        raise InvalidPrompt(
            f"prompt is {_a(type(value).__name__)}; expected a string, a list of chat messages "
            "or a list of token ids"
        )
    if all(_is_int(v) for v in value):  # an empty list too
        ids = [int(v) for v in value]
        problem = token_id_problem(ids)  # no model here: only the rules that hold for every model
        if problem is not None:
            rule, low = problem
            raise InvalidPrompt("empty prompt" if rule == "empty" else f"prompt holds the negative token id {low}")
        return ids
    if all(isinstance(v, Mapping) for v in value):
        _require_tokenizer(tokenizer)
        return _encode_chat(tokenizer, value)
    raise InvalidPrompt(
        "prompt list mixes types; expected only token ids (ints) or only chat messages "
        "(dicts with 'role' and 'content')"
    )


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _encode_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    if getattr(tokenizer, "chat_template", None) is None:
        raise RolloutError(
            "the prompts are chat messages but the tokenizer has no chat template; add "
            "chat_template to the checkpoint's tokenizer_config.json or pass plain-string prompts"
        )
    clean = []
    for k, m in enumerate(messages):
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise InvalidPrompt(f"chat message {k} has no 'role' string")
        if not isinstance(m.get("content"), str):
            raise InvalidPrompt(f"chat message {k} has no 'content' string")
        # A list<struct> column holds the union of all messages' keys, so a message
        # gets e.g. name=None it never had; templates test `is defined`, so drop those.
        clean.append({key: val for key, val in m.items() if val is not None})
    _silence_length_warning(tokenizer)
    try:
        out = tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=True)
    except (jinja2.TemplateError, ValueError, TypeError, KeyError) as err:
        # Templates reject rows with raise_exception (TemplateError) or trip on odd values.
        raise InvalidPrompt(f"chat template failed: {_one_line(err)}") from err
    # transformers 5 returns a BatchEncoding ({'input_ids': [...], ...}); 4.x a plain list.
    if isinstance(out, Mapping):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], (list, tuple)):
        out = out[0]
    if not out:
        raise InvalidPrompt("empty prompt")
    return [int(t) for t in out]


def _require_tokenizer(tokenizer: Any) -> None:
    if tokenizer is None:
        raise RolloutError(
            "the model directory has no tokenizer files, so text and chat prompts cannot be encoded; "
            "add the tokenizer files or give prompts as token ids"
        )


def _encode_batch(tokenizer: Any, values: list[Any]) -> list[list[int] | InvalidPrompt]:
    """encode_prompt over a batch: ids, or the InvalidPrompt, per value in order.

    Non-empty strings go to the tokenizer in one call, which the fast (Rust)
    tokenizers run in parallel; the rest go one by one.
    """
    results: list[list[int] | InvalidPrompt | None] = [None] * len(values)
    string_pos: list[int] = []
    for pos, raw in enumerate(values):
        if isinstance(raw, InvalidPrompt):  # a cell _cells could not read
            results[pos] = raw
            continue
        if isinstance(raw, str) and raw:
            string_pos.append(pos)
            continue
        try:
            results[pos] = encode_prompt(tokenizer, raw)
        except InvalidPrompt as err:
            results[pos] = err
    if string_pos:
        _require_tokenizer(tokenizer)
        strings = [values[p] for p in string_pos]
        _silence_length_warning(tokenizer)
        if callable(tokenizer):
            # verbose=False: long prompts are judged against max_prompt_len below,
            # not against the tokenizer's model_max_length warning.
            encoded = tokenizer(strings, add_special_tokens=True, verbose=False)["input_ids"]
        else:
            encoded = [tokenizer.encode(s) for s in strings]
        for p, ids in zip(string_pos, encoded):
            results[p] = [int(t) for t in ids]
    return results  # type: ignore[return-value]


def _cells(column: pa.Array | pa.ChunkedArray) -> list[Any]:
    """column.to_pylist(), except that a cell that is not valid UTF-8 becomes an InvalidPrompt.

    Parquet does not check that a string column holds UTF-8, so such a file reads fine and only
    the conversion to Python fails, for the whole batch at once; cell by cell, the bad rows can be
    named (or skipped) and the rest kept. The fast path converts the batch in one call.
    """
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        pass
    values: list[Any] = []
    for i in range(len(column)):
        try:
            values.append(column[i].as_py())
        except UnicodeDecodeError as err:
            values.append(InvalidPrompt(f"prompt is not valid UTF-8 (byte 0x{err.object[err.start]:02x} "
                                        f"at offset {err.start})"))
    return values


class _TokenIdCache:
    """The token ids validate() computed, kept for iteration so that no row is tokenized twice.

    One entry per batch of validate(): its first row, row offsets [rows + 1] (int64) and the ids of all
    its rows end to end [tokens] (int32; int64 for a token-id column past 2**31): 4 bytes a token and 8 a
    row, where Python lists of ints cost ~36 bytes a token. Once a batch would go past `budget` bytes
    nothing more is kept, so memory stays bounded on a file of any size; iteration tokenizes those later
    rows again. Iteration asks for rows in file order and frees every batch it has passed.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.nbytes = 0
        self.full = False  # a batch did not fit: this batch and every later one are not kept
        self._batches: deque[tuple[int, np.ndarray, np.ndarray]] = deque()

    def add(self, start: int, rows: list[list[int] | None]) -> None:
        """Keep the ids of the batch whose first row is `start` (None: a row that is not valid)."""
        if self.full:
            return
        lengths = np.fromiter((0 if r is None else len(r) for r in rows), dtype=np.int64, count=len(rows))
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = int(offsets[-1])
        if self.nbytes + offsets.nbytes + 4 * tokens > self.budget:  # cheap early out: int32 at best
            self.full = True
            return
        ids = np.fromiter(itertools.chain.from_iterable(r for r in rows if r is not None), dtype=np.int64,
                          count=tokens)
        if tokens and int(ids.max()) < 2**31:  # token ids of any real vocabulary
            ids = ids.astype(np.int32)
        if self.nbytes + offsets.nbytes + ids.nbytes > self.budget:  # ids past int32 take 8 bytes
            self.full = True
            return
        self._batches.append((start, offsets, ids))
        self.nbytes += offsets.nbytes + ids.nbytes

    def pop(self, index: int) -> list[int] | None:
        """The ids of row `index`, or None when they were not kept; the rows up to `index` are freed."""
        while self._batches:
            start, offsets, ids = self._batches[0]
            if index < start:
                return None
            row = index - start
            end = len(offsets) - 1  # rows in the batch
            if row >= end - 1:  # the batch's last row, or past it: the batch is done with
                self._batches.popleft()
                self.nbytes -= offsets.nbytes + ids.nbytes
            if row < end:
                return ids[offsets[row]:offsets[row + 1]].tolist()
        return None


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


class PromptSource:
    """The valid prompts of one Parquet file, streamed in file order.

    Attributes:
        num_rows: rows considered, min(file rows, limit).
        num_valid: rows that iteration yields; None until validate() ran.
        passthrough_schema: the input schema minus the prompt column (no metadata),
            what the trajectory writer appends to its fixed columns.

    `cache_bytes` bounds the token ids validate() keeps so that iteration need not
    tokenize again (module docstring); rows past it are tokenized twice.
    """

    def __init__(
        self,
        path: str | Path,
        tokenizer: Any,
        prompt_key: str = "prompt",
        limit: int | None = None,
        max_prompt_len: int | None = None,
        skip_invalid: bool = False,
        batch_rows: int = 1024,
        vocab_size: int | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        if limit is not None and limit < 1:
            raise RolloutError(f"--limit must be at least 1, got {limit}; pass a positive row count")
        if batch_rows < 1:
            raise ValueError(f"batch_rows must be at least 1, got {batch_rows}")
        self.path = Path(path)
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.limit = limit
        self.max_prompt_len = max_prompt_len
        self.skip_invalid = skip_invalid
        self.vocab_size = vocab_size
        self.batch_rows = batch_rows

        if not self.path.exists():
            raise RolloutError(f"prompt file {self.path} does not exist; check the --data path")
        if self.path.is_dir():
            raise RolloutError(f"{self.path} is a directory; pass one Parquet file to --data")
        try:
            self._file = pq.ParquetFile(self.path)
        except (pa.ArrowException, OSError) as err:
            raise RolloutError(
                f"{self.path} is not a readable Parquet file ({_one_line(err)}); "
                "pass a Parquet file to --data"
            ) from err
        schema = self._file.schema_arrow
        if prompt_key not in schema.names:
            listed = ", ".join(schema.names[:_MAX_LISTED_COLUMNS])
            if len(schema.names) > _MAX_LISTED_COLUMNS:
                listed += f", ... ({len(schema.names)} in all)"
            raise RolloutError(
                f"{self.path} has no column {prompt_key!r} (columns: {listed}); "
                "pass --prompt-key NAME to pick the prompt column"
            )
        # Schema metadata (pandas index info) describes the input table, not ours: drop it.
        self.passthrough_schema = pa.schema([f for f in schema if f.name != prompt_key])
        file_rows = self._file.metadata.num_rows
        self.num_rows = file_rows if limit is None else min(file_rows, limit)
        self.num_valid: int | None = None
        self._skipped_rows: list[SkippedRow] | None = None
        self._skipped_index: set[int] = set()
        self._cache = _TokenIdCache(cache_bytes)

    def validate(self) -> list[SkippedRow]:
        """Tokenize every considered row; fail on the first bad row unless skip_invalid.

        Returns the skipped rows (empty without skip_invalid). Reads only the
        prompt column. Keeps the ids for iteration (up to cache_bytes). Idempotent:
        a second call returns the first result.
        """
        if self._skipped_rows is not None:
            return list(self._skipped_rows)
        skipped: list[SkippedRow] = []
        for start, batch in self._batches(columns=[self.prompt_key]):
            values = _cells(batch.column(0))
            encoded = _encode_batch(self.tokenizer, values)
            for offset, result in enumerate(encoded):
                index = start + offset
                problem = self._problem(result)
                if problem is None:
                    continue
                reason, fix = problem
                if not self.skip_invalid:
                    raise RolloutError(
                        f"row {index} of {self.path}: {reason}; {fix}, or pass --skip-invalid "
                        "to leave invalid rows out"
                    )
                skipped.append(SkippedRow(index, reason))
                encoded[offset] = None
            self._cache.add(start, encoded)  # type: ignore[arg-type] # bad rows are None by now
        self._skipped_rows = skipped
        self._skipped_index = {s.prompt_index for s in skipped}
        self.num_valid = self.num_rows - len(skipped)
        return list(skipped)

    def _problem(self, result: list[int] | InvalidPrompt) -> tuple[str, str] | None:
        """(reason, fix) when a row cannot be used, else None."""
        if isinstance(result, InvalidPrompt):
            return str(result), "fix or drop that row"
        problem = token_id_problem(result, self.vocab_size, self.max_prompt_len)
        if problem is None:
            return None
        rule, number = problem
        if rule == "length":
            limit = self.max_prompt_len
            return (
                f"prompt of {number} tokens exceeds the limit of {limit} "
                f"(--max-model-len {limit + 1} minus one generated token)",
                "raise --max-model-len",
            )
        # encode_prompt already refused empty ids and negative ones: a rule past the vocabulary is left
        return (f"prompt holds token id {number}, outside the model's vocabulary of {self.vocab_size}",
                "fix the token ids")

    def valid_indices(self) -> Iterator[int]:
        """Row numbers that iteration yields (after validate())."""
        return (i for i in range(self.num_rows) if i not in self._skipped_index)

    def __iter__(self) -> Iterator[PromptInput]:
        """Valid rows in file order, one batch of all columns in memory at a time.

        The ids come from validate()'s cache; only rows past its budget (or a second
        iteration, the cache being spent) are tokenized here.
        """
        if self._skipped_rows is None:
            self.validate()
        names = self.passthrough_schema.names
        for start, batch in self._batches(columns=None):
            keep = [o for o in range(batch.num_rows) if start + o not in self._skipped_index]
            ids = [self._cache.pop(start + o) for o in keep]
            self._encode_uncached(batch, start, keep, ids)
            passthrough = self._passthrough(batch.select(names), start, keep)
            for offset, row_ids in zip(keep, ids):
                yield PromptInput(start + offset, row_ids, passthrough[offset])  # type: ignore[arg-type]

    def _encode_uncached(self, batch: pa.RecordBatch, start: int, keep: list[int],
                         ids: list[list[int] | None]) -> None:
        """Fill in the ids of the kept rows that the cache did not hold, tokenizing them again."""
        missing = [k for k, row_ids in enumerate(ids) if row_ids is None]
        if not missing:
            return
        prompts = _cells(batch.column(self.prompt_key))
        for k, result in zip(missing, _encode_batch(self.tokenizer, [prompts[keep[k]] for k in missing])):
            if isinstance(result, InvalidPrompt):
                # validate() saw this row pass; only a non-deterministic tokenizer gets here.
                raise RuntimeError(f"row {start + keep[k]} passed validation but now fails: {result}")
            ids[k] = result

    def _passthrough(self, batch: pa.RecordBatch, start: int, keep: list[int]) -> dict[int, dict[str, Any]]:
        """{offset in batch: {column: value}} of the kept rows.

        Row by row only when the batch holds a string that is not UTF-8 (a skipped row may hold
        it, and is not read); in a kept row it is an error naming the row and column.
        """
        try:
            rows = batch.to_pylist()
            return {o: rows[o] for o in keep}
        except UnicodeDecodeError:
            pass
        out = {}
        for o in keep:
            row = {}
            for name, column in zip(batch.schema.names, batch.columns):
                try:
                    row[name] = column[o].as_py()
                except UnicodeDecodeError as err:
                    raise RolloutError(
                        f"row {start + o} of {self.path}: column {name!r} is not valid UTF-8 "
                        f"(byte 0x{err.object[err.start]:02x} at offset {err.start}); fix or drop that row"
                    ) from err
            out[o] = row
        return out

    def _batches(self, columns: list[str] | None) -> Iterator[tuple[int, pa.RecordBatch]]:
        """(index of the batch's first row, batch) over the first num_rows rows."""
        start = 0
        if self.num_rows == 0:
            return
        for batch in self._file.iter_batches(batch_size=self.batch_rows, columns=columns):
            if start + batch.num_rows > self.num_rows:
                batch = batch.slice(0, self.num_rows - start)
            yield start, batch
            start += batch.num_rows
            if start >= self.num_rows:
                return
