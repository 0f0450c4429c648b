"""Weight updates that do not come from disk: tensors a trainer hands over (in process, by CUDA IPC
or shared memory), and tensors broadcast by the trainer's rank 0 over a weight update group.

Same rules as `reload-weights` (engine/control.py): every name, shape and dtype is checked by the
loader's `plan_tensors` and control's `check_dtypes` before a live weight changes, HF checkpoint
names are mapped into fused parameters (qkv, gate_up, stacked experts) exactly as from disk, and
`commit_weights` copies, flushes the prefix cache and bumps the version. A refused update changes
nothing, weights and version included.

By default an update must carry every tensor of the model (never skip a tensor silently);
`partial=True` accepts a subset (names, shapes and dtypes of what is there are still checked),
for trainers that send only what changed.
"""

from __future__ import annotations

import weakref

import torch

from rollout_cli.engine.control import SAFETENSORS_DTYPES, check_dtypes, checkpoint_dtypes, commit_weights, next_version
from rollout_cli.engine.tensor_bucket import FlattenedBucket, unflatten_bucket
from rollout_cli.engine.tensor_ipc import deserialize_named_tensors
from rollout_cli.engine.weight_group import WeightGroup, open_weight_group
from rollout_cli.errors import RolloutError
from rollout_cli.models.loader import TensorHeader, TensorTarget, plan_tensors

# torch dtype -> safetensors name, so tensor dtypes are checked and named like checkpoint ones.
_SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()} | {
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_START_DTYPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> its start checkpoint's dtypes


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


def start_dtypes(engine) -> dict[str, str]:
    """Tensor name -> dtype in the checkpoint the engine started from (also accepted, as for reloads)."""
    if engine not in _START_DTYPES:
        dummy = engine.config.load_format == "dummy"
        _START_DTYPES[engine] = {} if dummy else checkpoint_dtypes(engine.config.model)
    return _START_DTYPES[engine]


def _refused(engine, err: Exception) -> RolloutError:
    return RolloutError(f"refused the update: {err}; the engine keeps weight version {engine.weight_version}")


def _check_idle(engine) -> None:
    if engine.scheduler.has_work():
        raise RolloutError("cannot update weights while requests are in flight; abort the job or let it finish")


def plan_update(engine, headers: list[TensorHeader], partial: bool, accepted_dtypes: dict[str, str] | None,
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
        check_dtypes(engine, targets, start_dtypes(engine) if accepted_dtypes is None else accepted_dtypes,
                     fix="send tensors in the dtype of the live weights or of the checkpoint the engine started from")
    except RolloutError as err:
        raise _refused(engine, err) from err
    return targets, new_version, not missing


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


def update_weights_from_tensor(engine, named_tensors, version: str | None = None, partial: bool = False,
                               accepted_dtypes: dict[str, str] | None = None) -> str:
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


def update_weights_from_distributed(engine, names, dtypes, shapes, group_name: str, version: str | None = None,
                                    partial: bool = False, accepted_dtypes: dict[str, str] | None = None) -> str:
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
