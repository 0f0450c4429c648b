"""--max-model-len against the model's positions: refused past them, unless rope scaling stretches them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import transformers

from rollout_cli import Engine
from rollout_cli.errors import RolloutError
from rollout_cli.models.build import model_positions, resolve_max_model_len

MODEL = Path(__file__).resolve().parents[2] / "recipes" / "example_model"


def _qwen3(**kwargs):
    return transformers.Qwen3Config(max_position_embeddings=2048, **kwargs)


def test_default_is_max_position_embeddings_even_with_rope_scaling():
    assert resolve_max_model_len(_qwen3(), None) == 2048
    yarn = _qwen3(rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=2048))
    assert resolve_max_model_len(yarn, None) == 2048  # the stretched context is opted into


def test_past_the_positions_is_refused_with_the_fix():
    assert resolve_max_model_len(_qwen3(), 2048) == 2048
    with pytest.raises(RolloutError) as info:
        resolve_max_model_len(_qwen3(), 100000)
    msg = str(info.value)
    assert "--max-model-len 100000 exceeds the model's 2048 positions" in msg
    assert "max_position_embeddings" in msg and "lower it to at most 2048" in msg and "rope_scaling" in msg


@pytest.mark.parametrize("rope_type", ["yarn", "linear"])
def test_rope_scaling_with_a_factor_allows_the_stretched_length(rope_type):
    config = _qwen3(rope_scaling=dict(rope_type=rope_type, factor=4.0, original_max_position_embeddings=2048))
    assert model_positions(config)[0] == 8192
    assert resolve_max_model_len(config, 8192) == 8192
    with pytest.raises(RolloutError, match=rf"exceeds the 8192 positions the model's rope_scaling allows "
                                           rf"\(2048 x {rope_type} factor 4\); lower it to at most 8192"):
        resolve_max_model_len(config, 8193)


def test_llama3_scaling_already_counts_in_max_position_embeddings():
    config = transformers.LlamaConfig(max_position_embeddings=512, rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))
    assert model_positions(config) == (512, None)


def test_engine_refuses_before_loading_weights(tmp_path):
    with pytest.raises(RolloutError, match="exceeds the model's 2048 positions"):
        Engine(str(MODEL), device="cpu", max_model_len=100000)
    stretched = tmp_path / "yarn"
    shutil.copytree(MODEL, stretched)
    config = json.loads((stretched / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048}
    config.pop("rope_parameters", None)
    (stretched / "config.json").write_text(json.dumps(config))
    assert Engine(str(stretched), device="cpu", max_model_len=4096, kv_cache_tokens=4097).max_model_len == 4096
