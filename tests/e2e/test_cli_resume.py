"""Kill and resume: SIGKILL mid-run leaves only whole shards and --resume completes the run to exactly the
rows of one uninterrupted run; SIGTERM flushes finished rows, exits 130, marks the manifest interrupted;
--resume with other sampling settings is refused.

No test here waits for something to happen: the runs signal themselves after a known number of rows
(the ROLLOUT_DEBUG_SIGNAL_AFTER_ROWS knob of rollout_cli/job.py), so a loaded machine changes only how
long they take. (Waiting for the first shard, then signalling, raced twice: a slow step let the
10 s flush write a 6-row shard first, and a fast run could finish before the signal.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "recipes" / "example_model"
PROMPTS = REPO / "recipes" / "prompts.parquet"
CLI = [sys.executable, "-m", "rollout_cli.cli.main", "run"]

N, LIMIT, MAX_NEW, SHARD_ROWS = 4, 8, 64, 8
TOTAL = N * LIMIT
LP_TOL = 1e-5
# The interrupted runs signal themselves at the first step after this many rows reached the writer:
# past the first shard, with rows buffered and prompts left with only some of their samples done.
SIGNAL_AFTER_ROWS = 11
# Fixed-length responses (ignore eos); the interrupted runs also cap requests in flight, so they
# finish in several waves of MAX_NEW decode steps and the signal lands mid-run; a flush only by
# row count keeps their shard layout the same however slow the machine is.
SETTINGS = ["--model", str(MODEL), "--data", str(PROMPTS), "--n", str(N), "--limit", str(LIMIT),
            "--max-new-tokens", str(MAX_NEW), "--ignore-eos", "--temperature", "1", "--seed", "3",
            "--shard-rows", str(SHARD_ROWS), "--device", "cpu", "--quiet"]
PART_RE = re.compile(r"^part-\d{5}\.parquet$")
TEMP_RE = re.compile(r"^\.part-\d{5}\.parquet\.tmp$")


def _env(**extra: str) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **extra)
    if not extra:
        env.pop("ROLLOUT_DEBUG_SIGNAL_AFTER_ROWS", None)
    return env


def _start(out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(CLI + SETTINGS + ["--out", str(out), *extra], cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run(out: Path, *extra: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + SETTINGS + ["--out", str(out), *extra], cwd=REPO, env=_env(**env),
                          capture_output=True, text=True, timeout=300)


def _run_until_signal(out: Path, signame: str, *extra: str) -> subprocess.CompletedProcess:
    """A run that raises SIG<signame> in itself at the first step after SIGNAL_AFTER_ROWS rows."""
    return _run(out, *extra, "--flush-seconds", "3600",
                ROLLOUT_DEBUG_SIGNAL_AFTER_ROWS=f"{SIGNAL_AFTER_ROWS}:{signame}")


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def _check_whole_shards(out: Path) -> int:
    """Every visible file is a readable part file; returns the row count."""
    directory = out / "trajectories"
    rows = 0
    for name in os.listdir(directory):
        if TEMP_RE.match(name):
            continue  # hidden and skipped by readers; resume deletes it
        assert PART_RE.match(name), f"unexpected visible file {name} in {directory}"
        rows += pq.read_table(directory / name).num_rows
    assert pq.read_table(directory).num_rows == rows
    return rows


def _by_pair(out: Path) -> dict:
    table = pq.read_table(out / "trajectories")
    rows = table.to_pylist()
    pairs = [(r["prompt_index"], r["sample_index"]) for r in rows]
    assert len(pairs) == len(set(pairs)), "duplicate (prompt_index, sample_index) rows"
    return {p: r for p, r in zip(pairs, rows)}


def _assert_same_rows(out: Path, reference: Path) -> None:
    got, want = _by_pair(out), _by_pair(reference)
    assert set(want) == {(p, s) for p in range(LIMIT) for s in range(N)}
    assert set(got) == set(want)
    for pair, w in want.items():
        g = got[pair]
        assert g["response_token_ids"] == w["response_token_ids"], pair
        assert len(g["response_token_ids"]) == MAX_NEW
        assert g["prompt_token_ids"] == w["prompt_token_ids"], pair
        assert max(abs(a - b) for a, b in zip(g["response_logprobs"], w["response_logprobs"])) <= LP_TOL, pair
        for key in ("response_text", "finish_reason", "weight_version", "data_source", "reward_model",
                    "extra_info"):
            assert g[key] == w[key], (pair, key)
    assert _manifest(out)["status"] == "complete"
    assert not [f for f in os.listdir(out / "trajectories") if TEMP_RE.match(f)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run, started in the background as soon as the module needs it."""
    out = tmp_path_factory.mktemp("resume") / "reference"
    proc = _start(out)

    def wait() -> Path:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        return out

    yield wait
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_sigkill_then_resume_matches_an_uninterrupted_run(reference, tmp_path):
    out = tmp_path / "killed"
    killed = _run_until_signal(out, "KILL", "--max-running", "8")
    assert killed.returncode == -signal.SIGKILL, killed.stderr

    rows = _check_whole_shards(out)
    assert SHARD_ROWS <= rows < TOTAL, f"{rows} rows: the kill did not land mid-run"
    assert _manifest(out)["status"] == "running"  # the killed run never got to write its summary

    # Another seed must not continue these samples: refused with one line, OUT unchanged.
    before = sorted(os.listdir(out / "trajectories")), (out / "manifest.json").read_bytes()
    other = [a if a != "3" else "4" for a in SETTINGS]
    refused = subprocess.run(CLI + other + ["--out", str(out), "--resume"], cwd=REPO, env=_env(),
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), refused.stderr
    assert "--resume" in lines[0] and "seed" in lines[0] and "same settings" in lines[0], lines[0]
    assert "Traceback" not in refused.stderr
    assert (sorted(os.listdir(out / "trajectories")), (out / "manifest.json").read_bytes()) == before

    resumed = _run(out, "--resume", "--max-running", "8")
    assert resumed.returncode == 0, resumed.stderr
    m = _manifest(out)
    assert m["trajectories"] == TOTAL and m["trajectories_this_run"] == TOTAL - rows
    _assert_same_rows(out, reference())


def test_sigterm_flushes_finished_rows_exits_130_and_resume_completes(reference, tmp_path):
    out = tmp_path / "terminated"
    # 6 in flight: rows finish in sixes, shards take eights, so rows are buffered when SIGTERM lands
    # and prompts are left with some of their samples done.
    terminated = _run_until_signal(out, "TERM", "--max-running", "6")
    err = terminated.stderr
    assert terminated.returncode == 130, err
    assert "Traceback" not in err
    assert "interrupted" in err and "--resume" in err, err

    m = _manifest(out)
    assert m["status"] == "interrupted"
    rows = _check_whole_shards(out)
    # every row that reached the writer before the signal is on disk: the buffered ones too
    assert SIGNAL_AFTER_ROWS <= rows < TOTAL, rows
    # Every finished trajectory was written, none twice.
    assert rows == m["trajectories"] == m["trajectories_this_run"], (rows, m["trajectories"])
    assert len(_by_pair(out)) == rows

    resumed = _run(out, "--resume", "--max-running", "6")
    assert resumed.returncode == 0, resumed.stderr
    _assert_same_rows(out, reference())
