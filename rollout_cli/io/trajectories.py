"""Trajectory rows as atomic, numbered Parquet shards: the output schema and the shard writers.

`ShardWriter` buffers rows of one schema and writes them as OUT/SUBDIR/part-NNNNN.parquet, each
shard whole or not at all (temp file, fsync, rename: `atomic_write.py`), numbering on from the
shards already there so that --resume never overwrites one. `TrajectoryWriter` is that writer over
the trajectory schema, with the routing shards of routing capture written in the same flush.
Where the shards go and how a run's directory is checked, read back and described is
`output_dir.py`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rollout_cli.errors import RolloutError
from rollout_cli.io.atomic_write import OutputWriteError, fsync_dir, write_temp, writing
from rollout_cli.io.output_dir import ROUTING_SUBDIR, TRAJECTORIES_SUBDIR, part_files, shard_key

# One row per (prompt, sample). Token ids fit int32 (vocabularies < 2**31);
# logprobs are float32 like the sampler's output.
FIXED_FIELDS: tuple[pa.Field, ...] = (
    pa.field("prompt_index", pa.int64()),
    pa.field("sample_index", pa.int32()),
    pa.field("prompt_token_ids", pa.list_(pa.int32())),
    pa.field("response_token_ids", pa.list_(pa.int32())),
    pa.field("response_logprobs", pa.list_(pa.float32())),
    pa.field("response_text", pa.string()),
    pa.field("finish_reason", pa.string()),
    pa.field("weight_version", pa.string()),
    pa.field("response_weight_versions", pa.list_(pa.string())),
)
FIXED_NAMES: tuple[str, ...] = tuple(f.name for f in FIXED_FIELDS)
# `rollout run --top-logprobs K`: per response token, its position's K most likely tokens and their logprobs
# (as response_logprobs reports logprobs; empty lists for tokens carried over by --continue-aborted)
TOP_LOGPROB_FIELDS: tuple[pa.Field, ...] = (
    pa.field("response_top_token_ids", pa.list_(pa.list_(pa.int32()))),
    pa.field("response_top_logprobs", pa.list_(pa.list_(pa.float32()))),
)
# `rollout run --sampling-mask`: per response token, the ids the top-k / top-p / min-p filters kept (the set
# it was drawn from; empty for tokens carried over by --continue-aborted)
SAMPLING_MASK_FIELDS: tuple[pa.Field, ...] = (
    pa.field("response_sampling_mask", pa.list_(pa.list_(pa.int32()))),
)
# `rollout run --env` (rollout_cli/episodes.py): the response holds model and environment tokens
EPISODE_FIELDS: tuple[pa.Field, ...] = (
    pa.field("response_loss_mask", pa.list_(pa.int8())),  # 1: a model token, 0: an environment token
    pa.field("model_turns", pa.list_(pa.list_(pa.int32()))),  # [start, end) in the response of each model turn
    pa.field("episode_reward", pa.float64()),  # the sum of the environment's rewards
    pa.field("turn_cached_tokens", pa.list_(pa.int32())),  # per model turn: prompt tokens the prefix cache served
)

# `rollout run --stop` / `--stop-token-ids`: the stop string, or the stop token id as text, that ended the
# row (finish_reason stop); null for eos and every other finish (vLLM's stop_reason)
STOP_REASON_FIELDS: tuple[pa.Field, ...] = (
    pa.field("stop_reason", pa.string()),
)

# a run over an image column (vision-language models): per row, each image's [t, h, w] patch grid in
# prompt order ([] for a row without images), which a trainer needs with prompt_token_ids to rebuild the
# vision inputs (the image processor's image_grid_thw)
IMAGE_FIELDS: tuple[pa.Field, ...] = (
    pa.field("image_grid_thw", pa.list_(pa.list_(pa.int32()))),
)


def trajectory_schema(passthrough_schema: pa.Schema, episodes: bool = False, top_logprobs: bool = False,
                      images: bool = False, sampling_mask: bool = False, stop_reason: bool = False) -> pa.Schema:
    """The fixed columns in order (then the episode columns, the top-logprob columns, the image columns, the
    sampling-mask column, the stop-reason column, as asked), then the input's passthrough columns in input order."""
    fields = (list(FIXED_FIELDS) + (list(EPISODE_FIELDS) if episodes else [])
              + (list(TOP_LOGPROB_FIELDS) if top_logprobs else []) + (list(IMAGE_FIELDS) if images else [])
              + (list(SAMPLING_MASK_FIELDS) if sampling_mask else [])
              + (list(STOP_REASON_FIELDS) if stop_reason else []))
    names = [f.name for f in fields]
    for name in passthrough_schema.names:
        if name in names:
            raise RolloutError(
                f"input column {name!r} has the name of an output column "
                f"({', '.join(names)}); rename it in the prompt file"
            )
    # pa.schema(fields) carries no schema metadata: the input's pandas metadata
    # would describe columns the output does not have.
    return pa.schema(fields + list(passthrough_schema))


