"""--speculative mtp with K > 1 draft tokens inside a hybrid's verify graph: the head's chain replayed.

An entry verifying d drafts arrives with draft 1 (the head's prediction behind the step before) and DRAFT_LATER
at drafts 2..d: those positions had no KV slots until this step allocated its rows. Eagerly, MTPStep.extend_drafts
fills them in before the target's forward. Inside a verify graph the same chain runs from static buffers: pass j
(1..K-1) runs the head at position start + j - 1 on (its output at the position before, Request.mtp_hidden for
j = 1; draft j), stores the head's KV at that position's slot, and writes the greedy token of its output as draft
j + 1 into the step's input ids, which the target's forward then reads. The graph hands its input ids back as a
third row of its results, so the host learns the drafts when it reads the sampled tokens (fill_drafts), before
post-processing compares them.

Static buffers, for a chain width C (an entry that chains has at least 3 rows: C = rows // 3 suffices):
    meta [7, K - 1, C] int64: per pass and chaining entry, the row holding draft j, the row receiving draft j + 1,
        the req_to_token row, the KV slot, the position, the rotary position and the sequence length. An entry not
        drafting that far, and every padding column, reads and writes the scratch row past the widest bucket and
        attends one key at slot 0 of the padding row, which no request owns.
    hidden [C, H]: each chaining entry's Request.mtp_hidden.
"""

from __future__ import annotations

import torch

from rollout_cli.engine.execution.graph_replay import host_buffer
from rollout_cli.engine.scheduling.schedule_output import DRAFT_LATER

_TOKEN_ROW, _DEST_ROW, _TABLE_ROW, _SLOT, _POSITION, _ROPE_POSITION, _SEQ_LEN = range(7)


