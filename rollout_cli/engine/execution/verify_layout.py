"""The static layout a hybrid model's verify steps are replayed from CUDA graphs with.

A step verifying drafts on a model with Gated DeltaNet layers runs each request's last token and its d drafts
in order through the linear layers, keeping the state after each draft position in a fork slot
(linear_state.LinearBatch's verify kernels). A graph of such steps cannot read that layout on the host, so it
lives in device buffers, rewritten before each replay: for a bucket of R rows,

    cu [R + 1]     entry b's rows are cu[b] .. cu[b + 1] - 1 (the verify rows, flattened entry by entry)
    slots [R]      entry b's state slot
    forks [R, K]   the slots receiving entry b's state after its token j (-1: none)

The real entries come first; each row of the bucket past them (the graph's padding rows) is an entry of one
row on the pool's padding slot 0, so every row is computed from finite inputs; the entries left after those
have no rows and slot -1 (they touch nothing). R entries always suffice: an entry has at least one row.
"""

from __future__ import annotations

import torch

from rollout_cli.engine.execution.graph_replay import host_buffer
from rollout_cli.engine.execution.linear_state import LinearBatch
from rollout_cli.engine.execution.mtp_chain import ChainedDrafts
from rollout_cli.engine.scheduling.schedule_output import DRAFT_LATER, BatchEntry

PADDING_SLOT = 0  # the linear-state pool's slot that padding rows use (never a request's)


def layout_rows(entries, bucket: int, max_drafts: int) -> list[int]:
    """entries (a verify step's, in row order: num_new_tokens = 1 + d rows, request.state_slot, state_forks)
    padded to `bucket` rows -> cu [bucket + 1] + slots [bucket] + forks [bucket * max_drafts], one flat list
    of host ints (the staging buffer's order)."""
    cu, slots, forks = [0], [], []
    for e in entries:
        cu.append(cu[-1] + e.num_new_tokens)
        slots.append(e.request.state_slot)
        own = list(e.state_forks or [])
        forks += own + [-1] * (max_drafts - len(own))
    rows = cu[-1]
    assert rows <= bucket, f"{rows} verify rows past the bucket of {bucket}"
    cu += list(range(rows + 1, bucket + 1))  # one-row padding entries
    slots += [PADDING_SLOT] * (bucket - rows)
    cu += [bucket] * (bucket + 1 - len(cu))  # entries of no rows
    slots += [-1] * (bucket - len(slots))
    forks += [-1] * (bucket * max_drafts - len(forks))
    return cu + slots + forks


def graph_rows(entries, graphs, hybrid: bool) -> list | None:
    """The one-token rows a decode graph replays for this step (graphs: the runner's DecodeGraphs), or None
    where no graph can run it. A verify entry (speculative decoding) becomes its 1 + d rows: row j decodes
    token j at start + j, attends through the decode kernel to its own prefix (the drafts before it
    included: each layer stores every row's k/v before it attends) and samples at its own position, as the
    entry's row j does in an eager step. A `hybrid` model keeps a state per draft position: its rows replay
    the verify graphs, whose linear layers read the entries' layout (VerifyLayout), or run eagerly where
    none were captured. MTP's chained drafts (DRAFT_LATER) are drawn inside those graphs (mtp_chain.py), or
    eagerly where none chains. A step that also prefills a request admitted beside the drafts runs eagerly
    (its prompt rows would each sample, and the step's results would no longer be one per sampling entry
    plus its drafts)."""
    if not any(e.num_draft or e.shifted for e in entries):  # a shifted step needs the verify graph's prologue
        return entries if graphs.can_run(entries) else None
    if any(e.num_new_tokens != 1 + e.num_draft for e in entries):
        return None
    chained = any(DRAFT_LATER in e.token_ids for e in entries)  # MTP's drafts 2.., drawn inside the step
    if (hybrid or chained) and (graphs.verify is None or chained and graphs.verify.chain is None):
        return None
    # (a shifted entry's slots are read on the device at the positions it moves to: 0 stands in)
    rows = [BatchEntry(e.request, e.table_row, e.start + j, [e.token_ids[j]], e.start + j,
                       [0 if e.shifted else e.new_slots[j]], True, shifted=e.shifted)
            for e in entries for j in range(e.num_new_tokens)]
    return rows if graphs.can_run(rows, verify=hybrid) else None


class VerifyLayout:
    """The device buffers (one set, sized for the widest bucket) and their two pinned staging copies."""

    def __init__(self, max_rows: int, max_drafts: int, device: torch.device, chain: ChainedDrafts | None = None):
        self.max_rows, self.max_drafts = max_rows, max_drafts
        self.chain = chain  # --speculative mtp, K > 1: the head's chain drawn inside the step (mtp_chain.py)
        self.cu = torch.zeros(max_rows + 1, dtype=torch.int64, device=device)
        self.slots = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.forks = torch.full((max_rows, max_drafts), -1, dtype=torch.int64, device=device)
        size = max_rows + 1 + max_rows + max_rows * max_drafts
        self.staging = [host_buffer(size, torch.int64, device) for _ in range(2)]

    def linear_batch(self, pool, bucket: int) -> LinearBatch:
        """The LinearBatch a graph of `bucket` rows captures: views of the static buffers."""
        return LinearBatch(pool, self.slots[:bucket], triton_kernels=True,
                           verify=(self.cu[:bucket + 1], self.forks[:bucket]))

    def fill(self, entries, bucket: int, parity: int) -> None:
        """Queue this step's layout (entries padded to `bucket` rows) into the buffers a graph of that bucket
        reads: one pinned host buffer, three asynchronous copies."""
        staged = self.staging[parity]
        values = layout_rows(entries, bucket, self.max_drafts)
        staged[:len(values)] = torch.tensor(values, dtype=torch.int64)
        cu, slots, forks = staged[:len(values)].split([bucket + 1, bucket, bucket * self.max_drafts])
        self.cu[:bucket + 1].copy_(cu, non_blocking=True)
        self.slots[:bucket].copy_(slots, non_blocking=True)
        self.forks[:bucket].copy_(forks.view(bucket, self.max_drafts), non_blocking=True)
        if self.chain is not None:
            self.chain.fill(entries, bucket, parity)

    def fill_padding(self) -> None:
        """Every row an entry of its own on the padding slot, no forks: what warm-up and capture run."""
        self.cu.copy_(torch.arange(self.max_rows + 1))
        self.slots.fill_(PADDING_SLOT)
        self.forks.fill_(-1)
        if self.chain is not None:
            self.chain.fill_padding()
