"""Tensor-parallel loading without processes: a rank's model holds exactly its slices of the checkpoint.

The tensor-parallel group is faked (rank r of N, no collectives): building and loading a model
only asks tp_rank() / tp_size(); forwards run in tests/e2e/test_cli_tensor_parallel.py.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from rollout_cli.errors import RolloutError
from rollout_cli.models import tensor_parallel
from rollout_cli.models.build import build_model, load_model_config
from rollout_cli.models.loader import copy_into_parameters, plan_checkpoint, read_checkpoint_tensors
from rollout_cli.models.tensor_parallel import HeadSplit, TensorParallelGroup
from rollout_cli.models.tensor_parallel_support import check_tensor_parallel


def _checkpoint(model_dir: str) -> dict[str, torch.Tensor]:
    with safe_open(f"{model_dir}/model.safetensors", framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def _rank_model(model_dir: str, rank: int, size: int, monkeypatch):
    monkeypatch.setattr(tensor_parallel, "_GROUP", TensorParallelGroup(rank, size, None, None))
    config = load_model_config(model_dir)
    return build_model(model_dir, config, torch.device("cpu"), torch.float32, 64)


def _expected_slices(full: dict, layer: int, kv_heads_of_rank: list[int], rank: int, size: int, d: int):
    """The rows / columns of layer `layer` that rank `rank` must hold, cut from the full checkpoint."""
    p = f"model.layers.{layer}."
    q = full[p + "self_attn.q_proj.weight"]  # [heads * d, hidden]
    heads = q.shape[0] // d // size
    qs = q[rank * heads * d:(rank + 1) * heads * d]
    kv_rows = torch.cat([torch.arange(h * d, (h + 1) * d) for h in kv_heads_of_rank])
    k, v = full[p + "self_attn.k_proj.weight"][kv_rows], full[p + "self_attn.v_proj.weight"][kv_rows]
    o = full[p + "self_attn.o_proj.weight"]  # [hidden, heads * d]: the rank's input columns
    inter = full[p + "mlp.gate_proj.weight"].shape[0] // size
    rows = slice(rank * inter, (rank + 1) * inter)
    return {
        "self_attn.qkv_proj.weight": torch.cat([qs, k, v]),
        "self_attn.o_proj.weight": o[:, rank * heads * d:(rank + 1) * heads * d],
        "mlp.gate_up_proj.weight": torch.cat([full[p + "mlp.gate_proj.weight"][rows],
                                              full[p + "mlp.up_proj.weight"][rows]]),
        "mlp.down_proj.weight": full[p + "mlp.down_proj.weight"][:, rows],
        "self_attn.q_norm.weight": full[p + "self_attn.q_norm.weight"],  # per head_dim: replicated
    }


@pytest.mark.parametrize("size, kv_heads, kv_of_rank", [
    (2, 2, [[0], [1]]),  # 4 q heads, 2 kv heads: split, one each
    (4, 2, [[0], [0], [1], [1]]),  # tp > kv heads: replicated, each rank the kv head of its q head
    (2, 1, [[0], [0]]),  # MQA: both ranks hold the one kv head
])
def test_rank_holds_its_slices(tiny_checkpoints, tmp_path, monkeypatch, size, kv_heads, kv_of_rank):
    model_dir = tiny_checkpoints["qwen3"]
    if kv_heads != 2:  # the same checkpoint with fewer kv heads: keep the first head's k/v rows
        model_dir = str(shutil.copytree(model_dir, tmp_path / "mqa"))
        tensors = load_file(f"{model_dir}/model.safetensors")
        for name in [n for n in tensors if ".k_proj." in n or ".v_proj." in n]:
            tensors[name] = tensors[name][:32].clone()  # head_dim 32
        save_file(tensors, f"{model_dir}/model.safetensors")
        config = (tmp_path / "mqa" / "config.json")
        config.write_text(config.read_text().replace('"num_key_value_heads": 2', '"num_key_value_heads": 1'))
    full = _checkpoint(model_dir)
    for rank in range(size):
        model = _rank_model(model_dir, rank, size, monkeypatch)
        params = dict(model.named_parameters())
        for layer in range(2):
            want = _expected_slices(full, layer, kv_of_rank[rank], rank, size, d=32)
            for name, tensor in want.items():
                got = params[f"model.layers.{layer}.{name}"]
                assert got.shape == tensor.shape, (rank, name)
                assert torch.equal(got, tensor), (rank, layer, name)
        rows = 384 // size  # tied embedding / head: the rank's rows of the vocabulary
        assert torch.equal(params["model.embed_tokens.weight"],
                           full["model.embed_tokens.weight"][rank * rows:(rank + 1) * rows])


def uneven_vocab_copy(src: str, dst, vocab: int) -> str:
    """The checkpoint with its vocabulary cut to `vocab` rows (embedding and untied head)."""
    model_dir = str(shutil.copytree(src, dst))
    tensors = load_file(f"{model_dir}/model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in tensors:
            tensors[name] = tensors[name][:vocab].clone()
    save_file(tensors, f"{model_dir}/model.safetensors")
    config = dst / "config.json"
    text = config.read_text()
    old = f'"vocab_size": {load_model_config(src).vocab_size}'
    assert old in text
    config.write_text(text.replace(old, f'"vocab_size": {vocab}'))
    return model_dir


def test_uneven_vocabulary_is_padded_on_the_last_rank(tiny_checkpoints, tmp_path, monkeypatch):
    model_dir = uneven_vocab_copy(tiny_checkpoints["llama3_scaled"], tmp_path / "v318", 318)  # untied head
    full = _checkpoint(model_dir)
    rows = 80  # ceil(318 / 4)
    for rank in range(4):
        params = dict(_rank_model(model_dir, rank, 4, monkeypatch).named_parameters())
        real = min(rows, 318 - rank * rows)  # 78 on the last rank
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            got = params[name]
            assert got.shape == (rows, 64), name
            assert torch.equal(got[:real], full[name][rank * rows:rank * rows + real]), (rank, name)
            assert not got[real:].any(), (rank, name)  # padding rows: never looked up, cut from the logits


def test_disk_reads_only_the_slice_and_in_memory_tensors_are_cut(tiny_checkpoints, monkeypatch):
    model_dir = tiny_checkpoints["llama_bias"]  # biases: the qkv bias splits, o_proj's stays whole
    full = _checkpoint(model_dir)
    model = _rank_model(model_dir, 1, 2, monkeypatch)
    targets = {t.checkpoint_name: t for t in plan_checkpoint(model, model_dir)}
    down = targets["model.layers.0.mlp.down_proj.weight"]
    assert down.tp_slice == (1, 64, 64)  # intermediate 128 over 2 ranks: columns 64..127
    assert targets["model.layers.0.self_attn.o_proj.bias"].tp_slice is None
    read = dict((t.checkpoint_name, x) for t, x in read_checkpoint_tensors(list(targets.values())))
    assert read["model.layers.0.mlp.down_proj.weight"].shape == (64, 64)  # not the full [64, 128]
    k_bias = read["model.layers.0.self_attn.k_proj.bias"]  # kv head 1 of 2, head_dim 16
    assert torch.equal(k_bias, full["model.layers.0.self_attn.k_proj.bias"][16:32])
    # a whole tensor handed over in memory (a trainer's update) is cut to the rank's slice
    params = dict(model.named_parameters())
    new = torch.randn_like(full["model.layers.0.mlp.down_proj.weight"])
    copy_into_parameters(params, down, new)
    assert torch.equal(params["model.layers.0.mlp.down_proj.weight"], new[:, 64:])


def test_shapes_are_checked_against_the_full_checkpoint(tiny_checkpoints, tmp_path, monkeypatch):
    src = tiny_checkpoints["qwen3"]
    broken = str(shutil.copytree(src, tmp_path / "half"))
    tensors = load_file(f"{broken}/model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name][:, :64].clone()  # a rank's slice saved as if it were the whole tensor
    save_file(tensors, f"{broken}/model.safetensors")
    model = _rank_model(src, 0, 2, monkeypatch)
    with pytest.raises(RolloutError, match=rf"wrong shapes: {name} \(64, 64\) \(model: \(64, 128\)\)"):
        plan_checkpoint(model, broken)


def test_splits_that_do_not_divide_are_refused(tiny_checkpoints, tiny_moe_checkpoints, tiny_hybrid_checkpoints):
    config = load_model_config(tiny_checkpoints["qwen3"])  # 4 heads, 2 kv heads, intermediate 128
    with pytest.raises(RolloutError, match="--tp 3 must divide the 4 attention heads"):
        check_tensor_parallel(config, 3)
    moe = load_model_config(tiny_moe_checkpoints["qwen2_moe"])  # 4 heads; experts 32 wide, the shared one 48
    check_tensor_parallel(moe, 4)
    moe.shared_expert_intermediate_size = 50
    with pytest.raises(RolloutError, match="--tp 4 must divide the shared expert intermediate size 50"):
        check_tensor_parallel(moe, 4)
    moe.moe_intermediate_size = 30
    with pytest.raises(RolloutError, match="--tp 4 must divide the expert intermediate size 30"):
        check_tensor_parallel(moe, 4)
    hybrid = load_model_config(tiny_hybrid_checkpoints["qwen3_next"])  # linear heads: 2 key, 4 value
    check_tensor_parallel(hybrid, 2)
    hybrid.linear_num_value_heads = 6
    with pytest.raises(RolloutError, match="--tp 4 must divide the 2 linear-attention key heads"):
        check_tensor_parallel(hybrid, 4)
    hybrid.linear_num_key_heads = 4
    with pytest.raises(RolloutError, match="--tp 4 must divide the 6 linear-attention value heads"):
        check_tensor_parallel(hybrid, 4)
    with pytest.raises(RolloutError, match="multiple of the 3 kv heads"):
        HeadSplit.of(12, 3, 4, 0)
    assert HeadSplit.of(8, 2, 8, 5) == HeadSplit(1, 1, 5, 1)  # q head 5 uses kv head 5 // 4 = 1


def _fused_experts_copy(src: str, dst, experts: int, prefix: str = "mlp.experts") -> str:
    """The checkpoint with every sparse layer's per-expert tensors fused as transformers holds them in
    memory: experts.gate_up_proj [E, 2I, H] (gate rows, then up rows) and experts.down_proj [E, H, I]."""
    model_dir = str(shutil.copytree(src, dst))
    tensors = load_file(f"{model_dir}/model.safetensors")
    layers = sorted({n.split(f".{prefix}.")[0] for n in tensors if f".{prefix}.0." in n})
    for layer in layers:
        p = f"{layer}.{prefix}."
        gate_up = [torch.cat([tensors.pop(f"{p}{e}.gate_proj.weight"), tensors.pop(f"{p}{e}.up_proj.weight")])
                   for e in range(experts)]
        tensors[p + "gate_up_proj"] = torch.stack(gate_up)
        tensors[p + "down_proj"] = torch.stack([tensors.pop(f"{p}{e}.down_proj.weight") for e in range(experts)])
    save_file(tensors, f"{model_dir}/model.safetensors")
    return model_dir


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_moe_rank_holds_its_expert_slices(tiny_moe_checkpoints, tmp_path, monkeypatch, layout):
    src = tiny_moe_checkpoints["qwen2_moe"]  # 4 experts of width 32, a shared expert of width 48, 2 layers
    full = _checkpoint(src)
    model_dir = src if layout == "per_expert" else _fused_experts_copy(src, tmp_path / "fused", 4)
    for rank in range(2):
        params = dict(_rank_model(model_dir, rank, 2, monkeypatch).named_parameters())
        rows, shared_rows = slice(rank * 16, rank * 16 + 16), slice(rank * 24, rank * 24 + 24)
        for layer in range(2):
            p = f"model.layers.{layer}.mlp."
            w13 = torch.stack([torch.cat([full[f"{p}experts.{e}.gate_proj.weight"][rows],
                                          full[f"{p}experts.{e}.up_proj.weight"][rows]]) for e in range(4)])
            w2 = torch.stack([full[f"{p}experts.{e}.down_proj.weight"][:, rows] for e in range(4)])
            want = {
                "experts.w13": w13,  # [4, 2 * 16, 64]
                "experts.w2": w2,  # [4, 64, 16]
                "shared_expert.gate_up_proj.weight": torch.cat([full[p + "shared_expert.gate_proj.weight"][shared_rows],
                                                                full[p + "shared_expert.up_proj.weight"][shared_rows]]),
                "shared_expert.down_proj.weight": full[p + "shared_expert.down_proj.weight"][:, shared_rows],
                "gate.weight": full[p + "gate.weight"],  # the router: replicated
                "shared_expert_gate.weight": full[p + "shared_expert_gate.weight"],
            }
            for name, tensor in want.items():
                got = params[p + name]
                assert got.shape == tensor.shape, (rank, name)
                assert torch.equal(got, tensor), (rank, layer, name)


def test_fused_experts_read_two_blocks_and_in_memory_tensors_are_cut(tiny_moe_checkpoints, tmp_path, monkeypatch):
    fused_dir = _fused_experts_copy(tiny_moe_checkpoints["qwen3_moe"], tmp_path / "fused", 8)
    full = _checkpoint(fused_dir)
    model = _rank_model(fused_dir, 1, 2, monkeypatch)
    targets = {t.checkpoint_name: t for t in plan_checkpoint(model, fused_dir)}
    name = "model.layers.0.mlp.experts.gate_up_proj"  # [8, 64, 64]: gate rows 0..31, up rows 32..63
    assert (targets[name].tp_slice, targets[name].tp_blocks) == ((1, 16, 16), 2)
    read = dict((t.checkpoint_name, x) for t, x in read_checkpoint_tensors([targets[name]]))
    assert torch.equal(read[name], torch.cat([full[name][:, 16:32], full[name][:, 48:64]], dim=1))
    params = dict(model.named_parameters())
    new = torch.randn_like(full[name])  # a trainer's whole fused tensor: cut to this rank's two blocks
    copy_into_parameters(params, targets[name], new)
    assert torch.equal(params["model.layers.0.mlp.experts.w13"], torch.cat([new[:, 16:32], new[:, 48:64]], dim=1))
    down = "model.layers.2.mlp.experts.down_proj"
    copy_into_parameters(params, targets[down], full[down])
    assert torch.equal(params["model.layers.2.mlp.experts.w2"], full[down][:, :, 16:])
