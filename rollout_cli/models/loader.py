"""Stream safetensors checkpoints into a model's own parameters.

Loading is two passes: `plan_checkpoint` reads only the safetensors headers
and checks every name and shape against the model (`plan_tensors`, which also
checks tensors a trainer hands over), so a bad checkpoint is refused before
any live weight changes; `load_checkpoint` then copies each
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
# An FP8 checkpoint's per-block weight scales, beside each e4m3 weight (models/fp8.py)
SCALE_SUFFIX = "_scale_inv"
FP8_CHECKPOINT_DTYPE = "F8_E4M3"
INTEGER_DTYPES = ("BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64")  # safetensors header names
FP8_BLOCK = 128
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt")
# Shard id of a stacked tensor stored with dims 1 and 2 swapped ([E, K, N] for a parameter [E, N, K]: the
# hub's Qwen3-VL-MoE experts); only parameters with `loads_transposed` take it, and the weight loader
# transposes it back (models/moe.FusedExperts)
TRANSPOSED = "transposed"


@dataclass(frozen=True)
class TensorTarget:
    checkpoint_name: str
    file: str
    param_name: str
    shard_id: object  # None for unfused parameters
    dtype: str  # safetensors header dtype: "BF16", "F32", ...
    # tensor parallel: (dim, start, size) of the checkpoint tensor this rank holds; None: all of it
    tp_slice: tuple[int, int, int] | None = None
    # the sliced dim is this many equal blocks and the rank holds [start, start + size) of each
    # (stacked experts' fused gate_up_proj: the gate rows, then the up rows)
    tp_blocks: int = 1


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


def _canonical(model, name: str) -> str:
    """The checkpoint name in the model's own naming (`checkpoint_renames`: Mixtral's block_sparse_moe -> mlp)."""
    for old, new in getattr(model, "checkpoint_renames", ()):
        name = name.replace(old, new)
    return name


def _as_checkpoint(model, name: str) -> str:
    """Inverse of _canonical, for naming missing tensors as the checkpoint would."""
    for old, new in getattr(model, "checkpoint_renames", ()):
        name = name.replace(new, old)
    return name


def layout_names(model) -> dict[str, tuple[str, object, int]]:
    """checkpoint name -> (param name, shard id, layout number) for parameters with `checkpoint_layouts`.

    Such a parameter (MoE experts) lists alternative checkpoint layouts, each a dict of
    names relative to its module -> shard id; a checkpoint must hold exactly one of them.
    """
    names = {}
    for param_name, param in model.named_parameters():
        prefix = param_name.rsplit(".", 1)[0] + "."
        for number, layout in enumerate(getattr(param, "checkpoint_layouts", ())):
            for rel, shard_id in layout.items():
                names[prefix + rel] = (param_name, shard_id, number)
    return names


def scale_names(model) -> dict[str, tuple[str, object, str]]:
    """checkpoint name -> (scale param name, shard id, weight param name) of an FP8 checkpoint's per-expert
    weight scales: optional tensors (a bf16 checkpoint has none), listed by the scale parameters of
    W8A8 experts as `checkpoint_scale_names` (models/fp8.quantize_experts)."""
    names = {}
    for param_name, param in model.named_parameters():
        prefix = param_name.rsplit(".", 1)[0] + "."
        for rel, (shard_id, weight) in getattr(param, "checkpoint_scale_names", {}).items():
            names[prefix + rel] = (param_name, shard_id, prefix + weight)
    return names


def _layout_problems(model, found: set[str]) -> tuple[list[str], list[str]]:
    """(missing names, params mixing layouts) of the layout parameters, given the names found.

    A parameter none of whose tensors is present is reported in the layout the rest of
    the checkpoint uses (per-expert names if it uses none).
    """
    per_param = []  # (param name, full names per layout, hits per layout)
    for param_name, param in model.named_parameters():
        layouts = getattr(param, "checkpoint_layouts", None)
        if layouts:
            prefix = param_name.rsplit(".", 1)[0] + "."
            full = [{prefix + rel for rel in layout} for layout in layouts]
            per_param.append((param_name, full, [len(names & found) for names in full]))
    used = [hits.index(max(hits)) for _, _, hits in per_param if max(hits)]
    usual = max(set(used), key=used.count) if used else 0
    missing, mixed = [], []
    for param_name, full, hits in per_param:
        if sum(1 for h in hits if h) > 1:
            mixed.append(param_name)
        chosen = hits.index(max(hits)) if max(hits) else usual
        missing.extend(full[chosen] - found)
    return missing, mixed


def expected_checkpoint_names(model) -> set[str]:
    """Every checkpoint tensor name the model needs, fused parameters expanded (layout parameters excluded)."""
    inverse: dict[str, list[str]] = {}
    for part, (fused, _) in model.packed_modules_mapping.items():
        inverse.setdefault(fused, []).append(part)
    names = set()
    for param_name, param in model.named_parameters():
        if getattr(param, "checkpoint_layouts", None) or getattr(param, "derived_from_weight", False):
            continue  # layout parameters; fp8 scales (written by their weight's loader)
        for fused, parts in inverse.items():
            if f".{fused}." in param_name:
                names.update(param_name.replace(f".{fused}.", f".{p}.") for p in parts)
                break
        else:
            names.add(param_name)
    return names


@dataclass(frozen=True)
class TensorHeader:
    """What the check needs of one incoming tensor: a safetensors header entry, or an in-memory tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name: "BF16", "F32", ...
    file: str = ""  # the safetensors file it is read from; "" for tensors handed over in memory


