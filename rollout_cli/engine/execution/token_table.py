"""The device-side token table: the token each request row sampled last.

A decode step scheduled ahead of its inputs (Scheduler.schedule_ahead, engine/scheduling/overlap_schedule.py)
carries PENDING as its input token: the step before it has not been post-processed, so the host does not
know the token yet. The GPU does. Every sampling step stores its tokens here by request row (the runner's
req_to_token row, `BatchEntry.table_row`; the CUDA graphs do it inside the replay), and a step reads a
PENDING input from here, on the device, so the host never waits for a token or patches one in. Only the
paths that need the input as a host integer (the on-policy mode's per-token forwards, tensor-parallel
followers) read it back, after the step that sampled it.

Verify steps (speculative decoding) sample 1 + d tokens per request row. Eager ones store none, and nothing
is scheduled ahead of them; a hybrid's verify graph stores each entry's bonus token (the one drawn after its
last accepted draft), which the verify step planned ahead of it reads (engine/execution/verify_ahead.py).
"""

from __future__ import annotations

import torch

from rollout_cli.engine.scheduling.schedule_output import PENDING


class TokenTable:
    def __init__(self, num_rows: int, device: torch.device):
        # [num_rows] int64: row r's last sampled token. A fixed address: the decode graphs read and write it
        # (the padding row, the last one, takes the padding entries' writes and is never read).
        self.next_token = torch.zeros(num_rows, dtype=torch.int64, device=device)

    def store(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """rows [B] int64, tokens [B] int64 (capturable): each row's newly sampled token."""
        self.next_token[rows] = tokens

    def input_ids(self, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """ids [T] int64 with PENDING where the input is the row's last sampled token, rows [T] int64 (each
        token's request row) -> [T] input ids (capturable). Other negative ids (MTP's drafts still to come)
        are not PENDING and pass through."""
        return torch.where(ids == PENDING, self.next_token[rows], ids)

    def resolve_on_host(self, entries) -> None:
        """Entries (BatchEntry) scheduled ahead take their input token (PENDING) as a host int, for the paths
        that need one (the per-token forwards, tensor-parallel followers). Waits for the step that sampled
        it, as those paths' previous step (eager) already did."""
        pending = [e for e in entries if e.token_ids == [PENDING]]
        if pending:
            index = torch.tensor([e.table_row for e in pending], dtype=torch.int64, device=self.next_token.device)
            for e, token in zip(pending, self.next_token[index].tolist()):
                e.token_ids = [token]
