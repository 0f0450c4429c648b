"""One replica failing under `rollout run --dp 2` ends the other at once, with one line, as a --tp rank
does (rollout_cli/cli/rank_failure.py); on the CPU (gloo), with the example model.

The replicas join one process group (torchrun's rendezvous) but wait for each other only at the start
and at the end, so a failing replica left the other generating its share (for ever, without the
launcher's SIGTERM), or, waiting in the final gather, printing gloo's "connection closed" traceback,
exiting 1 and leaving the manifest "running". rank_faults/sitecustomize.py makes one replica fail; the
two views are rank_fault_runs.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from rank_fault_runs import MID_RUN_STEP, PROMPTS, Ranks, fault_message, job_args, lines, run_cli, write_prompts

from rollout_cli.data_parallel import PEER_FAILED

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds leftover ranks in /proc")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    return write_prompts(tmp_path_factory.mktemp("dp_fail_prompts") / "prompts.parquet")


@pytest.mark.parametrize("failing", [0, 1])
def test_the_other_replica_ends_its_job_because_of_the_claim(prompts, tmp_path, failing):
    """The other replica has far more to generate than the test waits for, and nobody signals it: it ends
    its job on the claim (its shards closed), silently, with PEER_FAILED; the manifest records the failing
    replica's line, also where replica 0 is the one that did not fail."""
    out = tmp_path / "out"
    point = f"step={MID_RUN_STEP}"
    # a million samples per prompt: hours of work, so the other replica cannot end by finishing its share
    results = Ranks(job_args(prompts, out, "--dp", n=1_000_000), f"{failing}:{point}", tmp_path).wait()
    code, stderr = results[failing]
    assert (code, lines(stderr)) == (2, [f"error: {fault_message(failing, point)}"]), stderr
    peer_code, peer_stderr = results[1 - failing]
    assert (peer_code, lines(peer_stderr)) == (PEER_FAILED, []), peer_stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["status"], manifest["error"]) == ("failed", fault_message(failing, point))
    written = pq.read_table(out / "trajectories").to_pylist()
    assert any(row["prompt_index"] % 2 == failing for row in written)  # the failing replica's first wave


@pytest.mark.parametrize("failing", [0, 1])
def test_a_replica_failing_mid_run_is_one_line_and_resume_completes(prompts, tmp_path, failing):
    out = tmp_path / "out"
    args = job_args(prompts, out, "--dp")
    failed = run_cli("run", args, f"{failing}:step={MID_RUN_STEP}")
    message = fault_message(failing, f"step={MID_RUN_STEP}")
    assert failed.returncode == 2, failed.stderr
    assert lines(failed.stderr) == [f"error: {message}"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["status"], manifest["error"]) == ("failed", message)

    resumed = run_cli("run", [*args, "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((out / "manifest.json").read_text())["status"] == "complete"
    rows = pq.read_table(out / "trajectories").to_pylist()
    assert sorted((row["prompt_index"], row["sample_index"]) for row in rows) == \
        [(p, s) for p in range(len(PROMPTS)) for s in range(2)]


@pytest.mark.parametrize("fault", ["0:load", "1:load"])
def test_a_replica_failing_to_load_is_one_line(prompts, tmp_path, fault):
    """The other replica may be loading, or waiting for it in the barrier before the job (gloo's
    "connection closed" once it left): either way only the failing replica's line, and its exit code."""
    result = run_cli("run", job_args(prompts, tmp_path / "out", "--dp"), fault)
    assert result.returncode == 2, result.stderr
    assert lines(result.stderr) == [f"error: {fault_message(int(fault[0]), fault[2:])}"]
