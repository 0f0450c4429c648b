"""Streaming prompt input from one Parquet file.

The prompt file may hold a million rows, so nothing here loads it whole: a
`PromptSource` walks it with `ParquetFile.iter_batches`, one batch of
`batch_rows` rows in memory at a time. `validate()` is a pre-pass over the
prompt column alone, so a bad row fails the run before any GPU work or output;
iteration then reads all columns, batch by batch.

What a cell may hold and how it becomes token ids is `prompt_encoding.py`; the ids
validate() computed are kept for iteration, within a memory budget, by
`prompt_token_cache.py`, so that each row is tokenized once.

Images (vision-language checkpoints, `image_prompts.py`): an image column is read with the prompt
column. validate() decodes every image (a corrupt one fails the run, or is skipped, before any GPU
work) and keeps only the ids; the patch rows, megabytes an image, are made as iteration yields the
row, so memory holds the images of the rows in flight, never those of the file.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rollout_cli.engine.scheduling.request_maker import token_id_problem
from rollout_cli.engine.trajectory import PromptInput
from rollout_cli.errors import RolloutError, one_line
from rollout_cli.io.image_cells import holds_images, refuse_text_cells
from rollout_cli.io.image_prompts import ImageCountMismatch, VisionPromptEncoder
from rollout_cli.io.prompt_encoding import InvalidPrompt, encode_batch
from rollout_cli.io.prompt_token_cache import TokenIdCache
from rollout_cli.io.trajectories import nanoseconds_as_ints

# How many column names an error message lists before it elides the rest.
_MAX_LISTED_COLUMNS = 20
# How many bytes of token ids validate() keeps for iteration (see TokenIdCache).
DEFAULT_CACHE_BYTES = 256 * 2**20
# Rows per batch when the file has an image column: its cells hold encoded images (often 100 KB+ each).
_IMAGE_BATCH_ROWS = 64
# Image columns looked for when --image-key is not given, in this order (verl's, then HF datasets' single image).
DEFAULT_IMAGE_KEYS = ("images", "image")
# Threads that decode a batch's images in validate() and prepare rows ahead of the engine at iteration
# (PIL decodes, numpy resizes and blake2b hashes without the GIL).
_DECODE_THREADS = min(8, os.cpu_count() or 1)
# Rows whose images iteration prepares ahead of the engine: ~17 ms of host work a 448 x 448 image (decode,
# processor, digest) would stall the step loop; 32 rows of such images hold ~150 MB of patch rows.
_PREPARE_AHEAD = 32


@dataclass(frozen=True)
class SkippedRow:
    """A row that `--skip-invalid` left out, and why."""

    prompt_index: int
    reason: str


def _cells(column: pa.Array | pa.ChunkedArray, what: str = "prompt") -> list[Any]:
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
            values.append(InvalidPrompt(f"{what} is not valid UTF-8 (byte 0x{err.object[err.start]:02x} "
                                        f"at offset {err.start})"))
    return values


def _listed(schema: pa.Schema) -> str:
    """The file's column names for an error line, elided past _MAX_LISTED_COLUMNS."""
    listed = ", ".join(schema.names[:_MAX_LISTED_COLUMNS])
    if len(schema.names) > _MAX_LISTED_COLUMNS:
        listed += f", ... ({len(schema.names)} in all)"
    return listed


