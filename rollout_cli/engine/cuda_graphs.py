"""CUDA graphs for decode steps: one graph per batch-size bucket, captured once.

A decode step of B requests replays the graph of the smallest bucket >= B.
Inputs live in static device buffers, filled from one pinned host buffer per
step; the graph itself records each request's new slot in req_to_token.
Bucket entries past B are padding: they use row `pad_row` of req_to_token
(slot 0), attend one key, and write their k/v into slot 0, which the slot
allocator never hands out. Prefill steps run eagerly.

MoE models record their expert ids into a `GraphRoutingBuffer` while the graphs are captured
(rows [0, B) after a replay of B tokens), whatever recorder the model has outside the graphs;
`routing_rows` hands them to the runner, which stores them in the routing pool when capture is on.
"""

from __future__ import annotations

import time

import torch

from rollout_cli.engine.triton_attention import TritonAttentionBatch
from rollout_cli.models.moe import GraphRoutingBuffer, SparseMoeBlock


def batch_buckets(max_batch: int) -> list[int]:
    buckets = [b for b in (1, 2, 4, 8) if b < max_batch]
    buckets += list(range(16, max_batch, 16))
    return sorted(set(buckets + [max_batch]))


class DecodeGraphs:
    def __init__(self, model, kv, req_to_token: torch.Tensor, pad_row: int, scale: float, max_batch: int):
        self.model = model
        self.kv = kv
        self.req_to_token = req_to_token
        self.pad_row = pad_row
        self.scale = scale
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        device = req_to_token.device
        # rows of `inputs`: token id, position, table row, KV slot; seq_lens is int32 for the kernel
        self.inputs = torch.zeros((4, self.max_batch), dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(self.max_batch, dtype=torch.int32, device=device)
        self.staging = torch.zeros((4, self.max_batch), dtype=torch.int64).pin_memory()
        self.staging_seq_lens = torch.ones(self.max_batch, dtype=torch.int32).pin_memory()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        moe_layers = getattr(model, "moe_layers", None)
        self.routing = (GraphRoutingBuffer(self.max_batch, len(moe_layers), model.top_k, model.num_experts, device)
                        if moe_layers else None)

    def _forward(self, batch: int) -> torch.Tensor:
        ids, positions, rows, slots = (self.inputs[i, :batch] for i in range(4))
        self.req_to_token[rows, positions] = slots.to(torch.int32)  # this step's slots, inside the graph
        attn = TritonAttentionBatch(self.kv, self.req_to_token, slots, rows, self.seq_lens[:batch], None, self.scale)
        return self.model.compute_logits(self.model(ids, positions, attn))  # [batch, vocab] float32

    @torch.inference_mode()
    def capture(self) -> None:
        blocks = [m for m in self.model.modules() if isinstance(m, SparseMoeBlock)]
        outside = [block.routing_recorder for block in blocks]
        for block in blocks:
            block.routing_recorder = self.routing
        try:
            self._capture()
        finally:
            for block, recorder in zip(blocks, outside):
                block.routing_recorder = recorder

    def _capture(self) -> None:
        start = time.monotonic()
        self.inputs[2].fill_(self.pad_row)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: compiles the kernels, settles the allocator
            for batch in self.buckets:
                self._forward(batch)
        torch.cuda.current_stream().wait_stream(side)
        pool = None
        for batch in reversed(self.buckets):  # largest first so smaller graphs reuse its pool
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(batch)
            pool = graph.pool()
            self.graphs[batch] = (graph, logits)
        torch.cuda.synchronize()
        self.capture_seconds = time.monotonic() - start

    def can_run(self, entries) -> bool:
        return 0 < len(entries) <= self.max_batch and all(e.num_new_tokens == 1 and e.sample for e in entries)

    def run(self, entries) -> torch.Tensor:
        """Replay for a decode-only step; returns logits [len(entries), vocab]."""
        batch = len(entries)
        bucket = next(b for b in self.buckets if b >= batch)
        pad = bucket - batch
        # Build plain lists, then one host copy and one device copy per buffer.
        values = [
            [e.token_ids[0] for e in entries] + [0] * pad,
            [e.start for e in entries] + [0] * pad,
            [e.table_row for e in entries] + [self.pad_row] * pad,
            [e.new_slots[0] for e in entries] + [0] * pad,
        ]
        self.staging[:, :bucket] = torch.tensor(values, dtype=torch.int64)
        self.staging_seq_lens[:bucket] = torch.tensor([e.start + 1 for e in entries] + [1] * pad, dtype=torch.int32)
        self.inputs[:, :bucket].copy_(self.staging[:, :bucket], non_blocking=True)
        self.seq_lens[:bucket].copy_(self.staging_seq_lens[:bucket], non_blocking=True)
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits[:batch]

    def routing_rows(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """After `run` of `batch` entries: (KV slots [batch], expert ids [batch, num_moe_layers, top_k])."""
        return self.inputs[3, :batch], self.routing.ids[:batch]
