"""Admission pacing (engine/scheduling/admission_pacing.py): while decode steps replay CUDA graphs, waiting
requests join once the seats left empty have forgone as much work as the eager step that admits them costs.
Without a model: steps are reported as the step loop reports them (decode-only steps "replayed")."""

from __future__ import annotations

import pytest

from rollout_cli.engine.scheduling.admission_pacing import (EAGER_STEP_COST, MAX_WAIT_EAGER_STEPS, MAX_WAIT_STEPS,
                                                             AdmissionPacing, eager_step_cost)
from rollout_cli.engine.scheduling.scheduler import Scheduler

from scheduler_oracle import FakeRunner, drive, drive_overlapped, expected_output, make_request, random_workload


def test_nothing_is_held_while_decode_steps_run_eagerly():
    pacing = AdmissionPacing()
    assert pacing.due()  # nothing replayed yet
    pacing.admitted()
    pacing.step_done(decode_only=True, graph_step=False, running=8, empty_seats=0)
    assert pacing.due()  # the CPU, --no-cuda-graphs, a batch past the largest graph
    pacing.step_done(decode_only=True, graph_step=True, running=8, empty_seats=0)
    assert not pacing.due()
    pacing.step_done(decode_only=False, graph_step=False, running=8, empty_seats=0)
    assert not pacing.due()  # a step with a prompt runs eagerly: it says nothing of the decode steps
    assert AdmissionPacing(enabled=False).due()


def test_empty_seats_accumulate_until_they_forgo_one_eager_step():
    pacing = AdmissionPacing()
    pacing.step_done(decode_only=True, graph_step=True, running=8, empty_seats=0)
    pacing.admitted()
    steps = 0
    while not pacing.due():  # 2 empty seats of 8: a quarter of a step forgone each step
        pacing.step_done(decode_only=True, graph_step=True, running=8, empty_seats=2)
        steps += 1
    assert steps == EAGER_STEP_COST * 4
    pacing.admitted()
    assert not pacing.due()
    # a wave: most of the batch finished at once, few rows left to share the step: due at once
    pacing.step_done(decode_only=True, graph_step=True, running=2, empty_seats=6)
    assert pacing.due()


def test_one_free_seat_in_a_large_batch_waits_at_most_max_wait_steps():
    pacing = AdmissionPacing()
    pacing.step_done(decode_only=True, graph_step=True, running=255, empty_seats=0)
    pacing.admitted()
    for _ in range(MAX_WAIT_STEPS):
        assert not pacing.due()
        pacing.step_done(decode_only=True, graph_step=True, running=255, empty_seats=1)
    assert pacing.due() and pacing.forgone_steps < EAGER_STEP_COST


def test_the_measured_eager_price_lands_on_a_rung():
    """DecodeGraphs' eager-over-replayed time ratio -> the extra cost in decode steps, on coarse rungs: the
    0.6B shape's 28.1 / 8.5 ms keeps the old constant, the small hybrid's 18.5 / 0.73 ms is 24 steps, and
    nearby measurements agree (reruns pace alike)."""
    assert eager_step_cost(28.1 / 8.5) == EAGER_STEP_COST == 2.0
    assert eager_step_cost(18.5 / 0.73) == eager_step_cost(24.0) == eager_step_cost(27.0) == 24.0
    assert eager_step_cost(1.0) == 2.0 and eager_step_cost(0.5) == 2.0  # no cheaper than the old constant
    assert eager_step_cost(400.0) == 32.0


def test_a_dearer_eager_step_holds_longer_and_bounds_the_wait_in_eager_steps():
    """With eager steps 24 decode steps dear, 2 empty seats of 8 wait 96 steps (not 8), and one free seat
    in a batch of 255 waits 16 eager steps' worth (384 steps), not MAX_WAIT_STEPS."""
    pacing = AdmissionPacing()
    pacing.price_eager_steps(18.5 / 0.73)
    assert pacing.cost == 24.0 and pacing.max_wait_steps == MAX_WAIT_EAGER_STEPS * 24 > MAX_WAIT_STEPS
    pacing.step_done(decode_only=True, graph_step=True, running=8, empty_seats=0)
    pacing.admitted()
    steps = 0
    while not pacing.due():
        pacing.step_done(decode_only=True, graph_step=True, running=8, empty_seats=2)
        steps += 1
    assert steps == 24 * 4
    pacing.admitted()
    steps = 0
    while not pacing.due():
        pacing.step_done(decode_only=True, graph_step=True, running=255, empty_seats=1)
        steps += 1
    assert steps == pacing.max_wait_steps == 384


