"""Verify steps planned ahead of the step before (`--speculative mtp` on a hybrid's verify graphs).

A verify step keeps 1 + m of its entry's rows (m: the leading drafts the sampled tokens equal), which the host
learns only once it has read the step's results. A step planned before that cannot know where each request's
next step starts. The device does: each verify graph settles its own acceptance into per-request tables (its
epilogue, `settle`), and a verify step scheduled ahead of it (BatchEntry.shifted: Scheduler.schedule_ahead,
engine/scheduling/verify_ahead_plan.py) is planned at the lowest start it can have (the step before kept one
token) and shifted on the device in the graph's prologue (`shift`) by the m the step before kept:

    accepted    [rows] int64     m of the request row's last verify step
    state_of    [rows] int64     the linear-state slot holding the state after its last kept token: the fork
                                 of row m, or (every draft kept) the request's own slot; the host hands the
                                 request that fork when it post-processes the step (Speculation._accept_drafts)
    next_draft  [rows] int64     the MTP head's greedy draft after the bonus token (the token sampled at row m,
                                 which goes into the TokenTable, where a PENDING input reads it)
    next_hidden [rows, H]        the head's output at row m: the chain's first input (mtp_chain.py)

`settle_head` fills the last two inside the head's verify graph (DecodeGraphs.run_head). The shifted step's
positions, KV slots (read from req_to_token, where the host wrote every slot it may use), sampling keys,
rotary positions, sequence lengths, linear-state slots and the chain's inputs then follow from the tables,
so the step is the one the host would have planned after reading the results: the same tokens.
"""

from __future__ import annotations

import torch

from rollout_cli.engine.execution.token_table import TokenTable
from rollout_cli.engine.scheduling.schedule_output import DRAFT_AHEAD


def entry_rows(cu: torch.Tensor, num_rows: int, width: int) -> torch.Tensor:
    """cu [E + 1] (entry b's rows cu[b] .. cu[b + 1] - 1) -> row indices [E, width], clamped into the step's
    `num_rows` rows: an entry's rows past its count repeat a valid one, masked by the caller."""
    return (cu[:-1, None] + torch.arange(width, device=cu.device)).clamp(max=num_rows - 1)


class AheadTables:
    """The per-request-row tables a verify graph settles and a shifted step reads (see the module doc)."""

    def __init__(self, num_rows: int, hidden_size: int, dtype: torch.dtype, pad_row: int, device: torch.device):
        self.pad_row = pad_row  # entries with no rows write here: no request owns it
        self.accepted = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self.state_of = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self.next_draft = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self.next_hidden = torch.zeros((num_rows, hidden_size), dtype=dtype, device=device)

    def _entries(self, cu: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (row counts [E], each entry's first row [E] (clamped into the step), its req_to_token row [E]: the
        pad row for entries of no rows)."""
        counts = cu[1:] - cu[:-1]
        first = cu[:-1].clamp(max=rows.shape[0] - 1)
        return counts, first, torch.where(counts > 0, rows[first], self.pad_row)

    def shift(self, shifted: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, rope: torch.Tensor,
              sample_positions: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor, req_to_token: torch.Tensor,
              cu: torch.Tensor, state_slots: torch.Tensor) -> torch.Tensor:
        """The prologue of a verify graph of R rows, in place on its static inputs: rows with shifted [R] = 1
        move by their request's `accepted`; their KV slots are read from req_to_token at the moved positions,
        and each shifted entry's linear-state slot (state_slots [E], by layout cu [E + 1]) is `state_of` its
        row. positions, rope, sample_positions, slots [R] int64 and seq_lens [R] int32 are views of the step's
        buffers. -> the shift per row [R] (0 where not shifted), which the chain's columns add too."""
        delta = self.accepted[rows] * shifted  # [R]
        positions += delta
        rope += delta
        sample_positions += delta
        seq_lens += delta.to(seq_lens.dtype)
        moved = shifted.bool()
        slots.copy_(torch.where(moved, req_to_token[rows, positions].long(), slots))
        counts, first, table_rows = self._entries(cu, rows)
        state_slots.copy_(torch.where(moved[first] & (counts > 0), self.state_of[table_rows], state_slots))
        return delta

    def input_ids(self, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """ids [R] with DRAFT_AHEAD where the row's input is its request's `next_draft` -> [R] input ids."""
        return torch.where(ids == DRAFT_AHEAD, self.next_draft[rows], ids)

    def settle(self, cu: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, sampled: torch.Tensor,
               state_slots: torch.Tensor, forks: torch.Tensor, tokens: TokenTable) -> None:
        """The epilogue of a verify graph: entry b (rows cu[b] .. cu[b + 1] - 1, input ids [R], sampled tokens
        [R], state slot state_slots[b], forks [E, K]) kept 1 + m rows, m the leading rows whose sampled token
        equals the next row's input (its draft): `accepted`, `state_of`, and the bonus token (row m's) into the
        token table, at the entry's request row. What Speculation._accept_drafts decides on the host, unless
        the request finishes inside the step (then nothing reads these)."""
        num_rows, num_drafts = rows.shape[0], forks.shape[1]
        counts, _, table_rows = self._entries(cu, rows)
        index = entry_rows(cu, num_rows, num_drafts + 1)  # [E, K + 1]
        later = torch.arange(num_drafts + 1, device=cu.device) + 1 < counts[:, None]  # row j has a draft after it
        equal = (sampled[index] == ids[(index + 1).clamp(max=num_rows - 1)]) & later
        kept = equal.long().cumprod(dim=1).sum(dim=1)  # [E]: m
        bonus = sampled[index].gather(1, kept[:, None]).squeeze(1)
        fork = forks.gather(1, kept.clamp(max=num_drafts - 1)[:, None]).squeeze(1)
        self.accepted[table_rows] = kept
        self.state_of[table_rows] = torch.where(kept < counts - 1, fork, state_slots)
        tokens.store(table_rows, bonus)

    def settle_head(self, cu: torch.Tensor, rows: torch.Tensor, head_out: torch.Tensor, model) -> None:
        """The epilogue of the head's verify graph (after `settle`): each entry's head output at its last kept
        row (head_out [R, H]) and the greedy draft it makes through the target's LM head."""
        _, first, table_rows = self._entries(cu, rows)
        last_kept = (first + self.accepted[table_rows]).clamp(max=rows.shape[0] - 1)
        hidden = head_out[last_kept]  # [E, H]
        self.next_hidden[table_rows] = hidden
        self.next_draft[table_rows] = model.compute_logits(hidden).argmax(dim=-1)
