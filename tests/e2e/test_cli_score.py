"""`rollout score` end to end on the CPU: a --deterministic run scored bit for bit, the output layout,
--resume after a lost shard, the settings the run recorded, and bad input as one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file, save_file

from rollout_cli import Engine, SamplingParams
from rollout_cli.errors import RolloutError
from rollout_cli.score_job import ScoreJobConfig, run_score_job
from trajectory_edits import cut_response, edit_trajectory_rows

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "recipes" / "example_model"
PROMPTS = REPO / "recipes" / "prompts.parquet"
CLI = [sys.executable, "-m", "rollout_cli.cli.main"]
COMMON = ["--model", str(MODEL), "--dtype", "bfloat16", "--quiet"]


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("score") / "traj"
    done = _cli("run", *COMMON, "--data", PROMPTS, "--out", out, "--n", 2, "--max-new-tokens", 12, "--limit", 4,
                "--temperature", 0.8, "--top-p", 0.9, "--deterministic", "--shard-rows", 3)
    assert done.returncode == 0, done.stderr
    return out


def test_deterministic_scores_equal_the_run_and_the_layout_holds(run_dir, tmp_path):
    out = tmp_path / "scores"
    done = _cli("score", *COMMON, "--data", run_dir, "--out", out, "--deterministic", "--shard-rows", 3)
    assert done.returncode == 0, done.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["samples"] == 8 and manifest["tokens"] > 0
    assert manifest["settings"]["sampling"] == {"temperature": 0.8, "logprobs_mode": "processed", "top_p": 0.9,
                                                "top_k": 0, "min_p": 0.0}  # the run's
    assert manifest["max_abs_diff"] == 0.0 and manifest["bitwise_equal_tokens"] == 1.0
    assert manifest["bitwise_equal_samples"] == 8
    scores = pq.read_table(out / "scores")
    assert scores.schema.names == ["prompt_index", "sample_index", "response_logprobs"]
    assert scores.schema.field("response_logprobs").type == pa.list_(pa.float32())
    run = {(r["prompt_index"], r["sample_index"]): r for r in pq.read_table(run_dir / "trajectories").to_pylist()}
    for row in scores.to_pylist():
        assert row["response_logprobs"] == run[(row["prompt_index"], row["sample_index"])]["response_logprobs"]


def test_resume_scores_only_what_a_lost_shard_held(run_dir, tmp_path):
    out = tmp_path / "scores"
    assert _cli("score", *COMMON, "--data", run_dir, "--out", out, "--deterministic", "--shard-rows", 3).returncode == 0
    shards = sorted((out / "scores").glob("part-*.parquet"))
    assert len(shards) == 3  # 8 samples, 3 rows a shard
    lost = pq.read_table(shards[1]).num_rows
    shards[1].unlink()
    again = _cli("score", *COMMON, "--data", run_dir, "--out", out, "--deterministic", "--resume")
    assert again.returncode == 0, again.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["scored_this_run"] == lost and manifest["samples"] == 8 and manifest["max_abs_diff"] == 0.0
    keys = [(r["prompt_index"], r["sample_index"]) for r in pq.read_table(out / "scores").to_pylist()]
    assert len(keys) == len(set(keys)) == 8


def test_resume_in_the_other_mode_is_refused(run_dir, tmp_path):
    out = tmp_path / "scores"
    assert _cli("score", *COMMON, "--data", run_dir, "--out", out, "--deterministic").returncode == 0
    again = _cli("score", *COMMON, "--data", run_dir, "--out", out, "--resume")
    assert again.returncode == 2
    assert again.stderr.count("\n") == 1 and "deterministic" in again.stderr and "Traceback" not in again.stderr


def test_a_run_resumed_in_the_other_mode_is_refused(run_dir, tmp_path):
    out = tmp_path / "traj"
    args = ["run", *COMMON, "--data", PROMPTS, "--out", out, "--n", 2, "--max-new-tokens", 4, "--limit", 2]
    assert _cli(*args, "--deterministic").returncode == 0
    again = _cli(*args, "--resume")
    assert again.returncode == 2 and "deterministic=True" in again.stderr and again.stderr.count("\n") == 1


@pytest.mark.parametrize("args,message", [
    (["--data", "/nonexistent/traj"], "does not exist"),
    (["--data", str(PROMPTS)], "response_token_ids"),
])
def test_bad_input_is_one_line(tmp_path, args, message):
    done = _cli("score", *COMMON, "--out", tmp_path / "s", *args)
    assert done.returncode == 2 and message in done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_top_logprobs_columns(run_dir, tmp_path):
    out = tmp_path / "scores"
    done = _cli("score", *COMMON, "--data", run_dir, "--out", out, "--deterministic", "--top-logprobs", 3)
    assert done.returncode == 0, done.stderr
    table = pq.read_table(out / "scores")
    assert table.schema.field("top_token_ids").type == pa.list_(pa.list_(pa.int32()))
    assert table.schema.field("top_logprobs").type == pa.list_(pa.list_(pa.float32()))
    for row in table.to_pylist():
        assert len(row["top_token_ids"]) == len(row["top_logprobs"]) == len(row["response_logprobs"])
        for ids, lps, chosen in zip(row["top_token_ids"], row["top_logprobs"], row["response_logprobs"], strict=True):
            assert len(ids) == 3 and lps == sorted(lps, reverse=True) and lps[0] >= chosen
    assert json.loads((out / "manifest.json").read_text())["settings"]["top_logprobs"] == 3


def _one_line(done: subprocess.CompletedProcess, *words: str) -> str:
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: "), done.stderr
    for word in words:
        assert word in done.stderr, f"{word!r} missing from: {done.stderr}"
    return done.stderr


def test_a_score_output_as_data_is_one_line(tmp_path):
    scored = tmp_path / "scored"  # the layout `rollout score` writes
    (scored / "scores").mkdir(parents=True)
    (scored / "manifest.json").write_text(json.dumps({"status": "complete", "settings": {}}))
    done = _cli("score", *COMMON, "--data", scored, "--out", tmp_path / "s")
    _one_line(done, str(scored), "rollout score", "trajectories/")
    assert not (tmp_path / "s").exists()


def _with_bad_shard(run_dir: Path, tmp_path: Path, kind: str) -> Path:
    """A copy of the run with one more shard: random bytes, or the first shard with a broken prompt_index."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    shard = copy / "trajectories" / "part-00009.parquet"
    if kind == "garbage":
        shard.write_bytes(bytes(range(256)) * 4)
        return copy
    table = pq.read_table(copy / "trajectories" / "part-00000.parquet")
    column = table.column("prompt_index")
    broken = (pa.array([None] * len(column), pa.int64()) if kind == "null"
              else column.cast(pa.string()))
    index = table.schema.get_field_index("prompt_index")
    pq.write_table(table.set_column(index, "prompt_index", broken), shard)
    return copy


