"""Atomic, durable file writes for the output directory: temp file, fsync, rename.

A file is written under its hidden temp name (`.NAME.tmp`), fsynced, then renamed over the
final name with os.replace, so a crash leaves only whole files (the old one or the new one),
plus at most a hidden temp file. An OSError on the way (a full disk, a broken mount) becomes `OutputWriteError`,
one line naming the file. Separate from the shard writers and the output directory's layout,
which both write through it.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rollout_cli.errors import RolloutError


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
def writing(path: Path):
    """An OSError while writing `path` becomes an OutputWriteError naming it."""
    try:
        yield
    except OSError as err:
        raise OutputWriteError(path, err) from err


def write_temp(table: pa.Table, final: Path) -> Path:
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


def fsync_dir(path: Path) -> None:
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
