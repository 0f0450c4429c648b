"""Read a checkpoint directory and build its model on a device, weights loaded."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os

import torch

from rollout_cli.errors import RolloutError
from rollout_cli.models.architectures import MULTIMODAL_ARCHITECTURES
from rollout_cli.models.finite import describe, nonfinite_names
from rollout_cli.models.fp8 import quantize_model
from rollout_cli.models.loader import load_checkpoint, safetensors_files
from rollout_cli.models.mtp import attach_mtp, check_mtp_checkpoint
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
    if not isinstance(raw, dict):
        held = "null" if raw is None else "an array" if isinstance(raw, list) else f"a {type(raw).__name__}"
        raise RolloutError(f"config.json must hold a JSON object, {path} holds {held}; "
                           "restore the checkpoint's config.json")
    architectures = _architectures(raw, path)
    model_class_for(type("RawConfig", (), {"architectures": architectures}))  # fail early, one line
    with _warnings_unless_refused():
        try:
            config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        except Exception as err:  # transformers raises many types for bad configs
            raise RolloutError(f"cannot load {path}: {str(err).splitlines()[0]}") from err
        config = _language_model_config(config, architectures)
        _check_sizes(config, path)
        _check_rope(config, _rope_field(raw), path)
    return config


class _Held(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _warnings_unless_refused():
    """Hold transformers' log lines while it reads config.json and print them only when the checks pass: a
    config refused here is one line, not transformers' warning about the same key and then ours."""
    logger = logging.getLogger("transformers")
    held = _Held()
    handlers, propagate = logger.handlers, logger.propagate
    logger.handlers, logger.propagate = [held], False
    try:
        yield
    finally:
        logger.handlers, logger.propagate = handlers, propagate
    for record in held.records:  # reached only when nothing was refused
        logger.handle(record)


def _architectures(raw: dict, path: str) -> list[str]:
    """config.json's architectures list; a bare string would be read as a list of its letters."""
    architectures = raw.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise RolloutError(f"{path}: architectures is {architectures!r}, it must be a list of class names such as "
                           '["Qwen3ForCausalLM"]; fix config.json')
    return architectures


# sizes the layers are allocated with: a non-positive one fails deep in torch (negative dimension) or
# builds empty layers that only fail when the weights do not fit
# (max_position_embeddings: 0 ran with a made-up 4096, a negative one failed in torch.arange)
_SIZE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
              "intermediate_size", "head_dim", "max_position_embeddings")


def _check_sizes(config, path: str) -> None:
    """Refuse a size in the (language model's) config that is not a positive integer, naming its key."""
    for key in _SIZE_KEYS:
        value = getattr(config, key, None)
        if value is None:  # not used by this architecture, or derived from the others
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise RolloutError(f"{path}: {key} is {value!r}, it must be a positive integer; fix config.json")


