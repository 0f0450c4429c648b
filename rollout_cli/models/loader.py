"""Stream safetensors checkpoints into a model's own parameters.

Loading is two passes: `plan_checkpoint` reads only the safetensors headers
and checks every name and shape against the model, so a bad checkpoint is
refused before any live weight changes; `load_checkpoint` then copies each
tensor into its parameter through that parameter's `weight_loader`.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open

from rollout_cli.errors import RolloutError

# Tensors some checkpoints carry that the model recomputes itself.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt")


@dataclass(frozen=True)
class TensorTarget:
    checkpoint_name: str
    file: str
    param_name: str
    shard_id: object  # None for unfused parameters


def safetensors_files(model_dir: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if files:
        return files
    pickles = [p for pattern in PICKLE_PATTERNS for p in glob.glob(os.path.join(model_dir, pattern))]
    if pickles:
        raise RolloutError(
            f"{model_dir} holds only pickle weights ({os.path.basename(pickles[0])}), which can run code when loaded; "
            "convert them to safetensors (model.save_pretrained(dir, safe_serialization=True))"
        )
    raise RolloutError(f"no *.safetensors weights in {model_dir}; pass a HuggingFace checkpoint directory")


def _param_target(model, name: str) -> tuple[str, object]:
    for part, (fused, shard_id) in model.packed_modules_mapping.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard_id
    return name, None


def expected_checkpoint_names(model) -> set[str]:
    """Every checkpoint tensor name the model needs, fused parameters expanded."""
    inverse: dict[str, list[str]] = {}
    for part, (fused, _) in model.packed_modules_mapping.items():
        inverse.setdefault(fused, []).append(part)
    names = set()
    for param_name, _ in model.named_parameters():
        for fused, parts in inverse.items():
            if f".{fused}." in param_name:
                names.update(param_name.replace(f".{fused}.", f".{p}.") for p in parts)
                break
        else:
            names.add(param_name)
    return names


def plan_checkpoint(model, model_dir: str) -> list[TensorTarget]:
    """Check names and shapes of every tensor in the checkpoint; touch no weights."""
    params = dict(model.named_parameters())
    expected = expected_checkpoint_names(model)
    tied = getattr(model, "tie_word_embeddings", False)
    targets, unexpected, bad_shapes = [], [], []
    for path in safetensors_files(model_dir):
        try:
            handle = safe_open(path, framework="pt", device="cpu")
        except Exception as err:  # safetensors raises its own error types
            raise RolloutError(f"cannot read {path}: {err}; the file is not valid safetensors") from err
        with handle:
            for name in handle.keys():
                if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                    continue
                param_name, shard_id = _param_target(model, name)
                if param_name not in params or name not in expected:
                    unexpected.append(name)
                    continue
                shape = tuple(handle.get_slice(name).get_shape())
                want = model_shard_shape(params[param_name], shard_id)
                if shape != want:
                    bad_shapes.append(f"{name} {shape} (model: {want})")
                targets.append(TensorTarget(name, path, param_name, shard_id))
    found = {t.checkpoint_name for t in targets}
    missing = sorted(expected - found)
    problems = []
    if missing:
        problems.append(f"missing tensors: {_short_list(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_short_list(sorted(unexpected))}")
    if bad_shapes:
        problems.append(f"wrong shapes: {_short_list(bad_shapes)}")
    duplicates = len(targets) - len(found)
    if duplicates:
        problems.append(f"{duplicates} tensors appear in more than one file")
    if problems:
        raise RolloutError(
            f"checkpoint {model_dir} does not match the model ({'; '.join(problems)}); "
            "check that config.json belongs to these weights"
        )
    return targets


def model_shard_shape(param, shard_id) -> tuple[int, ...]:
    """Shape of the checkpoint tensor that fills `shard_id` of `param`."""
    if shard_id is None:
        return tuple(param.shape)
    _, size = param.shard_offsets[shard_id]
    return (size,) + tuple(param.shape[1:])


def load_checkpoint(model, model_dir: str) -> None:
    """Validate the whole checkpoint, then copy each tensor into its parameter."""
    targets = plan_checkpoint(model, model_dir)
    params = dict(model.named_parameters())
    by_file: dict[str, list[TensorTarget]] = {}
    for target in targets:
        by_file.setdefault(target.file, []).append(target)
    with torch.no_grad():
        for path, file_targets in by_file.items():
            with safe_open(path, framework="pt", device="cpu") as handle:
                for target in file_targets:
                    tensor = handle.get_tensor(target.checkpoint_name)
                    param = params[target.param_name]
                    param.weight_loader(param, tensor.to(param.dtype), target.shard_id)


def init_dummy_weights(model, seed: int = 0) -> None:
    """Random weights from config.json alone (benchmarks): norms at 1, the rest N(0, 0.02)."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name.rsplit(".", 2)[-2]:
                param.fill_(1.0)
                continue
            if param.device not in generators:  # generate on the parameter's device: fast on GPU
                generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            param.normal_(0.0, 0.02, generator=generators[param.device])


def _short_list(items: list[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")
