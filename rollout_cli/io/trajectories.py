"""Sharded, atomic Parquet output and the output directory around it.

Layout of one run:

    OUT/manifest.json                     run settings and counters (write_manifest)
    OUT/trajectories/part-00000.parquet   one shard per flush, numbered upward
    OUT/trajectories/.part-00001.parquet.tmp   a shard being written (hidden)
    OUT/routing/part-00000.parquet        with routing capture: the expert ids of the trajectories
                                          of the trajectory shard with the same number
    OUT/trajectories/part-r001-00000.parquet   data-parallel replica 1's shards (rollout_cli.data_parallel)

A shard is written under a dot-name, fsynced, then renamed with os.replace, so
a crash leaves whole shards plus at most one hidden temp file. Readers never
see the temp file: pyarrow's dataset discovery (`pq.read_table(dir)`) skips
names starting with '.' or '_'. Resume reads the (prompt_index, sample_index)
pairs of the whole shards and generates only the rest; new shards continue the
numbering, so nothing written is ever overwritten.

Routing shards are paired with trajectory shards: written in the same flush under the
same number, routing renamed first. Trajectories are the truth: resume deletes routing
shards without a trajectory shard of their number, so a trajectory and its routing are
both present or both absent.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rollout_cli.errors import RolloutError

MANIFEST_NAME = "manifest.json"
TRAJECTORIES_SUBDIR = "trajectories"
ROUTING_SUBDIR = "routing"

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
)
FIXED_NAMES: tuple[str, ...] = tuple(f.name for f in FIXED_FIELDS)

# part-NNNNN.parquet, or part-rRRR-NNNNN.parquet from data-parallel replica RRR (each numbers its own)
_PART_RE = re.compile(r"^(part-(?:r\d+-)?)(\d+)\.parquet$")
_TEMP_RE = re.compile(r"^\.part-(?:r\d+-)?\d+\.parquet\.tmp$")


class OutputWriteError(RolloutError):
    """Writing OUT failed (a full disk, a broken mount). The whole shards already written stay valid;
    the rows that were buffered are left for --resume."""

    def __init__(self, path: Path, err: OSError):
        self.disk_full = err.errno in (errno.ENOSPC, errno.EDQUOT)
        if self.disk_full:
            message = f"disk full writing {path}: free space and re-run with --resume"
        else:
            message = f"cannot write {path} ({err.strerror or err}); fix that and re-run with --resume"
        super().__init__(message)


@contextlib.contextmanager
def _writing(path: Path):
    """An OSError while writing `path` becomes an OutputWriteError naming it."""
    try:
        yield
    except OSError as err:
        raise OutputWriteError(path, err) from err


def trajectory_schema(passthrough_schema: pa.Schema) -> pa.Schema:
    """The fixed columns in order, then the input's passthrough columns in input order."""
    for name in passthrough_schema.names:
        if name in FIXED_NAMES:
            raise RolloutError(
                f"input column {name!r} has the name of an output column "
                f"({', '.join(FIXED_NAMES)}); rename it in the prompt file"
            )
    # pa.schema(fields) carries no schema metadata: the input's pandas metadata
    # would describe columns the output does not have.
    return pa.schema(list(FIXED_FIELDS) + list(passthrough_schema))


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
        self._next_part = max((number for prefix, number in map(_shard_key, _part_files(self.dir))
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
            with _writing(final):
                temp = _write_temp(table, final)
                try:
                    self._before_rename(final.name)
                except OutputWriteError:
                    temp.unlink(missing_ok=True)
                    raise
                os.replace(temp, final)
        except OutputWriteError:
            self.failed = True
            raise
        _fsync_dir(self.dir)  # make the rename itself durable
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
    ) -> None:
        super().__init__(
            out_dir,
            trajectory_schema(passthrough_schema),
            shard_rows=shard_rows,
            flush_seconds=flush_seconds,
            subdir=subdir,
            clock=clock,
            replica=replica,
        )
        self.routing_dtype = routing_dtype
        self.routing_shape = routing_shape  # (num_layers, top_k): the shape of an empty routing
        if routing_dtype is not None:
            self.routing_schema = routing_schema(routing_dtype)
            self.routing_dir = Path(out_dir) / ROUTING_SUBDIR
            self.routing_dir.mkdir(parents=True, exist_ok=True)
            self._routing: list[tuple[int, int, np.ndarray]] = []

    def add(self, row: dict[str, Any], routing: np.ndarray | None = None) -> None:
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
        with _writing(final):
            os.replace(_write_temp(table, final), final)
        _fsync_dir(self.routing_dir)


def completed_pairs(out_dir: str | Path, subdir: str = TRAJECTORIES_SUBDIR,
                    clean: bool = True) -> set[tuple[int, int]]:
    """(prompt_index, sample_index) of every row in the whole shards; with `clean`, deletes leftover
    temp shards and routing shards without their trajectories (only when no writer is running:
    data-parallel replicas that start after the first one pass clean=False).

    Reads only those two columns. A missing directory means nothing done yet.
    """
    directory = Path(out_dir) / subdir
    if not directory.is_dir():
        return set()
    for entry in directory.iterdir():
        if clean and _TEMP_RE.match(entry.name):
            entry.unlink()  # a shard a crash interrupted; its rows are generated again
    pairs: set[tuple[int, int]] = set()
    for _, path in sorted(_part_files(directory).items()):
        try:
            table = pq.read_table(path, columns=["prompt_index", "sample_index"])
        except (pa.ArrowException, OSError) as err:
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise RolloutError(
                f"shard {path} is unreadable ({reason}); delete it and run again with --resume "
                "to regenerate its rows"
            ) from err
        pairs.update(zip(table.column(0).to_pylist(), table.column(1).to_pylist()))
    routing = Path(out_dir) / ROUTING_SUBDIR
    if clean and routing.is_dir():  # trajectories are the truth: drop routing a crash left without its trajectories
        whole = _part_files(directory)
        for entry in routing.iterdir():
            if _TEMP_RE.match(entry.name):
                entry.unlink()
        for name, path in _part_files(routing).items():
            if name not in whole:
                path.unlink()
    return pairs


def prepare_output_dir(out_dir: str | Path, resume: bool) -> None:
    """Refuse an --out that would mix runs; creates nothing (see create_output_dir)."""
    path = Path(out_dir)
    if path.exists() and not path.is_dir():
        raise RolloutError(f"--out {path} is a file, not a directory; choose another --out")
    if not path.exists():
        _check_creatable(path)
        return
    if not any(path.iterdir()):
        return
    if not resume:
        raise RolloutError(
            f"output directory {path} is not empty; pass --resume to continue that run, "
            "or choose another --out"
        )
    if not (path / MANIFEST_NAME).exists() and not (path / TRAJECTORIES_SUBDIR).is_dir():
        raise RolloutError(
            f"--resume: {path} holds no rollout output (no {MANIFEST_NAME} or "
            f"{TRAJECTORIES_SUBDIR}/); choose another --out"
        )


def _check_creatable(path: Path) -> None:
    """Refuse an --out whose nearest existing parent is no writable directory, before the model loads.

    Not every failure shows here (as root, /proc passes os.access but refuses mkdir):
    create_output_dir turns the rest into the same kind of one-line error.
    """
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise RolloutError(f"cannot create --out {path}: {parent} is a file, not a directory; choose another --out")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise RolloutError(f"cannot create --out {path}: {parent} is not writable; choose another --out")


def create_output_dir(out_dir: str | Path, subdirs: Iterable[str] = (TRAJECTORIES_SUBDIR,)) -> None:
    """Make OUT and its shard folders; call it only after every input check passed."""
    try:
        for sub in subdirs:
            (Path(out_dir) / sub).mkdir(parents=True, exist_ok=True)
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OutputWriteError(Path(out_dir), err) from err
        raise RolloutError(f"cannot create --out {out_dir} ({err.strerror or err}); choose another --out") from err


def write_manifest(out_dir: str | Path, manifest: dict[str, Any]) -> None:
    """Write OUT/manifest.json atomically (temp file, fsync, rename), indent=2."""
    directory = Path(out_dir)
    final = directory / MANIFEST_NAME
    temp = directory / f".{MANIFEST_NAME}.tmp"
    with _writing(final):
        try:
            with open(temp, "w", encoding="utf-8") as f:
                f.write(json.dumps(manifest, indent=2) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, final)
        except OSError:
            temp.unlink(missing_ok=True)  # the previous manifest.json stays whole
            raise
    _fsync_dir(directory)


def read_manifest(out_dir: str | Path) -> dict[str, Any] | None:
    """OUT/manifest.json as a dict, or None when there is none."""
    path = Path(out_dir) / MANIFEST_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as err:
        raise RolloutError(
            f"{path} is not valid JSON ({err}); restore or delete it, or choose another --out"
        ) from err
    if not isinstance(manifest, dict):
        raise RolloutError(f"{path} does not hold a JSON object; restore or delete it, or choose another --out")
    return manifest


def _part_files(directory: Path) -> dict[str, Path]:
    """{file name: path} of the whole shards in directory."""
    return {name: directory / name for name in sorted(os.listdir(directory)) if _PART_RE.match(name)}


def _shard_key(name: str) -> tuple[str, int]:
    """"part-r001-00007.parquet" -> ("part-r001-", 7)."""
    match = _PART_RE.match(name)
    return match.group(1), int(match.group(2))


def _write_temp(table: pa.Table, final: Path) -> Path:
    """Write table to the hidden temp name of `final` and fsync it; returns the temp path."""
    temp = final.parent / f".{final.name}.tmp"
    try:
        pq.write_table(table, temp, compression="zstd")
        _fsync_file(temp)
    except OSError:
        temp.unlink(missing_ok=True)  # a partial file only takes space; resume would delete it anyway
        raise
    return temp


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    """Best effort: not every OS or filesystem lets a directory be opened and fsynced."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