def _rope_field(raw: dict) -> str:
    """The name config.json gives rope scaling (transformers 5 reads `rope_scaling` into `rope_parameters`),
    for errors that name the key the user wrote."""
    for section in (raw, raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}):
        if section.get("rope_scaling") is not None:
            return "rope_scaling"
    return "rope_parameters"


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_rope(config, field: str, path: str) -> None:
    """Refuse a rope scaling factor below 1 or a rope_theta that is not positive: transformers only warns,
    and the rotary tables (and the positions --max-model-len allows) would be garbage."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return
    rope_type = params.get("rope_type", params.get("type", "default"))
    factor = params.get("factor")
    if rope_type != "default" and "factor" in params and not (_is_number(factor) and factor >= 1):
        raise RolloutError(f"{path}: {field} factor is {factor!r} (rope_type {rope_type}), it must be a number >= 1 "
                           "(how many times the original context is stretched); fix config.json")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is not None and not (_is_number(theta) and theta > 0):
        raise RolloutError(f"{path}: rope_theta is {theta!r}, it must be a positive number (the rotary base, "
                           "e.g. 10000 or 1000000); fix config.json")


def _language_model_config(config, architectures: list[str]):
    """A vision-language checkpoint's text_config, named by the checkpoint's architecture (the registry
    maps it to the model class), with the vision config and the image token id attached; other
    configs unchanged."""
    name = next((a for a in architectures if a in MULTIMODAL_ARCHITECTURES), None)
    if name is None:
        return config
    text = config.text_config
    text.architectures = [name]
    text.vision_config = config.vision_config
    for key in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
        setattr(text, key, getattr(config, key, None))
    # tying is decided by the outer config (the text config's own flag may say otherwise)
    text.tie_word_embeddings = getattr(config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False))
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if getattr(text, key, None) is None and getattr(config, key, None) is not None:
            setattr(text, key, getattr(config, key))
    return text


# rope types whose factor stretches the original context: vLLM's rule (max_position_embeddings of llama3
# and longrope configs already count the stretch); dynamic is refused when the model is built
_STRETCHING_ROPE_TYPES = ("linear", "yarn", "dynamic")


def model_positions(hf_config) -> tuple[int, str | None]:
    """(positions the model can take, how rope scaling stretches them or None), for --max-model-len."""
    base = getattr(hf_config, "max_position_embeddings", None) or 4096
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return base, None
    rope_type = params.get("rope_type", params.get("type", "default"))
    factor = params.get("factor")
    if rope_type in _STRETCHING_ROPE_TYPES and factor:
        original = params.get("original_max_position_embeddings") or base
        stretched = int(original * factor)
        if stretched > base:
            return stretched, f"{original} x {rope_type} factor {factor:g}"
    return base, None


def resolve_max_model_len(hf_config, requested: int | None) -> int:
    """--max-model-len, or max_position_embeddings when it is not given.

    Past the positions the model was trained for (or that its rope scaling stretches to) outputs
    are garbage without any error, so a longer --max-model-len is refused.
    """
    if requested is None:  # a stretched context is opted into: it costs rope tables and KV per request
        return getattr(hf_config, "max_position_embeddings", None) or 4096
    positions, stretch = model_positions(hf_config)
    if requested <= positions:
        return requested
    if stretch is not None:
        raise RolloutError(f"--max-model-len {requested} exceeds the {positions} positions the model's rope_scaling "
                           f"allows ({stretch}); lower it to at most {positions}")
    raise RolloutError(
        f"--max-model-len {requested} exceeds the model's {positions} positions (max_position_embeddings in "
        f"config.json, no rope_scaling); lower it to at most {positions}, or add rope_scaling (yarn or linear "
        "with a factor) to config.json where the model supports a longer context"
    )


def is_hybrid(config) -> bool:
    """The model has linear-attention (Gated DeltaNet) layers beside full attention."""
    return "linear_attention" in (getattr(config, "layer_types", None) or ())


def resolve_attention_backend(name: str, device: torch.device, deterministic: bool = False,
                              tensor_parallel_size: int = 1) -> str:
    """--attention-backend (auto, torch, triton) for this device, mode and --tp."""
    if deterministic and tensor_parallel_size > 1:
        # The on-policy mode has two exact paths: the batch-invariant Triton kernels (one GPU), and the
        # torch path's one token per forward (every layout; slow).
        if name == "triton":
            raise RolloutError("--deterministic runs on one GPU for now (--tp 1): the all-reduce's order depends on "
                               "the batch; pass --attention-backend torch")
        if name == "auto":
            return "torch"
    # auto: the Triton kernels and CUDA graphs on a GPU (tests/e2e/test_gpu_engine.py passed on the
    # H200: graph replay equals eager, greedy tokens equal the torch path; hybrid models: tests/e2e/
    # test_gpu_hybrid.py), the torch path on the CPU.
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    # Under Triton's interpreter (TRITON_INTERPRET=1) the kernels run on the CPU: slow, but how CI tests them.
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RolloutError("--attention-backend triton needs a CUDA device; use torch on the CPU")
    return name


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


def init_dummy_weights(model, seed: int = 0) -> None:
    """Random weights from config.json alone (benchmarks): norms at 1, the rest N(0, 0.02)."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if getattr(param, "dummy_fill", None) is not None:  # zero-centred norms: (1 + w) with w = 0
                param.fill_(param.dummy_fill)
                continue
            if "norm" in name.rsplit(".", 2)[-2]:
                param.fill_(1.0)
                continue
            if param.device not in generators:  # generate on the parameter's device: fast on GPU
                generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            param.normal_(0.0, 0.02, generator=generators[param.device])


def build_model(model_dir: str, hf_config, device: torch.device, dtype: torch.dtype, max_positions: int,
                load_format: str = "auto", quantization: str | None = None, mtp: bool = False):
    """Construct the model directly on `device` in `dtype`, then fill its weights. With `quantization`
    (fp8) the layers are quantized before the checkpoint streams in, each tensor as it arrives (an e4m3
    one as it is): the whole model never sits in memory unquantized. `mtp`: with the checkpoint's
    multi-token-prediction head too (models/mtp.py, --speculative mtp)."""
    cls = model_class_for(hf_config)
    if load_format != "dummy":
        safetensors_files(model_dir)  # refuse pickle-only or empty dirs before allocating anything
    if mtp:
        check_mtp_checkpoint(model_dir, cls, load_format)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(hf_config, max_positions)
            if mtp:
                attach_mtp(model, max_positions)
    finally:
        torch.set_default_dtype(previous)
    if load_format == "dummy":
        init_dummy_weights(model)
        if quantization is not None:
            quantize_model(model, quantization)
    else:
        if quantization is not None:
            quantize_model(model, quantization, empty=True)
        load_checkpoint(model, model_dir)
        bad = nonfinite_names(model.named_parameters())
        if bad:
            raise RolloutError(f"{model_dir}: {describe(bad)}; every logprob would be NaN: export the checkpoint again")
    if quantization is not None and device.type == "cuda":
        from rollout_kernels.fp8_blockwise import probe_cublas_blockwise  # Triton: optional on the CPU

        probe_cublas_blockwise(device)  # before the decode graphs are captured: a capture cannot probe
    if mtp:  # reloads may leave the head out: trainers often drop it, and a stale head only drafts
        model.optional_checkpoint_prefixes = ("mtp.",)
    return model.eval()
