"""Weight updates of one rank's shard: from a checkpoint on disk, from tensors a trainer hands over
(in process, by CUDA IPC or shared memory), and from tensors broadcast by the trainer's rank 0 over
a weight update group. engine.control calls these on every rank (EngineControl).

Same rules as `reload-weights` (from disk, `reload_weights` below): every name, shape and dtype is
checked by the loader's `plan_tensors` and `check_dtypes` before a live weight changes, HF checkpoint
names are mapped into fused parameters (qkv, gate_up, stacked experts) exactly as from disk, and
`commit_weights` copies, flushes the prefix cache and bumps the version. A refused update changes
nothing, weights and version included.

By default an update must carry every tensor of the model (never skip a tensor silently);
`partial=True` accepts a subset (names, shapes and dtypes of what is there are still checked),
for trainers that send only what changed.
"""

from __future__ import annotations

import os
import re

import torch

from safetensors import safe_open

from rollout_cli.engine.weights.tensor_bucket import FlattenedBucket, unflatten_bucket
from rollout_cli.engine.weights.tensor_ipc import deserialize_named_tensors
from rollout_cli.engine.weights.weight_group import WeightGroup, open_weight_group
from rollout_cli.errors import RolloutError
from rollout_cli.models.finite import describe, nonfinite_names
from rollout_cli.models.loader import (
    TensorHeader,
    TensorTarget,
    _short_list,
    copy_into_parameters,
    plan_checkpoint,
    plan_tensors,
    read_checkpoint_tensors,
    safetensors_files,
)

# safetensors header dtype names -> torch dtypes (the float ones a weight can hold).
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}

