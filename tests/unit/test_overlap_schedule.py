"""Overlap scheduling (engine/scheduling/overlap_schedule.py) without a model: steps scheduled ahead of their inputs
give the same outputs as sequential steps (KV oracle every step), ghosts, length finishes, admissions."""

from __future__ import annotations

import pytest

from rollout_cli.engine.scheduling.schedule_output import PENDING
from rollout_cli.engine.scheduling.scheduler import Scheduler

from scheduler_oracle import (FakeRunner, check_accounting, drive, drive_overlapped, expected_output, make_request, next_token,
                              random_workload)


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlapped"])
@pytest.mark.parametrize("seed", range(8))
def test_random_workloads(seed, overlap):
    """Shared prefixes, sample groups, eos, small pools, chunking: KV oracle and accounting every step;
    overlapped: the same outputs when decode steps are scheduled ahead of their inputs."""
    s, requests, eos, max_model_len, num_slots = random_workload(seed)
    prefix_cache = s.cache is not None
    if overlap:
        finished, ahead_steps = drive_overlapped(s)
        assert ahead_steps > 0
    else:
        finished = drive(s)
    assert len(finished) == len(requests)
    for r in requests:
        assert r.output_token_ids == expected_output(r, eos, max_model_len)
        assert r.finish_reason in ("stop", "length")
    if prefix_cache and num_slots == 200:
        assert s.stats.cached_prompt_tokens > 0


@pytest.mark.parametrize("seed", range(8))
def test_overlap_keeps_the_counters(seed):
    """Ghost rows (requests that hit eos while their next step was already planned) are not counted."""
    sequential, _, _, _, _ = random_workload(seed)
    drive(sequential)
    overlapped, _, _, _, _ = random_workload(seed)
    drive_overlapped(overlapped)
    if sequential.stats.preemptions:
        # Under memory pressure the two orders free and take slots at other moments, so the radix
        # cache may keep other tokens for a recompute; the outputs still agree (test_random_workloads).
        assert overlapped.stats.prompt_tokens == sequential.stats.prompt_tokens
    else:
        assert overlapped.stats == sequential.stats


def _decoding_pair(eos=frozenset(), max_new_tokens=(6, 6), waiting=()):
    """A scheduler with two requests past their prompts (one decode step done), and the step ahead."""
    s = Scheduler(num_kv_slots=64, max_running=2, max_batch_tokens=64)
    a = make_request(0, [1, 2, 3], max_new_tokens=max_new_tokens[0], eos_token_ids=eos)
    b = make_request(1, [4, 5], max_new_tokens=max_new_tokens[1], eos_token_ids=eos)
    runner = FakeRunner(2)
    for r in (a, b, *waiting):
        s.add(r)
    for _ in range(2):  # prefill, then the first true decode step
        out = s.schedule()
        result = runner.run(out)
        if _ == 1:
            return s, runner, a, b, out, result
        s.postprocess(out, *result)


def test_eos_in_the_running_step_turns_the_step_ahead_into_a_ghost():
    probe = make_request(0, [1, 2, 3])
    probe.append_token(next_token(probe), 0.0)  # a's token of the prefill step
    eos = frozenset([next_token(probe)])  # a's token of the running (first decode) step
    s, runner, a, b, out, result = _decoding_pair(eos=eos)
    computed = s.stats.computed_tokens
    ahead = s.schedule_ahead(out)
    assert [(e.request, e.start, e.token_ids, e.ahead) for e in ahead.entries] == [
        (a, 4, [PENDING], True), (b, 3, [PENDING], True)]
    assert [r.slots[-1] for r in (a, b)] == [e.table_slots[0] for e in ahead.entries]  # theirs at once
    next_result = runner.run(ahead)  # the inputs: each row's token of the running step (the token table)
    assert runner.steps[-1] == [(0, 4, 1, True), (1, 3, 1, True)]
    free_before = s.allocator.num_free
    assert s.postprocess(out, *result) == [a] and a.finish_reason == "stop"
    assert s.allocator.num_free > free_before  # a's slots are back, its slot ahead included:
    check_accounting(s, in_flight=ahead)  # free + cached + owned by running requests = every slot
    assert ahead.entries[1].table_slots[0] == b.slots[-1]
    a_output = list(a.output_token_ids)
    assert s.postprocess(ahead, *next_result) == []
    assert [e.ghost for e in ahead.entries] == [True, False]
    assert s.stats.computed_tokens == computed + 1  # b's token: the ghost's is not counted
    assert a.output_token_ids == a_output and len(b.output_token_ids) == 3  # the ghost's token is dropped


def test_step_ahead_leaves_out_length_finishes_and_yields_to_admissions():
    s, runner, a, b, out, result = _decoding_pair(max_new_tokens=(2, 6))
    ahead = s.schedule_ahead(out)  # a ends by length in the running step; nobody waits
    assert [e.request for e in ahead.entries] == [b]
    s, runner, a, b, out, result = _decoding_pair(max_new_tokens=(2, 6))
    s.add(make_request(2, [7, 8]))
    assert s.schedule_ahead(out) is None  # a's row is about to free up: the waiting request goes first
    s.postprocess(out, *result)
    assert [e.request.request_id for e in s.schedule().entries] == [1, 2]


def test_no_step_ahead_after_a_prompt_step_or_without_free_slots():
    s = Scheduler(num_kv_slots=64, max_running=2, max_batch_tokens=64)
    s.add(make_request(0, [1, 2, 3]))
    out = s.schedule()
    assert s.schedule_ahead(out) is None  # a prompt step: postprocess publishes the prompt first
    s.postprocess(out, *FakeRunner(2).run(out))
    out = s.schedule()
    taken = s.allocator.allocate(s.allocator.num_free)
    assert s.schedule_ahead(out) is None  # no free slot: schedule() may evict or preempt
    s.allocator.free(taken)
    assert s.schedule_ahead(out) is not None