@pytest.mark.parametrize("kind,words", [
    ("garbage", ("not a readable Parquet file",)),
    ("null", ("prompt_index", "null")),
    ("string", ("prompt_index", "string", "not integers")),
])
def test_a_bad_shard_is_one_line_naming_it_and_out_is_not_created(run_dir, tmp_path, kind, words):
    data = _with_bad_shard(run_dir, tmp_path, kind)
    done = _cli("score", *COMMON, "--data", data, "--out", tmp_path / "s")
    _one_line(done, "part-00009.parquet", *words)
    assert not (tmp_path / "s").exists()


def test_resume_into_a_run_output_is_refused_and_creates_nothing(run_dir, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    done = _cli("score", *COMMON, "--data", copy, "--out", copy, "--resume")
    _one_line(done, "--resume", "trajectories/", "--out")
    assert sorted(p.name for p in copy.iterdir()) == ["manifest.json", "trajectories"]


def test_resume_finds_the_weights_and_the_run_by_content(run_dir, tmp_path):
    """A --resume scores with the same weights (by content, not path), dtype and run: other weights at the
    same path, another --dtype, or the run made again at its path are refused in one line."""
    model = tmp_path / "model"
    shutil.copytree(MODEL, model)
    data = tmp_path / "run"
    shutil.copytree(run_dir, data)
    out = tmp_path / "scores"
    common = ["--model", model, "--quiet", "--data", data, "--out", out, "--deterministic", "--dtype", "bfloat16"]
    assert _cli("score", *common).returncode == 0
    assert _cli("score", *common, "--resume").returncode == 0  # the same job resumes
    _one_line(_cli("score", *common[:-1], "float32", "--resume"), "identity.dtype")
    tensors = load_file(model / "model.safetensors")
    save_file({k: v * 1.5 for k, v in tensors.items()}, model / "model.safetensors")
    _one_line(_cli("score", *common, "--resume"), "identity.checkpoint")
    shutil.copy(MODEL / "model.safetensors", model / "model.safetensors")  # the same bytes back
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["sampling"]["seed"] += 1  # as if the run had been made again at its path with another seed
    (data / "manifest.json").write_text(json.dumps(manifest))
    _one_line(_cli("score", *common, "--resume"), "identity.run.sampling.seed")


def _score_in_process(data: Path, out: Path, on_progress=None) -> dict:
    """Score `data` in this process and return the manifest it left, whatever the job raised (re-raised)."""
    engine = Engine(str(MODEL), device="cpu", dtype="bfloat16")
    try:
        run_score_job(engine, SamplingParams(), ScoreJobConfig(data=str(data), out=str(out), shard_rows=1),
                      on_progress=on_progress)
    finally:
        manifest = json.loads((out / "manifest.json").read_text())
    return manifest


def test_a_failure_mid_score_leaves_a_failed_manifest_as_run_does(run_dir, tmp_path):
    """An error after OUT exists is `failed` with its line in `error` (score wrote `interrupted`, which tells
    the user --resume completes it); Ctrl-C / SIGTERM stay `interrupted`."""
    data = tmp_path / "traj"
    shutil.copytree(run_dir, data)
    shard = sorted((data / "trajectories").glob("*.parquet"))[-1]
    rows = pq.read_table(shard).to_pylist()
    rows[-1]["response_token_ids"] = [99999] * len(rows[-1]["response_token_ids"])
    pq.write_table(pa.Table.from_pylist(rows, schema=pq.read_schema(shard)), shard)
    with pytest.raises(RolloutError, match="outside") as err:
        _score_in_process(data, tmp_path / "failed")
    manifest = json.loads((tmp_path / "failed" / "manifest.json").read_text())
    assert manifest["status"] == "failed" and manifest["error"] == str(err.value)

    def ctrl_c(progress):
        if progress.samples_done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _score_in_process(run_dir, tmp_path / "interrupted", ctrl_c)
    manifest = json.loads((tmp_path / "interrupted" / "manifest.json").read_text())
    assert manifest["status"] == "interrupted" and "error" not in manifest and manifest["scored_this_run"] == 2



def _with_bad_row(run_dir: Path, tmp_path: Path, change) -> Path:
    """A copy of the run whose last shard's last row went through `change` (row dict in, row dict out)."""
    data = tmp_path / "run"
    shutil.copytree(run_dir, data)
    shard = sorted((data / "trajectories").glob("*.parquet"))[-1]
    rows = pq.read_table(shard).to_pylist()
    rows[-1] = change(rows[-1])
    pq.write_table(pa.Table.from_pylist(rows, schema=pq.read_schema(shard)), shard)
    return data


@pytest.mark.parametrize("kind,words", [
    ("float", ("double", "not lists of token ids")),
    ("string", ("string", "not lists of token ids")),
    ("scalar", ("int64", "not lists")),
])
def test_token_ids_of_another_type_are_one_line_and_out_is_not_created(run_dir, tmp_path, kind, words):
    """A shard whose token ids are floats, strings or not lists was a torch / numpy traceback mid-job."""
    data = tmp_path / "run"
    shutil.copytree(run_dir, data)
    table = pq.read_table(data / "trajectories" / "part-00000.parquet")
    ids = table.column("response_token_ids").to_pylist()
    column = {"float": pa.array([[float(t) for t in row] for row in ids]),
              "string": pa.array([[str(t) for t in row] for row in ids]),
              "scalar": pa.array([row[0] for row in ids])}[kind]
    index = table.schema.get_field_index("response_token_ids")
    pq.write_table(table.set_column(index, "response_token_ids", column), data / "trajectories" / "part-00009.parquet")
    _one_line(_cli("score", *COMMON, "--data", data, "--out", tmp_path / "s"), "part-00009.parquet",
              "response_token_ids", *words)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("change,words", [
    (lambda row: {**row, "response_logprobs": row["response_logprobs"][:-1]},
     ("response_logprobs for", "response_token_ids (one each)")),
    (lambda row: {**row, "response_token_ids": None}, ("response_token_ids is null",)),
    (lambda row: {**row, "prompt_token_ids": None}, ("prompt_token_ids is null",)),
    (lambda row: {**row, "response_logprobs": [float("nan")] + row["response_logprobs"][1:]},
     ("response_logprobs holds a null, NaN or infinite value",)),
], ids=["short-logprobs", "null-response", "null-prompt", "nan-logprob"])
def test_a_bad_row_fails_the_job_in_one_line(run_dir, tmp_path, change, words):
    """Logprobs not one per response token failed the comparison after the scores were written (a numpy
    traceback, the manifest left `running`); a null list was a traceback. Now one line naming the row,
    and a `failed` manifest holding it."""
    data = _with_bad_row(run_dir, tmp_path, change)
    out = tmp_path / "s"
    line = _one_line(_cli("score", *COMMON, "--data", data, "--out", out), "trajectory (prompt_index", *words)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "failed" and manifest["error"] == line.removeprefix("error: ").strip()


@pytest.mark.parametrize("sampling,words", [
    ({"temperature": "hot"}, ("sampling.temperature = 'hot'", "not a number")),
    ({"top_k": "5"}, ("sampling.top_k = '5'", "not a number")),
    (5, ("sampling = 5", "not an object")),
], ids=["temperature", "top-k", "not-an-object"])
def test_a_damaged_run_manifest_is_one_line(run_dir, tmp_path, sampling, words):
    """The run's recorded sampling settings are score's defaults: a value of the wrong type was a TypeError
    traceback in SamplingParams."""
    data = tmp_path / "run"
    shutil.copytree(run_dir, data)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["sampling"] = {**manifest["sampling"], **sampling} if isinstance(sampling, dict) else sampling
    (data / "manifest.json").write_text(json.dumps(manifest))
    _one_line(_cli("score", *COMMON, "--data", data, "--out", tmp_path / "s"), "manifest.json", *words)
    assert not (tmp_path / "s").exists()



def _with_repeated_pair(run_dir: Path, tmp_path: Path, aborted: tuple[bool, ...], abort_first: bool = False) -> Path:
    """A copy of the run with one more shard repeating its first row, once per entry of `aborted` (True: as
    an abort leaves it, its response cut to 2 tokens; False: as it is); `abort_first`: that first row is cut
    to 3 tokens too. With (True,): what a crashed --continue-aborted run leaves (the continued row written,
    its aborted row not yet dropped)."""
    data = tmp_path / "run"
    shutil.copytree(run_dir, data)
    if abort_first:
        edit_trajectory_rows(data, lambda row: (row["prompt_index"], row["sample_index"]) == (0, 0)
                             and cut_response(row, 3) is None)
    first = pq.read_table(data / "trajectories" / "part-00000.parquet")
    rows = []
    for abort in aborted:
        row = first.slice(0, 1).to_pylist()[0]
        if abort:
            cut_response(row, 2)
        rows.append(row)
    pq.write_table(pa.Table.from_pylist(rows, schema=first.schema), data / "trajectories" / "part-00009.parquet")
    return data


def test_an_aborted_row_beside_its_finished_continuation_is_not_scored(run_dir, tmp_path):
    """A pair held twice was scored and written twice (and counted twice against the run); a crashed
    --continue-aborted run legitimately holds an aborted row and its finished continuation: the finished
    one is the sample."""
    data = _with_repeated_pair(run_dir, tmp_path, (True,))
    out = tmp_path / "scores"
    done = _cli("score", *COMMON, "--data", data, "--out", out, "--deterministic")
    assert done.returncode == 0, done.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["samples"] == manifest["scored_this_run"] == 8 and manifest["max_abs_diff"] == 0.0
    keys = [(r["prompt_index"], r["sample_index"]) for r in pq.read_table(out / "scores").to_pylist()]
    assert len(keys) == len(set(keys)) == 8


@pytest.mark.parametrize("aborted,abort_first,words", [
    ((False,), False, ("2 finished rows of (prompt_index 0, sample_index 0)", "keep one")),
    ((True,), True, ("2 aborted rows of (prompt_index 0, sample_index 0)", "--continue-aborted")),
], ids=["two-finished", "only-aborted"])
def test_a_pair_with_no_one_row_to_score_is_one_line(run_dir, tmp_path, aborted, abort_first, words):
    """Two finished rows of a pair (or only aborted ones) leave no one row to score: refused before OUT exists."""
    data = _with_repeated_pair(run_dir, tmp_path, aborted, abort_first)
    _one_line(_cli("score", *COMMON, "--data", data, "--out", tmp_path / "s"), *words)
    assert not (tmp_path / "s").exists()
