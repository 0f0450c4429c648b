"""One rank failing under --tp 2 ends every rank at once, with one line (rollout_cli/cli/rank_failure.py);
on the CPU (gloo), with the example model.

Nothing real fails on one rank alone on the CPU: rank_faults/sitecustomize.py raises a RolloutError in
the rank and at the point a test names. Two views:

- the two ranks started by this test as torchrun starts them (the environment, and this test's
  rendezvous store as the agent's): nobody signals them, so a rank that ends does so through the new
  mechanism, which its exit code proves (PEER_FAILED: it left because the other rank claimed the
  failure). Without it, the other rank waits in the rendezvous or in an all-reduce for ever;
- `rollout run --tp 2` as typed: the launcher's one line and exit code, no rank left behind, the
  finished rows kept and --resume completing the run.

The timeouts (SAFETY_TIMEOUT) are only a safety net: no verdict depends on how fast a loaded machine is.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch.distributed as dist

from rollout_cli.data_parallel import PEER_FAILED, REPLICA_ERRORS_ENV
from rollout_cli.errors import INTERRUPTED

REPO = Path(__file__).resolve().parents[2]
MODEL = str(REPO / "recipes" / "example_model")
FAULTS = Path(__file__).resolve().parent / "rank_faults"
SAFETY_TIMEOUT = 120  # seconds; each case takes about 10 on two CPU cores
PROMPTS = [[5, 9, 17, 33, 2], [7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [5, 9, 17, 40]]
# waves of 2 requests of 8 tokens: the first wave's rows are on disk by the 12th forward
MID_RUN_STEP = 12
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_USE_AGENT_STORE", "ROLLOUT_ENGINE", REPLICA_ERRORS_ENV)

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds leftover ranks in /proc")


def _faults():
    """rank_faults/sitecustomize.py as a module (importing it by its name could pick another sitecustomize)."""
    spec = importlib.util.spec_from_file_location("rank_faults", FAULTS / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_FAULTS = _faults()
FAULT_ENV, fault_message = _FAULTS.FAULT_ENV, _FAULTS.fault_message


def _env(tag: str, fault: str | None) -> dict:
    """The environment of the command, marked with `tag` (every rank inherits it: _left_behind finds them)."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", ROLLOUT_TEST_TAG=tag)
    if fault is not None:
        env[FAULT_ENV] = fault
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(FAULTS), env.get("PYTHONPATH")) if p)
    return env


def _left_behind(tag: str) -> list[int]:
    """Live processes (zombies have no environment) that carry `tag`."""
    needle = f"ROLLOUT_TEST_TAG={tag}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and needle in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                pids.append(int(entry))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return pids


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tp_fail_prompts") / "prompts.parquet"
    pq.write_table(pa.table({"prompt": PROMPTS}), path)
    return path


def _args(prompts: Path, out: Path) -> list[str]:
    """Greedy, fixed lengths, two requests at a time, every finished row written at once."""
    return ["--model", MODEL, "--data", str(prompts), "--out", str(out), "--n", "2", "--max-new-tokens", "8",
            "--temperature", "0", "--ignore-eos", "--max-running", "2", "--flush-seconds", "0", "--device", "cpu",
            "--kv-cache-tokens", "1024", "--max-model-len", "64", "--quiet", "--tp", "2"]


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


class _Ranks:
    """`rollout run ARGS` started as torchrun starts its two ranks, this test's store standing in for the
    agent's; nobody else signals them."""

    def __init__(self, args: list[str], fault: str | None, tmp_path: Path):
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # alive as long as this
        self.tag = uuid.uuid4().hex
        env = dict(_env(self.tag, fault), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.store.port), WORLD_SIZE="2",
                   LOCAL_WORLD_SIZE="2", TORCHELASTIC_USE_AGENT_STORE="True")
        self.logs = [tmp_path / f"rank{rank}.stderr" for rank in range(2)]
        self.processes = [subprocess.Popen([sys.executable, "-m", "rollout_cli.cli.main", "run", *args], cwd=REPO,
                                           env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                                           stdout=subprocess.DEVNULL, stderr=log.open("w"))
                          for rank, log in enumerate(self.logs)]

    def wait(self) -> list[tuple[int, str]]:
        """(exit code, stderr) of each rank once both ended by themselves."""
        try:
            for rank, process in enumerate(self.processes):
                try:
                    process.wait(timeout=SAFETY_TIMEOUT)
                except subprocess.TimeoutExpired:
                    pytest.fail(f"rank {rank} still runs {SAFETY_TIMEOUT} s after the start: nothing ended it")
        finally:
            for process in self.processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        assert _left_behind(self.tag) == []
        return [(process.returncode, log.read_text()) for process, log in zip(self.processes, self.logs)]


