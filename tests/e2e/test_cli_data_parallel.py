"""`rollout run --dp N` on the CPU: replicas started by torch's launcher split the prompts, share OUT,
and their union equals a one-replica run with the same seed; --resume completes a lost replica's rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

LP_TOL = 1e-5  # float32 logprobs move in the last bits with the batch a row shared (as in test_seeded_sampling)

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "recipes" / "example_model"
PROMPTS = REPO / "recipes" / "prompts.parquet"
ARGS = ["--model", str(MODEL), "--data", str(PROMPTS), "--n", "2", "--max-new-tokens", "10", "--limit", "9",
        "--seed", "5", "--temperature", "1.0", "--device", "cpu", "--kv-cache-tokens", "4096", "--quiet"]


def _run(*args, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("ROLLOUT_ENGINE", None)
    return subprocess.run([sys.executable, "-m", "rollout_cli.cli.main", "run", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


def _rows(out: Path) -> list[dict]:
    table = pq.read_table(out / "trajectories")
    return table.sort_by([("prompt_index", "ascending"), ("sample_index", "ascending")]).to_pylist()


def _assert_same_rows(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        key = (a["prompt_index"], a["sample_index"])
        assert {k: v for k, v in a.items() if k != "response_logprobs"} == \
            {k: v for k, v in b.items() if k != "response_logprobs"}, key
        assert a["response_logprobs"] == pytest.approx(b["response_logprobs"], abs=LP_TOL), key


def test_two_replicas_equal_one_and_resume_completes(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    single = _run(*ARGS, "--out", one)
    assert single.returncode == 0, single.stderr
    result = _run(*ARGS, "--out", two, "--dp", "2")
    assert result.returncode == 0, result.stderr
    _assert_same_rows(_rows(two), _rows(one))
    shards = sorted(p.name for p in (two / "trajectories").iterdir())
    assert {name[:10] for name in shards} == {"part-r000-", "part-r001-"}, shards
    manifest = json.loads((two / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["data_parallel"] == 2
    assert manifest["trajectories"] == 18 and manifest["prompts"] == 9 and manifest["prompts_done"] == 9

    # replica 1's shards lost (say its node died): --resume with another replica count redoes only them
    for shard in (two / "trajectories").glob("part-r001-*"):
        shard.unlink()
    resumed = _run(*ARGS, "--out", two, "--dp", "3", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    _assert_same_rows(_rows(two), _rows(one))
    manifest = json.loads((two / "manifest.json").read_text())
    assert manifest["trajectories"] == 18 and manifest["trajectories_this_run"] == 8  # prompts 1, 3, 5, 7 x 2


def test_dp_needs_an_embedded_engine(tmp_path):
    result = _run("--data", PROMPTS, "--out", tmp_path / "o", "--dp", "2", "--engine", tmp_path / "none.sock")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: --dp starts embedded replicas: give --model (a daemon serves one engine)"]


def test_a_bad_row_under_dp_is_one_line(tmp_path):
    """Every replica finds the same bad row: the launcher prints it once (replicas hand their one-line
    errors to it), with no launcher log line beside it, and exits 2 with nothing written."""
    import pyarrow as pa

    data = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["hello there", "", "hi"]}), data)
    result = _run("--model", MODEL, "--data", data, "--out", tmp_path / "o", "--dp", "2", "--device", "cpu",
                  "--max-new-tokens", "4", "--quiet")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: row 1 of {data}: empty prompt; fix or drop that row, or pass --skip-invalid to leave invalid "
        "rows out"]
    assert not (tmp_path / "o").exists()


def test_deterministic_dp2_equals_dp1_bit_for_bit(tmp_path):
    """--deterministic: the union of two replicas' rows equals one replica's, logprobs included, bit for bit."""
    args = [*ARGS, "--deterministic", "--dtype", "bfloat16"]
    one = _run(*args, "--out", tmp_path / "one")
    assert one.returncode == 0, one.stderr
    two = _run(*args, "--out", tmp_path / "two", "--dp", "2")
    assert two.returncode == 0, two.stderr
    got, want = _rows(tmp_path / "two"), _rows(tmp_path / "one")
    assert len(got) == len(want) == 18
    for a, b in zip(got, want, strict=True):
        assert a == b, (a["prompt_index"], a["sample_index"])
