"""One rank failing under --tp 2 ends every rank at once, with one line (rollout_cli/cli/rank_failure.py);
on the CPU (gloo), with the example model.

Nothing real fails on one rank alone on the CPU: rank_faults/sitecustomize.py raises a RolloutError in
the rank and at the point a test names. Two views (rank_fault_runs.py):

- the two ranks started by this test as torchrun starts them: a rank that ends does so through the new
  mechanism, which its exit code proves (PEER_FAILED: it left because the other rank claimed the
  failure). Without it, the other rank waits in the rendezvous or in an all-reduce for ever;
- `rollout run --tp 2` (and `serve --tp 2`) as typed: the launcher's one line and exit code, no rank
  left behind, the finished rows kept, the failing rank's line in the manifest, and --resume
  completing the run.

The timeouts (SAFETY_TIMEOUT) are only a safety net: no verdict depends on how fast a loaded machine is.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from rank_fault_runs import (MID_RUN_STEP, MODEL, PROMPTS, REPO, SAFETY_TIMEOUT, Ranks, fault_env, fault_message,
                             job_args, left_behind, lines, run_cli, write_prompts)

from rollout_cli.data_parallel import PEER_FAILED
from rollout_cli.errors import INTERRUPTED

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds leftover ranks in /proc")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    return write_prompts(tmp_path_factory.mktemp("tp_fail_prompts") / "prompts.parquet")


@pytest.mark.parametrize("fault", [
    "0:rendezvous",  # rank 1 waits in the rendezvous (gloo's store waits, deaf to signals)
    "1:load",  # rank 0 waits in the rendezvous, its own load, or the pool sizes' all-reduce
    f"0:step={MID_RUN_STEP}",  # rank 1 waits in the forward's all-reduce; rank 0 used to wait in "stop"
    f"1:step={MID_RUN_STEP}",  # rank 0 holds the job's files: it closes them, then leaves
])
def test_the_other_rank_leaves_because_of_the_claim(prompts, tmp_path, fault):
    failing, point = int(fault[0]), fault[2:]
    out = tmp_path / "out"
    results = Ranks(job_args(prompts, out, "--tp"), fault, tmp_path).wait()
    code, stderr = results[failing]
    assert (code, lines(stderr)) == (2, [f"error: {fault_message(failing, point)}"]), stderr
    peer_code, peer_stderr = results[1 - failing]
    assert (peer_code, lines(peer_stderr)) == (PEER_FAILED, []), peer_stderr
    if point.startswith("step"):  # rank 0 closed the job: its final manifest, the first wave's rows
        manifest = json.loads((out / "manifest.json").read_text())
        # the failing rank's line, also where rank 0 saw only gloo's "connection closed" (a follower failed)
        assert (manifest["status"], manifest["error"]) == ("failed", fault_message(failing, point))
        assert pq.read_table(out / "trajectories").num_rows >= 2


def test_an_interrupt_is_rank_0s_to_end(prompts, tmp_path):
    """SIGTERM to both ranks, as torchrun passes the user's on: the follower leaves it to rank 0, which
    closes the job as interrupted (not failed by a follower that left first) and then releases it."""
    out = tmp_path / "out"
    args = job_args(prompts, out, "--tp")
    args[args.index("--n") + 1] = "4096"  # far more than the test waits for
    ranks = Ranks(args, None, tmp_path)
    deadline = time.monotonic() + SAFETY_TIMEOUT  # the safety net: the first rows come after ~10 s
    while not list(out.glob("trajectories/part-*.parquet")) and time.monotonic() < deadline:
        time.sleep(0.2)
    for process in ranks.processes:
        process.send_signal(signal.SIGTERM)
    (code, stderr), (peer_code, peer_stderr) = ranks.wait()
    assert (code, lines(stderr)) == (130, [INTERRUPTED]), stderr
    assert (peer_code, lines(peer_stderr)) == (PEER_FAILED, []), peer_stderr
    assert json.loads((out / "manifest.json").read_text())["status"] == "interrupted"


@pytest.mark.parametrize("fault", ["0:rendezvous", "1:load"])
def test_an_early_failure_is_one_line(prompts, tmp_path, fault):
    out = tmp_path / "out"
    result = run_cli("run", job_args(prompts, out, "--tp"), fault)
    assert result.returncode == 2, result.stderr
    assert lines(result.stderr) == [f"error: {fault_message(int(fault[0]), fault[2:])}"]
    assert not out.exists()  # the job never started


def _serve_args(socket: Path) -> list[str]:
    """`serve --tp 2` of the example model on the CPU, on `socket`."""
    return ["--model", MODEL, "--tp", "2", "--device", "cpu", "--max-model-len", "64", "--kv-cache-tokens", "1024",
            "--socket", str(socket)]


def _rows(out: Path) -> dict:
    rows = pq.read_table(out / "trajectories").to_pylist()
    return {(row["prompt_index"], row["sample_index"]): row for row in rows}


@pytest.mark.parametrize("failing", [0, 1])  # 1: rank 0 saw only gloo's "connection closed" in the all-reduce
def test_a_failure_mid_run_keeps_the_finished_rows_and_resume_completes(prompts, tmp_path, failing):
    out = tmp_path / "out"
    args = job_args(prompts, out, "--tp")
    failed = run_cli("run", args, f"{failing}:step={MID_RUN_STEP}")
    message = fault_message(failing, f"step={MID_RUN_STEP}")
    assert failed.returncode == 2, failed.stderr
    assert lines(failed.stderr) == [f"error: {message}"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["status"], manifest["error"]) == ("failed", message)
    kept = _rows(out)
    assert 2 <= len(kept) < 8  # the first wave finished before the failure, the rest did not

    resumed = run_cli("run", [*args, "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((out / "manifest.json").read_text())["status"] == "complete"
    rows = _rows(out)
    assert sorted(rows) == [(p, s) for p in range(len(PROMPTS)) for s in range(2)]
    assert {key: rows[key] for key in kept} == kept  # the rows written before the failure, untouched


@pytest.mark.parametrize("failing", [1, 0])
def test_serve_with_a_rank_that_fails_to_load_is_one_line(tmp_path, failing):
    """`serve --tp 2`, a follower failing to load: rank 0's engine thread sees only gloo's "connection
    closed" where the follower left; rank 0 failing: its daemon's line and the launcher's "a rank failed"
    were two. Either way: the failing rank's line alone (no traceback), exit 2, no socket left."""
    socket = tmp_path / "engine.sock"
    result = run_cli("serve", _serve_args(socket), f"{failing}:load")
    assert result.returncode == 2, result.stderr
    # rank 0 may log that its engine loads (an info line, with a timestamp) before the failure
    said = [line for line in lines(result.stderr) if "rollout serve: engine loading" not in line]
    assert said == [f"error: {fault_message(failing, 'load')}"], result.stderr
    assert not socket.exists()


