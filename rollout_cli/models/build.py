"""Read a checkpoint directory and build its model on a device, weights loaded."""

from __future__ import annotations

import json
import os

import torch

from rollout_cli.errors import RolloutError
from rollout_cli.models.loader import init_dummy_weights, load_checkpoint, safetensors_files
from rollout_cli.models.registry import model_class_for

DTYPE_BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model_config(model_dir: str):
    """The transformers config of a checkpoint directory, with one-line errors."""
    from transformers import AutoConfig

    if not os.path.isdir(model_dir):
        raise RolloutError(f"model directory {model_dir} does not exist; pass --model DIR with a HuggingFace checkpoint")
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise RolloutError(f"{model_dir} has no config.json; pass a HuggingFace checkpoint directory")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise RolloutError(f"cannot parse {path}: {err}") from err
    architectures = raw.get("architectures") or []
    model_class_for(type("RawConfig", (), {"architectures": architectures}))  # fail early, one line
    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except Exception as err:  # transformers raises many types for bad configs
        raise RolloutError(f"cannot load {path}: {str(err).splitlines()[0]}") from err
    return _language_model_config(config, architectures)


def _language_model_config(config, architectures: list[str]):
    """A vision-language checkpoint's text_config, named by the checkpoint's architecture (the registry
    maps it to the language model that reads model.language_model.*); other configs unchanged."""
    from rollout_cli.models.registry import MULTIMODAL_ARCHITECTURES

    name = next((a for a in architectures if a in MULTIMODAL_ARCHITECTURES), None)
    if name is None:
        return config
    text = config.text_config
    text.architectures = [name]
    # tying is decided by the outer config (the text config's own flag may say otherwise)
    text.tie_word_embeddings = getattr(config, "tie_word_embeddings", text.tie_word_embeddings)
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if getattr(text, key, None) is None and getattr(config, key, None) is not None:
            setattr(text, key, getattr(config, key))
    return text


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RolloutError("--device cuda was asked for but torch sees no CUDA GPU; use --device cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPE_BY_NAME[name]


def build_model(model_dir: str, hf_config, device: torch.device, dtype: torch.dtype, max_positions: int,
                load_format: str = "auto"):
    """Construct the model directly on `device` in `dtype`, then fill its weights."""
    cls = model_class_for(hf_config)
    if load_format != "dummy":
        safetensors_files(model_dir)  # refuse pickle-only or empty dirs before allocating anything
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(hf_config, max_positions)
    finally:
        torch.set_default_dtype(previous)
    if load_format == "dummy":
        init_dummy_weights(model)
    else:
        load_checkpoint(model, model_dir)
    return model.eval()
