"""Weights holding NaN or inf are refused where they load (models/finite.py): a checkpoint at start in one
line, and a reload or a tensor update with the engine keeping its version and its outputs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rollout_cli import Engine, SamplingParams
from rollout_cli.errors import RolloutError
from rollout_cli.models.finite import nonfinite_names

REPO = Path(__file__).resolve().parents[2]
PARAMS = SamplingParams(temperature=0.0, max_new_tokens=4)


def _poisoned(src: str, dst: Path, value: float) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name].clone()
    tensors[name][3, 5] = value
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_nonfinite_names_finds_nan_and_inf_only():
    pairs = [("ok", torch.ones(4)), ("nan", torch.tensor([1.0, float("nan")])), ("inf", torch.tensor([float("inf")])),
             ("ints", torch.tensor([1, 2])), ("bf16", torch.tensor([float("-inf")], dtype=torch.bfloat16)),
             ("empty", torch.zeros(0))]
    assert nonfinite_names(pairs) == ["nan", "inf", "bf16"]


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_checkpoint_with_nan_is_one_line(tiny_checkpoints, tmp_path, value):
    model = _poisoned(tiny_checkpoints["qwen3"], tmp_path / "bad", value)
    result = subprocess.run([sys.executable, "-m", "rollout_cli.cli.main", "run", "--model", str(model), "--data",
                             str(REPO / "recipes" / "prompts.parquet"), "--out", str(tmp_path / "out"), "--limit", "1",
                             "--device", "cpu", "--quiet"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "1 tensor hold NaN or inf (model.layers.1.mlp.down_proj.weight)" in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_a_reload_or_update_with_nan_keeps_the_weights(tiny_checkpoints, tmp_path):
    model = tiny_checkpoints["qwen3"]
    engine = Engine(model, device="cpu", max_model_len=64)
    before = engine.generate([[5, 9, 17]], PARAMS)[0].response_logprobs
    bad = _poisoned(model, tmp_path / "bad", float("nan"))
    with pytest.raises(RolloutError, match=r"refused: 1 tensor hold NaN or inf \(model.layers.1.mlp.down_proj.weight\); "
                                           r"the engine keeps weight version 0"):
        engine.reload_weights(str(bad))
    with pytest.raises(RolloutError, match="hold NaN or inf"):
        engine.update_weights_from_tensor(load_file(bad / "model.safetensors"))
    assert engine.weight_version == "0"
    # the same weights (the prompt now comes from the prefix cache: float32's last bits may move)
    assert engine.generate([[5, 9, 17]], PARAMS)[0].response_logprobs == pytest.approx(before, abs=1e-5)
