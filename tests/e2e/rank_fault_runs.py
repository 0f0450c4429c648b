"""Running `rollout` with one rank failing on purpose (rank_faults/sitecustomize.py), for the tests of
rollout_cli/cli/rank_failure.py: test_tensor_parallel_failures.py (--tp, serve --tp) and
test_data_parallel_failures.py (--dp).

Two views of a command:

- `Ranks`: its two ranks started as torchrun starts them (the environment, and this module's rendezvous
  store standing in for the agent's): nobody signals them, so a rank that ends does so through
  rank_failure's claim, which its exit code proves (PEER_FAILED). Without it, the other rank waits in
  the rendezvous or a collective, or generates on, for ever;
- `run_cli`: the command as typed (the launcher starts the ranks): its one line and exit code, and no
  rank left behind.

The timeouts (SAFETY_TIMEOUT) are only a safety net: no verdict depends on how fast a loaded machine is.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch.distributed as dist

from rollout_cli.data_parallel import REPLICA_ERRORS_ENV

REPO = Path(__file__).resolve().parents[2]
MODEL = str(REPO / "recipes" / "example_model")
FAULTS = Path(__file__).resolve().parent / "rank_faults"
SAFETY_TIMEOUT = 120  # seconds; each case takes about 10 on two CPU cores
PROMPTS = [[5, 9, 17, 33, 2], [7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [5, 9, 17, 40]]
# waves of 2 requests of 8 tokens (per --dp replica): the first wave's rows are on disk by the 12th forward
MID_RUN_STEP = 12
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_USE_AGENT_STORE", "ROLLOUT_ENGINE", REPLICA_ERRORS_ENV)


def _faults():
    """rank_faults/sitecustomize.py as a module (importing it by its name could pick another sitecustomize)."""
    spec = importlib.util.spec_from_file_location("rank_faults", FAULTS / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_FAULTS = _faults()
FAULT_ENV, fault_message = _FAULTS.FAULT_ENV, _FAULTS.fault_message


def fault_env(tag: str, fault: str | None) -> dict:
    """The environment of the command, marked with `tag` (every rank inherits it: left_behind finds them)."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", ROLLOUT_TEST_TAG=tag)
    if fault is not None:
        env[FAULT_ENV] = fault
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(FAULTS), env.get("PYTHONPATH")) if p)
    return env


def left_behind(tag: str) -> list[int]:
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


def write_prompts(path: Path) -> Path:
    pq.write_table(pa.table({"prompt": PROMPTS}), path)
    return path


def job_args(prompts: Path, out: Path, parallel: str, n: int = 2) -> list[str]:
    """`run`'s arguments for two ranks (parallel: "--tp" or "--dp"): greedy, fixed lengths, two requests
    at a time, every finished row written at once."""
    return ["--model", MODEL, "--data", str(prompts), "--out", str(out), "--n", str(n), "--max-new-tokens", "8",
            "--temperature", "0", "--ignore-eos", "--max-running", "2", "--flush-seconds", "0", "--device", "cpu",
            "--kv-cache-tokens", "1024", "--max-model-len", "64", "--quiet", parallel, "2"]


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


class Ranks:
    """`rollout run ARGS` started as torchrun starts its two ranks, this module's store standing in for the
    agent's; nobody else signals them."""

    def __init__(self, args: list[str], fault: str | None, tmp_path: Path):
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # alive as long as this
        self.tag = uuid.uuid4().hex
        env = dict(fault_env(self.tag, fault), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.store.port),
                   WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", TORCHELASTIC_USE_AGENT_STORE="True")
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
        assert left_behind(self.tag) == []
        return [(process.returncode, log.read_text()) for process, log in zip(self.processes, self.logs)]


def run_cli(command: str, args: list[str], fault: str | None = None) -> subprocess.CompletedProcess:
    """`rollout COMMAND ARGS` as typed (the launcher starts the ranks); asserts that no rank outlives it."""
    tag = uuid.uuid4().hex
    try:
        result = subprocess.run([sys.executable, "-m", "rollout_cli.cli.main", command, *args], capture_output=True,
                                text=True, timeout=SAFETY_TIMEOUT, cwd=REPO, env=fault_env(tag, fault))
    except subprocess.TimeoutExpired:
        for pid in left_behind(tag):  # the ranks run in sessions of their own: not killed with the launcher
            os.kill(pid, signal.SIGKILL)
        pytest.fail(f"rollout {command} still runs {SAFETY_TIMEOUT} s after the start")
    assert left_behind(tag) == []
    return result