def checkpoint_headers(model_dir: str):
    """Yield a TensorHeader per tensor of the checkpoint's safetensors files, reading headers only."""
    for path in safetensors_files(model_dir):
        try:
            handle = safe_open(path, framework="pt", device="cpu")
        except Exception as err:  # safetensors raises its own error types
            raise RolloutError(f"cannot read {path}: {err}; the file is not valid safetensors") from err
        with handle:
            for name in handle.keys():
                header = handle.get_slice(name)
                yield TensorHeader(name, tuple(header.get_shape()), header.get_dtype(), path)


def plan_tensors(model, headers, require_all: bool = True) -> tuple[list[TensorTarget], list[str], list[str]]:
    """Map incoming tensors (HF checkpoint names) onto the model's parameters; touch no weights.

    Returns (targets, problems, missing names): problems are missing (unless `require_all` is
    False: a partial update), unexpected, wrong-shaped, duplicated tensors and mixed expert
    layouts. Used for checkpoints on disk (plan_checkpoint) and for tensors handed over by a
    trainer (engine.weights.weight_updates).
    """
    params = dict(model.named_parameters())
    expected = expected_checkpoint_names(model)
    by_layout = layout_names(model)
    expert_scales = scale_names(model)
    tied = getattr(model, "tie_word_embeddings", False)
    targets, unexpected, bad_shapes = [], [], []
    for header in headers:
        name = header.name
        if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        if name.startswith(getattr(model, "checkpoint_ignored_prefixes", ())):  # Qwen3-Next's mtp.*
            continue
        key = _canonical(model, name)
        scale = False
        if key in by_layout:  # stacked experts: one of several layouts
            param_name, shard_id, _ = by_layout[key]
            shard_id = _stored_transposed(params[param_name], shard_id, header.shape)
        elif key in expert_scales:  # an FP8 checkpoint's expert scales
            param_name, shard_id, weight_name = expert_scales[key]
            want = _checkpoint_scale_shape(params[weight_name], shard_id)
            if tuple(header.shape) != want:
                bad_shapes.append(f"{name} {tuple(header.shape)} (model: {want})")
            targets.append(TensorTarget(name, header.file, param_name, shard_id, header.dtype))
            continue
        else:
            param_name, shard_id = _param_target(model, key)
            # an FP8 checkpoint's scales: for the layers that hold fp8 weights
            scale = key.endswith(".weight" + SCALE_SUFFIX) and getattr(params.get(param_name), "derived_from_weight", False)
            if param_name not in params or (key not in expected and not scale):
                unexpected.append(name)
                continue
        want = (_checkpoint_scale_shape(params[param_name.removesuffix(SCALE_SUFFIX)], shard_id) if scale
                else model_shard_shape(params[param_name], shard_id))
        if tuple(header.shape) != want:
            bad_shapes.append(f"{name} {tuple(header.shape)} (model: {want})")
        targets.append(TensorTarget(name, header.file, param_name, shard_id, header.dtype,
                                    *_tp_target_fields(params[param_name], shard_id)))
    problems = _fp8_problems(params, targets)
    found = {_canonical(model, t.checkpoint_name) for t in targets}
    layout_missing, mixed = _layout_problems(model, found)
    missing = sorted(_as_checkpoint(model, n) for n in (expected - found) | set(layout_missing))
    # once loaded, parts a new checkpoint may leave out keep their weights (an MTP head a trainer dropped)
    missing = [n for n in missing if not n.startswith(getattr(model, "optional_checkpoint_prefixes", ()))]
    if missing and require_all:
        problems.append(f"missing tensors: {_short_list(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_short_list(sorted(unexpected))}")
    if bad_shapes:
        problems.append(f"wrong shapes: {_short_list(bad_shapes)}")
    if mixed:
        problems.append(f"both per-expert and fused expert tensors for {_short_list(mixed)}")
    duplicates = len(targets) - len(found)
    if duplicates:
        where = "in more than one file" if any(t.file for t in targets) else "more than once"
        problems.append(f"{duplicates} tensors appear {where}")
    return targets, problems, missing


