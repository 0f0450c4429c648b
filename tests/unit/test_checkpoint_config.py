"""A checkpoint's config.json, generation_config.json and tokenizer files when they are broken: one
RolloutError line that names the file (and the key), never a traceback from transformers or torch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rollout_cli.engine.tokenizer import checkpoint_eos_token_ids, load_tokenizer
from rollout_cli.errors import RolloutError
from rollout_cli.models.build import load_model_config

MODEL = Path(__file__).resolve().parents[2] / "recipes" / "example_model"


@pytest.fixture
def model(tmp_path) -> Path:
    """A copy of the example model to break."""
    return Path(shutil.copytree(MODEL, tmp_path / "model"))


def _edit_config(model: Path, **changes) -> None:
    config = json.loads((model / "config.json").read_text())
    config.update(changes)
    (model / "config.json").write_text(json.dumps(config))


def _one_line_error(call, *words: str) -> str:
    with pytest.raises(RolloutError) as info:
        call()
    line = str(info.value)
    assert "\n" not in line, line
    for word in words:
        assert word in line, f"{word!r} missing from: {line}"
    return line


@pytest.mark.parametrize("text", ["[]", "null", '"Qwen3ForCausalLM"', "7"])
def test_config_that_is_no_json_object_is_one_line(model, text):
    (model / "config.json").write_text(text)
    _one_line_error(lambda: load_model_config(str(model)), "config.json must hold a JSON object", str(model))


@pytest.mark.parametrize("key,value", [
    ("hidden_size", -64), ("num_hidden_layers", 0), ("num_attention_heads", 0), ("vocab_size", -1),
    ("intermediate_size", 0), ("num_key_value_heads", -2), ("head_dim", 0),
    ("max_position_embeddings", 0), ("max_position_embeddings", -4096),  # 0 ran with a made-up 4096
])
def test_non_positive_sizes_are_refused_naming_the_key(model, key, value):
    _edit_config(model, **{key: value})
    if key == "num_hidden_layers":  # transformers checks layer_types against it first otherwise
        _edit_config(model, layer_types=[])
    _one_line_error(lambda: load_model_config(str(model)), "config.json", key, "positive integer")


@pytest.mark.parametrize("spelling", ["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("factor", [-2, 0, 0.5, "4"])
def test_rope_factor_below_one_is_refused_naming_the_field(model, caplog, spelling, factor):
    """transformers 5 reads the older rope_scaling into rope_parameters and only warns about the factor: the
    line names the key config.json holds, and transformers' warning is not printed before it."""
    config = json.loads((model / "config.json").read_text())
    config.pop("rope_parameters")
    config[spelling] = {"rope_type": "linear", "factor": factor, "rope_theta": 10000.0}
    (model / "config.json").write_text(json.dumps(config))
    _one_line_error(lambda: load_model_config(str(model)), "config.json", f"{spelling} factor is {factor!r}",
                    "rope_type linear", ">= 1")
    assert not [r for r in caplog.records if r.name.startswith("transformers")], caplog.text


@pytest.mark.parametrize("theta", [0, -10000.0])
def test_rope_theta_not_positive_is_refused(model, theta):
    _edit_config(model, rope_parameters={"rope_type": "default", "rope_theta": theta})
    _one_line_error(lambda: load_model_config(str(model)), "config.json", f"rope_theta is {theta!r}", "positive")


def test_transformers_warnings_still_print_for_a_config_that_loads(model, caplog):
    _edit_config(model, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0, "bogus": 1})
    assert load_model_config(str(model)).rope_parameters["factor"] == 2.0
    assert "bogus" in caplog.text


def test_architectures_as_a_string_is_refused_as_not_a_list(model):
    _edit_config(model, architectures="Qwen3ForCausalLM")
    line = _one_line_error(lambda: load_model_config(str(model)), "architectures", "must be a list")
    assert "Q, w, e" not in line


def test_the_example_config_still_loads(model):
    assert load_model_config(str(model)).hidden_size == 64


def test_garbage_generation_config_is_one_line_naming_it(model):
    (model / "generation_config.json").write_text("this is not json {")
    config = load_model_config(str(model))
    _one_line_error(lambda: checkpoint_eos_token_ids(str(model), config, None), "generation_config.json",
                    "cannot load")


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_corrupt_tokenizer_files_are_not_reported_as_missing(model, name):
    (model / name).write_text("not json")
    line = _one_line_error(lambda: load_tokenizer(str(model)), "cannot load the tokenizer", str(model))
    assert "no tokenizer files" not in line


def test_without_tokenizer_files_there_is_no_tokenizer(model):
    """Token-id prompts work without a tokenizer: its absence is None, not an error."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    assert load_tokenizer(str(model)) is None
    assert load_tokenizer(str(MODEL)) is not None