# torch dtype -> safetensors name, so tensor dtypes are checked and named like checkpoint ones.
_SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()} | {
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def dtype_name(dtype: torch.dtype) -> str:
    return _SAFETENSORS_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def parse_dtype(name: str) -> torch.dtype:
    """"bfloat16", "torch.bfloat16" or "BF16" -> torch.bfloat16."""
    key = name.removeprefix("torch.")
    found = getattr(torch, key, None)
    if isinstance(found, torch.dtype):
        return found
    for dtype, st_name in _SAFETENSORS_NAMES.items():
        if st_name == name:
            return dtype
    raise RolloutError(f"unknown dtype {name!r}; use a torch dtype name such as bfloat16 or float32")


# ---- checks shared by every update, and the commit ---------------------------------------


def checkpoint_dtypes(model_dir: str) -> dict[str, str]:
    """Checkpoint tensor name -> safetensors dtype name ("BF16", "F32", ...), read from the headers only."""
    dtypes = {}
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as handle:
            for name in handle.keys():
                dtypes[name] = handle.get_slice(name).get_dtype()
    return dtypes


def next_version(current: str, requested: str | None) -> str:
    if requested is not None:
        if not requested.strip():
            raise RolloutError("--version must not be empty")
        return requested
    if re.fullmatch(r"\d+", current):
        return str(int(current) + 1)
    raise RolloutError(f"the current weight version {current!r} is not a number, so it cannot be bumped; pass --version V")


def check_dtypes(engine, targets: list[TensorTarget], accepted: dict[str, str],
                 fix: str = "save the checkpoint in the dtype the engine was started from") -> None:
    """A tensor may be the live parameter's dtype or the dtype it had in the checkpoint the engine
    started from; anything else (another float width, ints, fp8 without scales) is refused."""
    params = dict(engine.model.named_parameters())
    bad = []
    for target in targets:
        found = target.dtype
        param = params[target.param_name]
        live = getattr(param, "load_dtype", param.dtype)  # an fp8 weight takes the model's dtype
        if SAFETENSORS_DTYPES.get(found) == live or accepted.get(target.checkpoint_name) == found:
            continue
        if hasattr(param, "load_dtype") and found == "F8_E4M3":  # or e4m3 with its scales (loader._fp8_problems)
            continue
        want = accepted.get(target.checkpoint_name) or str(live).removeprefix("torch.")
        bad.append(f"{target.checkpoint_name} {found} (expected {want})")
    if bad:
        raise RolloutError(f"wrong dtypes: {_short_list(bad)}; {fix}")


def commit_weights(engine, staged: list[tuple[TensorTarget, torch.Tensor]], new_version: str,
                   complete: bool = True) -> str:
    """The last phase of every weight update (disk, tensors, broadcast), once all of it was checked and
    staged: copy in place, flush the prefix cache (its KV came from the old weights), bump the version.
    Only a `complete` update (every tensor) makes weights lost in a release without backup valid again.
    Tensors holding NaN or inf are refused first (a trainer that diverged), where checking is cheap: on
    the engine's device, and on the host for a CPU engine (a GPU engine's reload from disk stages on the
    host, where the check would cost about 1 s per GB: not checked there)."""
    checked = [(t.checkpoint_name, x) for t, x in staged if x.device.type != "cpu" or engine.device.type == "cpu"]
    bad = nonfinite_names(checked)
    if bad:
        raise RolloutError(f"refused: {describe(bad)}; the engine keeps weight version {engine.weight_version}")
    params = dict(engine.model.named_parameters())
    for target, tensor in staged:
        copy_into_parameters(params, target, tensor)
    engine.scheduler.flush_cache()
    if engine.runner.encoder_cache is not None:  # image embeddings came from the old vision tower
        engine.runner.encoder_cache.clear()
    engine.weight_version = new_version
    if complete:
        engine.memory.weights_loaded()
    return new_version


def _refused(engine, err: Exception) -> RolloutError:
    return RolloutError(f"refused the update: {err}; the engine keeps weight version {engine.weight_version}")


def _check_idle(engine) -> None:
    if engine.scheduler.running:  # waiting requests (a paused job's, retracted too) hold no KV
        raise RolloutError("cannot update weights while requests are in flight; abort the job or let it finish")


def plan_update(engine, headers: list[TensorHeader], partial: bool, accepted_dtypes: dict[str, str],
                version: str | None) -> tuple[list[TensorTarget], str, bool]:
    """Everything checked before a tensor is received or copied: (targets, new version, whether the
    update holds every tensor), or RolloutError."""
    _check_idle(engine)
    engine.memory.check_weights_writable()
    try:
        new_version = next_version(engine.weight_version, version)
        targets, problems, missing = plan_tensors(engine.model, headers, require_all=not partial)
        if problems:
            raise RolloutError(f"the tensors do not match the model ({'; '.join(problems)})")
        if not targets:
            raise RolloutError("the update holds no tensor of the model")
        check_dtypes(engine, targets, accepted_dtypes,
                     fix="send tensors in the dtype of the live weights or of the checkpoint the engine started from")
    except RolloutError as err:
        raise _refused(engine, err) from err
    return targets, new_version, not missing


# ---- from disk ------------------------------------------------------------------------


def reload_weights(engine, path: str, version: str | None, accepted_dtypes: dict[str, str]) -> str:
    """Replace the live weights with the checkpoint in `path`; return the new weight version.

    Three phases so a bad checkpoint changes nothing: (1) names and shapes from the headers
    (plan_checkpoint) and dtypes; (2) every tensor read into host memory (catches truncated or
    corrupt data; costs one checkpoint of host RAM); (3) only then the in-place copies into the
    live parameters (addresses unchanged, so captured CUDA graphs stay valid). The prefix cache is
    flushed after, since its KV came from the old weights.
    """
    if engine.scheduler.running:  # waiting requests (a paused job's, retracted too) hold no KV
        raise RolloutError("cannot reload weights while requests are in flight; abort the job or let it finish")
    engine.memory.check_weights_writable()
    if not os.path.isdir(path):
        raise RolloutError(f"checkpoint directory {path} does not exist")
    new_version = next_version(engine.weight_version, version)
    try:
        targets = plan_checkpoint(engine.model, path)
        check_dtypes(engine, targets, accepted_dtypes)
    except RolloutError as err:
        raise RolloutError(f"refused {path}: {err}; the engine keeps weight version {engine.weight_version}") from err
    try:  # read everything before the first live weight changes
        staged = list(read_checkpoint_tensors(targets))
    except RolloutError as err:
        raise RolloutError(f"refused {path}: {err}; the engine keeps weight version {engine.weight_version}") from err
    return commit_weights(engine, staged, new_version)


# ---- tensors handed over -------------------------------------------------------------------


def named_tensors_of(named_tensors) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from pairs, a dict, a FlattenedBucket or a serialized payload (tensor_ipc)."""
    if isinstance(named_tensors, (str, bytes)):
        named_tensors = deserialize_named_tensors(named_tensors)
    if isinstance(named_tensors, FlattenedBucket):
        return unflatten_bucket(named_tensors)
    items = list(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise RolloutError(f"expected (name, tensor) pairs, got {type(item).__name__}")
    return items


def update_weights_from_tensor(engine, named_tensors, version: str | None, partial: bool,
                               accepted_dtypes: dict[str, str]) -> str:
    """Replace weights with the given tensors (HF checkpoint names); returns the new weight version."""
    try:
        items = named_tensors_of(named_tensors)
    except RolloutError as err:
        raise _refused(engine, err) from err
    headers = [TensorHeader(name, tuple(t.shape), dtype_name(t.dtype)) for name, t in items]
    targets, new_version, complete = plan_update(engine, headers, partial, accepted_dtypes, version)
    by_name = dict(items)  # duplicates were refused by plan_tensors
    committed = commit_weights(engine, [(t, by_name[t.checkpoint_name].detach()) for t in targets], new_version,
                               complete)
    if any(t.is_cuda for _, t in items):
        torch.cuda.synchronize(engine.device)  # copies from IPC memory done before the trainer may reuse it
    return committed


# ---- broadcast from the trainer's rank 0 ---------------------------------------------------


def init_weights_update_group(engine, master_address: str, master_port: int, rank_offset: int, world_size: int,
                              group_name: str, backend: str | None = None, timeout_seconds: float = 600.0) -> None:
    """Join the trainer's group as rank `rank_offset` (the trainer is rank 0); blocks until all joined."""
    groups = engine.weight_update_groups
    if group_name in groups:
        raise RolloutError(f"weight update group {group_name!r} already exists; destroy it first")
    if rank_offset < 1:
        raise RolloutError(f"rank_offset {rank_offset}: rank 0 is the trainer's, the engine needs 1 or more")
    backend = backend or ("nccl" if engine.device.type == "cuda" else "gloo")
    groups[group_name] = open_weight_group(master_address, master_port, rank_offset, world_size, group_name,
                                           backend, engine.device, timeout_seconds)


def destroy_weights_update_group(engine, group_name: str) -> None:
    group = engine.weight_update_groups.pop(group_name, None)
    if group is None:
        raise RolloutError(f"no weight update group {group_name!r}; known: {sorted(engine.weight_update_groups) or 'none'}")
    group.close()


def close_weight_update_groups(engine) -> None:
    """Leave every trainer group this process still belongs to (at exit: a trainer may never destroy
    them, and a gloo group still alive at interpreter finalization can abort the process)."""
    for group in engine.weight_update_groups.values():
        group.close()
    engine.weight_update_groups.clear()


def _metadata(names, dtypes, shapes) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    if not (len(names) == len(dtypes) == len(shapes)):
        raise RolloutError(f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})")
    if not names:
        raise RolloutError("names is empty; list the tensors the trainer broadcasts")
    out = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        if not all(isinstance(s, int) and s >= 0 for s in shape):
            raise RolloutError(f"shape of {name} {list(shape)} is not a list of sizes")
        out.append((name, parse_dtype(dtype) if isinstance(dtype, str) else dtype, tuple(shape)))
    return out


