"""Which rows of a run's trajectories `rollout score` reads: one per (prompt_index, sample_index) pair.

A run writes each pair once, but a `--continue-aborted` run that crashed between writing a continued
row and dropping the aborted one it replaces (job_continue.py) leaves both: the finished row is the
sample, the aborted one is superseded. Any other repeated pair (two finished rows, two aborted rows,
or a repeat in trajectories without finish_reason) has no row that is plainly the sample, and is
refused before OUT is touched: scoring every row wrote the pair's scores twice and counted it twice
in the comparison with the run.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from rollout_cli.errors import RolloutError
from rollout_cli.job_continue import KEY  # a sample's key, as the continuation reads it


def superseded_aborts(dataset: ds.Dataset, data: str) -> tuple[frozenset, int]:
    """-> (the pairs whose aborted rows a finished row of the same pair supersedes, how many rows those
    aborted rows are). Raises RolloutError on any other repeated pair. Reads three columns."""
    has_reason = "finish_reason" in dataset.schema.names
    table = dataset.to_table(columns=[*KEY, "finish_reason"] if has_reason else list(KEY))
    aborted = (pc.fill_null(pc.equal(table.column("finish_reason"), "abort"), False) if has_reason
               else pa.chunked_array([pa.array([False] * table.num_rows)]))
    pairs = (table.select(list(KEY)).append_column("abort", pc.cast(aborted, pa.int64()))
             .group_by(list(KEY)).aggregate([("abort", "sum"), ([], "count_all")]))
    repeated = pairs.filter(pc.greater(pairs.column("count_all"), 1))
    superseded, dropped = set(), 0
    for pair in repeated.to_pylist():
        key, aborts, total = (pair["prompt_index"], pair["sample_index"]), pair["abort_sum"], pair["count_all"]
        where = f"--data {data} holds {{}} rows of (prompt_index {key[0]}, sample_index {key[1]})"
        if not has_reason:
            raise RolloutError(where.format(total) + " and no finish_reason column to tell which is the sample; "
                               "keep one row of each pair")
        if total - aborts > 1:
            raise RolloutError(where.format(f"{total - aborts} finished") + "; keep one of them (a run writes each "
                               "sample once)")
        if total == aborts:
            raise RolloutError(where.format(f"{aborts} aborted") + " and no finished one; finish them with "
                               "`rollout run --resume --continue-aborted` on that run, or keep one of them")
        superseded.add(key)
        dropped += aborts
    return frozenset(superseded), dropped


def is_superseded(row: dict, superseded: frozenset) -> bool:
    """Whether `row` (with its finish_reason when `superseded` is not empty) is an aborted row a
    finished row of its pair replaces."""
    return bool(superseded) and row["finish_reason"] == "abort" and (row["prompt_index"], row["sample_index"]) \
        in superseded
