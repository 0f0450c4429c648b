"""Safetensors loading: sharded checkpoints, and refusals that name the offending tensors."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rollout_cli import Engine, SamplingParams
from rollout_cli.errors import RolloutError
from rollout_cli.models.build import build_model, load_model_config
from rollout_cli.models.loader import plan_checkpoint

PROMPTS = [[5, 9, 17, 33, 2], [7, 7, 8]]


def _greedy(model_dir: str) -> list[list[int]]:
    engine = Engine(model_dir, device="cpu", max_model_len=64)
    return [r.response_token_ids for r in engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=6))]


def _copy_with_tensors(src: str, dst: Path, edit) -> str:
    """Copy a single-file checkpoint, letting `edit` change its tensor dict."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return str(dst)


def _model(model_dir: str):
    config = load_model_config(model_dir)
    return build_model(model_dir, config, torch.device("cpu"), torch.float32, 64, load_format="dummy")


def test_sharded_checkpoint_with_index_loads_like_one_file(tiny_checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    src = tiny_checkpoints["qwen2"]
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(sharded, max_shard_size="40KB")
    assert len(list(sharded.glob("*.safetensors"))) > 1 and (sharded / "model.safetensors.index.json").is_file()
    assert _greedy(str(sharded)) == _greedy(src)


def test_missing_tensor_is_named(tiny_checkpoints, tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    broken = _copy_with_tensors(tiny_checkpoints["qwen2"], tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(RolloutError, match=f"missing tensors: {name}"):
        plan_checkpoint(_model(broken), broken)


def test_unexpected_tensor_is_named(tiny_checkpoints, tmp_path):
    broken = _copy_with_tensors(tiny_checkpoints["qwen2"], tmp_path / "m",
                                lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(RolloutError, match="unexpected tensors: model.layers.0.extra.weight"):
        plan_checkpoint(_model(broken), broken)


def test_wrong_shape_is_named_and_nothing_is_copied(tiny_checkpoints, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"

    def shrink(tensors):
        tensors[name] = tensors[name][:-1].clone()

    broken = _copy_with_tensors(tiny_checkpoints["qwen2"], tmp_path / "m", shrink)
    model = _model(broken)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RolloutError, match=r"wrong shapes: model\.layers\.0\.mlp\.up_proj\.weight"):
        from rollout_cli.models.loader import load_checkpoint

        load_checkpoint(model, broken)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_integer_weight_is_refused_at_start_and_on_reload_alike(tiny_checkpoints, tmp_path):
    """An int32 tensor in a float layer was cast in silently at start while a reload refused it as a dtype
    change (and a reload of the start checkpoint accepted it): now both refuse, naming the tensor."""
    name = "model.layers.0.self_attn.q_proj.weight"

    def to_int(tensors):
        tensors[name] = tensors[name].round().to(torch.int32)

    broken = _copy_with_tensors(tiny_checkpoints["qwen2"], tmp_path / "m", to_int)
    reason = f"holds integer tensors for float weights ({name} I32)"
    with pytest.raises(RolloutError, match=rf"^checkpoint {broken} {re.escape(reason)}: a broken export"):
        Engine(broken, device="cpu", max_model_len=64)
    engine = Engine(tiny_checkpoints["qwen2"], device="cpu", max_model_len=64)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with pytest.raises(RolloutError, match=rf"^refused {broken}: checkpoint {broken} {re.escape(reason)}"):
        engine.reload_weights(broken)
    assert engine.weight_version == "0"
    assert all(torch.equal(before[k], v) for k, v in engine.model.state_dict().items())