def shards_have_column(out_dir: str | Path, name: str) -> bool:
    """Whether every trajectory shard already in OUT has the column `name` (True for none): a resumed run
    writes its rows as the run's first shards were written, since reading the folder takes the first
    shard's schema (a column that only later shards have would be dropped). Reads Parquet footers only."""
    folder = Path(out_dir) / TRAJECTORIES_SUBDIR
    return not folder.is_dir() or all(name in pq.read_schema(path).names for path in part_files(folder).values())


def nanoseconds_as_ints(batch: pa.RecordBatch | pa.Table) -> pa.RecordBatch | pa.Table:
    """`batch` with its nanosecond timestamp / duration / time values as int64, for to_pylist: Python's
    datetime holds microseconds, so a value with nanoseconds (pandas' datetime64[ns] writes them) was a
    ValueError traceback mid-run, at any depth (a struct's field, a list's items, a map's values). The
    writer builds the same values back from the ints, under the input's type (trajectory_schema keeps the
    passthrough schema)."""
    types = [_without_nanoseconds(field.type) for field in batch.schema]
    if types == list(batch.schema.types):
        return batch
    columns = [column.cast(kind) if kind != column.type else column for column, kind in zip(batch.columns, types)]
    return type(batch).from_arrays(columns, names=batch.schema.names)


def _without_nanoseconds(kind: pa.DataType) -> pa.DataType:
    """`kind` with every nanosecond timestamp / duration / time64 in it, however deep, as int64."""
    if (pa.types.is_timestamp(kind) or pa.types.is_duration(kind) or pa.types.is_time64(kind)) and kind.unit == "ns":
        return pa.int64()
    if pa.types.is_struct(kind):
        return pa.struct([field.with_type(_without_nanoseconds(field.type)) for field in kind])
    if pa.types.is_map(kind):
        return pa.map_(kind.key_field.with_type(_without_nanoseconds(kind.key_type)),
                       kind.item_field.with_type(_without_nanoseconds(kind.item_type)), kind.keys_sorted)
    if pa.types.is_fixed_size_list(kind):
        return pa.list_(kind.value_field.with_type(_without_nanoseconds(kind.value_type)), kind.list_size)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        make = pa.large_list if pa.types.is_large_list(kind) else pa.list_
        return make(kind.value_field.with_type(_without_nanoseconds(kind.value_type)))
    return kind  # a Parquet file holds no union; its dictionaries are of strings (ns values read back plain)


def routing_schema(dtype: str) -> pa.Schema:
    """One row per trajectory; routed_experts flattened row-major from [num_tokens, num_layers, top_k]."""
    return pa.schema([
        pa.field("prompt_index", pa.int64()),
        pa.field("sample_index", pa.int32()),
        pa.field("num_tokens", pa.int32()),
        pa.field("num_layers", pa.int32()),
        pa.field("top_k", pa.int32()),
        pa.field("routed_experts", pa.list_(pa.from_numpy_dtype(np.dtype(dtype)))),
    ])


