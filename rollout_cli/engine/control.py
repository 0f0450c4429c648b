"""The engine's control API: every operation on a loaded engine outside the step loop.

`EngineControl` is the one API that the CLI, the daemon's worker and the Python `Engine` call:
abort, flush the prefix cache, reload weights from disk, weight updates from a trainer (tensors,
broadcast groups), release and resume of memory, and what memory the engine holds.

Operations that change what every tensor-parallel rank holds (weights, memory, weight update
groups) are carried out by `RankOperations`, one rank's share on its own shard, reached through
the engine's `ranks` object chosen once at construction: `SingleRank` calls it directly,
`engine.tensor_parallel.TensorParallelRanks` sends the call to every rank first. Operations on the
scheduler alone (abort, flush) run on rank 0 only: the followers keep no cache index of their own.

Each operation is called by the one thread that owns the engine (the daemon's worker), between
engine steps; none is safe to call while another thread steps the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from rollout_cli.engine.memory.memory_saver import MEMORY_TAGS, free_device_bytes, parse_tags
from rollout_cli.engine.weights import weight_updates
from rollout_cli.engine.weights.tensor_ipc import serialize_named_tensors
from rollout_cli.errors import RolloutError

if TYPE_CHECKING:  # annotations only: the engine builds its control
    from rollout_cli.engine.engine import Engine, Trajectory
    from rollout_cli.engine.scheduling.request import Request


class RankOperations:
    """One rank's share of the operations that reach every rank, on its own shard of the engine.
    Every rank checks the same things (names, full shapes, dtypes, memory state) and so refuses alike."""

    def __init__(self, engine: Engine, rank: int = 0):
        self.engine = engine
        self.rank = rank

    def reload_weights(self, path: str, version: str | None, accepted_dtypes: dict[str, str]) -> str:
        return weight_updates.reload_weights(self.engine, path, version, accepted_dtypes)

    def update_weights_from_tensor(self, named_tensors, version: str | None, partial: bool,
                                   accepted_dtypes: dict[str, str]) -> str:
        return weight_updates.update_weights_from_tensor(self.engine, named_tensors, version, partial, accepted_dtypes)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str | None, timeout_seconds: float,
                                  num_ranks: int) -> None:
        """Join the trainer's group as rank rank_offset + this rank (SGLang's numbering), so the
        trainer's one broadcast reaches every shard."""
        if rank_offset + num_ranks > world_size:
            raise RolloutError(f"world_size {world_size} leaves no room for the engine's {num_ranks} tensor-parallel "
                               f"ranks from rank_offset {rank_offset}; the trainer's group needs world_size "
                               f"{rank_offset + num_ranks} or more")
        weight_updates.init_weights_update_group(self.engine, master_address, master_port, rank_offset + self.rank,
                                                 world_size, group_name, backend, timeout_seconds)

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name: str, version: str | None,
                                        partial: bool, accepted_dtypes: dict[str, str]) -> str:
        return weight_updates.update_weights_from_distributed(self.engine, names, dtypes, shapes, group_name,
                                                              version, partial, accepted_dtypes)

    def drain_broadcast(self, group_name: str, names, dtypes, shapes) -> None:
        weight_updates.drain_broadcast(self.engine, group_name, names, dtypes, shapes)

    def destroy_weights_update_group(self, group_name: str) -> None:
        weight_updates.destroy_weights_update_group(self.engine, group_name)

    def release_memory(self, tags) -> dict:
        """Free the memory of `tags` (default: all). Refused while requests are in flight; returns only
        after the memory is free. Cached prefixes live in the cache memory, so a KV release flushes
        them; graphs whose pool or captured tensors go are dropped (re-captured on resume)."""
        engine, memory = self.engine, self.engine.memory
        tags = parse_tags(tags)
        if engine.scheduler.has_work():
            raise RolloutError("cannot release memory while requests are in flight; "
                               "stop the job first (rollout pause --mode abort, or rollout abort)")
        todo = [t for t in tags if t not in memory.released]
        started = time.perf_counter()
        free_before = free_device_bytes(engine.device)
        if "kv_cache" in todo:
            engine.scheduler.flush_cache()
        if memory.graphs_must_go(todo):
            engine.runner.drop_cuda_graphs()
        memory.release(todo, engine.model, engine.cache_pools)
        return {"released": todo, "already_released": [t for t in tags if t not in todo],
                "seconds": time.perf_counter() - started, "free_bytes_before": free_before,
                "free_bytes_after": free_device_bytes(engine.device)}

    def resume_memory(self, tags) -> dict:
        """Take back the memory of `tags` (default: all released ones); re-capture dropped graphs once
        everything they point at is back."""
        engine, memory = self.engine, self.engine.memory
        tags = parse_tags(tags)
        todo = [t for t in tags if t in memory.released]
        started = time.perf_counter()
        memory.resume(todo, engine.model, engine.cache_pools)
        capture_seconds = None
        if not memory.released & set(MEMORY_TAGS) and engine.runner.graphs_dropped:
            capture_seconds = engine.runner.recapture_cuda_graphs()
        return {"resumed": todo, "not_released": [t for t in tags if t not in todo],
                "seconds": time.perf_counter() - started, "cuda_graph_capture_seconds": capture_seconds,
                "weights_stale": memory.weights_stale, "free_bytes_after": free_device_bytes(engine.device)}


