"""Stacked MoE experts stored transposed (the hub's Qwen3-VL-MoE: gate_up_proj [E, H, 2I], down_proj [E, I, H])
load like transformers' own layout ([E, 2I, H], [E, H, I]), on one rank and on a tensor-parallel rank; a
square stack (H == 2I) reads as transformers' layout, as HF's Transpose(check_dims=True) reads it."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from rollout_cli.models import tensor_parallel
from rollout_cli.models.loader import (TRANSPOSED, TensorHeader, copy_into_parameters, plan_tensors,
                                       read_checkpoint_tensors)
from rollout_cli.models.moe import FusedExperts
from rollout_cli.models.tensor_parallel import TensorParallelGroup

E = 3


class _Block(nn.Module):
    packed_modules_mapping: dict = {}

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.experts = FusedExperts(E, hidden, intermediate)


def _stacks(hidden: int, intermediate: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"experts.gate_up_proj": torch.randn(E, 2 * intermediate, hidden, generator=g),  # [E, 2I, H]
            "experts.down_proj": torch.randn(E, hidden, intermediate, generator=g)}  # [E, H, I]


def _transposed(tensors: dict) -> dict:
    return {name: t.transpose(1, 2).contiguous() for name, t in tensors.items()}


def _load(block: nn.Module, tensors: dict) -> dict:
    """Plan the tensors against the block, copy them in; -> {name: shard id}."""
    headers = [TensorHeader(name, tuple(t.shape), "F32") for name, t in tensors.items()]
    targets, problems, _ = plan_tensors(block, headers)
    assert problems == []
    params = dict(block.named_parameters())
    for target in targets:
        copy_into_parameters(params, target, tensors[target.checkpoint_name])
    return {t.checkpoint_name: t.shard_id for t in targets}


def test_both_layouts_fill_the_same_weights():
    tensors = _stacks(hidden=10, intermediate=4)
    plain, hub = _Block(10, 4), _Block(10, 4)
    assert set(_load(plain, tensors).values()) == {None}
    assert set(_load(hub, _transposed(tensors)).values()) == {TRANSPOSED}
    assert torch.equal(hub.experts.w13, tensors["experts.gate_up_proj"])
    assert torch.equal(hub.experts.w2, tensors["experts.down_proj"])
    hidden = torch.randn(5, 10)
    weights, ids = torch.full((5, 2), 0.5), torch.tensor([[0, 1], [2, 0], [1, 2], [0, 2], [1, 0]])
    assert torch.equal(plain.experts(hidden, weights, ids), hub.experts(hidden, weights, ids))


def test_a_square_stack_reads_as_transformers_layout_and_other_shapes_are_refused():
    tensors = _stacks(hidden=8, intermediate=4)  # gate_up [E, 8, 8] fits both ways; down [E, 8, 4] does not
    block = _Block(8, 4)
    hub = _transposed(tensors)
    shard_ids = _load(block, hub)
    assert shard_ids == {"experts.gate_up_proj": None, "experts.down_proj": TRANSPOSED}
    assert torch.equal(block.experts.w13, hub["experts.gate_up_proj"])  # taken as it is, not transposed
    assert torch.equal(block.experts.w2, tensors["experts.down_proj"])
    wrong = [TensorHeader("experts.gate_up_proj", (E, 8, 7), "F32"), TensorHeader("experts.down_proj", (E, 4, 8), "F32")]
    _, problems, _ = plan_tensors(block, wrong)
    assert problems == ["wrong shapes: experts.gate_up_proj (3, 8, 7) (model: (3, 8, 8))"]


def test_a_tensor_parallel_rank_holds_its_slices_of_a_transposed_stack(monkeypatch, tmp_path):
    """Expert width 8 over 2 ranks, hidden 4: rank 1 holds rows 4..7 of gate and of up, and columns 4..7 of
    down; its w2 [E, 4, 4] is square, so only the planned shard id (not the shape) can say the incoming
    slice is transposed."""
    monkeypatch.setattr(tensor_parallel, "_GROUP", TensorParallelGroup(1, 2, None, None))
    tensors = _stacks(hidden=4, intermediate=8)
    gate_up, down = tensors["experts.gate_up_proj"], tensors["experts.down_proj"]
    want_w13 = torch.cat([gate_up[:, 4:8], gate_up[:, 12:16]], dim=1)  # [E, 2 * 4, H]
    want_w2 = down[:, :, 4:8]  # [E, H, 4]
    hub = _transposed(tensors)
    in_memory = _Block(4, 8)
    _load(in_memory, hub)  # whole tensors handed over: cut to the rank's slices, then transposed
    assert torch.equal(in_memory.experts.w13, want_w13) and torch.equal(in_memory.experts.w2, want_w2)
    save_file(hub, str(tmp_path / "model.safetensors"))
    from_disk = _Block(4, 8)
    headers = [TensorHeader(n, tuple(t.shape), "F32", str(tmp_path / "model.safetensors")) for n, t in hub.items()]
    targets, problems, _ = plan_tensors(from_disk, headers)
    assert problems == []
    slices = {t.checkpoint_name: (t.shard_id, t.tp_slice, t.tp_blocks) for t in targets}
    assert slices == {"experts.gate_up_proj": (TRANSPOSED, (2, 4, 4), 2), "experts.down_proj": (TRANSPOSED, (1, 4, 4), 1)}
    params = dict(from_disk.named_parameters())
    read = dict((t.checkpoint_name, x) for t, x in read_checkpoint_tensors(targets))  # only the rank's slices
    assert (read["experts.gate_up_proj"].shape, read["experts.down_proj"].shape) == ((E, 4, 8), (E, 4, 4))
    for target in targets:
        copy_into_parameters(params, target, read[target.checkpoint_name])
    assert torch.equal(from_disk.experts.w13, want_w13) and torch.equal(from_disk.experts.w2, want_w2)


@pytest.mark.parametrize("layout", ["plain", "hub"])
def test_weight_loader_places_a_transposed_stack_by_shard_id(layout):
    """training.state_dict_hf reads weights back through the loader with the checkpoint's own shapes."""
    tensors = _stacks(hidden=10, intermediate=4)
    block = _Block(10, 4)
    source = tensors if layout == "plain" else _transposed(tensors)
    shard_ids = _load(block, source)
    w13 = block.experts.w13
    where = torch.full(w13.shape, -1, dtype=torch.int64)
    shape = source["experts.gate_up_proj"].shape
    w13.weight_loader(where, torch.arange(w13.numel()).reshape(shape), shard_ids["experts.gate_up_proj"])
    flat = torch.empty(w13.numel())
    flat[where.reshape(-1)] = w13.detach().reshape(-1)
    assert torch.equal(flat.reshape(shape), source["experts.gate_up_proj"])