@pytest.mark.parametrize("fault", [
    "0:rendezvous",  # rank 1 waits in the rendezvous (gloo's store waits, deaf to signals)
    "1:load",  # rank 0 waits in the rendezvous, its own load, or the pool sizes' all-reduce
    f"0:step={MID_RUN_STEP}",  # rank 1 waits in the forward's all-reduce; rank 0 used to wait in "stop"
    f"1:step={MID_RUN_STEP}",  # rank 0 holds the job's files: it closes them, then leaves
])
def test_the_other_rank_leaves_because_of_the_claim(prompts, tmp_path, fault):
    failing, point = int(fault[0]), fault[2:]
    out = tmp_path / "out"
    results = _Ranks(_args(prompts, out), fault, tmp_path).wait()
    code, stderr = results[failing]
    assert (code, _lines(stderr)) == (2, [f"error: {fault_message(failing, point)}"]), stderr
    peer_code, peer_stderr = results[1 - failing]
    assert (peer_code, _lines(peer_stderr)) == (PEER_FAILED, []), peer_stderr
    if point.startswith("step"):  # rank 0 closed the job: its final manifest, the first wave's rows
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["status"] == "failed"
        assert pq.read_table(out / "trajectories").num_rows >= 2


def test_an_interrupt_is_rank_0s_to_end(prompts, tmp_path):
    """SIGTERM to both ranks, as torchrun passes the user's on: the follower leaves it to rank 0, which
    closes the job as interrupted (not failed by a follower that left first) and then releases it."""
    out = tmp_path / "out"
    args = _args(prompts, out)
    args[args.index("--n") + 1] = "4096"  # far more than the test waits for
    ranks = _Ranks(args, None, tmp_path)
    deadline = time.monotonic() + SAFETY_TIMEOUT  # the safety net: the first rows come after ~10 s
    while not list(out.glob("trajectories/part-*.parquet")) and time.monotonic() < deadline:
        time.sleep(0.2)
    for process in ranks.processes:
        process.send_signal(signal.SIGTERM)
    (code, stderr), (peer_code, peer_stderr) = ranks.wait()
    assert (code, _lines(stderr)) == (130, [INTERRUPTED]), stderr
    assert (peer_code, _lines(peer_stderr)) == (PEER_FAILED, []), peer_stderr
    assert json.loads((out / "manifest.json").read_text())["status"] == "interrupted"


def _run(args: list[str], fault: str | None = None) -> subprocess.CompletedProcess:
    """`rollout run ARGS` as typed (the launcher starts the ranks); asserts that no rank outlives it."""
    tag = uuid.uuid4().hex
    try:
        result = subprocess.run([sys.executable, "-m", "rollout_cli.cli.main", "run", *args], capture_output=True,
                                text=True, timeout=SAFETY_TIMEOUT, cwd=REPO, env=_env(tag, fault))
    except subprocess.TimeoutExpired:
        for pid in _left_behind(tag):  # the ranks run in sessions of their own: not killed with the launcher
            os.kill(pid, signal.SIGKILL)
        pytest.fail(f"rollout run --tp 2 still runs {SAFETY_TIMEOUT} s after the start")
    assert _left_behind(tag) == []
    return result


@pytest.mark.parametrize("fault", ["0:rendezvous", "1:load"])
def test_an_early_failure_is_one_line(prompts, tmp_path, fault):
    out = tmp_path / "out"
    result = _run(_args(prompts, out), fault)
    assert result.returncode == 2, result.stderr
    assert _lines(result.stderr) == [f"error: {fault_message(int(fault[0]), fault[2:])}"]
    assert not out.exists()  # the job never started


def _rows(out: Path) -> dict:
    rows = pq.read_table(out / "trajectories").to_pylist()
    return {(row["prompt_index"], row["sample_index"]): row for row in rows}


def test_a_failure_mid_run_keeps_the_finished_rows_and_resume_completes(prompts, tmp_path):
    out = tmp_path / "out"
    args = _args(prompts, out)
    failed = _run(args, f"0:step={MID_RUN_STEP}")
    message = fault_message(0, f"step={MID_RUN_STEP}")
    assert failed.returncode == 2, failed.stderr
    assert _lines(failed.stderr) == [f"error: {message}"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["status"], manifest["error"]) == ("failed", message)
    kept = _rows(out)
    assert 2 <= len(kept) < 8  # the first wave finished before the failure, the rest did not

    resumed = _run([*args, "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((out / "manifest.json").read_text())["status"] == "complete"
    rows = _rows(out)
    assert sorted(rows) == [(p, s) for p in range(len(PROMPTS)) for s in range(2)]
    assert {key: rows[key] for key in kept} == kept  # the rows written before the failure, untouched
