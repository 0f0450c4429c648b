"""The engine across tensor-parallel ranks: rank 0 leads, the other ranks follow its steps.

Rank 0 runs the scheduler, the sampler and the writer as in a single-process engine. Before each
forward its runner sends the step's batch entries (token ids, positions as start + count, KV slots,
req_to_token writes; a small pickled list, broadcast over the gloo `cpu_group`) to the followers,
which run the same forward on their shards with their own KV pool (their kv heads) and wait for the
next message. The all-reduces inside the model keep the ranks in step; only rank 0 samples.

Control operations that change what every rank holds (weights, memory, weight update groups) go
through `on_every_rank`: rank 0 sends the operation's name and arguments, every rank runs it on its
own shard, and rank 0 gathers the outcomes (a refusal anywhere is raised on rank 0). Operations on
the scheduler alone (pause, abort, flush the prefix cache: the followers keep no cache index of
their own) stay on rank 0.

Messages, rank 0 -> all:

    ("step", [BatchEntry, its request cut to the state slot, ...], state copies)   one forward
    ("call", operation, args, kwargs)                  a control operation (CONTROL_OPERATIONS) on every rank
    ("stop",)                                         followers return from `follow`
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout_cli.engine.model_runner import ModelRunner
from rollout_cli.engine.schedule_output import BatchEntry, ScheduleOutput
from rollout_cli.errors import RolloutError
from rollout_cli.models.tensor_parallel import TensorParallelGroup, tp_group

STEP, CALL, STOP = "step", "call", "stop"


def _broadcast(group: TensorParallelGroup, message=None):
    """Rank 0's `message` on every rank (None in, the message out, on the followers)."""
    import torch.distributed as dist

    box = [message]
    dist.broadcast_object_list(box, group=group.cpu_group, group_src=0)  # this engine's rank 0
    return box[0]


def _gather(group: TensorParallelGroup, value) -> list:
    import torch.distributed as dist

    values = [None] * group.size
    dist.all_gather_object(values, value, group=group.cpu_group)
    return values


@dataclass(slots=True)
class FollowerRequest:
    """What a follower's forward reads of a request: its linear-state slot (hybrid models; -1 otherwise)."""

    state_slot: int


def _wire(entry: BatchEntry) -> BatchEntry:
    """The entry as followers need it: no Request (only rank 0 samples), only its state slot."""
    return BatchEntry(FollowerRequest(entry.request.state_slot), entry.table_row, entry.start, entry.token_ids,
                      entry.table_start, entry.table_slots, entry.sample)


class TensorParallelRunner(ModelRunner):
    """ModelRunner of one tensor-parallel rank (eager forward only: no CUDA graphs in this slice)."""

    def _run_eager(self, out: ScheduleOutput) -> tuple[list[int], list[float]]:
        """Rank 0: send the step (sorted by launch(), input tokens known) to the followers, then run it."""
        # hybrid models: the step's state copies (snapshots, forks) go along, applied on every rank
        _broadcast(tp_group(), (STEP, [_wire(e) for e in out.entries], out.state_copies))
        return super()._run_eager(out)

    @torch.inference_mode()
    def follow_step(self, entries: list[BatchEntry], state_copies: list[tuple[int, int]]) -> None:
        """A follower's share of one step: table writes and the forward (its logits are dropped)."""
        self._write_table(entries)
        self._eager_logits(ScheduleOutput(entries, state_copies=state_copies))


def follow(engine) -> None:
    """A follower's loop: run rank 0's steps and control operations until it sends stop."""
    group = engine.tp
    while True:
        message = _broadcast(group)
        kind = message[0]
        if kind == STEP:
            engine.runner.follow_step(message[1], message[2])
        elif kind == CALL:
            _call_here(engine, *message[1:])
        elif kind == STOP:
            return
        else:
            raise RuntimeError(f"unknown tensor-parallel message {kind!r}")


def stop_followers(engine) -> None:
    """Rank 0: release the followers from `follow` (end of the job, or an error on rank 0)."""
    _broadcast(engine.tp, (STOP,))


def release_followers(engine) -> None:
    """Rank 0, when the command ends: stop the followers and leave the process group (also on errors)."""
    from rollout_cli.models.tensor_parallel import close_tensor_parallel

    if engine.tp is None:
        return
    try:
        stop_followers(engine)
    finally:
        close_tensor_parallel()


