"""`rollout serve --tp 2` on the CPU (gloo, two ranks): rank 0 serves, rank 1 follows its steps and its
control operations. In file order against one daemon on a tiny Qwen2-MoE checkpoint (experts and the
shared expert split over the ranks): a job equals a one-process engine; a reload of another checkpoint,
a refused one, a memory release and resume, an update from shared-memory tensor handles and one from a
trainer's broadcast all reach both ranks (the next job equals a one-process engine on those weights);
then shutdown stops both ranks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file, save_file

from rollout_cli import Engine, SamplingParams
from rollout_cli.engine.weights.weight_group import broadcast_metadata, broadcast_tensors, open_weight_group
from rollout_cli.errors import RolloutError
from weight_trainers import broadcast_order, checkpoint_tensors, free_port, perturbed_checkpoint, wait_for_daemon

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "rollout_cli.cli.main"]
PROMPTS = [[5, 9, 17, 33, 2], [7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
MAX_NEW = 8
LP_TOL = 1e-5


def _env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    env.pop("ROLLOUT_ENGINE", None)
    return env


def _cli(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + [str(a) for a in args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=_env())


@pytest.fixture(scope="module")
def daemon(tiny_moe_checkpoints, tmp_path_factory):
    work = tmp_path_factory.mktemp("serve_tp")
    base = tiny_moe_checkpoints["qwen2_moe"]
    ckpts = {"a": base, **{name: perturbed_checkpoint(base, work / name, seed) for name, seed in (("b", 1), ("c", 2))}}
    bad = Path(shutil.copytree(base, work / "bad"))
    tensors = load_file(str(bad / "model.safetensors"))
    name = "model.layers.1.mlp.experts.2.down_proj.weight"  # [64, 32] cut to one rank's columns
    tensors[name] = tensors[name][:, :16].clone()
    save_file(tensors, str(bad / "model.safetensors"))
    data = work / "prompts.parquet"
    pq.write_table(pa.table({"prompt": PROMPTS}), data)
    sock, log = work / "engine.sock", work / "serve.log"
    proc = subprocess.Popen(CLI + ["serve", "--model", base, "--tp", "2", "--device", "cpu", "--max-model-len", "64",
                                   "--kv-cache-tokens", "1024", "--max-batch-tokens", "16", "--socket", str(sock)],
                            stdout=subprocess.DEVNULL, stderr=log.open("w"), cwd=REPO, env=_env())
    try:
        client = wait_for_daemon(proc, sock, log)
        yield dict(client=client, proc=proc, sock=sock, log=log, ckpts=ckpts, bad=str(bad), data=data, work=work)
        client.close()
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(60)


_REFERENCE: dict = {}


def _one_process(model_dir: str) -> list:
    """Greedy tokens and logprobs of a one-process engine (--tp 1) on the checkpoint, per prompt."""
    if model_dir not in _REFERENCE:
        engine = Engine(model_dir, device="cpu", max_model_len=64, max_batch_tokens=16)
        results = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW))
        _REFERENCE[model_dir] = [(r.response_token_ids, r.response_logprobs) for r in results]
    return _REFERENCE[model_dir]


def _job_equals(daemon, name: str, model_dir: str, version: str) -> None:
    out = daemon["work"] / f"out_{name}"
    result = _cli("run", "--engine", daemon["sock"], "--data", daemon["data"], "--out", out, "--temperature", "0",
                  "--max-new-tokens", MAX_NEW, "--quiet")
    assert result.returncode == 0, result.stderr
    rows = pq.read_table(out / "trajectories").sort_by("prompt_index").to_pylist()
    want = _one_process(model_dir)
    assert len(rows) == len(want) == len(PROMPTS)
    for row, (tokens, logprobs) in zip(rows, want):
        assert row["response_token_ids"] == tokens, (name, row["prompt_index"])
        assert row["response_logprobs"] == pytest.approx(logprobs, abs=LP_TOL), (name, row["prompt_index"])
        assert row["weight_version"] == version


def test_job_equals_one_process(daemon):
    info = daemon["client"].get("/get_server_info")
    assert info["tensor_parallel"] == 2 and info["state"] == "serving"
    assert "over 2 tensor-parallel ranks" in daemon["log"].read_text()
    status = _cli("status", "--engine", daemon["sock"])
    assert status.returncode == 0 and "tensor parallel 2 ranks" in status.stdout, status.stderr
    _job_equals(daemon, "a", daemon["ckpts"]["a"], "0")
    assert [t for t, _ in _one_process(daemon["ckpts"]["a"])] != [t for t, _ in _one_process(daemon["ckpts"]["b"])]


def test_reload_reaches_every_rank(daemon):
    result = _cli("reload-weights", daemon["ckpts"]["b"], "--engine", daemon["sock"])
    assert result.returncode == 0, result.stderr
    assert daemon["client"].get("/get_weight_version") == {"weight_version": "1"}
    _job_equals(daemon, "b", daemon["ckpts"]["b"], "1")


def test_refused_reload_changes_nothing(daemon):
    result = _cli("reload-weights", daemon["bad"], "--engine", daemon["sock"])
    assert result.returncode != 0
    assert "wrong shapes: model.layers.1.mlp.experts.2.down_proj.weight (64, 16) (model: (64, 32))" in result.stderr
    assert daemon["client"].get("/get_weight_version") == {"weight_version": "1"}
    _job_equals(daemon, "b_again", daemon["ckpts"]["b"], "1")


def test_release_resume_then_tensor_update_on_every_rank(daemon):
    client = daemon["client"]
    released = client.post("/release_memory_occupation", {})
    assert set(released["released"]) == {"weights", "kv_cache", "cuda_graph"}
    assert client.get("/get_server_info")["state"] == "released"
    resumed = client.post("/resume_memory_occupation", {})
    assert resumed["weights_stale"]  # no --weights-cpu-backup: every rank's weights must be loaded again
    refused = _cli("run", "--engine", daemon["sock"], "--data", daemon["data"], "--out", daemon["work"] / "stale",
                   "--quiet")
    assert refused.returncode != 0 and "load weights first" in refused.stderr
    # shared-memory handles: rank 0 and rank 1 each open them and copy their slices
    answer = client.update_weights_from_tensor(checkpoint_tensors(daemon["ckpts"]["a"]))
    assert answer["weight_version"] == "2"
    _job_equals(daemon, "a_tensors", daemon["ckpts"]["a"], "2")


def test_update_from_a_broadcast_reaches_every_rank(daemon):
    client = daemon["client"]
    port = free_port()
    with pytest.raises(RolloutError, match="world_size 2 leaves no room for the engine's 2 tensor-parallel ranks"):
        client.init_weights_update_group("127.0.0.1", port, 1, 2, "weights", "gloo", 60)
    with ThreadPoolExecutor(1) as pool:  # the trainer is rank 0 of 3; the engine's ranks join as 1 and 2
        joined = pool.submit(client.init_weights_update_group, "127.0.0.1", port, 1, 3, "weights", "gloo", 120)
        group = open_weight_group("127.0.0.1", port, 0, 3, "weights", "gloo", torch.device("cpu"), timeout_seconds=120)
        assert joined.result(timeout=120)["success"]
        named = broadcast_order(daemon["ckpts"]["c"])
        answer = pool.submit(client.update_weights_from_distributed, **broadcast_metadata(named),
                             group_name="weights", weight_version="7")
        broadcast_tensors(group, [t for _, t in named])
        assert answer.result(timeout=120)["weight_version"] == "7"
    _job_equals(daemon, "c", daemon["ckpts"]["c"], "7")
    assert client.destroy_weights_update_group("weights")["success"]
    group.close()


def test_shutdown_stops_every_rank(daemon):
    result = _cli("shutdown", "--engine", daemon["sock"])
    assert result.returncode == 0, result.stderr
    assert daemon["proc"].wait(60) == 0, daemon["log"].read_text()
    assert not daemon["sock"].exists()
    assert "Traceback" not in daemon["log"].read_text()


def test_sigterm_to_the_launcher_stops_every_rank(tiny_moe_checkpoints, tmp_path):
    """torch.distributed.run passes SIGTERM on to the ranks; rank 0 shuts the daemon down and releases rank 1
    (which leaves signals to rank 0), and the command exits 0 as a one-process daemon does."""
    sock, log = tmp_path / "engine.sock", tmp_path / "serve.log"
    proc = subprocess.Popen(CLI + ["serve", "--model", tiny_moe_checkpoints["qwen3_moe"], "--tp", "2", "--device", "cpu",
                                   "--max-model-len", "64", "--kv-cache-tokens", "512", "--socket", str(sock)],
                            stdout=subprocess.DEVNULL, stderr=log.open("w"), cwd=REPO, env=_env())
    try:
        deadline = time.monotonic() + 120
        while "ready:" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        proc.terminate()
        assert proc.wait(90) == 0, log.read_text()
        assert not sock.exists()
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("tp, message", [
    ("3", "error: --tp 3 must divide the 4 attention heads; choose a divisor"),
    ("0", "error: --tp must be >= 1"),
])
def test_bad_serve_tp_is_one_line(tiny_moe_checkpoints, tmp_path, tp, message):
    result = _cli("serve", "--model", tiny_moe_checkpoints["qwen3_moe"], "--device", "cpu", "--tp", tp,
                  "--socket", tmp_path / "engine.sock")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [message]
    assert not (tmp_path / "engine.sock").exists()