class PromptSource:
    """The valid prompts of one Parquet file, streamed in file order.

    Attributes:
        num_rows: rows considered, min(file rows, limit).
        num_valid: rows that iteration yields; None until validate() ran.
        passthrough_schema: the input schema minus the prompt column (no metadata),
            what the trajectory writer appends to its fixed columns; minus the image
            column too when `vision` reads it (image bytes do not belong in trajectories).
        image_column: the column holding the rows' images (None: none); `image_key`,
            else the first of DEFAULT_IMAGE_KEYS the file has.

    `vision` encodes rows for a vision-language checkpoint (image_prompts.py); without it
    (a text-only model) a row whose image column holds an image fails the run.

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
        image_key: str | None = None,
        vision: VisionPromptEncoder | None = None,
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
        self.vision = vision

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
            raise RolloutError(f"{self.path} has no column {prompt_key!r} (columns: {_listed(schema)}); "
                               "pass --prompt-key NAME to pick the prompt column")
        self.image_column = self._image_column(schema, image_key)
        if vision is not None and self.image_column is not None:
            self.batch_rows = min(batch_rows, _IMAGE_BATCH_ROWS)
        # A text-only model keeps an image column as a passthrough column, as before images were read: it
        # holds none (validate() refuses a row with one), and a resumed text run keeps its output schema.
        dropped = {prompt_key, self.image_column} if vision is not None else {prompt_key}
        # Schema metadata (pandas index info) describes the input table, not ours: drop it.
        self.passthrough_schema = pa.schema([f for f in schema if f.name not in dropped])
        file_rows = self._file.metadata.num_rows
        self.num_rows = file_rows if limit is None else min(file_rows, limit)
        self.num_valid: int | None = None
        self._skipped_rows: list[SkippedRow] | None = None
        self._skipped_index: set[int] = set()
        self._cache = TokenIdCache(cache_bytes)

    def _image_column(self, schema: pa.Schema, image_key: str | None) -> str | None:
        if image_key is None:
            return next((name for name in DEFAULT_IMAGE_KEYS if name in schema.names and name != self.prompt_key), None)
        if image_key not in schema.names:
            raise RolloutError(f"{self.path} has no column {image_key!r} (columns: {_listed(schema)}); "
                               "pass --image-key NAME to pick the image column")
        if image_key == self.prompt_key:
            raise RolloutError(f"--image-key and --prompt-key both name the column {image_key!r}; "
                               "images and prompts are two columns")
        return image_key

    @property
    def has_images(self) -> bool:
        """Whether the rows may carry images: a vision-language model and an image column (the output
        then has an image_grid_thw column)."""
        return self.vision is not None and self.image_column is not None

    def validate(self) -> list[SkippedRow]:
        """Tokenize every considered row; fail on the first bad row unless skip_invalid.

        Returns the skipped rows (empty without skip_invalid). Reads only the
        prompt column (and the image column). Keeps the ids for iteration (up to
        cache_bytes). Idempotent: a second call returns the first result.
        """
        if self._skipped_rows is not None:
            return list(self._skipped_rows)
        skipped: list[SkippedRow] = []
        columns = [self.prompt_key] + ([self.image_column] if self.image_column is not None else [])
        decoding = self.has_images and _DECODE_THREADS > 1
        with ThreadPoolExecutor(_DECODE_THREADS) if decoding else nullcontext() as pool:
            for start, batch in self._batches(columns=columns):
                skipped += self._validate_batch(start, batch, pool)
        self._skipped_rows = skipped
        self._skipped_index = {s.prompt_index for s in skipped}
        self.num_valid = self.num_rows - len(skipped)
        return list(skipped)

    def _validate_batch(self, start: int, batch: pa.RecordBatch, pool: ThreadPoolExecutor | None) -> list[SkippedRow]:
        """Encode one batch, keep its ids in the cache; the rows it skipped (raises without skip_invalid)."""
        skipped = []
        values = _cells(batch.column(0))
        images = _cells(batch.column(1), "image path") if self.image_column is not None else None
        if images is not None:
            refuse_text_cells(images, start, self.path, self.image_column)
        if self.vision is not None:
            counts = (self._token_counts(images, pool) if images is not None else [[] for _ in values])
            encoded = self.vision.ids_batch(values, counts)
        else:
            if images is not None:
                self._refuse_images(start, images)
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
        return skipped

    def _token_counts(self, cells: list[Any], pool: ThreadPoolExecutor | None) -> list[list[int] | InvalidPrompt]:
        """Per row: the image tokens of each of its images, or why they cannot be read (images decoded
        on `pool`'s threads, then dropped: validation keeps no pixels)."""
        vision, base = self.vision, self.path.parent
        assert vision is not None

        def counts(cell: Any) -> list[int] | InvalidPrompt:
            if isinstance(cell, InvalidPrompt):
                return cell
            try:
                return vision.token_counts(cell, base)
            except InvalidPrompt as err:
                return err

        if pool is None or sum(map(holds_images, cells)) < 2:
            return [counts(cell) for cell in cells]
        return list(pool.map(counts, cells))

    def _refuse_images(self, start: int, cells: list[Any]) -> None:
        """A text-only model cannot take the rows' images: wrong for the whole run, so no --skip-invalid."""
        for offset, cell in enumerate(cells):
            if holds_images(cell):
                raise RolloutError(f"row {start + offset} of {self.path} holds an image in column "
                                   f"{self.image_column!r}, but the model is text-only and takes no images; drop that "
                                   "column from the file (or run a vision-language checkpoint)")

    def _problem(self, result: list[int] | InvalidPrompt) -> tuple[str, str] | None:
        """(reason, fix) when a row cannot be used, else None."""
        if isinstance(result, ImageCountMismatch) and self.image_column is None:
            return f"{result} (the file has no image column)", "pass --image-key NAME to pick the image column"
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
            passthrough = self._passthrough(nanoseconds_as_ints(batch.select(names)), start, keep)
            if self.vision is not None:
                yield from self._vision_rows(batch, start, keep, ids, passthrough)
                continue
            self._encode_uncached(batch, start, keep, ids)
            for offset, row_ids in zip(keep, ids):
                yield PromptInput(start + offset, row_ids, passthrough[offset])  # type: ignore[arg-type]

    def _vision_rows(self, batch: pa.RecordBatch, start: int, keep: list[int], ids: list[list[int] | None],
                     passthrough: dict[int, dict[str, Any]]) -> Iterator[PromptInput]:
        """The kept rows of a batch with their images, each made as the row is asked for (the patch rows
        of a batch's images would be gigabytes); ids the cache did not hold are encoded again."""
        vision = self.vision
        assert vision is not None
        prompts = _cells(batch.column(self.prompt_key))
        cells = (_cells(batch.column(self.image_column), "image path") if self.image_column is not None
                 else [None] * batch.num_rows)
        with ThreadPoolExecutor(_DECODE_THREADS) as pool:
            rows = iter(zip(keep, ids))
            ahead: deque = deque()  # (offset, cached ids or None, future of the row's ImageInputs), in row order

            def prepare_next() -> None:
                for offset, row_ids in rows:
                    ahead.append((offset, row_ids, pool.submit(vision.images, cells[offset], self.path.parent)))
                    return

            for _ in range(_PREPARE_AHEAD):
                prepare_next()
            while ahead:
                offset, row_ids, images = ahead.popleft()
                prepare_next()
                yield self._vision_row(start + offset, row_ids, images, prompts[offset], passthrough[offset])

    def _vision_row(self, index: int, row_ids: list[int] | None, images, prompt: Any, passthrough: dict) -> PromptInput:
        """One row with its images (`images`: the future of vision.images on its cell)."""
        vision: VisionPromptEncoder = self.vision  # type: ignore[assignment] # _vision_rows' caller checked
        try:
            images = images.result()
            counts = [image.num_tokens(vision.merge_size) for image in images]
            if row_ids is None:
                row_ids = vision.prompt_ids(prompt, counts)
        except InvalidPrompt as err:  # a file the row names changed or went away since validate()
            raise RolloutError(f"row {index} of {self.path}: {err}, though it passed validation when the run "
                               "started; restore its images and --resume") from err
        if row_ids.count(vision.image_token_id) != sum(counts):
            # validate() counted the tokens by the processor's resize rule; the processor disagrees
            raise RuntimeError(f"row {index}: the image processor made {sum(counts)} image tokens, "
                               f"validation counted {row_ids.count(vision.image_token_id)}")
        return PromptInput(index, row_ids, passthrough, images=images)

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
        """{offset in batch: {column: value}} of the kept rows. Row by row only when the batch holds a
        string that is not UTF-8 (a skipped row may hold it, and is not read); in a kept row it is an
        error naming the row and column."""
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
