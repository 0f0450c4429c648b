"""Editing a run's trajectory shards in place, as another writer would have left them (tests of
--continue-aborted make aborted rows out of a finished run's)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def edit_trajectory_rows(out: Path, edit: Callable[[dict], bool]) -> int:
    """Apply `edit(row)` (it changes the row in place and says whether it did) to every row of OUT's
    trajectory shards, each shard rewritten with its own schema -> rows changed."""
    changed = 0
    for shard in sorted((Path(out) / "trajectories").glob("*.parquet")):
        table = pq.read_table(shard)
        rows = table.to_pylist()
        changed += sum(bool(edit(row)) for row in rows)
        pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), shard)
    return changed


def cut_response(row: dict, end: int, columns=("response_token_ids", "response_logprobs",
                                                "response_weight_versions")) -> None:
    """The row as an abort leaves it: its response's first `end` positions (in every per-position column)."""
    for column in columns:
        row[column] = row[column][:end]
    row["finish_reason"] = "abort"
