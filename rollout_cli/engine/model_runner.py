"""Runs one scheduled step: build input tensors, forward, sample.

Owns the device side of the engine: the model, the KV pool and the
req_to_token table ([max_running, max_model_len] slot ids; row r holds the
KV slot of every position of the request in row r).
"""

from __future__ import annotations

import torch

from rollout_cli.engine.attention import KVCache, prepare_attention
from rollout_cli.engine.sampler import SamplingBatch, sample
from rollout_cli.engine.scheduler import ScheduleOutput


class ModelRunner:
    def __init__(self, model, kv: KVCache, max_running: int, max_model_len: int, device: torch.device):
        self.model = model
        self.kv = kv
        self.device = device
        self.req_to_token = torch.zeros((max_running, max_model_len), dtype=torch.int32, device=device)
        attention = model.model.layers[0].self_attn
        self.scale = attention.head_dim ** -0.5

    def _write_table(self, out: ScheduleOutput) -> None:
        rows, cols, slots = [], [], []
        for e in out.entries:
            n = len(e.table_slots)
            rows.extend([e.table_row] * n)
            cols.extend(range(e.table_start, e.table_start + n))
            slots.extend(e.table_slots)
        if slots:
            index = (torch.tensor(rows, device=self.device), torch.tensor(cols, device=self.device))
            self.req_to_token.index_put_(index, torch.tensor(slots, dtype=torch.int32, device=self.device))

    @torch.inference_mode()
    def run(self, out: ScheduleOutput) -> tuple[list[int], list[float]]:
        """One forward over all entries; returns the sampled token and its logprob per sampling entry."""
        self._write_table(out)
        input_ids = torch.tensor([t for e in out.entries for t in e.token_ids], device=self.device)
        positions = torch.tensor(
            [p for e in out.entries for p in range(e.start, e.start + e.num_new_tokens)], device=self.device
        )
        attn = prepare_attention(out.entries, self.req_to_token, self.kv, self.scale)
        hidden = self.model(input_ids, positions, attn)  # [T, hidden]
        last_rows, to_sample, offset = [], [], 0
        for e in out.entries:
            offset += e.num_new_tokens
            if e.sample:
                last_rows.append(offset - 1)
                to_sample.append((e.request, e.start + e.num_new_tokens))
        if not to_sample:
            return [], []
        logits = self.model.compute_logits(hidden[torch.tensor(last_rows, device=self.device)])  # [B, V]
        tokens, logprobs = sample(logits, SamplingBatch.build(to_sample, self.device))
        return tokens.tolist(), logprobs.tolist()