def chain_width(rows: int) -> int:
    """Chaining entries a step of `rows` verify rows can hold (each has 1 + d >= 3 rows)."""
    return max(1, rows // 3)


def chains(entry) -> bool:
    """Whether the head draws `entry`'s drafts 2.. inside its step (MTPDrafter left them DRAFT_LATER)."""
    return entry.num_draft > 1 and entry.token_ids[2] == DRAFT_LATER


def fill_drafts(entries, input_ids: list) -> None:
    """After a verify graph ran: each chaining entry's drafts 2.., and every input of an entry planned ahead
    (its bonus token and drafts: verify_ahead.py), from the step's input ids (the results' third row, one float
    per row in entry order)."""
    offset = 0
    for e in entries:
        if e.shifted:
            e.token_ids[:] = [int(t) for t in input_ids[offset:offset + e.num_new_tokens]]
        elif chains(e):
            for j in range(2, 1 + e.num_draft):
                e.token_ids[j] = int(input_ids[offset + j])
        offset += e.num_new_tokens


class ChainedDrafts:
    """The chain's static buffers for verify graphs of up to `max_rows` rows and `num_drafts` drafts."""

    def __init__(self, max_rows: int, num_drafts: int, hidden_size: int, dtype: torch.dtype, pad_row: int,
                 device: torch.device):
        self.passes = num_drafts - 1
        self.width = chain_width(max_rows)
        self.scratch = max_rows  # the input-id row nobody reads: inactive columns read and write it
        self._inactive = (self.scratch, self.scratch, pad_row, 0, 0, 0, 1)  # one column of one pass
        shape = (7, self.passes, self.width)
        self.padding = torch.tensor(self._inactive, dtype=torch.int64)[:, None, None].expand(shape).contiguous()
        self.meta = self.padding.clone().to(device)  # a copy on the CPU too (.to(cpu) would alias it)
        self.hidden = torch.zeros((self.width, hidden_size), dtype=dtype, device=device)
        self.staging = [host_buffer(shape, torch.int64, device) for _ in range(2)]

    def fill(self, entries, bucket: int, parity: int) -> None:
        """Queue the chain of a verify step's entries (in row order, padded to `bucket` rows) into the buffers, and
        their Request.mtp_hidden; the requests hand those over (as MTPStep.extend_drafts does)."""
        columns, hidden = [], []
        offset = 0
        for e in entries:
            if chains(e):
                column = []
                for j in range(1, self.passes + 1):
                    if e.num_draft > j:  # pass j draws draft j + 1 at position start + j - 1
                        at = e.start + j - 1
                        slot = 0 if e.shifted else e.new_slots[j - 1]  # shifted: read on the device (shift)
                        column.append((offset + j, offset + j + 1, e.table_row, slot, at, at + e.request.rope_delta,
                                       at + 1))
                    else:
                        column.append(self._inactive)
                columns.append(column)
                # a shifted entry's (planned ahead): read on the device, from the step before (shift)
                hidden.append(self.hidden[0] if e.shifted else e.request.mtp_hidden)
                e.request.mtp_hidden = None
            offset += e.num_new_tokens
        assert len(columns) <= chain_width(bucket), f"{len(columns)} chaining entries in a bucket of {bucket} rows"
        staged = self.staging[parity]
        staged.copy_(self.padding)
        if columns:
            staged[:, :, :len(columns)] = torch.tensor(columns, dtype=torch.int64).permute(2, 1, 0)
            self.hidden[:len(columns)].copy_(torch.stack(hidden))
        self.meta.copy_(staged, non_blocking=True)

    def fill_padding(self) -> None:
        """Every column inactive: what warm-up and capture run."""
        self.meta.copy_(self.padding)

    def shift(self, bucket: int, delta: torch.Tensor, shifted: torch.Tensor, req_to_token: torch.Tensor,
              next_hidden: torch.Tensor) -> None:
        """Inside a verify graph of `bucket` rows, before draft_inside: the columns of entries planned ahead
        (shifted [bucket] = 1 on their rows) move by their rows' delta [bucket] (verify_ahead.AheadTables.shift),
        read their KV slots from req_to_token at the moved positions and start from the head's output the
        step before kept (next_hidden [table rows, H])."""
        meta, width = self.meta, chain_width(bucket)
        token_rows = meta[_TOKEN_ROW, :, :width]  # [P, C]
        active = token_rows < bucket
        at = token_rows.clamp(max=bucket - 1)
        moved = shifted[at].bool() & active
        step = delta[at] * active
        for field in (_POSITION, _ROPE_POSITION, _SEQ_LEN):
            meta[field, :, :width] += step
        positions, table_rows = meta[_POSITION, :, :width], meta[_TABLE_ROW, :, :width]
        meta[_SLOT, :, :width] = torch.where(moved, req_to_token[table_rows, positions].long(), meta[_SLOT, :, :width])
        first = moved[0, :, None]  # pass 1 is active in every chaining column
        self.hidden[:width] = torch.where(first, next_hidden[table_rows[0]], self.hidden[:width])

    def draft_inside(self, graphs, bucket: int, ids: torch.Tensor) -> torch.Tensor:
        """Inside a verify graph of `bucket` rows (graphs: the DecodeGraphs capturing it): the step's input ids
        [bucket] with drafts 2.. drawn by the head's chain."""
        model, width = graphs.model, chain_width(bucket)
        meta, hidden = self.meta[:, :, :width], self.hidden[:width]
        ids = torch.cat((ids, ids.new_zeros(self.scratch + 1 - bucket)))  # [max_rows + 1]: the scratch row last
        for j in range(self.passes):
            attn = graphs.row_attention(meta[_SLOT, j], meta[_TABLE_ROW, j], meta[_SEQ_LEN, j].to(torch.int32),
                                        meta[_POSITION, j])
            embeds = model.model.embed_tokens(ids[meta[_TOKEN_ROW, j]])  # [C, H]
            hidden = model.mtp(embeds, hidden, meta[_ROPE_POSITION, j], attn)  # [C, H], its KV stored
            drafts = model.compute_logits(hidden).argmax(dim=-1)  # [C]: what MTPStep._greedy draws
            ids = ids.scatter(0, meta[_DEST_ROW, j], drafts)
        return ids[:bucket]
