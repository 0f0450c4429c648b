"""Helpers for the weight-update tests: perturbed checkpoints, and "trainer" processes (spawned)
that hand tensors to the engine by serialized handles or broadcast them over a gloo group."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def perturbed_checkpoint(src: str, dst: Path, seed: int) -> str:
    """A copy of `src` (same config, same shapes) whose every tensor got N(0, 0.2) noise."""
    shutil.copytree(src, dst)
    gen = torch.Generator().manual_seed(seed)
    tensors = {k: v + 0.2 * torch.randn(v.shape, generator=gen, dtype=v.dtype)
               for k, v in load_file(os.path.join(src, "model.safetensors")).items()}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def checkpoint_tensors(model_dir: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(model_dir, "model.safetensors"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_daemon(proc, sock, log: Path, timeout: float = 120.0):
    """An EngineClient on `sock` once the `rollout serve` process `proc` (stderr in `log`) answers /health."""
    from rollout_cli.errors import RolloutError
    from rollout_cli.server.client import EngineClient

    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        try:
            client = EngineClient(str(sock))
            client.get("/health")
            return client
        except RolloutError:
            time.sleep(0.1)


def broadcast_order(model_dir: str, truncate: str | None = None) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors in name order; `truncate` names one whose first row is cut off (a wrong shape)."""
    tensors = checkpoint_tensors(model_dir)
    return [(n, tensors[n][1:].contiguous() if n == truncate else tensors[n]) for n in sorted(tensors)]


def wait_exit(process, timeout: float = 60.0) -> int | None:
    """The exit code, polled. Not Process.join(timeout): that waits for the sentinel pipe, which a
    trainer's torch_shm_manager (forked with the pipe open) holds for a while after the trainer exited."""
    deadline = time.monotonic() + timeout
    while process.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return process.exitcode


def wait_shm_gone(pid: int, timeout: float = 60.0) -> bool:
    """True once no /dev/shm segment of process `pid` is left (its torch_shm_manager unlinked them)."""
    deadline = time.monotonic() + timeout
    while glob.glob(f"/dev/shm/torch_{pid}_*") and time.monotonic() < deadline:
        time.sleep(0.1)
    return not glob.glob(f"/dev/shm/torch_{pid}_*")


# ---- spawned trainers (module-level so spawn can import them) ---------------------------------


def ipc_trainer(model_dir: str, device: str, flatten: bool, queue, done) -> None:
    """Serialize the checkpoint's tensors (on `device`) and wait until the engine says it is done with them."""
    from rollout_cli.engine.weights.tensor_bucket import flatten_tensors
    from rollout_cli.engine.weights.tensor_ipc import serialize_named_tensors

    tensors = {k: v.to(device) for k, v in checkpoint_tensors(model_dir).items()}
    queue.put(serialize_named_tensors(flatten_tensors(tensors) if flatten else tensors))
    done.wait(300)


def broadcast_trainer(port: int, steps: list[tuple[str, str | None, str]], backend: str = "gloo",
                      device: str = "cpu") -> None:
    """Rank 0 of a 2-rank group. Each step (model_dir, truncate, how) broadcasts broadcast_order(...):
    how = "all", or "half_then_exit" (a trainer that dies mid-transfer)."""
    from rollout_cli.engine.weights.weight_group import broadcast_tensors, open_weight_group

    group = open_weight_group("127.0.0.1", port, 0, 2, "weights", backend, torch.device(device), timeout_seconds=120)
    for model_dir, truncate, how in steps:
        tensors = [t.to(device) for _, t in broadcast_order(model_dir, truncate)]
        if how == "half_then_exit":
            broadcast_tensors(group, tensors[: len(tensors) // 2])
            os._exit(0)
        broadcast_tensors(group, tensors)
    group.close()