def _stored_transposed(param, shard_id, shape) -> object:
    """TRANSPOSED for a whole stacked tensor whose dims 1 and 2 are swapped, where `param` takes that layout;
    else `shard_id`. A shape that fits both ways (square) reads as the model's own layout, as HF reads it."""
    if shard_id is not None or not getattr(param, "loads_transposed", False):
        return shard_id
    shape = tuple(shape)
    if shape != model_shard_shape(param, None) and shape == model_shard_shape(param, TRANSPOSED):
        return TRANSPOSED
    return shard_id


def _checkpoint_scale_shape(weight, shard_id) -> tuple[int, int]:
    """An FP8 checkpoint's weight_scale_inv shape for the weight tensor of `shard_id`: one scale per 128 x 128 block."""
    n, k = model_shard_shape(weight, shard_id)
    return -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)


def _fp8_problems(params: dict, targets: list[TensorTarget]) -> list[str]:
    """e4m3 weights come with their scales and go only where the engine keeps fp8 weights."""
    names = {t.checkpoint_name for t in targets}
    fp8 = [t for t in targets if t.dtype == FP8_CHECKPOINT_DTYPE]
    kept = [t.checkpoint_name for t in fp8 if not hasattr(params[t.param_name], "load_dtype")]
    stacked = [t.checkpoint_name for t in fp8 if t.shard_id in (None, TRANSPOSED)
               and getattr(params[t.param_name], "checkpoint_layouts", None)]
    unscaled = [t.checkpoint_name for t in fp8 if t.checkpoint_name + SCALE_SUFFIX not in names]
    fp8_names = {t.checkpoint_name for t in fp8}
    orphans = [t.checkpoint_name for t in targets if t.checkpoint_name.endswith(SCALE_SUFFIX)
               and t.checkpoint_name.removesuffix(SCALE_SUFFIX) not in fp8_names]
    problems = []
    if kept:
        problems.append(f"FP8 tensors for layers this engine keeps in the model's dtype (the LM head, norms, "
                        f"routers): {_short_list(sorted(kept))}")
    if stacked:
        problems.append(f"stacked e4m3 MoE experts, which load per expert only (experts.E.gate_proj.weight with its "
                        f"weight_scale_inv): {_short_list(sorted(stacked))}")
    if unscaled:
        problems.append(f"FP8 weights without their weight_scale_inv: {_short_list(sorted(unscaled))}")
    if orphans:
        problems.append(f"weight_scale_inv without its FP8 (e4m3) weight: {_short_list(sorted(orphans))}")
    return problems


def plan_checkpoint(model, model_dir: str) -> list[TensorTarget]:
    """Check names, shapes and integer dtypes of every tensor in the checkpoint; touch no weights. An
    integer tensor would be cast into its float weight (run) or refused as a dtype change (reload)."""
    targets, problems, _ = plan_tensors(model, checkpoint_headers(model_dir))
    if problems:
        raise RolloutError(
            f"checkpoint {model_dir} does not match the model ({'; '.join(problems)}); "
            "check that config.json belongs to these weights"
        )
    integer = [f"{t.checkpoint_name} {t.dtype}" for t in targets if t.dtype in INTEGER_DTYPES]
    if integer:
        raise RolloutError(f"checkpoint {model_dir} holds integer tensors for float weights ({_short_list(integer)}): "
                           "a broken export; save the checkpoint again in bfloat16, float16 or float32")
    return targets


