"""--continue-aborted's bookkeeping on OUT: which aborted rows are continued, and how superseded ones go."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from rollout_cli.job_continue import drop_superseded_aborts, prepare_continuation


def _shard(out, name, rows, subdir="trajectories"):
    (out / subdir).mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out / subdir / name)


def _row(p, s, reason, response):
    return {"prompt_index": p, "sample_index": s, "prompt_token_ids": [1, 2], "response_token_ids": response,
            "response_logprobs": [-1.0] * len(response), "finish_reason": reason,
            "response_weight_versions": ["3"] * len(response)}


def test_aborted_rows_without_a_finished_row_are_continued(tmp_path):
    _shard(tmp_path, "part-00000.parquet", [_row(0, 0, "length", [5, 6]), _row(0, 1, "abort", [7]),
                                            _row(1, 0, "abort", [])])
    _shard(tmp_path, "part-00001.parquet", [_row(1, 0, "length", [8, 9])])  # 1/0 was continued already
    samples = prepare_continuation(tmp_path)
    assert list(samples) == [(0, 1)]
    sample = samples[(0, 1)]
    assert (sample.response_token_ids, sample.response_weight_versions) == ([7], ["3"])


def test_superseded_aborted_rows_and_their_routing_are_dropped_and_nothing_else(tmp_path):
    _shard(tmp_path, "part-00000.parquet", [_row(0, 0, "length", [5]), _row(0, 1, "abort", [7]),
                                            _row(1, 0, "abort", [4])])
    _shard(tmp_path, "part-00000.parquet", [{"prompt_index": p, "sample_index": s, "num_tokens": 3}
                                            for p, s in ((0, 0), (0, 1), (1, 0))], subdir="routing")
    _shard(tmp_path, "part-00001.parquet", [_row(0, 1, "length", [7, 8])])  # a crash left both rows of 0/1
    assert drop_superseded_aborts(tmp_path) == 1
    rows = pq.read_table(tmp_path / "trajectories").to_pylist()
    assert sorted((r["prompt_index"], r["sample_index"], r["finish_reason"]) for r in rows) == [
        (0, 0, "length"), (0, 1, "length"), (1, 0, "abort")]  # 1/0 has no finished row: kept
    routing = pq.read_table(tmp_path / "routing" / "part-00000.parquet").to_pylist()
    assert [(r["prompt_index"], r["sample_index"]) for r in routing] == [(0, 0), (1, 0)]
    assert not list((tmp_path / "trajectories").glob(".*"))  # no temp file left
    assert drop_superseded_aborts(tmp_path) == 0


def test_a_newer_aborted_row_supersedes_the_older_and_is_the_one_continued(tmp_path):
    """A continuation aborted again writes the pair's newest aborted row (its response extends the older
    one's) in a later shard: the older row and its routing go, the newest is what the next run continues."""
    _shard(tmp_path, "part-00000.parquet", [_row(0, 0, "abort", [7]), _row(0, 1, "abort", [4])])
    _shard(tmp_path, "part-00000.parquet", [{"prompt_index": p, "sample_index": s, "num_tokens": 3}
                                            for p, s in ((0, 0), (0, 1))], subdir="routing")
    _shard(tmp_path, "part-00001.parquet", [_row(0, 0, "abort", [7, 8])])  # 0/0 continued, aborted again
    _shard(tmp_path, "part-00002.parquet", [_row(0, 0, "abort", [7, 8, 9])])  # and once more
    assert drop_superseded_aborts(tmp_path) == 2
    rows = pq.read_table(tmp_path / "trajectories").to_pylist()
    assert sorted((r["prompt_index"], r["sample_index"], r["response_token_ids"]) for r in rows) == [
        (0, 0, [7, 8, 9]), (0, 1, [4])]
    routing = pq.read_table(tmp_path / "routing" / "part-00000.parquet").to_pylist()
    assert [(r["prompt_index"], r["sample_index"]) for r in routing] == [(0, 1)]
    _shard(tmp_path, "part-00003.parquet", [_row(0, 1, "abort", [4, 5])])  # a crash before the drop
    samples = prepare_continuation(tmp_path)
    assert {pair: s.response_token_ids for pair, s in samples.items()} == {(0, 0): [7, 8, 9], (0, 1): [4, 5]}
    assert len(pq.read_table(tmp_path / "trajectories")) == 2


def test_continue_aborted_needs_resume(tmp_path):
    import pytest

    from rollout_cli.errors import RolloutError
    from rollout_cli.job import JobConfig

    with pytest.raises(RolloutError, match="--continue-aborted continues .* add --resume"):
        JobConfig(data="p.parquet", out=str(tmp_path), continue_aborted=True)
