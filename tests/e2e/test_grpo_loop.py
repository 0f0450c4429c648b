"""The shell-scripted GRPO recipe end to end on the tiny example model (CPU)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROLLOUT = f"{sys.executable} -m rollout_cli.cli.main"


def _loop_env(workdir: Path, **extra) -> dict:
    env = dict(os.environ, WORKDIR=str(workdir), ROLLOUT=ROLLOUT, PYTHON=sys.executable, DEVICE="cpu")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _daemons_on(socket: Path) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if str(socket) in line and " serve " in line]


def test_loop_learns_with_true_versions_and_on_policy_logprobs(tmp_path):
    workdir = tmp_path / "grpo"
    subprocess.run(["bash", "recipes/grpo_loop.sh"], cwd=REPO, env=_loop_env(workdir, ITERATIONS=4),
                   check=True, capture_output=True, timeout=600)
    metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [1, 2, 3, 4]
    assert [m["weight_version"] for m in metrics] == ["0", "1", "2", "3"]
    assert metrics[-1]["mean_reward"] > metrics[0]["mean_reward"]
    assert all(m["logprob_mismatch"] <= 1e-4 for m in metrics)
    assert all(m[k] > 0 for m in metrics for k in ("rollout_seconds", "train_seconds", "reload_seconds",
                                                   "release_seconds", "resume_seconds"))
    log = (workdir / "serve.log").read_text()
    assert log.count("released weights,kv_cache,cuda_graph") == 4 and log.count("resumed weights,kv_cache,cuda_graph") == 4
    assert not (workdir / "engine.sock").exists() and not _daemons_on(workdir / "engine.sock")


def test_deterministic_loop_is_on_policy_bit_for_bit(tmp_path):
    """serve --deterministic and the trainer on rollout_cli.training: the trainer's logprobs equal the
    rollout's exactly, also after a weight update went through reload-weights."""
    workdir = tmp_path / "grpo"
    subprocess.run(["bash", "recipes/grpo_loop.sh"], cwd=REPO, check=True, capture_output=True, timeout=600,
                   env=_loop_env(workdir, ITERATIONS=2, LIMIT=2, GROUP_SIZE=4, MAX_NEW_TOKENS=8, TRAIN_STEPS=1,
                                 DETERMINISTIC=1))
    metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [m["weight_version"] for m in metrics] == ["0", "1"]
    assert [m["logprob_mismatch"] for m in metrics] == [0.0, 0.0]


def test_killed_loop_leaves_no_daemon_and_no_partial_checkpoint(tmp_path):
    workdir = tmp_path / "grpo"
    loop = subprocess.Popen(["bash", "recipes/grpo_loop.sh"], cwd=REPO, env=_loop_env(workdir, ITERATIONS=50),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not (workdir / "traj_1" / "manifest.json").exists():
            assert loop.poll() is None and time.monotonic() < deadline, "the loop did not start its first rollout"
            time.sleep(0.2)
        loop.send_signal(signal.SIGTERM)
        assert loop.wait(timeout=120) != 0
    finally:
        if loop.poll() is None:
            loop.kill()
    assert not _daemons_on(workdir / "engine.sock")
    for checkpoint in workdir.glob("ckpt_*"):
        # checkpoints appear only by rename of a complete temp dir; a leftover temp dir is never loaded
        if not checkpoint.name.endswith(".tmp"):
            assert (checkpoint / "config.json").is_file() and (checkpoint / "model.safetensors").is_file()


def test_tool_loop_trains_on_episodes_with_the_tool_results_masked(tmp_path):
    """recipes/tool_loop.sh: calculator episodes, then the GRPO trainer on them; the engine's logprobs of
    the model's tokens match the trainer's (the tool results, logprob 0 in the rows, are masked out:
    counted, they would differ by several nats), and the next iteration runs on the new checkpoint."""
    workdir = tmp_path / "tools"
    subprocess.run(["bash", "recipes/tool_loop.sh"], cwd=REPO, check=True, capture_output=True, timeout=600,
                   env=_loop_env(workdir, ITERATIONS=2, PROMPTS=4, GROUP_SIZE=2, MAX_TURNS=3, MAX_NEW_TOKENS=8,
                                 TRAIN_STEPS=1))
    metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [1, 2]
    assert all(m["trajectories"] == 8 and m["logprob_mismatch"] <= 1e-4 for m in metrics)
    assert all(m["episodes"]["turns"] == 8 * 3 and m["episodes"]["prefix_hit_rate"] > 0.5 for m in metrics)
    manifest = json.loads((workdir / "episodes_2" / "manifest.json").read_text())
    assert manifest["model"].endswith("ckpt_1")