def test_a_follower_failing_during_a_daemon_job_is_one_line(prompts, tmp_path):
    """`serve --tp 2`, the follower failing mid-job: the client's run ends with the follower's line, the
    daemon too (no gloo traceback from rank 0 stopping a follower that is gone), the job's finished rows
    and manifest are kept with that line, the socket is removed, no rank is left, and --resume completes."""
    socket, out, tag = tmp_path / "engine.sock", tmp_path / "out", uuid.uuid4().hex
    log = tmp_path / "serve.stderr"
    message = fault_message(1, f"step={MID_RUN_STEP}")
    with log.open("w") as stderr:
        daemon = subprocess.Popen([sys.executable, "-m", "rollout_cli.cli.main", "serve", *_serve_args(socket),
                                   "--max-running", "2"],
                                  cwd=REPO, env=fault_env(tag, f"1:step={MID_RUN_STEP}"), stdout=subprocess.DEVNULL,
                                  stderr=stderr)
    try:
        ready = run_cli("status", ["--engine", str(socket), "--wait", str(SAFETY_TIMEOUT)])
        assert ready.returncode == 0, ready.stderr + log.read_text()
        sampling = ["--n", "2", "--max-new-tokens", "8", "--temperature", "0", "--ignore-eos", "--flush-seconds", "0"]
        failed = run_cli("run", ["--engine", str(socket), "--data", str(prompts), "--out", str(out), *sampling])
        assert failed.returncode == 2, failed.stderr
        assert [line for line in lines(failed.stderr) if line.startswith("error")] == [f"error: {message}"]
        assert daemon.wait(SAFETY_TIMEOUT) == 2
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
    said = log.read_text()
    assert "Traceback" not in said, said
    assert [line for line in lines(said) if "error" in line] == [f"error: {message}"], said
    assert not socket.exists() and left_behind(tag) == []
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["status"], manifest["error"]) == ("failed", message)
    kept = _rows(out)
    assert 2 <= len(kept) < 8

    resumed = run_cli("run", [*job_args(prompts, out, "--tp"), "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    rows = _rows(out)
    assert sorted(rows) == [(p, s) for p in range(len(PROMPTS)) for s in range(2)]
    assert {key: rows[key] for key in kept} == kept