class ShardWriter:
    """Buffers rows of one schema and writes them as atomic numbered Parquet shards.

    A shard is written when `shard_rows` rows are buffered, or when the oldest
    buffered row has waited `flush_seconds` (bounding what a crash can lose
    without writing a one-row shard for every quiet spell), or on flush/close.
    """

    def __init__(
        self,
        out_dir: str | Path,
        schema: pa.Schema,
        shard_rows: int = 1024,
        flush_seconds: float = 10.0,
        subdir: str = TRAJECTORIES_SUBDIR,
        clock: Callable[[], float] = time.monotonic,
        replica: int | None = None,
    ) -> None:
        if shard_rows < 1:
            raise ValueError(f"shard_rows must be at least 1, got {shard_rows}")
        self.dir = Path(out_dir) / subdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.schema = schema
        self.shard_rows = shard_rows
        self.flush_seconds = flush_seconds
        self.clock = clock
        self._names = frozenset(schema.names)
        self._columns: dict[str, list[Any]] = {name: [] for name in schema.names}
        self._buffered = 0
        self._oldest: float = 0.0  # clock() when the first row of the buffer came
        # data-parallel replicas share the directory: each writes and numbers its own shards
        self.prefix = "part-" if replica is None else f"part-r{replica:03d}-"
        self._next_part = max((number for prefix, number in map(shard_key, part_files(self.dir))
                               if prefix == self.prefix), default=-1) + 1
        self.rows_written = 0
        self.shards_written = 0
        self.failed = False  # a write failed: close() writes nothing more (see flush)

    def add(self, row: dict[str, Any]) -> None:
        """Buffer one row holding every schema field; flush when the buffer is due."""
        if row.keys() != self._names:
            missing = sorted(self._names - row.keys())
            extra = sorted(row.keys() - self._names)
            raise ValueError(f"row fields do not match the schema: missing {missing}, unexpected {extra}")
        if self._buffered == 0:
            self._oldest = self.clock()
        for name, values in self._columns.items():
            values.append(row[name])
        self._buffered += 1
        if self._buffered >= self.shard_rows:
            self.flush()
        else:
            self.maybe_flush()

    @property
    def rows_added(self) -> int:
        """Rows given to add(): written in whole shards, or buffered."""
        return self.rows_written + self._buffered

    def maybe_flush(self) -> None:
        """Flush when the oldest buffered row has waited flush_seconds (engine loop calls this)."""
        if self._buffered and self.clock() - self._oldest >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        """Write the buffer as one new shard: temp file, fsync, rename. No-op when empty.

        A failed write (OSError: disk full, ...) removes its temp files, so the space it took is free
        again for the manifest, and raises OutputWriteError. The writer then stops: a paired routing
        buffer was already taken, so a retry could write trajectories without their routing; the
        buffered rows are not in a whole shard, so --resume generates them again.
        """
        if not self._buffered or self.failed:
            return
        # from_pydict with the schema casts Python values back to the input's
        # types (structs, timestamps, dictionaries) instead of inferring them.
        table = pa.Table.from_pydict(self._columns, schema=self.schema)
        final = self.dir / f"{self.prefix}{self._next_part:05d}.parquet"
        try:
            with writing(final):
                temp = write_temp(table, final)
                try:
                    self._before_rename(final.name)
                except OutputWriteError:
                    temp.unlink(missing_ok=True)
                    raise
                os.replace(temp, final)
        except OutputWriteError:
            self.failed = True
            raise
        fsync_dir(self.dir)  # make the rename itself durable
        self.rows_written += self._buffered
        self.shards_written += 1
        self._next_part += 1
        self._columns = {name: [] for name in self.schema.names}
        self._buffered = 0

    def _before_rename(self, name: str) -> None:
        """Hook of paired writers: runs after this shard's temp file is written, before its rename."""

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        # Flush even on an exception: finished rows are worth keeping for --resume.
        self.close()