def model_shard_shape(param, shard_id) -> tuple[int, ...]:
    """Shape of the checkpoint tensor that fills `shard_id` of `param` (the full tensor under
    tensor parallelism: every rank checks the checkpoint against the whole model)."""
    if hasattr(param, "shard_shape"):  # parameters that compute it themselves (stacked experts)
        return tuple(param.shard_shape(shard_id))
    if shard_id is None:
        shape = list(param.shape)
    else:
        _, size = param.shard_offsets[shard_id]
        shape = [size] + list(param.shape[1:])
    split = getattr(param, "tp_split", None)
    if split is not None:
        dim, _, _, full = split[shard_id]
        shape[dim] = full
    return tuple(shape)


def _tp_target_fields(param, shard_id) -> tuple[tuple[int, int, int] | None, int]:
    """(tp_slice, tp_blocks) of a TensorTarget: the part of the checkpoint tensor this tensor-parallel
    rank holds ((dim, start, size) in each of `blocks` blocks of dim), or (None, 1): all of it."""
    split = getattr(param, "tp_split", None)
    if split is None:
        return None, 1
    dim, start, size, _, *blocks = split[shard_id]
    return (dim, start, size), (blocks[0] if blocks else 1)


def _rank_ranges(target: TensorTarget, length: int) -> list[tuple[int, int]]:
    """(start, size) along the split dim of each piece this rank holds, for a dim of `length`."""
    _, start, size = target.tp_slice
    block = length // target.tp_blocks
    return [(b * block + start, size) for b in range(target.tp_blocks)]


def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _read(handle, target: TensorTarget) -> torch.Tensor:
    """The target's tensor from an open safetensors file: only this rank's slice under tensor parallelism."""
    if target.tp_slice is None:
        return handle.get_tensor(target.checkpoint_name)
    dim = target.tp_slice[0]
    view = handle.get_slice(target.checkpoint_name)
    return _cat([view[(slice(None),) * dim + (slice(start, start + size),)]
                 for start, size in _rank_ranges(target, view.get_shape()[dim])], dim)


def read_checkpoint_tensors(targets: list[TensorTarget]):
    """Yield (target, CPU tensor) for every planned tensor, one file open at a time.

    A file whose data cannot be read (truncated, corrupt) raises RolloutError naming it.
    """
    by_file: dict[str, list[TensorTarget]] = {}
    for target in targets:
        by_file.setdefault(target.file, []).append(target)
    for path, file_targets in by_file.items():
        try:
            with safe_open(path, framework="pt", device="cpu") as handle:
                for target in file_targets:
                    yield target, _read(handle, target)
        except Exception as err:  # safetensors raises its own error types
            raise RolloutError(f"cannot read {path}: {err}; the file is not valid safetensors") from err


def copy_into_parameters(params: dict, target: TensorTarget, tensor: torch.Tensor) -> None:
    """Copy one checkpoint tensor into (its shard of) the live parameter, in place.

    A whole tensor meant for a tensor-parallel rank (handed over in memory) is cut to the rank's slice."""
    param = params[target.param_name]
    if target.tp_slice is not None:
        dim, _, size = target.tp_slice
        if tensor.shape[dim] != size * target.tp_blocks:
            tensor = _cat([tensor.narrow(dim, start, n) for start, n in _rank_ranges(target, tensor.shape[dim])], dim)
    with torch.no_grad():
        # an fp8 weight takes the model's dtype and quantizes it itself, or e4m3 as it is (models/fp8.py)
        dtype = param.dtype if tensor.dtype == param.dtype else getattr(param, "load_dtype", param.dtype)
        param.weight_loader(param, tensor.to(dtype), target.shard_id)


def load_checkpoint(model, model_dir: str) -> None:
    """Validate the whole checkpoint, then stream each tensor into its parameter."""
    targets = plan_checkpoint(model, model_dir)
    params = dict(model.named_parameters())
    for target, tensor in read_checkpoint_tensors(targets):
        copy_into_parameters(params, target, tensor)


def _short_list(items: list[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")
