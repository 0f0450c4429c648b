"""The output directory of a run: its layout, the checks before it is used, its manifest, and what
--resume reads back from it.

Layout of one run:

    OUT/manifest.json                     run settings and counters (write_manifest)
    OUT/trajectories/part-00000.parquet   one shard per flush, numbered upward
    OUT/trajectories/.part-00001.parquet.tmp   a shard being written (hidden)
    OUT/routing/part-00000.parquet        with routing capture: the expert ids of the trajectories
                                          of the trajectory shard with the same number
    OUT/trajectories/part-r001-00000.parquet   data-parallel replica 1's shards (rollout_cli.data_parallel)

Shards are written whole or not at all (`trajectories.py`, through `atomic_write.py`). Readers
never see a temp file: pyarrow's dataset discovery (`pq.read_table(dir)`) skips names starting
with '.' or '_'. Resume reads the (prompt_index, sample_index) pairs of the whole shards and
generates only the rest; new shards continue the numbering, so nothing written is ever overwritten.

Routing shards are paired with trajectory shards: written in the same flush under the
same number, routing renamed first. Trajectories are the truth: resume deletes routing
shards without a trajectory shard of their number, so a trajectory and its routing are
both present or both absent.

Separate from the writers: this is the directory as a whole (`rollout run` and `rollout score`
share it), the writers only add shards to it.
"""

from __future__ import annotations

import errno
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rollout_cli.errors import RolloutError
from rollout_cli.io.atomic_write import OutputWriteError, fsync_dir, writing

MANIFEST_NAME = "manifest.json"
TRAJECTORIES_SUBDIR = "trajectories"
ROUTING_SUBDIR = "routing"

# part-NNNNN.parquet, or part-rRRR-NNNNN.parquet from data-parallel replica RRR (each numbers its own)
_PART_RE = re.compile(r"^(part-(?:r\d+-)?)(\d+)\.parquet$")
_TEMP_RE = re.compile(r"^\.part-(?:r\d+-)?\d+\.parquet\.tmp$")


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
    for _, path in sorted(part_files(directory).items()):
        try:
            table = pq.read_table(path, columns=["prompt_index", "sample_index"])
        except (pa.ArrowException, OSError) as err:
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise RolloutError(
                f"shard {path} is unreadable ({reason}); delete it and run again with --resume "
                "to regenerate its rows"
            ) from err
        problem = sample_key_problem(table)
        if problem is not None:
            raise RolloutError(f"shard {path} is not one rollout wrote (its {table.column_names[0]} / "
                               f"{table.column_names[1]} must be integers without nulls: {problem}); delete it and "
                               "run again with --resume to regenerate its rows")
        pairs.update(zip(table.column(0).to_pylist(), table.column(1).to_pylist()))
    routing = Path(out_dir) / ROUTING_SUBDIR
    if clean and routing.is_dir():  # trajectories are the truth: drop routing a crash left without its trajectories
        whole = part_files(directory)
        for entry in routing.iterdir():
            if _TEMP_RE.match(entry.name):
                entry.unlink()
        for name, path in part_files(routing).items():
            if name not in whole:
                path.unlink()
    return pairs


def sample_key_problem(keys: pa.Table) -> str | None:
    """What is wrong with a shard's sample keys (its prompt_index and sample_index columns, read alone),
    or None: both must be integers without nulls (a shard rollout did not write may hold anything)."""
    for name in keys.column_names:
        column = keys.column(name)
        if not pa.types.is_integer(column.type):
            return f"column {name} holds {column.type}, not integers"
        if column.null_count:
            return f"column {name} holds {column.null_count} null(s)"
    return None


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
    with writing(final):
        try:
            with open(temp, "w", encoding="utf-8") as f:
                f.write(json.dumps(manifest, indent=2) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, final)
        except OSError:
            temp.unlink(missing_ok=True)  # the previous manifest.json stays whole
            raise
    fsync_dir(directory)


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


def part_files_in(out_dir: str | Path, subdir: str = TRAJECTORIES_SUBDIR) -> dict[str, Path]:
    """{file name: path} of the whole shards in OUT/subdir ({} when there is no such folder)."""
    directory = Path(out_dir) / subdir
    return part_files(directory) if directory.is_dir() else {}


def part_files(directory: Path) -> dict[str, Path]:
    """{file name: path} of the whole shards in directory."""
    return {name: directory / name for name in sorted(os.listdir(directory)) if _PART_RE.match(name)}


def shard_key(name: str) -> tuple[str, int]:
    """"part-r001-00007.parquet" -> ("part-r001-", 7)."""
    match = _PART_RE.match(name)
    return match.group(1), int(match.group(2))
