"""Weight updates on the GPU (skipped on the CPU): CUDA IPC from a trainer process on the same GPU,
and (with two GPUs) an NCCL broadcast from a trainer on the other one.

The reference is an engine loaded from the checkpoint the tensors came from, on the same device
and dtype: the updated weights must be bit-identical to it, and so its greedy tokens.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from rollout_cli import Engine, SamplingParams
from rollout_cli.engine.weights.weight_group import broadcast_metadata
from weight_trainers import (broadcast_order, broadcast_trainer, free_port, ipc_trainer,
                             perturbed_checkpoint, wait_exit)

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 9, 17, 33, 2], [7, 7, 8], [100, 3, 250, 41]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


@pytest.fixture(scope="module")
def ckpts(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_weights")
    base = tiny_checkpoints["qwen3"]
    return {"base": base, "new": perturbed_checkpoint(base, root / "new", seed=1),
            "newer": perturbed_checkpoint(base, root / "newer", seed=2)}


def _engine(model_dir: str, device: str = "cuda:0") -> Engine:
    return Engine(model_dir, device=device, dtype="float32", max_model_len=128, kv_cache_tokens=4096)


def _assert_same_weights_and_tokens(engine: Engine, model_dir: str) -> None:
    reference = _engine(model_dir, str(engine.device))
    ours = dict(engine.model.named_parameters())
    for name, param in reference.model.named_parameters():
        assert torch.equal(ours[name], param), name
    tokens = [r.response_token_ids for r in engine.generate(PROMPTS, GREEDY)]
    assert tokens == [r.response_token_ids for r in reference.generate(PROMPTS, GREEDY)]


def test_update_from_tensor_by_cuda_ipc(ckpts):
    """The trainer keeps its tensors on the GPU; only handles cross over (pairs, then one bucket)."""
    engine = _engine(ckpts["base"])
    ctx = multiprocessing.get_context("spawn")
    for step, (model_dir, flatten) in enumerate([(ckpts["new"], False), (ckpts["newer"], True)], start=1):
        queue, done = ctx.Queue(), ctx.Event()
        trainer = ctx.Process(target=ipc_trainer, args=(model_dir, "cuda:0", flatten, queue, done))
        trainer.start()
        try:
            payload = queue.get(timeout=180)
            assert len(payload) < 30_000  # handles, not data
            assert engine.update_weights_from_tensor(payload) == str(step)
        finally:
            done.set()
        assert wait_exit(trainer, 120) == 0
        _assert_same_weights_and_tokens(engine, model_dir)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_update_from_distributed_over_nccl(ckpts):
    engine = _engine(ckpts["base"], "cuda:0")
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    trainer = ctx.Process(target=broadcast_trainer, args=(port, [(ckpts["new"], None, "all")], "nccl", "cuda:1"))
    trainer.start()
    try:
        engine.init_weights_update_group("127.0.0.1", port, 1, 2, "weights", backend="nccl", timeout_seconds=120)
        assert engine.update_weights_from_distributed(**broadcast_metadata(broadcast_order(ckpts["new"])),
                                                      group_name="weights") == "1"
    finally:
        assert wait_exit(trainer, 120) == 0
    engine.destroy_weights_update_group("weights")
    _assert_same_weights_and_tokens(engine, ckpts["new"])
