"""`rollout score` end to end on the CPU: a --deterministic run scored bit for bit, the output layout,
--resume after a lost shard, the settings the run recorded, and bad input as one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

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
