"""The daemon's trainer-facing weight endpoints end to end on the CPU: this test process is the
trainer, `rollout serve` (a subprocess, tiny qwen3 checkpoint) is the engine.

In file order against one daemon: /update_weights_from_tensor with shared-memory handles (the
rows of the next job equal HF on the new weights, version bumped), a refused one, updates while a
job is held (409; a broadcast is received and dropped so the trainer is not left hanging), then
/init_weights_update_group + /update_weights_from_distributed over gloo, and
/destroy_weights_update_group.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rollout_cli.engine.weights.tensor_ipc import serialize_named_tensors
from rollout_cli.engine.weights.weight_group import broadcast_metadata, broadcast_tensors, open_weight_group
from rollout_cli.errors import RolloutError
from weight_trainers import broadcast_order, checkpoint_tensors, free_port, perturbed_checkpoint, wait_for_daemon

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 9, 17, 33, 2], [7, 7, 8], [100, 3, 250, 41]]
MAX_NEW = 8


@pytest.fixture(scope="module")
def setup(tiny_checkpoints, tmp_path_factory):
    work = tmp_path_factory.mktemp("weights_daemon")
    base = tiny_checkpoints["qwen3"]
    ckpts = {"base": base, "new": perturbed_checkpoint(base, work / "new", seed=1),
             "newer": perturbed_checkpoint(base, work / "newer", seed=2)}
    data = work / "prompts.parquet"
    pq.write_table(pa.table({"prompt": PROMPTS}), data)
    sock = work / "engine.sock"
    log = work / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "rollout_cli.cli.main", "serve", "--model", base, "--device", "cpu",
                             "--max-model-len", "512", "--kv-cache-tokens", "16384", "--socket", str(sock)],
                            stdout=subprocess.DEVNULL, stderr=log.open("w"), cwd=REPO)
    try:
        client = wait_for_daemon(proc, sock, log, timeout=90)
        yield dict(client=client, ckpts=ckpts, data=data, work=work)
        client.close()
    finally:
        proc.terminate()
        proc.wait(30)


def _greedy_job(setup, name: str) -> list[dict]:
    out = setup["work"] / f"out_{name}"
    body = {"data": str(setup["data"]), "out": str(out),
            "sampling_params": {"temperature": 0.0, "max_new_tokens": MAX_NEW}}
    events = list(setup["client"].stream("/generate", body))
    assert events[-1]["event"] == "done", events[-1]
    return pq.read_table(out / "trajectories").sort_by("prompt_index").to_pylist()


def _assert_rows_match_hf(hf_ref, model_dir: str, rows: list[dict], version: str) -> None:
    assert [r["prompt_token_ids"] for r in rows] == PROMPTS
    for row, prompt in zip(rows, PROMPTS):
        assert row["response_token_ids"] == hf_ref.greedy(model_dir, prompt, MAX_NEW)
        assert row["weight_version"] == version


def test_update_from_tensor_by_shared_memory_handles(setup, hf_ref):
    client = setup["client"]
    _assert_rows_match_hf(hf_ref, setup["ckpts"]["base"], _greedy_job(setup, "base"), "0")
    answer = client.update_weights_from_tensor(checkpoint_tensors(setup["ckpts"]["new"]))
    assert answer["success"] and answer["weight_version"] == "1" and answer["previous_weight_version"] == "0"
    assert client.get("/get_weight_version") == {"weight_version": "1"}
    _assert_rows_match_hf(hf_ref, setup["ckpts"]["new"], _greedy_job(setup, "new"), "1")


def test_refused_tensor_update_is_400_and_changes_nothing(setup, hf_ref):
    client = setup["client"]
    tensors = checkpoint_tensors(setup["ckpts"]["newer"])
    tensors.pop("model.norm.weight")
    response = client._http.post("/update_weights_from_tensor", json={
        "serialized_named_tensors": [serialize_named_tensors(tensors)]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert "missing tensors: model.norm.weight" in error and "keeps weight version 1" in error
    two = client._http.post("/update_weights_from_tensor", json={"serialized_named_tensors": ["a", "b"]})
    assert two.status_code == 400 and "one rank: send one" in two.json()["error"]
    _assert_rows_match_hf(hf_ref, setup["ckpts"]["new"], _greedy_job(setup, "after_bad"), "1")


def _join_group(client, port: int):
    """The trainer's side of init: its own join (TCPStore master) while the engine joins through the daemon."""
    with ThreadPoolExecutor(1) as pool:
        engine_side = pool.submit(client.init_weights_update_group, "127.0.0.1", port, 1, 2, "weights", "gloo", 120)
        group = open_weight_group("127.0.0.1", port, 0, 2, "weights", "gloo", torch.device("cpu"), timeout_seconds=120)
        assert engine_side.result(timeout=120)["success"]
    return group


def _broadcast(client, group, named, **extra):
    """POST /update_weights_from_distributed in a thread while broadcasting; the daemon's answer."""
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(client._http.post, "/update_weights_from_distributed",
                             json={**broadcast_metadata(named), "group_name": "weights", **extra})
        broadcast_tensors(group, [t for _, t in named])
        return answer.result(timeout=120)


def test_updates_while_a_job_is_held_are_409_and_a_broadcast_is_drained(setup):
    client, http = setup["client"], setup["client"]._http
    group = _join_group(client, free_port())
    setup["group"] = group
    body = {"data": str(setup["data"]), "out": str(setup["work"] / "held"),
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 3000}}
    paused = threading.Event()

    def job():
        for event in client.stream("/generate", body):
            if not paused.is_set() and event["event"] == "progress":
                http.post("/pause_generation", json={"mode": "wait"})
                paused.set()

    thread = threading.Thread(target=job)
    thread.start()
    try:
        assert paused.wait(60)
        refused = http.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": [serialize_named_tensors(checkpoint_tensors(setup["ckpts"]["newer"]))]})
        assert refused.status_code == 409 and "a job is running" in refused.json()["error"]
        drained = _broadcast(client, group, broadcast_order(setup["ckpts"]["newer"]))
        assert drained.status_code == 409 and "received and dropped" in drained.json()["error"]
    finally:
        http.post("/abort_request")
        thread.join(60)
        http.post("/continue_generation")
    assert client.get("/get_weight_version") == {"weight_version": "1"}


def test_update_from_distributed_through_the_daemon(setup, hf_ref):
    client, group = setup["client"], setup["group"]  # the group stayed in step after the drained broadcast
    wrong = broadcast_order(setup["ckpts"]["newer"])
    wrong[0] = (wrong[0][0], wrong[0][1].to(torch.float16))
    refused = _broadcast(client, group, wrong)
    assert refused.status_code == 400 and "wrong dtypes" in refused.json()["error"]
    answer = _broadcast(client, group, broadcast_order(setup["ckpts"]["newer"]), weight_version="7")
    assert answer.status_code == 200 and answer.json()["weight_version"] == "7"
    info = client.get("/get_server_info")
    assert info["weight_version"] == "7" and "weights" in info["weights_path"]
    _assert_rows_match_hf(hf_ref, setup["ckpts"]["newer"], _greedy_job(setup, "newer"), "7")
    assert client.destroy_weights_update_group("weights")["success"]
    group.close()
    with pytest.raises(RolloutError, match="no weight update group 'weights'"):
        client.destroy_weights_update_group("weights")
