"""TrajectoryWriter shards, atomic renames, resume bookkeeping and the output directory."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from rollout_cli.errors import RolloutError
from rollout_cli.io.output_dir import (
    completed_pairs,
    create_output_dir,
    prepare_output_dir,
    read_manifest,
    write_manifest,
)
from rollout_cli.io.prompts import PromptSource
from rollout_cli.io.trajectories import FIXED_NAMES, TrajectoryWriter, nanoseconds_as_ints, trajectory_schema

PASSTHROUGH = pa.schema([("data_source", pa.string())])


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def row(prompt_index: int, sample_index: int = 0, **passthrough) -> dict:
    return {
        "prompt_index": prompt_index,
        "sample_index": sample_index,
        "prompt_token_ids": [1, 2, 3],
        "response_token_ids": [4, 5],
        "response_logprobs": [-0.5, -0.25],
        "response_text": "four five",
        "finish_reason": "stop",
        "weight_version": "v0",
        "response_weight_versions": ["v0", "v0"],
        **({"data_source": "gsm8k"} if not passthrough else passthrough),
    }


def shard_names(out):
    return sorted(p.name for p in (out / "trajectories").iterdir())


# ---- schema ----------------------------------------------------------------


def test_schema_fixed_columns_then_passthrough():
    schema = trajectory_schema(pa.schema([("z", pa.int8()), ("a", pa.string())]).with_metadata({"pandas": "{}"}))
    assert schema.names == list(FIXED_NAMES) + ["z", "a"]
    assert schema.names[:9] == [
        "prompt_index", "sample_index", "prompt_token_ids", "response_token_ids",
        "response_logprobs", "response_text", "finish_reason", "weight_version", "response_weight_versions",
    ]
    assert schema.field("response_weight_versions").type == pa.list_(pa.string())
    assert schema.field("prompt_index").type == pa.int64()
    assert schema.field("sample_index").type == pa.int32()
    assert schema.field("prompt_token_ids").type == pa.list_(pa.int32())
    assert schema.field("response_logprobs").type == pa.list_(pa.float32())
    assert schema.metadata is None  # the input's pandas metadata would describe other columns


def test_passthrough_named_like_fixed_column_is_refused(tmp_path):
    with pytest.raises(RolloutError, match="'finish_reason'.*rename it"):
        TrajectoryWriter(tmp_path, pa.schema([("finish_reason", pa.string())]))


# ---- writer ----------------------------------------------------------------


def test_shards_by_row_count(tmp_path):
    writer = TrajectoryWriter(tmp_path, PASSTHROUGH, shard_rows=3)
    for i in range(7):
        writer.add(row(i))
    assert writer.shards_written == 2 and writer.rows_written == 6
    writer.close()
    assert writer.shards_written == 3 and writer.rows_written == 7
    assert shard_names(tmp_path) == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    assert [pq.read_metadata(tmp_path / "trajectories" / n).num_rows for n in shard_names(tmp_path)] == [3, 3, 1]
    table = pq.read_table(tmp_path / "trajectories")
    assert sorted(table.column("prompt_index").to_pylist()) == list(range(7))
    assert table.schema.field("response_token_ids").type == pa.list_(pa.int32())
    first = table.filter(pc.equal(table["prompt_index"], 0)).to_pylist()[0]
    assert first["response_logprobs"] == [-0.5, -0.25] and first["data_source"] == "gsm8k"


def test_shards_by_time_since_oldest_buffered_row(tmp_path):
    clock = FakeClock()
    writer = TrajectoryWriter(tmp_path, PASSTHROUGH, shard_rows=100, flush_seconds=10, clock=clock)
    clock.now = 50.0  # an idle spell alone does not make a one-row shard
    writer.add(row(0))
    clock.now = 55.0
    writer.add(row(1))
    writer.maybe_flush()
    assert writer.shards_written == 0
    clock.now = 60.0
    writer.maybe_flush()
    assert writer.shards_written == 1 and writer.rows_written == 2
    clock.now = 65.0
    writer.maybe_flush()  # empty buffer: nothing to write
    assert writer.shards_written == 1
    writer.add(row(2))
    clock.now = 75.0
    writer.add(row(3))  # add() also checks the time
    assert writer.shards_written == 2 and writer.rows_written == 4


def test_flush_is_atomic_and_temp_files_are_invisible(tmp_path):
    create_output_dir(tmp_path)
    stray = tmp_path / "trajectories" / ".part-00007.parquet.tmp"
    stray.write_bytes(b"half a shard from a crash")
    with TrajectoryWriter(tmp_path, PASSTHROUGH, shard_rows=2) as writer:
        for i in range(3):
            writer.add(row(i))
    names = shard_names(tmp_path)
    assert [n for n in names if n.endswith(".tmp")] == [stray.name]  # the writer leaves none of its own
    # pyarrow's discovery skips dot-files, so the garbage temp file does not break or add rows.
    assert pq.read_table(tmp_path / "trajectories").num_rows == 3
    assert completed_pairs(tmp_path) == {(0, 0), (1, 0), (2, 0)}
    assert not stray.exists()  # completed_pairs cleans it up


def test_writer_flushes_on_exception(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with TrajectoryWriter(tmp_path, PASSTHROUGH, shard_rows=100) as writer:
            writer.add(row(0))
            raise KeyboardInterrupt
    assert completed_pairs(tmp_path) == {(0, 0)}


def test_numbering_continues_after_existing_shards(tmp_path):
    with TrajectoryWriter(tmp_path, PASSTHROUGH, shard_rows=1) as writer:
        writer.add(row(0))
        writer.add(row(1))
    before = (tmp_path / "trajectories" / "part-00001.parquet").read_bytes()
    with TrajectoryWriter(tmp_path, PASSTHROUGH, shard_rows=1) as writer:
        writer.add(row(2))
    assert shard_names(tmp_path) == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    assert (tmp_path / "trajectories" / "part-00001.parquet").read_bytes() == before
    assert pq.read_table(tmp_path / "trajectories" / "part-00002.parquet")["prompt_index"].to_pylist() == [2]


def test_add_rejects_rows_with_wrong_fields(tmp_path):
    writer = TrajectoryWriter(tmp_path, PASSTHROUGH)
    bad = row(0)
    del bad["weight_version"]
    bad["extra"] = 1
    with pytest.raises(ValueError, match=r"missing \['weight_version'\], unexpected \['extra'\]"):
        writer.add(bad)


def _written_through(tmp_path, data: pa.Table) -> pa.Table:
    """`data` as a prompt file, each prompt written as a trajectory row with its passthrough columns; the
    trajectories read back."""
    pq.write_table(data, tmp_path / "in.parquet")
    source = PromptSource(tmp_path / "in.parquet", None)
    out = tmp_path / "out"
    with TrajectoryWriter(out, source.passthrough_schema) as writer:
        for prompt in source:
            fixed = row(prompt.prompt_index)
            del fixed["data_source"]
            writer.add({**fixed, "prompt_token_ids": prompt.prompt_token_ids, **prompt.passthrough})
    return pq.read_table(out / "trajectories")


def test_nested_passthrough_round_trips_with_input_types(tmp_path):
    # verl's layout: chat messages plus reward_model / extra_info structs.
    reward = pa.struct([("ground_truth", pa.string()), ("style", pa.string())])
    extra = pa.struct([("index", pa.int64()), ("split", pa.string()), ("scores", pa.list_(pa.float64()))])
    data = pa.table(
        {
            "prompt": pa.array([[1, 2], [3]], pa.list_(pa.int64())),
            "data_source": ["gsm8k", "math"],
            "reward_model": pa.array(
                [{"ground_truth": "4", "style": "rule"}, {"ground_truth": None, "style": "model"}], reward
            ),
            "extra_info": pa.array(
                [{"index": 0, "split": "train", "scores": [0.5]}, {"index": 1, "split": "test", "scores": []}], extra
            ),
            "level": pa.array([1, 2], pa.int8()),
        }
    )
    table = _written_through(tmp_path, data)
    for name in ["data_source", "reward_model", "extra_info", "level"]:
        assert table.schema.field(name).type == data.schema.field(name).type, name
        assert table[name].to_pylist() == data[name].to_pylist(), name
    assert table["prompt_token_ids"].to_pylist() == [[1, 2], [3]]


def test_nested_nanosecond_passthrough_round_trips_exactly(tmp_path):
    """Python's datetime holds microseconds: a nanosecond timestamp / duration / time64 inside a struct, list,
    fixed-size list, large list or map was a ValueError traceback mid-run (top-level ones were already read as
    ints). The values come out bit for bit, under the input's types."""
    ts, dur, t64 = pa.timestamp("ns", tz="UTC"), pa.duration("ns"), pa.time64("ns")
    stamp = 1_700_000_000_123_456_789
    columns = {
        "event": pa.array([{"at": stamp, "took": 5, "name": "a"}, None],
                          pa.struct([("at", ts), ("took", dur), ("name", pa.string())])),
        "times": pa.array([[stamp, None], []], pa.list_(ts)),
        "pair": pa.array([[1, 2], [3, 4]], pa.list_(t64, 2)),
        "spans": pa.array([[{"d": [7]}], None], pa.large_list(pa.struct([("d", pa.list_(dur))]))),
        "by_name": pa.array([[("x", stamp)], [("y", None)]], pa.map_(pa.string(), ts)),
    }
    data = pa.table({"prompt": pa.array([[1, 2], [3]], pa.list_(pa.int64())), **columns})
    table = _written_through(tmp_path, data)
    assert table.select(list(columns)).schema == data.select(list(columns)).schema
    assert nanoseconds_as_ints(table.select(list(columns))).to_pylist() == \
        nanoseconds_as_ints(data.select(list(columns))).to_pylist()
    assert nanoseconds_as_ints(table.select(["event"])).column("event")[0].as_py()["at"] == stamp


