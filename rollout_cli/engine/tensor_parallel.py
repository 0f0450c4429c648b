"""The engine across tensor-parallel ranks: rank 0 leads, the other ranks follow its steps.

Rank 0 runs the scheduler, the sampler and the writer as in a single-process engine. Before each
forward its runner sends the step's batch entries (token ids, positions as start + count, KV slots,
req_to_token writes; a small pickled list, broadcast over the gloo `cpu_group`) to the followers,
which run the same forward on their shards with their own KV pool (their kv heads) and wait for the
next message. The all-reduces inside the model keep the ranks in step; only rank 0 samples.

Control operations that change what every rank holds (weights, memory, weight update groups) go
through `TensorParallelRanks.call`, the engine's `ranks` under --tp (engine.control.EngineControl
calls it): rank 0 sends the operation's name (a method of engine.control.RankOperations) and
arguments, every rank runs it on its own shard, and rank 0 gathers the outcomes (a refusal anywhere
is raised on rank 0). Operations on the scheduler alone (pause, abort, flush the prefix cache: the
followers keep no cache index of their own) stay on rank 0.

Messages, rank 0 -> all:

    ("step", [BatchEntry, its request cut to the state slot, ...], state copies)   one forward
    ("call", operation, args)                          a control operation (RankOperations) on every rank
    ("stop",)                                         followers return from `follow`
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rollout_cli.engine.execution.model_runner import ModelRunner
from rollout_cli.engine.scheduling.schedule_output import BatchEntry, ScheduleOutput
from rollout_cli.errors import RolloutError
from rollout_cli.models.tensor_parallel import TensorParallelGroup, close_tensor_parallel, tp_group

STEP, CALL, STOP = "step", "call", "stop"


def _broadcast(group: TensorParallelGroup, message=None):
    """Rank 0's `message` on every rank (None in, the message out, on the followers)."""
    box = [message]
    dist.broadcast_object_list(box, group=group.cpu_group, group_src=0)  # this engine's rank 0
    return box[0]


def _gather(group: TensorParallelGroup, value) -> list:
    values = [None] * group.size
    dist.all_gather_object(values, value, group=group.cpu_group)
    return values


def min_over_ranks(value: int, group) -> int:
    """The smallest of every rank's `value` (the pool sizes all ranks must agree on)."""
    box = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(box, op=dist.ReduceOp.MIN, group=group.cpu_group)
    return int(box.item())


@dataclass(slots=True)
class FollowerRequest:
    """What a follower's forward reads of a request: its linear-state slot (hybrid models; -1 otherwise);
    for a prompt with images, its layout while the entry runs prompt tokens (engine/execution/vision_step.py)
    and the position offset of the tokens after it."""

    state_slot: int
    vision: object = None
    num_prompt_tokens: int = 0
    rope_delta: int = 0


def _wire(entry: BatchEntry) -> BatchEntry:
    """The entry as followers need it: no Request (only rank 0 samples), only what their forward reads
    (the image layout, pixels included, only with prompt tokens: decode steps do not send it)."""
    request = entry.request
    vision = request.vision if request.vision is not None and entry.start < request.num_prompt_tokens else None
    follower = FollowerRequest(request.state_slot, vision, request.num_prompt_tokens, request.rope_delta)
    return BatchEntry(follower, entry.table_row, entry.start, entry.token_ids,
                      entry.table_start, entry.table_slots, entry.sample, score_first_row=entry.score_first_row,
                      score_targets=entry.score_targets)  # followers compute the same logits rows (all-gather)


class TensorParallelRunner(ModelRunner):
    """ModelRunner of one tensor-parallel rank (eager forward only: no CUDA graphs in this slice)."""

    def _run_eager(self, out: ScheduleOutput) -> tuple[list[int], list[float]]:
        """Rank 0: send the step (sorted by launch()) to the followers, then run it. Followers keep no token
        table: inputs scheduled ahead (PENDING) go as the host ints rank 0's table holds."""
        self.tokens.resolve_on_host(out.entries)
        # hybrid models: the step's state copies (snapshots, forks) go along, applied on every rank
        _broadcast(tp_group(), (STEP, [_wire(e) for e in out.entries], out.state_copies))
        return super()._run_eager(out)

    @torch.inference_mode()
    def follow_step(self, entries: list[BatchEntry], state_copies: list[tuple[int, int]]) -> None:
        """A follower's share of one step: table writes and the forward (its logits are dropped)."""
        self._write_table(entries)
        self._forward_logits(ScheduleOutput(entries, state_copies=state_copies))


def follow(engine) -> None:
    """A follower's loop: run rank 0's steps and control operations until it sends stop."""
    group = engine.tp
    while True:
        message = _broadcast(group)
        kind = message[0]
        if kind == STEP:
            engine.runner.follow_step(message[1], message[2])
        elif kind == CALL:
            engine.control.ranks.call_here(message[1], message[2])
        elif kind == STOP:
            return
        else:
            raise RuntimeError(f"unknown tensor-parallel message {kind!r}")


class TensorParallelRanks:
    """The `ranks` of a tensor-parallel engine: an operation of `operations` (engine.control.RankOperations)
    runs on every rank's shard. On rank 0 `call` sends it to the followers first; they run it from `follow`."""

    def __init__(self, group: TensorParallelGroup, operations):
        self.group = group
        self.operations = operations
        self.size = group.size

    def call(self, operation: str, *args, follower_args=None):
        """`operation(*args)` on this rank and on every follower; returns rank 0's result. `follower_args`
        (a function) gives the followers' arguments instead of `args` (tensors handed over in process:
        the followers get their handles). Rank 0 raises its own refusal, else the first follower's."""
        _broadcast(self.group, (CALL, operation, args if follower_args is None else follower_args()))
        return self.call_here(operation, args)

    def call_here(self, operation: str, args: tuple):
        """This rank's share; every rank then learns every rank's outcome (no rank is left waiting)."""
        result, failure, error = None, None, None
        try:
            result = getattr(self.operations, operation)(*args)
        except Exception as err:  # noqa: BLE001 - gathered first, so no rank is left waiting; rank 0 re-raises
            failure = err
            error = str(err) if isinstance(err, RolloutError) else f"{type(err).__name__}: {err}"
        errors = _gather(self.group, error)
        if not self.group.is_leader:
            return None
        if failure is not None:
            raise failure
        for rank, message in enumerate(errors):
            if message is not None:
                raise RolloutError(f"tensor-parallel rank {rank}: {message}; rank 0 carried it out, "
                                   "so the ranks disagree now: repeat the operation")
        return result

    def close(self) -> None:
        """When the command ends: rank 0 stops the followers (back from `follow`); every rank then leaves
        the process group (also on errors)."""
        try:
            if self.group.is_leader:
                _broadcast(self.group, (STOP,))
            # every rank reaches this point before any tears its connections down: a rank that left
            # first could leave another's gloo threads talking to a closed peer (exit -6 seen in CI)
            dist.barrier(group=self.group.cpu_group)
        finally:
            close_tensor_parallel()