def _group(engine, group_name: str) -> WeightGroup:
    group = engine.weight_update_groups.get(group_name)
    if group is None:
        raise RolloutError(f"no weight update group {group_name!r}; call init_weights_update_group first")
    return group


def drain_broadcast(engine, group_name: str, names, dtypes, shapes) -> None:
    """Receive and drop a broadcast the engine refuses, so the trainer's broadcasts complete and the
    group stays in step for the next update (one tensor of scratch memory at a time)."""
    group = _group(engine, group_name)
    for _, dtype, shape in _metadata(names, dtypes, shapes):
        group.broadcast(torch.empty(shape, dtype=dtype, device=group.device))


def update_weights_from_distributed(engine, names, dtypes, shapes, group_name: str, version: str | None,
                                    partial: bool, accepted_dtypes: dict[str, str]) -> str:
    """Receive the tensors rank 0 broadcasts (in `names` order) and make them the weights.

    Metadata is checked before anything is received; a refused update is still received (and
    dropped) so the trainer is not left hanging. Tensors land in staging buffers (transiently
    one more copy of the updated weights on the group's device) and are copied in only after the
    last one arrived, so a broken transfer leaves the old weights intact.
    """
    try:
        meta = _metadata(names, dtypes, shapes)
        group = _group(engine, group_name)
    except RolloutError as err:
        raise _refused(engine, err) from err
    headers = [TensorHeader(name, shape, dtype_name(dtype)) for name, dtype, shape in meta]
    try:
        targets, new_version, complete = plan_update(engine, headers, partial, accepted_dtypes, version)
    except RolloutError as refusal:
        try:
            drain_broadcast(engine, group_name, names, dtypes, shapes)
        except Exception as err:  # noqa: BLE001 - report the refusal first, then why draining failed
            raise RolloutError(f"{refusal}; receiving the refused broadcast failed too "
                               f"({str(err).splitlines()[0] if str(err) else type(err).__name__})") from err
        raise
    staged: dict[str, torch.Tensor] = {}
    for name, dtype, shape in meta:
        buffer = torch.empty(shape, dtype=dtype, device=group.device)
        try:
            group.broadcast(buffer)
        except Exception as err:  # noqa: BLE001 - gloo/NCCL raise RuntimeError subclasses of many kinds
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise RolloutError(
                f"the broadcast of group {group_name!r} failed after {len(staged)} of {len(meta)} tensors ({reason}); "
                f"no weight changed, the engine keeps weight version {engine.weight_version}; "
                "destroy the group and init it again") from err
        staged[name] = buffer
    if group.device.type == "cuda":
        torch.cuda.synchronize(group.device)  # NCCL receives run on their own stream
    return commit_weights(engine, [(t, staged[t.checkpoint_name]) for t in targets], new_version, complete)
