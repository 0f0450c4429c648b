"""A hybrid model's verify steps on CUDA graphs (engine/execution/verify_layout.py): the static layout the
graphs' linear layers read, and which steps expand into graph rows. The graphs themselves run on the GPU
(tests/e2e/test_gpu_hybrid.py); the kernels reading the layout are tested in tests/kernels."""

from __future__ import annotations

from types import SimpleNamespace

from rollout_cli.engine.execution.verify_layout import PADDING_SLOT, graph_rows, layout_rows
from rollout_cli.engine.scheduling.schedule_output import DRAFT_LATER, BatchEntry


def _entry(slot: int, tokens: list[int], forks=None, start: int = 10):
    request = SimpleNamespace(state_slot=slot, params=SimpleNamespace(per_token_extras=False))
    return BatchEntry(request, slot, start, tokens, start, list(range(100 + 10 * slot, 100 + 10 * slot + len(tokens))),
                      True, num_draft=len(tokens) - 1, state_forks=forks)


def test_the_layout_pads_with_one_row_entries_then_empty_ones():
    entries = [_entry(3, [7, 8, 9], forks=[11, 12]), _entry(5, [4], forks=None), _entry(6, [1, 2], forks=[13])]
    bucket, drafts = 8, 2
    values = layout_rows(entries, bucket, drafts)
    cu, slots, forks = values[:bucket + 1], values[bucket + 1:2 * bucket + 1], values[2 * bucket + 1:]
    assert cu == [0, 3, 4, 6, 7, 8, 8, 8, 8]  # 6 real rows, two one-row padding entries, then empty ones
    assert slots == [3, 5, 6, PADDING_SLOT, PADDING_SLOT, -1, -1, -1]
    assert forks == [11, 12, -1, -1, 13, -1] + [-1] * (bucket - 3) * drafts
    full = layout_rows([_entry(3, [7, 8, 9], forks=[11, 12])], 3, drafts)
    assert full[:4] == [0, 3, 3, 3] and full[4:7] == [3, -1, -1]  # no padding rows: the rest empty


def test_hybrid_verify_steps_expand_only_where_verify_graphs_exist_and_can_chain_their_drafts():
    graphs = SimpleNamespace(verify=SimpleNamespace(chain=None),
                             can_run=lambda rows, verify=False: verify and len(rows) <= 8)
    entries = [_entry(3, [7, 8, 9], forks=[11, 12]), _entry(5, [4])]
    rows = graph_rows(entries, graphs, hybrid=True)
    assert [(r.start, r.token_ids, r.new_slots) for r in rows] == [
        (10, [7], [130]), (11, [8], [131]), (12, [9], [132]), (10, [4], [150])]
    assert graph_rows(entries, SimpleNamespace(verify=None, can_run=graphs.can_run), hybrid=True) is None
    chained = [_entry(3, [7, 8, DRAFT_LATER], forks=[11, 12])]  # MTP's draft 2 is drawn inside the step
    assert graph_rows(chained, graphs, hybrid=True) is None  # graphs without the head's chain (mtp_chain.py)
    chaining = SimpleNamespace(verify=SimpleNamespace(chain=object()), can_run=graphs.can_run)
    assert [r.token_ids for r in graph_rows(chained, chaining, hybrid=True)] == [[7], [8], [DRAFT_LATER]]
    prefill = _entry(4, [1, 2, 3, 4])
    prefill.num_draft = 0  # an admitted prompt's chunk beside the drafts
    assert graph_rows(entries + [prefill], graphs, hybrid=True) is None


def test_mtp_drafts_come_from_each_entrys_newest_accepted_row():
    """MTPStep.drafts_from after a step whose head pass ran at launch over every row (a plain step's one row
    per entry, a verify step's 1 + d): each running request's draft comes from its last accepted row."""
    import torch

    from rollout_cli.engine.execution.mtp_step import MTPStep

    def entry(name, start, rows, computed, finished=False, ghost=False):
        request = SimpleNamespace(name=name, num_computed_tokens=computed, finish_reason="length" if finished else None)
        return SimpleNamespace(request=request, start=start, num_new_tokens=rows, ghost=ghost)

    step, picked = MTPStep.__new__(MTPStep), {}
    step._propose = lambda requests, head_out, rows: picked.update(zip((r.name for r in requests), rows))
    entries = [entry("plain", 10, 1, 11), entry("two accepted", 20, 4, 22), entry("done", 5, 3, 8, finished=True),
               entry("ghost", 7, 1, 7, ghost=True), entry("all accepted", 30, 3, 33)]
    step.drafts_from(entries, torch.zeros(12, 4))
    assert picked == {"plain": 0, "two accepted": 1 + 1, "all accepted": 1 + 4 + 3 + 1 + 2}
