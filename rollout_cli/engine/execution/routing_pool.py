"""Where captured expert ids live: engine state beside the KV pool, one row per KV slot.

The model only calls a recorder (models/moe.SparseMoeBlock.routing_recorder: record(moe_index,
topk_ids)); what records is here. `RoutingPool` is slot-indexed like the KV pool, so a prefix served
from the radix cache keeps the routing computed with it. `GraphRoutingBuffer` is the recorder
inside CUDA graphs (fixed addresses); a replay's rows go into the pool through `RoutingPool.store`.
Turning capture on and off, and handing finished requests their rows: engine/execution/routing_capture.py.
"""

from __future__ import annotations

import torch


def routing_dtype(num_experts: int) -> torch.dtype:
    """Storage dtype of captured expert ids: uint8 up to 256 experts, else int16."""
    return torch.uint8 if num_experts <= 256 else torch.int16


class GraphRoutingBuffer:
    """The recorder while CUDA graphs are captured: ids [max_tokens, num_moe_layers, top_k] at fixed
    addresses. A replay of a T-token graph leaves the step's ids in rows [0, T), which the runner
    hands to `RoutingPool.store` (padding rows of the bucket are never copied)."""

    def __init__(self, max_tokens: int, num_moe_layers: int, top_k: int, num_experts: int, device):
        self.ids = torch.zeros((max_tokens, num_moe_layers, top_k), dtype=routing_dtype(num_experts), device=device)

    def record(self, moe_index: int, topk_ids: torch.Tensor) -> None:
        self.ids[:topk_ids.shape[0], moe_index] = topk_ids  # one copy kernel, converts to the routing dtype


class RoutingPool:
    """A recorder writing each step's ids into ids [num_kv_slots, num_moe_layers, top_k] at the KV slots
    the step's tokens are stored to (`begin_step(slots)`, one slot per row of the flat batch).

    Slot-indexed like the KV pool, so a prefix served from the radix cache keeps the routing
    computed with it; `gather_async` reads finished requests' rows by their slots into pinned host
    memory without waiting for the GPU (`gather` waits).
    """

    def __init__(self, num_slots: int, num_moe_layers: int, top_k: int, num_experts: int, device):
        self.ids = torch.zeros((num_slots, num_moe_layers, top_k), dtype=routing_dtype(num_experts), device=device)
        self.slots: torch.Tensor | None = None

    def begin_step(self, slots: torch.Tensor) -> None:
        self.slots = slots

    def record(self, moe_index: int, topk_ids: torch.Tensor) -> None:
        if self.slots is None or self.slots.shape[0] != topk_ids.shape[0]:
            return  # a forward outside the engine's step loop (activation profiling)
        self.ids[self.slots, moe_index] = topk_ids.to(self.ids.dtype)

    def store(self, slots: torch.Tensor, ids: torch.Tensor) -> None:
        """ids [len(slots), num_moe_layers, top_k] (a GraphRoutingBuffer's rows) into the rows of `slots`."""
        self.ids[slots] = ids

    def gather(self, slot_lists: list[list[int]]) -> list:
        """Numpy arrays [len(slots), num_moe_layers, top_k], one per list, now (syncs on CUDA)."""
        return self.gather_async(slot_lists).wait()

    def gather_async(self, slot_lists: list[list[int]]) -> "RoutingGather":
        """Start reading the rows of each slot list to the host: one gather kernel and one copy into
        pinned memory, queued behind the work already on the stream; nothing here waits for the GPU.
        Rows are read before any step launched later can overwrite the slots."""
        lengths = [len(slots) for slots in slot_lists]
        index = torch.tensor([s for slots in slot_lists for s in slots], dtype=torch.long)
        if self.ids.device.type != "cuda":
            return RoutingGather(self.ids[index], lengths, None)
        # pinned index -> device and device rows -> pinned host, both asynchronous; a pageable copy
        # would wait for the step launched ahead to finish (overlap scheduling) before returning
        index = index.pin_memory().to(self.ids.device, non_blocking=True)
        rows = self.ids[index]  # [sum(lengths), num_moe_layers, top_k]
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return RoutingGather(host, lengths, done)


class RoutingGather:
    """Rows of finished requests on their way to the host (RoutingPool.gather_async)."""

    def __init__(self, host_rows: torch.Tensor, lengths: list[int], done):
        self._rows, self._lengths, self._done = host_rows, lengths, done

    def wait(self) -> list:
        """Numpy arrays [length, num_moe_layers, top_k], one per slot list; waits for the copy."""
        if self._done is not None:
            self._done.synchronize()
        rows = self._rows.numpy()
        out, start = [], 0
        for length in self._lengths:
            out.append(rows[start:start + length].copy())  # own memory: the pinned block is reused
            start += length
        return out