# ---- resume bookkeeping ----------------------------------------------------


def test_completed_pairs(tmp_path):
    assert completed_pairs(tmp_path / "missing") == set()
    with TrajectoryWriter(tmp_path, PASSTHROUGH, shard_rows=2) as writer:
        for p in range(2):
            for s in range(3):
                writer.add(row(p, s))
    assert completed_pairs(tmp_path) == {(p, s) for p in range(2) for s in range(3)}


def test_completed_pairs_names_an_unreadable_shard(tmp_path):
    create_output_dir(tmp_path)
    (tmp_path / "trajectories" / "part-00000.parquet").write_bytes(b"garbage")
    with pytest.raises(RolloutError, match="part-00000.parquet is unreadable.*delete it"):
        completed_pairs(tmp_path)


# ---- output directory and manifest ----------------------------------------


def test_prepare_output_dir_creates_nothing(tmp_path):
    out = tmp_path / "out"
    prepare_output_dir(out, resume=False)
    prepare_output_dir(out, resume=True)
    assert not out.exists()
    out.mkdir()
    prepare_output_dir(out, resume=False)  # an empty directory is fine
    assert list(out.iterdir()) == []


def test_prepare_output_dir_refusals(tmp_path):
    out = tmp_path / "out"
    create_output_dir(out)
    assert (out / "trajectories").is_dir()
    with pytest.raises(RolloutError, match=r"not empty; pass --resume .* or choose another --out"):
        prepare_output_dir(out, resume=False)
    prepare_output_dir(out, resume=True)

    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(RolloutError, match="holds no rollout output"):
        prepare_output_dir(foreign, resume=True)

    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(RolloutError, match="is a file"):
        prepare_output_dir(a_file, resume=True)


def test_manifest_round_trip(tmp_path):
    assert read_manifest(tmp_path) is None
    manifest = {"model": "ckpt0", "n": 8, "seed": 0, "sampling": {"temperature": 1.0}, "done": False}
    write_manifest(tmp_path, manifest)
    assert read_manifest(tmp_path) == manifest
    text = (tmp_path / "manifest.json").read_text()
    assert text.startswith('{\n  "model"')  # indent=2
    write_manifest(tmp_path, {**manifest, "done": True})
    assert read_manifest(tmp_path)["done"] is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]  # no temp left


def test_read_manifest_rejects_bad_json(tmp_path):
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(RolloutError, match="manifest.json is not valid JSON"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps([1, 2]))
    with pytest.raises(RolloutError, match="not hold a JSON object"):
        read_manifest(tmp_path)