class TrajectoryWriter(ShardWriter):
    """ShardWriter over trajectory_schema(passthrough_schema).

    With `images` the rows get an image_grid_thw column; a row without it (a text prompt of the run) gets [].
    With `stop_reason` the rows get a stop_reason column; a row without it (no stop rule ended it) gets null.
    Without, a row's stop_reason is left out (shards_have_column: the run's shards were written without it).

    With `routing_dtype` ("uint8" or "int16") every row comes with its routing (`add(row, routing)`,
    routing a numpy array [num_tokens, num_layers, top_k]) and each flush also writes
    OUT/routing/part-NNNNN.parquet with the same number: both temp files, then the routing rename,
    then the trajectory rename.
    """

    def __init__(
        self,
        out_dir: str | Path,
        passthrough_schema: pa.Schema,
        shard_rows: int = 1024,
        flush_seconds: float = 10.0,
        subdir: str = TRAJECTORIES_SUBDIR,
        clock: Callable[[], float] = time.monotonic,
        routing_dtype: str | None = None,
        routing_shape: tuple[int, int] = (0, 0),
        replica: int | None = None,
        episodes: bool = False,
        top_logprobs: bool = False,
        images: bool = False,
        sampling_mask: bool = False,
        stop_reason: bool = False,
    ) -> None:
        super().__init__(
            out_dir,
            trajectory_schema(passthrough_schema, episodes, top_logprobs, images, sampling_mask, stop_reason),
            shard_rows=shard_rows,
            flush_seconds=flush_seconds,
            subdir=subdir,
            clock=clock,
            replica=replica,
        )
        self.images = images
        self.stop_reason = stop_reason
        self.routing_dtype = routing_dtype
        self.routing_shape = routing_shape  # (num_layers, top_k): the shape of an empty routing
        if routing_dtype is not None:
            self.routing_schema = routing_schema(routing_dtype)
            self.routing_dir = Path(out_dir) / ROUTING_SUBDIR
            self.routing_dir.mkdir(parents=True, exist_ok=True)
            self._routing: list[tuple[int, int, np.ndarray]] = []

    def add(self, row: dict[str, Any], routing: np.ndarray | None = None) -> None:
        if self.images and "image_grid_thw" not in row:
            row = {**row, "image_grid_thw": []}
        if self.stop_reason and "stop_reason" not in row:
            row = {**row, "stop_reason": None}
        elif not self.stop_reason and "stop_reason" in row:  # a resumed OUT's shards have no such column
            row = {name: value for name, value in row.items() if name != "stop_reason"}
        if self.routing_dtype is not None:
            if routing is None:  # e.g. a sample aborted before any token was computed
                routing = np.zeros((0, *self.routing_shape), dtype=self.routing_dtype)
            self._routing.append((row["prompt_index"], row["sample_index"], routing))
        super().add(row)

    def _before_rename(self, name: str) -> None:
        if self.routing_dtype is None:
            return
        rows, self._routing = self._routing, []
        dtype = np.dtype(self.routing_dtype)
        # list<> offsets are int32: split the rows into chunks of under 2**31 values each
        chunks, current, size = [], [], 0
        for row in rows:
            if current and size + row[2].size >= 2**31:
                chunks.append(current)
                current, size = [], 0
            current.append(row)
            size += row[2].size
        chunks.append(current)
        tables = []
        for chunk in chunks:
            lengths = np.array([r.size for _, _, r in chunk], dtype=np.int64)
            offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
            values = (np.concatenate([r.reshape(-1) for _, _, r in chunk]).astype(dtype, copy=False)
                      if chunk else np.zeros(0, dtype=dtype))
            shape = np.array([r.shape for _, _, r in chunk], dtype=np.int32).reshape(-1, 3)
            tables.append(pa.Table.from_arrays([
                pa.array([p for p, _, _ in chunk], pa.int64()),
                pa.array([s for _, s, _ in chunk], pa.int32()),
                pa.array(shape[:, 0]), pa.array(shape[:, 1]), pa.array(shape[:, 2]),
                pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)),
            ], schema=self.routing_schema))
        table = pa.concat_tables(tables)
        final = self.routing_dir / name
        with writing(final):
            os.replace(write_temp(table, final), final)
        fsync_dir(self.routing_dir)
