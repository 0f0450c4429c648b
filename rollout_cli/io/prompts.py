"""Streaming prompt input from one Parquet file.

The prompt file may hold a million rows, so nothing here loads it whole: a
`PromptSource` walks it with `ParquetFile.iter_batches`, one batch of
`batch_rows` rows in memory at a time. `validate()` is a pre-pass over the
prompt column alone, so a bad row fails the run before any GPU work or output;
iteration then reads all columns, batch by batch.

What a cell may hold and how it becomes token ids is `prompt_encoding.py`; the ids
validate() computed are kept for iteration, within a memory budget, by
`prompt_token_cache.py`, so that each row is tokenized once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rollout_cli.engine.scheduling.request_maker import token_id_problem
from rollout_cli.engine.trajectory import PromptInput
from rollout_cli.errors import RolloutError, one_line
from rollout_cli.io.prompt_encoding import InvalidPrompt, encode_batch
from rollout_cli.io.prompt_token_cache import TokenIdCache

# How many column names an error message lists before it elides the rest.
_MAX_LISTED_COLUMNS = 20
# How many bytes of token ids validate() keeps for iteration (see TokenIdCache).
DEFAULT_CACHE_BYTES = 256 * 2**20


@dataclass(frozen=True)
class SkippedRow:
    """A row that `--skip-invalid` left out, and why."""

    prompt_index: int
    reason: str


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


class PromptSource:
    """The valid prompts of one Parquet file, streamed in file order.

    Attributes:
        num_rows: rows considered, min(file rows, limit).
        num_valid: rows that iteration yields; None until validate() ran.
        passthrough_schema: the input schema minus the prompt column (no metadata),
            what the trajectory writer appends to its fixed columns.

    `cache_bytes` bounds the token ids validate() keeps so that iteration need not
    tokenize again (prompt_token_cache.py); rows past it are tokenized twice.
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
                f"{self.path} is not a readable Parquet file ({one_line(err)}); "
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
        self._cache = TokenIdCache(cache_bytes)

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
            encoded = encode_batch(self.tokenizer, values)
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
        for k, result in zip(missing, encode_batch(self.tokenizer, [prompts[keep[k]] for k in missing])):
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