def _staggered_workload(s: Scheduler) -> list:
    """24 requests, 4 running at a time, finishing at staggered steps."""
    requests = [make_request(i, [1 + i, 2, 3, 4], max_new_tokens=6 + (5 * i) % 11) for i in range(24)]
    for r in requests:
        s.add(r)
    return requests


def _reporter(s: Scheduler, admitting_steps: list):
    def on_step(out):
        prompt = any(e.start < e.request.num_prompt_tokens for e in out.entries)
        admitting_steps.append(prompt)
        s.report_step(out, graph_step=not prompt)
    return on_step


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlapped"])
def test_paced_admission_gives_the_same_tokens_in_fewer_eager_steps(overlap):
    """With eager steps 1 + EAGER_STEP_COST times a replayed one, paced admission takes more steps and less
    time; every request's tokens are its own (the KV oracle checks every step)."""
    runs = {}
    for paced in (False, True):
        s = Scheduler(num_kv_slots=512, max_running=4, max_batch_tokens=64, admission_pacing=paced)
        requests = _staggered_workload(s)
        steps: list[bool] = []
        finished = (drive_overlapped if overlap else drive)(s, on_step=_reporter(s, steps))
        finished = finished[0] if overlap else finished
        assert sorted(r.request_id for r in finished) == list(range(24))
        for r in requests:
            assert r.output_token_ids == expected_output(r)
        eager = sum(steps)
        runs[paced] = (eager, len(steps) + EAGER_STEP_COST * eager, s.stats.admission_held_steps)
    (eager_unpaced, time_unpaced, held_unpaced), (eager_paced, time_paced, held_paced) = runs[False], runs[True]
    assert held_unpaced == 0 and held_paced > 0
    assert eager_paced < eager_unpaced and time_paced < time_unpaced


def test_overlapped_scheduling_paces_admissions_as_sequential_scheduling_does():
    """The same batches step by step (in bf16 a row's bits depend on its batch): a step planned ahead
    counts the empty seats of the step in flight as its report will."""
    batches = {}
    for overlap in (False, True):
        s = Scheduler(num_kv_slots=512, max_running=4, max_batch_tokens=64)
        _staggered_workload(s)
        steps: list = []

        def on_step(out, s=s, steps=steps):
            steps.append(sorted((e.request.request_id, e.start, e.num_new_tokens) for e in out.entries))
            s.report_step(out, graph_step=all(e.start >= e.request.num_prompt_tokens for e in out.entries))

        (drive_overlapped if overlap else drive)(s, on_step=on_step)
        batches[overlap] = (steps, s.stats.admission_held_steps)
    assert batches[True][1] > 0
    assert batches[True][0] == batches[False][0]


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlapped"])
@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_with_paced_admission(seed, overlap):
    """Shared prefixes, sample groups, eos, small pools, chunking, preemption: the KV oracle and the
    accounting every step and each request's tokens, while decode steps are reported as replayed."""
    s, requests, eos, max_model_len, _ = random_workload(seed)

    def on_step(out):
        s.report_step(out, graph_step=all(e.start >= e.request.num_prompt_tokens for e in out.entries))

    finished = drive_overlapped(s, on_step=on_step)[0] if overlap else drive(s, on_step=on_step)
    assert len(finished) == len(requests)
    for r in requests:
        assert r.output_token_ids == expected_output(r, eos, max_model_len)


def test_a_preempted_request_comes_back_while_admission_is_closed():
    """Under the daemon's pause finish nothing new starts, but a preempted request still returns while the
    others decode on replayed graphs: its empty seat counts, so it waits at most MAX_WAIT_STEPS steps."""
    s = Scheduler(num_kv_slots=400, max_running=4, max_batch_tokens=64)
    requests = [make_request(i, [1 + i, 2, 3], max_new_tokens=80) for i in range(3)]
    for r in requests:
        s.add(r)
    runner = FakeRunner(4)

    def step():
        out = s.schedule()
        s.postprocess(out, *runner.run(out))
        s.report_step(out, graph_step=all(e.start >= e.request.num_prompt_tokens for e in out.entries))

    step()
    step()
    s.admit_new = False
    s.add(make_request(9, [7, 8], max_new_tokens=4))  # new: may not start
    s.preempt(requests[2])
    waited = 0
    while requests[2] not in s.running:
        step()
        waited += 1
    assert 1 < waited <= MAX_WAIT_STEPS + 1 and s.stats.admission_held_steps > 0
    assert [r.request_id for r in s.waiting] == [9]
