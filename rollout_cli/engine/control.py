"""Engine control outside the step loop: abort in-flight requests, flush the prefix cache,
reload weights from disk with every name, shape and dtype checked before a live weight changes
(updates from tensors and broadcasts share the checks and commit_weights: engine/weight_updates.py).

Each function is called by the one thread that owns the engine (the daemon's worker), between
engine steps; none of them is safe to call while another thread steps the engine.
"""

from __future__ import annotations

import os
import re

import torch
from safetensors import safe_open

from rollout_cli.engine.engine import Engine, Trajectory
from rollout_cli.errors import RolloutError
from rollout_cli.models.loader import (
    TensorTarget,
    _short_list,
    copy_into_parameters,
    plan_checkpoint,
    read_checkpoint_tensors,
    safetensors_files,
)

# safetensors header dtype names -> torch dtypes (the float ones a weight can hold).
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def abort_unfinished(engine: Engine) -> list[Trajectory]:
    """Finish every running and waiting request with finish_reason "abort"; return their trajectories
    (partial responses, possibly empty) so the caller writes them like any other row."""
    scheduler = engine.scheduler
    requests = list(scheduler.running) + list(scheduler.waiting)
    # routing of the computed positions, read before abort_all gives the slots back
    routing = (engine.routing_pool.gather([r.slots[: r.num_computed_tokens] for r in requests])
               if engine.routing_pool is not None and requests else [None] * len(requests))
    scheduler.abort_all()  # gives back slots and table rows; running ones get "abort"
    for request in requests:
        request.finish_reason = "abort"
    order = sorted(range(len(requests)), key=lambda i: (requests[i].prompt_index, requests[i].sample_index))
    return [engine._trajectory(requests[i], routing[i]) for i in order]


def flush_prefix_cache(engine: Engine) -> None:
    """Drop every cached prefix (their KV was computed by the current weights)."""
    if engine.scheduler.has_work():
        raise RolloutError("cannot flush the prefix cache while requests are in flight; abort or let them finish")
    if engine.scheduler.cache is not None:
        engine.scheduler.cache.reset()
    if engine.scheduler.linear is not None:  # hybrid models: the prompt-state snapshots go with their KV
        engine.scheduler.linear.clear()


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


def check_dtypes(engine: Engine, targets: list[TensorTarget], accepted: dict[str, str],
                 fix: str = "save the checkpoint in the dtype the engine was started from") -> None:
    """A tensor may be the live parameter's dtype or the dtype it had in the checkpoint the engine
    started from; anything else (another float width, ints, fp8 without scales) is refused."""
    params = dict(engine.model.named_parameters())
    bad = []
    for target in targets:
        found = target.dtype
        live = params[target.param_name].dtype
        if SAFETENSORS_DTYPES.get(found) == live or accepted.get(target.checkpoint_name) == found:
            continue
        want = accepted.get(target.checkpoint_name) or str(live).removeprefix("torch.")
        bad.append(f"{target.checkpoint_name} {found} (expected {want})")
    if bad:
        raise RolloutError(f"wrong dtypes: {_short_list(bad)}; {fix}")


def reload_weights(engine: Engine, path: str, version: str | None, accepted_dtypes: dict[str, str]) -> str:
    """Replace the live weights with the checkpoint in `path`; return the new weight version.

    Three phases so a bad checkpoint changes nothing: (1) names and shapes from the headers
    (plan_checkpoint) and dtypes; (2) every tensor read into host memory (catches truncated or
    corrupt data; costs one checkpoint of host RAM); (3) only then the in-place copies into the
    live parameters (addresses unchanged, so captured CUDA graphs stay valid). The prefix cache is
    flushed after, since its KV came from the old weights.
    """
    if engine.scheduler.has_work():
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


def commit_weights(engine: Engine, staged: list[tuple[TensorTarget, torch.Tensor]], new_version: str,
                   complete: bool = True) -> str:
    """The last phase of every weight update (disk, tensors, broadcast), once all of it was checked and
    staged: copy in place, flush the prefix cache (its KV came from the old weights), bump the version.
    Only a `complete` update (every tensor) makes weights lost in a release without backup valid again."""
    params = dict(engine.model.named_parameters())
    for target, tensor in staged:
        copy_into_parameters(params, target, tensor)
    flush_prefix_cache(engine)
    engine.weight_version = new_version
    if complete:
        engine.memory.weights_loaded()
    return new_version


def memory_held(engine: Engine) -> dict:
    """Bytes the engine holds: weights, KV pool and (CUDA) what the allocator reserved."""
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    kv = sum(t.numel() * t.element_size() for t in _tensors(engine.kv))
    info = {"device": str(engine.device), "weights_bytes": weights, "kv_cache_bytes": kv, **engine.memory.state()}
    if "weights" in engine.memory.released:
        info["weights_bytes"] = 0
    if "kv_cache" in engine.memory.released:
        info["kv_cache_bytes"] = 0
    if engine.device.type == "cuda":
        info["cuda_reserved_bytes"] = torch.cuda.memory_reserved(engine.device)
        free, total = torch.cuda.mem_get_info(engine.device)
        info["device_free_bytes"], info["device_total_bytes"] = free, total
    return info


def _tensors(obj) -> list[torch.Tensor]:
    found = []
    for value in vars(obj).values():
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found