# ---- control operations on every rank ----------------------------------------------------------


def _join_weight_group(engine, master_address: str, master_port: int, rank_offset: int, world_size: int,
                       group_name: str, backend: str | None = None, timeout_seconds: float = 600.0) -> None:
    """Every rank joins the trainer's group, rank r as rank_offset + r (SGLang's numbering), so the
    trainer's one broadcast reaches every shard."""
    from rollout_cli.engine.weight_updates import init_weights_update_group

    size, rank = (1, 0) if engine.tp is None else (engine.tp.size, engine.tp.rank)
    if rank_offset + size > world_size:
        raise RolloutError(f"world_size {world_size} leaves no room for the engine's {size} tensor-parallel ranks "
                           f"from rank_offset {rank_offset}; the trainer's group needs world_size "
                           f"{rank_offset + size} or more")
    init_weights_update_group(engine, master_address, master_port, rank_offset + rank, world_size, group_name,
                              backend, timeout_seconds)


def _operations() -> dict:
    from rollout_cli.engine import control, memory_saver, weight_updates

    return {
        "reload_weights": control.reload_weights,
        "release_memory": memory_saver.release_memory,
        "resume_memory": memory_saver.resume_memory,
        "update_weights_from_tensor": weight_updates.update_weights_from_tensor,
        "init_weights_update_group": _join_weight_group,
        "update_weights_from_distributed": weight_updates.update_weights_from_distributed,
        "drain_broadcast": weight_updates.drain_broadcast,
        "destroy_weights_update_group": weight_updates.destroy_weights_update_group,
    }


def on_every_rank(engine, operation: str, *args, leader_args: tuple | None = None, **kwargs):
    """`operation(engine, *args, **kwargs)` (a name of `_operations()`) on this engine, and under --tp on
    every rank's shard of it; returns rank 0's result. `leader_args` replaces `args` on rank 0 (tensors
    handed over in process: the followers get their handles instead).

    Every rank checks the same things (names, full shapes, dtypes, memory state) and so refuses alike;
    rank 0 raises its own refusal, else the first follower's."""
    if engine.tp is None:
        return _operations()[operation](engine, *(args if leader_args is None else leader_args), **kwargs)
    _broadcast(engine.tp, (CALL, operation, args, kwargs))
    return _call_here(engine, operation, args if leader_args is None else leader_args, kwargs)


def _call_here(engine, operation: str, args: tuple, kwargs: dict):
    group = engine.tp
    result, failure, error = None, None, None
    try:
        result = _operations()[operation](engine, *args, **kwargs)
    except Exception as err:  # noqa: BLE001 - gathered first, so no rank is left waiting; rank 0 re-raises
        failure = err
        error = str(err) if isinstance(err, RolloutError) else f"{type(err).__name__}: {err}"
    errors = _gather(group, error)
    if not group.is_leader:
        return None
    if failure is not None:
        raise failure
    for rank, message in enumerate(errors):
        if message is not None:
            raise RolloutError(f"tensor-parallel rank {rank}: {message}; rank 0 carried it out, "
                               "so the ranks disagree now: repeat the operation")
    return result


def reload_weights(engine, path: str, version: str | None = None) -> str:
    """Every rank loads its slices of the checkpoint in `path` (checked against the full shapes on each
    rank, as engine.control.reload_weights does); returns the new weight version."""
    from rollout_cli.engine.weight_updates import start_dtypes

    return on_every_rank(engine, "reload_weights", path, version, start_dtypes(engine))


def update_weights_from_tensor(engine, named_tensors, version: str | None = None, partial: bool = False,
                               accepted_dtypes: dict[str, str] | None = None) -> str:
    """engine.weight_updates.update_weights_from_tensor on every rank: the followers open handles to the
    tensors (tensor_ipc; a serialized payload is opened by every rank as it is)."""
    from rollout_cli.engine.tensor_ipc import serialize_named_tensors

    args = (named_tensors, version, partial, accepted_dtypes)
    if engine.tp is None or isinstance(named_tensors, (str, bytes)):
        return on_every_rank(engine, "update_weights_from_tensor", *args)
    payload = serialize_named_tensors(named_tensors)
    return on_every_rank(engine, "update_weights_from_tensor", payload, *args[1:], leader_args=args)
