"""The engine across tensor-parallel ranks: rank 0 leads, the other ranks follow its steps.

Rank 0 runs the scheduler, the sampler and the writer as in a single-process engine. Before each
forward its runner sends the step's batch entries (token ids, positions as start + count, KV slots,
req_to_token writes; a small pickled list, broadcast over the gloo `cpu_group`) to the followers,
which run the same forward on their shards with their own KV pool (their kv heads) and wait for the
next message. The all-reduces inside the model keep the ranks in step; only rank 0 samples.

Messages, rank 0 -> all:

    ("step", [BatchEntry without its request, ...])   one forward
    ("reload", path, version)                         every rank loads its slices of a checkpoint
    ("stop",)                                         followers return from `follow`
"""

from __future__ import annotations

import torch

from rollout_cli.engine.model_runner import ModelRunner
from rollout_cli.engine.scheduler import BatchEntry, ScheduleOutput
from rollout_cli.errors import RolloutError
from rollout_cli.models.tensor_parallel import TensorParallelGroup, tp_group

STEP, RELOAD, STOP = "step", "reload", "stop"


def _broadcast(group: TensorParallelGroup, message=None):
    """Rank 0's `message` on every rank (None in, the message out, on the followers)."""
    import torch.distributed as dist

    box = [message]
    dist.broadcast_object_list(box, src=0, group=group.cpu_group)
    return box[0]


def _gather(group: TensorParallelGroup, value) -> list:
    import torch.distributed as dist

    values = [None] * group.size
    dist.all_gather_object(values, value, group=group.cpu_group)
    return values


def _wire(entry: BatchEntry) -> BatchEntry:
    """The entry as followers need it: no Request (only rank 0 samples)."""
    return BatchEntry(None, entry.table_row, entry.start, entry.token_ids, entry.table_start,
                      entry.table_slots, entry.sample)


class TensorParallelRunner(ModelRunner):
    """ModelRunner of one tensor-parallel rank (eager forward only: no CUDA graphs in this slice)."""

    def _run_eager(self, out: ScheduleOutput) -> tuple[list[int], list[float]]:
        """Rank 0: send the step (sorted by launch(), input tokens known) to the followers, then run it."""
        _broadcast(tp_group(), (STEP, [_wire(e) for e in out.entries]))
        return super()._run_eager(out)

    @torch.inference_mode()
    def follow_step(self, entries: list[BatchEntry]) -> None:
        """A follower's share of one step: table writes and the forward (its logits are dropped)."""
        self._write_table(entries)
        self._eager_logits(ScheduleOutput(entries))


def follow(engine) -> None:
    """A follower's loop: run rank 0's steps and reloads until it sends stop."""
    group = engine.tp
    while True:
        message = _broadcast(group)
        kind = message[0]
        if kind == STEP:
            engine.runner.follow_step(message[1])
        elif kind == RELOAD:
            _reload_here(engine, message[1], message[2], group)
        elif kind == STOP:
            return
        else:
            raise RuntimeError(f"unknown tensor-parallel message {kind!r}")


def stop_followers(engine) -> None:
    """Rank 0: release the followers from `follow` (end of the job, or an error on rank 0)."""
    _broadcast(engine.tp, (STOP,))


def reload_weights(engine, path: str, version: str | None = None) -> str:
    """Rank 0: every rank loads its slices of the checkpoint in `path` (checked against the full
    shapes on each rank, as engine.control.reload_weights does); returns the new weight version.
    A checkpoint refused on any rank raises that rank's reason."""
    _broadcast(engine.tp, (RELOAD, path, version))
    return _reload_here(engine, path, version, engine.tp)


def _reload_here(engine, path: str, version: str | None, group: TensorParallelGroup) -> str | None:
    from rollout_cli.engine.control import reload_weights as reload_checked
    from rollout_cli.engine.weight_updates import start_dtypes

    try:
        new, error = reload_checked(engine, path, version, start_dtypes(engine)), None
    except RolloutError as err:
        new, error = None, str(err)
    errors = [e for e in _gather(group, error) if e is not None]
    if errors:  # every rank checks the same full shapes, so a bad checkpoint is refused everywhere
        if group.is_leader:
            raise RolloutError(errors[0])
        return None
    return new
