"""The device-side token table (engine/execution/token_table.py): what a step scheduled ahead reads."""

from __future__ import annotations

import torch

from rollout_cli.engine.execution.token_table import TokenTable
from rollout_cli.engine.scheduling.schedule_output import DRAFT_LATER, PENDING, BatchEntry

from scheduler_oracle import make_request


def test_pending_inputs_read_their_rows_last_sampled_token():
    table = TokenTable(5, torch.device("cpu"))
    table.store(torch.tensor([3, 0, 4]), torch.tensor([30, 10, 40]))
    table.store(torch.tensor([3]), torch.tensor([31]))  # row 3 samples again: the newest token counts
    ids = torch.tensor([PENDING, 7, PENDING, DRAFT_LATER])
    rows = torch.tensor([3, 3, 0, 4])
    # known tokens and MTP's drafts to come (another negative marker) pass through untouched
    assert table.input_ids(ids, rows).tolist() == [31, 7, 10, DRAFT_LATER]


def test_entries_scheduled_ahead_take_host_tokens_only_where_pending():
    table = TokenTable(4, torch.device("cpu"))
    table.store(torch.tensor([1, 2]), torch.tensor([11, 22]))
    request = make_request(0, [1, 2, 3])
    ahead = BatchEntry(request, 2, 4, [PENDING], 4, [9], True, ahead=True)
    known = BatchEntry(request, 1, 3, [5], 3, [8], True)
    table.resolve_on_host([ahead, known])
    assert ahead.token_ids == [22] and known.token_ids == [5]