class SingleRank:
    """The `ranks` of a one-process engine: an operation runs here and nowhere else."""

    size = 1

    def __init__(self, operations: RankOperations):
        self.operations = operations

    def call(self, operation: str, *args, follower_args=None):
        """`operation` of RankOperations with `args`; `follower_args` (what other ranks would get) is unused."""
        return getattr(self.operations, operation)(*args)

    def close(self) -> None:
        pass


class EngineControl:
    """The control API of one engine (rank 0's under --tp)."""

    def __init__(self, engine: Engine, ranks):
        self.engine = engine
        self.ranks = ranks  # SingleRank or engine.tensor_parallel.TensorParallelRanks
        self._start_dtypes: dict[str, str] | None = None

    @property
    def start_dtypes(self) -> dict[str, str]:
        """Tensor name -> dtype in the checkpoint the engine started from: an update may also come in these."""
        if self._start_dtypes is None:
            config = self.engine.config
            self._start_dtypes = {} if config.load_format == "dummy" else weight_updates.checkpoint_dtypes(config.model)
        return self._start_dtypes

    # ---- rank 0's scheduler only ---------------------------------------------------------

    def abort(self, which: Callable[[Request], bool] | None = None) -> list[Trajectory]:
        """Finish every running and waiting request (or those `which` selects) with finish_reason "abort";
        return their trajectories (partial responses, possibly empty) so the caller writes them like any
        other row."""
        engine = self.engine
        scheduler = engine.scheduler
        requests = [r for r in list(scheduler.running) + list(scheduler.waiting) if which is None or which(r)]
        routing = engine.routing.gather_computed(requests)  # read before abort gives the slots back
        scheduler.abort(requests)  # gives back slots and table rows
        for request in requests:
            request.finish_reason = "abort"
        order = sorted(range(len(requests)), key=lambda i: (requests[i].prompt_index, requests[i].sample_index))
        return [engine.trajectory(requests[i], routing[i]) for i in order]

    def flush_cache(self) -> None:
        """Drop every cached prefix (rollout flush-cache); refused while requests are in flight."""
        self.engine.scheduler.flush_cache()

    def memory_held(self) -> dict:
        """Bytes the engine holds: weights, KV pool and (CUDA) what the allocator reserved."""
        engine = self.engine
        released = engine.memory.released
        weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        kv = [getattr(engine.kv, name) for name in engine.kv.storage_names]
        cache = sum(t.numel() * t.element_size() for t in kv)
        info = {"device": str(engine.device), "weights_bytes": 0 if "weights" in released else weights,
                "kv_cache_bytes": 0 if "kv_cache" in released else cache, **engine.memory.state()}
        if engine.device.type == "cuda":
            info["cuda_reserved_bytes"] = torch.cuda.memory_reserved(engine.device)
            free, total = torch.cuda.mem_get_info(engine.device)
            info["device_free_bytes"], info["device_total_bytes"] = free, total
        return info

    # ---- every rank ------------------------------------------------------------------------

    def reload_weights(self, path: str, version: str | None = None) -> str:
        """Replace the weights with the checkpoint in `path` on every rank; returns the new weight version.
        A refused checkpoint changes nothing (see weight_updates.reload_weights)."""
        return self.ranks.call("reload_weights", path, version, self.start_dtypes)

    def update_weights_from_tensor(self, named_tensors, version: str | None = None, partial: bool = False) -> str:
        """New weights from (name, tensor) pairs, a dict, a FlattenedBucket or a serialized payload
        (tensor_ipc). Other ranks open handles to in-process tensors (shared memory or CUDA IPC)."""
        args = (version, partial, self.start_dtypes)
        if isinstance(named_tensors, (str, bytes)):  # already a payload: every rank opens it as it is
            return self.ranks.call("update_weights_from_tensor", named_tensors, *args)
        return self.ranks.call("update_weights_from_tensor", named_tensors, *args,
                               follower_args=lambda: (serialize_named_tensors(named_tensors), *args))

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str | None = None, timeout_seconds: float = 600.0) -> None:
        """Join the trainer's broadcast group as rank `rank_offset` (nccl on CUDA, gloo on the CPU by
        default); under --tp N rank r joins as rank_offset + r, so `world_size` must count all N."""
        self.ranks.call("init_weights_update_group", master_address, master_port, rank_offset, world_size,
                        group_name, backend, timeout_seconds, self.ranks.size)

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name: str, version: str | None = None,
                                        partial: bool = False) -> str:
        """Receive the tensors the trainer's rank 0 broadcasts (in `names` order); returns the new version."""
        return self.ranks.call("update_weights_from_distributed", names, dtypes, shapes, group_name, version,
                               partial, self.start_dtypes)

    def drain_broadcast(self, group_name: str, names, dtypes, shapes) -> None:
        """Receive and drop a broadcast the engine refuses, so the trainer is not left hanging in it."""
        self.ranks.call("drain_broadcast", group_name, names, dtypes, shapes)

    def destroy_weights_update_group(self, group_name: str) -> None:
        self.ranks.call("destroy_weights_update_group", group_name)

    def release_memory(self, tags=None) -> dict:
        """Free GPU memory for a trainer (tags: weights, kv_cache, cuda_graph; default all)."""
        return self.ranks.call("release_memory", tags)

    def resume_memory(self, tags=None) -> dict:
        """Take released memory back; without --weights-cpu-backup new weights must be loaded before generating."""
        return self.ranks.call("resume_memory", tags)

    def close(self) -> None:
        """When the command ends: leave this rank's weight update groups (a gloo group alive at
        interpreter exit can abort the process), then release the other ranks (--tp)."""
        try:
            weight_updates.close_weight_update_groups(self.engine)
        finally:
            self.ranks.close()
