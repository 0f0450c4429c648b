"""`rollout run --resume --continue-aborted`: finish the samples a job left with finish_reason "abort".

An aborted job (the daemon's `abort`, `pause --mode abort`) writes its unfinished samples with the
response so far. Plain `--resume` counts them done; with --continue-aborted each one is continued
from its response (engine.trajectory.PartialSample: one prefill of prompt + response, then sampling
on the sample's own random stream) and written again whole, and its aborted row is removed. This is
how a long tail is carried over a weight update (APRIL, AReaL): abort, update the weights, continue;
each row's `response_weight_versions` says which weights sampled which token.

Nothing is ever lost: the continued row is written to a new shard first; only then is the aborted
row dropped, by rewriting the shard that holds it (routing shard first, then the trajectory shard,
each atomically). A crash in between leaves both rows; the next --continue-aborted (or the end of
this job) drops the aborted one, since a pair with a finished row is done.

A continuation can itself be aborted (the daemon's abort again): the sample is written again with
finish_reason "abort", its response the older row's plus what it sampled since. That newest aborted
row supersedes the older ones of its pair, which go the same way, so a job leaves at most one row per
pair (`rollout score` reads exactly one). Newest is the shard written last: aborted rows come only from
jobs on one engine (a daemon job, a continuation), whose shards are numbered upward.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rollout_cli.engine.trajectory import PartialSample
from rollout_cli.io.atomic_write import fsync_dir, write_temp, writing
from rollout_cli.io.output_dir import ROUTING_SUBDIR, TRAJECTORIES_SUBDIR, part_files, shard_key
from rollout_cli.io.trajectories import nanoseconds_as_ints

KEY = ("prompt_index", "sample_index")


def _pairs(table: pa.Table) -> list[tuple[int, int]]:
    return list(zip(table.column("prompt_index").to_pylist(), table.column("sample_index").to_pylist()))


def _shard_status(out: Path) -> tuple[dict[str, set], set]:
    """-> (shard name -> its aborted pairs, pairs with a row that is not aborted)."""
    aborted, finished = {}, set()
    for name, path in sorted(part_files(out / TRAJECTORIES_SUBDIR).items()):
        table = pq.read_table(path, columns=[*KEY, "finish_reason"])
        is_abort = pc.equal(table.column("finish_reason"), "abort").to_pylist()
        pairs = _pairs(table)
        aborted[name] = {pair for pair, hit in zip(pairs, is_abort) if hit}
        finished.update(pair for pair, hit in zip(pairs, is_abort) if not hit)
    return aborted, finished


def _stale_aborts(aborted: dict[str, set], finished: set) -> dict[str, set]:
    """shard name -> its aborted pairs that another row supersedes: a finished row of the pair, or an
    aborted row of the pair in a shard written later (a continuation aborted again)."""
    newest: dict[tuple[int, int], str] = {}
    for name in sorted(aborted, key=shard_key):  # write order: the last shard's row wins
        newest.update(dict.fromkeys(aborted[name], name))
    return {name: {pair for pair in pairs if pair in finished or newest[pair] != name}
            for name, pairs in aborted.items()}


def prepare_continuation(out: str | Path) -> dict[tuple[int, int], PartialSample]:
    """At the start of a --continue-aborted run, from one scan of OUT's shards: drop the aborted rows
    another row supersedes (a finished row after a crash, or a newer aborted row), and return the
    other aborted samples, to continue."""
    out = Path(out)
    aborted, finished = _shard_status(out)
    stale = _stale_aborts(aborted, finished)
    _drop_stale(out, stale)
    return _aborted_samples(out, {name: pairs - stale[name] for name, pairs in aborted.items()})


def _aborted_samples(out: Path, live: dict[str, set]) -> dict[tuple[int, int], PartialSample]:
    """The aborted samples of `live` (shard name -> its aborted pairs that nothing supersedes), as
    samples to continue."""
    samples: dict[tuple[int, int], PartialSample] = {}
    for name, wanted in live.items():
        if not wanted:
            continue
        rows = nanoseconds_as_ints(pq.read_table(part_files(out / TRAJECTORIES_SUBDIR)[name])).to_pylist()
        for row in rows:
            pair = (row["prompt_index"], row["sample_index"])
            if pair in wanted and row["finish_reason"] == "abort":
                episode = ({name: row[name] for name in ("response_loss_mask", "model_turns", "turn_cached_tokens")}
                           if "model_turns" in row else None)  # an --env run's episode
                samples[pair] = PartialSample(
                    row["prompt_index"], row["sample_index"], row["prompt_token_ids"], row["response_token_ids"],
                    row["response_logprobs"], row.get("response_weight_versions") or [""] * len(row["response_token_ids"]),
                    episode=episode, response_sampling_mask=row.get("response_sampling_mask"))
    return samples


def drop_superseded_aborts(out: str | Path) -> int:
    """Rewrite each shard holding an aborted row that another row of its pair supersedes (a finished
    row, or an aborted row in a later shard) without it (its routing shard first). -> rows dropped."""
    out = Path(out)
    return _drop_stale(out, _stale_aborts(*_shard_status(out)))


def _drop_stale(out: Path, stale: dict[str, set]) -> int:
    dropped = 0
    for name, pairs in stale.items():
        if not pairs:
            continue
        routing = part_files(out / ROUTING_SUBDIR).get(name) if (out / ROUTING_SUBDIR).is_dir() else None
        if routing is not None:
            _rewrite_without(routing, pairs, abort_only=False)
        dropped += _rewrite_without(part_files(out / TRAJECTORIES_SUBDIR)[name], pairs, abort_only=True)
    return dropped


def _rewrite_without(path: Path, stale: set, abort_only: bool) -> int:
    """Replace the shard at `path`, atomically, by itself without the rows of `stale` pairs (only
    their aborted rows in a trajectory shard). -> rows dropped."""
    table = pq.read_table(path)
    stale_rows = [pair in stale for pair in _pairs(table)]
    if abort_only:
        is_abort = pc.equal(table.column("finish_reason"), "abort").to_pylist()
        stale_rows = [s and a for s, a in zip(stale_rows, is_abort)]
    keep = pa.array([not s for s in stale_rows])
    with writing(path):
        temp = write_temp(table.filter(keep), path)
        temp.replace(path)
        fsync_dir(path.parent)
    return sum(stale_rows)
