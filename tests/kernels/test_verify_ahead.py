"""Verify steps planned ahead of the verify step in flight (engine/scheduling/verify_ahead_plan.py,
engine/execution/verify_ahead.py) on the CPU's stand-in for CUDA graphs (graph_replay.CallReplay).

The hybrid MTP fixture's head is random and drafts nothing the model samples, so every step would keep one token
and the device's shift would always be 0. Here the head's drafts come from an oracle instead, at each place the
engine draws one (the host's proposal, the eager chain, the chain inside the verify graph, and the next draft
the head's verify graph leaves on the device): the token plain decoding put at that position, wrong at every
fourth position. So the verify steps keep 1 to K + 1 tokens, the steps planned ahead move by what the step in
flight kept (its KV slots, positions, sampling keys, linear states, the chain's inputs), and the responses must
be plain decoding's."""

from __future__ import annotations

import pytest
import torch

from backends import interpreter_only
from rollout_cli import PromptInput, SamplingParams
import rollout_cli.engine.execution.triton_attention as triton_attention
from rollout_cli.engine.execution.cuda_graphs import _POSITION, _ROW
from rollout_cli.engine.execution.mtp_chain import ChainedDrafts, chains
from rollout_cli.engine.execution.mtp_step import MTPStep
from rollout_cli.engine.execution.verify_ahead import AheadTables
from rollout_cli.engine.scheduling.schedule_output import DRAFT_LATER
from test_engine_graph_replay import _assert_same, _engine, _prompts, _samples

pytestmark = [interpreter_only]


@pytest.fixture(autouse=True)
def few_kv_splits(monkeypatch):
    monkeypatch.setattr(triton_attention, "TARGET_DECODE_PROGRAMS", 8)  # as test_engine_graph_replay's


class Oracle:
    """The token at each position of each sample under plain decoding, wrong where (position + prompt) % 4 == 0."""

    def __init__(self, samples, vocab: int):
        self.full = {(t.prompt_index, t.sample_index): list(t.prompt_token_ids) + list(t.response_token_ids)
                     for t in samples}
        self.vocab = vocab
        self.engine = None

    def token(self, request, position: int) -> int:
        full = self.full[(request.prompt_index, request.sample_index)]
        token = full[position] if position < len(full) else 0
        return (token + 1) % self.vocab if (position + request.prompt_index) % 4 == 0 else token

    def by_row(self, table_row: int, position: int) -> int:
        request = next((r for r in self.engine.scheduler.running if r.table_row == table_row), None)
        return 0 if request is None else self.token(request, position)  # a finished request's ghost row


def _oracle_drafts(monkeypatch, oracle: Oracle) -> None:
    def propose(self, requests, head_out, rows):  # the host's draft after a step
        for request, row in zip(requests, rows):
            request.mtp_draft = (request.num_tokens, oracle.token(request, request.num_tokens))
            request.mtp_hidden = head_out[row]

    def extend_drafts(self, entries):  # the eager chain
        for e in entries:
            if chains(e):
                for j in range(2, 1 + e.num_draft):
                    e.token_ids[j] = oracle.token(e.request, e.start + j)
            e.request.mtp_hidden = None

    def draft_inside(self, graphs, bucket, ids):  # the chain inside a verify graph: every row's input position
        rows, positions = graphs.ints[_ROW, :bucket].tolist(), graphs.ints[_POSITION, :bucket].tolist()
        drawn = [oracle.by_row(r, p) if t == DRAFT_LATER else t for t, r, p in zip(ids.tolist(), rows, positions)]
        return torch.tensor(drawn, dtype=ids.dtype)

    real_settle_head = AheadTables.settle_head

    def settle_head(self, cu, rows, head_out, model):  # the next draft: after the bonus token of the kept rows
        real_settle_head(self, cu, rows, head_out, model)
        positions = oracle.engine.runner.graphs.ints[_POSITION].tolist()
        for b in range(cu.shape[0] - 1):
            first, count = int(cu[b]), int(cu[b + 1] - cu[b])
            if count:
                table_row = int(rows[first])
                bonus_at = positions[first] + int(self.accepted[table_row]) + 1
                self.next_draft[table_row] = oracle.by_row(table_row, bonus_at + 1)

    monkeypatch.setattr(MTPStep, "_propose", propose)
    monkeypatch.setattr(MTPStep, "extend_drafts", extend_drafts)
    monkeypatch.setattr(ChainedDrafts, "draft_inside", draft_inside)
    monkeypatch.setattr(AheadTables, "settle_head", settle_head)


@pytest.mark.parametrize("num_drafts", [1, 3])
def test_verify_steps_planned_ahead_give_plain_decodings_tokens(mtp_checkpoint, monkeypatch, num_drafts):
    prompts = [PromptInput(p.prompt_index, p.prompt_token_ids, params=SamplingParams(
        n=2, max_new_tokens=6 + 4 * i, temperature=0.0, ignore_eos=True)) for i, p in enumerate(_prompts(3, seed=5))]
    want = _samples(_engine(mtp_checkpoint, graphs=False), prompts, SamplingParams())
    engine = _engine(mtp_checkpoint, graphs=True, speculative="mtp", num_draft_tokens=num_drafts,
                     speculative_gate=False)
    oracle = Oracle(want, engine.hf_config.vocab_size)
    oracle.engine = engine
    _oracle_drafts(monkeypatch, oracle)
    _assert_same(_samples(engine, prompts, SamplingParams()), want)
    stats = engine.scheduler.stats
    assert stats.verify_ahead_steps >= 5  # steps planned ahead, moved by what the step in flight kept
    assert 0 < stats.accepted_draft_tokens < stats.draft_tokens
    assert stats.acceptance_length > 1.3
    scheduler = engine.scheduler
    assert scheduler.allocator.num_free == scheduler.allocator.num_slots - 1 - _cached_slots(scheduler)
    assert scheduler.linear.allocator.num_free + len(scheduler.linear.snapshots) == scheduler.linear.num_slots - 1


def _cached_slots(scheduler) -> int:
    """KV slots the prefix cache holds after the run (every other slot went back)."""
    return scheduler.cache.total_size if scheduler.cache is not None else 0

