"""Scheduler without a model: a fake runner checks every step's KV bookkeeping against a content oracle."""

from __future__ import annotations

import random

import pytest

from rollout_cli.engine.scheduling.request import RequestStatus
from rollout_cli.engine.scheduling.scheduler import Scheduler
from rollout_cli.errors import RolloutError

from scheduler_oracle import FakeRunner, drive, expected_output, make_request, next_token


def test_chunked_prefill_splits_budget():
    s = Scheduler(num_kv_slots=256, max_running=4, max_batch_tokens=16)
    r = make_request(0, range(1, 51), max_new_tokens=3)
    s.add(r)
    runner = FakeRunner(4)
    [done] = drive(s, runner)
    assert [step[0][1:] for step in runner.steps] == [
        (0, 16, False), (16, 16, False), (32, 16, False), (48, 2, True), (50, 1, True), (51, 1, True)]
    assert done.output_token_ids == expected_output(r)
    assert done.finish_reason == "length"


def test_decodes_go_first_and_new_prompts_take_the_rest():
    s = Scheduler(num_kv_slots=256, max_running=8, max_batch_tokens=8)
    a, b = make_request(0, [1, 2, 3], max_new_tokens=10), make_request(1, [4, 5, 6], max_new_tokens=10)
    s.add(a)
    s.add(b)
    runner = FakeRunner(8)
    out = s.schedule()
    assert [(e.request.request_id, e.num_new_tokens) for e in out.entries] == [(0, 3), (1, 3)]
    s.postprocess(out, *runner.run(out))
    c, d = make_request(2, range(10, 40), max_new_tokens=2), make_request(3, [7, 8], max_new_tokens=2)
    s.add(c)
    s.add(d)
    out = s.schedule()
    # the two decodes first, then the waiting prompt gets the remaining 6 tokens of budget
    assert [(e.request.request_id, e.start, e.num_new_tokens) for e in out.entries] == [
        (0, 3, 1), (1, 3, 1), (2, 0, 6)]
    s.postprocess(out, *runner.run(out))
    out = s.schedule()
    # c's unfinished prefill is running now: it continues before d is admitted
    assert [(e.request.request_id, e.num_new_tokens) for e in out.entries] == [(0, 1), (1, 1), (2, 6)]
    s.postprocess(out, *runner.run(out))
    finished = drive(s, runner)
    assert {r.request_id for r in finished} == {0, 1, 2, 3}
    for r in (a, b, c, d):
        assert r.output_token_ids == expected_output(r)


def test_group_followers_wait_for_leader_then_hit_cache():
    s = Scheduler(num_kv_slots=256, max_running=8, max_batch_tokens=8)
    prompt = list(range(1, 21))
    leader = make_request(0, prompt, prompt_index=0, sample_index=0)
    followers = [make_request(i, prompt, prompt_index=0, sample_index=i, leader=leader) for i in (1, 2, 3)]
    for r in [leader, *followers]:
        s.add(r)
    runner = FakeRunner(8)
    finished = drive(s, runner)
    first_step_of = {}
    for n, step in enumerate(runner.steps):
        for rid, start, count, _ in step:
            first_step_of.setdefault(rid, (n, start, count))
    leader_prompt_done = next(n for n, step in enumerate(runner.steps)
                              if any(rid == 0 and start + count == 20 for rid, start, count, _ in step))
    for f in followers:
        n, start, count = first_step_of[f.request_id]
        assert n > leader_prompt_done  # waited for the leader's prompt
        assert (start, count) == (19, 1)  # then only the last prompt token runs
    assert s.stats.cached_prompt_tokens == 3 * 19
    assert s.stats.prefix_hit_rate == pytest.approx(57 / 80)
    assert s.stats.computed_tokens == 20 + 3 * 1 + 4 * 3  # prefills + 3 decodes each (4 new tokens)
    assert len(finished) == 4
    for r in [leader, *followers]:
        assert r.output_token_ids == expected_output(r)


def test_followers_without_cache_compute_their_own_prompt():
    s = Scheduler(num_kv_slots=256, max_running=8, max_batch_tokens=64, enable_prefix_cache=False)
    prompt = list(range(1, 11))
    leader = make_request(0, prompt, prompt_index=0)
    followers = [make_request(i, prompt, prompt_index=0, sample_index=i, leader=leader) for i in (1, 2)]
    for r in [leader, *followers]:
        s.add(r)
    drive(s)
    assert s.stats.cached_prompt_tokens == 0
    assert s.stats.computed_tokens == 3 * 10 + 3 * 3


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_preemption_when_pool_is_exhausted_and_all_complete(prefix_cache):
    # 40 usable slots; 6 requests that each grow to ~30 tokens: they cannot all stay resident
    s = Scheduler(num_kv_slots=41, max_running=6, max_batch_tokens=32, enable_prefix_cache=prefix_cache)
    rng = random.Random(0)
    requests = [make_request(i, [rng.randrange(50) for _ in range(rng.randrange(8, 14))], max_new_tokens=16)
                for i in range(6)]
    for r in requests:
        s.add(r)
    finished = drive(s)
    assert s.stats.preemptions > 0
    assert sorted(r.request_id for r in finished) == list(range(6))
    for r in requests:
        assert r.status is RequestStatus.FINISHED
        assert r.output_token_ids == expected_output(r)
        assert r.finish_reason == "length"
    assert s.stats.prompt_tokens == sum(r.num_prompt_tokens for r in requests)  # counted once, not per admission
    assert any(r.num_preemptions for r in requests)


def test_stop_tokens_and_max_model_len():
    eos = frozenset({next_token(make_request(0, [5, 6, 7])) + 0})  # the very first token of request 0
    s = Scheduler(num_kv_slots=128, max_running=4, max_batch_tokens=64)
    r0 = make_request(0, [5, 6, 7], max_new_tokens=10, eos_token_ids=eos)
    r1 = make_request(1, [9, 9, 9, 9], max_new_tokens=10, max_model_len=7)
    for r in (r0, r1):
        s.add(r)
    drive(s)
    assert r0.finish_reason == "stop" and len(r0.output_token_ids) == 1
    assert r1.finish_reason == "length" and r1.num_tokens == 7
    assert r1.output_token_ids == expected_output(r1, max_model_len=7)


def test_request_larger_than_pool_is_an_error_not_a_hang():
    s = Scheduler(num_kv_slots=16, max_running=2, max_batch_tokens=64)
    s.add(make_request(0, range(1, 11), max_new_tokens=20))
    with pytest.raises(RolloutError, match="cannot hold one request"):
        drive(s, max_steps=200)


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_preempts_newest_running_request_and_requeues_it_first(prefix_cache):
    s = Scheduler(num_kv_slots=128, max_running=4, max_batch_tokens=64, enable_prefix_cache=prefix_cache)
    a, b = make_request(0, range(1, 11), max_new_tokens=8), make_request(1, range(20, 30), max_new_tokens=8)
    c = make_request(2, [7, 7, 7], max_new_tokens=2)
    runner = FakeRunner(4)
    for r in (a, b):
        s.add(r)
    for _ in range(2):  # both prefilled and decoding
        out = s.schedule()
        s.postprocess(out, *runner.run(out))
    s.add(c)
    # exhaust the pool: a's decode finds no slot and must take b's (b is the newest)
    if s.cache is not None:
        s.cache.evict(1 << 30)
    stolen = s.allocator.allocate(s.allocator.num_free)
    out = s.schedule()
    assert [e.request.request_id for e in out.entries] == [0]  # no admissions in a step that preempted
    assert (a.num_preemptions, b.num_preemptions) == (0, 1)
    assert s.stats.preemptions == 1
    assert list(s.waiting)[:2] == [b, c]  # b goes back to the front, outputs kept
    assert b.status is RequestStatus.WAITING and len(b.output_token_ids) == 2 and b.num_computed_tokens == 0
    s.postprocess(out, *runner.run(out))
    if prefix_cache:  # b's computed tokens went into the tree
        assert s.cache.match_prefix(b.all_token_ids)[0] != []
    s.allocator.free(stolen)
    drive(s, runner)
    for r in (a, b, c):
        assert r.output_token_ids == expected_output(r)
    # a: 10 + 7 decodes; c: 3 + 1; b: 10 + 1 + 5 decodes, plus its recompute of 12 tokens, of which the
    # cache still holds 10 (making room for a's slot evicted b's freshest cached token)
    assert s.stats.computed_tokens == 17 + 4 + 16 + (2 if prefix_cache else 12)


@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("after_schedule", [True, False])
def test_abort_all_returns_every_slot_and_row(prefix_cache, after_schedule):
    """An abandoned job (or a forward that raised between schedule and postprocess) leaks nothing."""
    s = Scheduler(num_kv_slots=60, max_running=3, max_batch_tokens=8, enable_prefix_cache=prefix_cache)
    rng = random.Random(1)
    for i in range(6):
        s.add(make_request(i, [rng.randrange(9) for _ in range(rng.randrange(5, 15))], max_new_tokens=20))
    runner = FakeRunner(3)
    for _ in range(7):
        out = s.schedule()
        s.postprocess(out, *runner.run(out))
    assert s.running and s.waiting
    if after_schedule:
        s.schedule()  # slots handed out for tokens that will never be computed
    running = list(s.running)
    s.abort_all()
    assert not s.has_work()
    assert all(r.status is RequestStatus.FINISHED and not r.slots and r.table_row == -1 for r in running)
    cached = s.cache.total_size if s.cache else 0
    assert s.allocator.num_free + cached == s.allocator.num_slots - 1
    assert s.cache is None or s.cache.protected_size == 0
    assert sorted(s._free_rows) == [0, 1, 2]
    fresh = make_request(99, [1, 2, 3], max_new_tokens=5)
    s.add(fresh)
    drive(s, runner)
    assert fresh.output_token_ids == expected_output(fresh)


def _running_mid_way(prefix_cache: bool, count: int, prompt_lengths: tuple[int, int], steps: int, **postprocess):
    """A scheduler (3 rows, 200 slots) `steps` steps into `count` random requests of 12 new tokens:
    some running, some waiting. -> (scheduler, requests, its fake runner)."""
    s = Scheduler(num_kv_slots=200, max_running=3, max_batch_tokens=8, enable_prefix_cache=prefix_cache)
    rng = random.Random(2)
    requests = [make_request(i, [rng.randrange(9) for _ in range(rng.randrange(*prompt_lengths))], max_new_tokens=12)
                for i in range(count)]
    for r in requests:
        s.add(r)
    runner = FakeRunner(3)
    for _ in range(steps):
        out = s.schedule()
        s.postprocess(out, *runner.run(out), **postprocess)
    return s, requests, runner


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_abort_of_some_requests_leaves_the_others_running_exactly(prefix_cache):
    """Abort by request id (the daemon's online requests): the chosen running and waiting requests end
    with "abort" and what they have; the others finish with the tokens they would have had; no slot leaks."""
    s, requests, runner = _running_mid_way(prefix_cache, count=6, prompt_lengths=(5, 15), steps=5)
    chosen = [s.running[0], s.waiting[-1]]
    so_far = [list(r.output_token_ids) for r in chosen]
    out = s.schedule()  # a step in flight holds the aborted running request: post-processing skips it
    s.abort(chosen)
    s.postprocess(out, *runner.run(out))
    assert [r.finish_reason for r in chosen] == ["abort", "abort"]
    assert [r.output_token_ids for r in chosen] == so_far and so_far[0] and not so_far[1]
    assert all(r.status is RequestStatus.FINISHED and not r.slots for r in chosen)
    assert chosen[1] not in s.waiting and chosen[0] not in s.running
    finished = drive(s, runner)
    others = [r for r in requests if r not in chosen]
    assert set(finished) == set(others)
    for r in others:
        assert r.output_token_ids == expected_output(r)
    cached = s.cache.total_size if s.cache else 0
    assert s.allocator.num_free + cached == s.allocator.num_slots - 1
    assert sorted(s._free_rows) == [0, 1, 2]


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_retracted_requests_recompute_on_new_weights_and_record_each_tokens_version(prefix_cache):
    """pause keep + a weight update: running requests give back every slot (none goes into the cache:
    old weights' KV), the cache can be flushed with requests still waiting, and each request's
    response continues where it stopped, its tokens labelled with the version that sampled them."""
    s, requests, runner = _running_mid_way(prefix_cache, count=5, prompt_lengths=(3, 12), steps=6,
                                           weight_version="0")
    running = list(s.running)
    sampled_before = {r.request_id: len(r.output_token_ids) for r in requests}
    assert running and s.waiting and any(sampled_before.values())
    assert s.retract_running() == len(running)
    assert not s.running and [r.request_id for r in list(s.waiting)[:len(running)]] == [r.request_id for r in running]
    assert all(not r.slots and r.table_row == -1 and r.num_computed_tokens == 0 for r in running)
    s.flush_cache()  # the weight update's flush: allowed with only waiting requests
    assert s.allocator.num_free == s.allocator.num_slots - 1 and sorted(s._free_rows) == [0, 1, 2]
    while s.has_work():
        out = s.schedule()
        s.postprocess(out, *runner.run(out), weight_version="1")
    for r in requests:
        assert r.output_token_ids == expected_output(r)
        k = sampled_before[r.request_id]
        assert r.response_weight_versions("1") == ["0"] * k + ["1"] * (len(r.output_token_ids) - k)
        assert r.version_spans == ([(0, "0")] if k else []) + ([(k, "1")] if k < len(r.output_token_ids) else [])


def test_flush_is_refused_while_requests_run():
    s = Scheduler(num_kv_slots=60, max_running=2, max_batch_tokens=8)
    s.add(make_request(0, [1, 2, 3], max_new_tokens=5))
    out = s.schedule()
    s.postprocess(out, *FakeRunner(2).run(out))
    with pytest.raises(RolloutError, match="while requests are in flight"):
        s.flush_cache()


def test_closed_admission_starts_nothing_new_but_lets_preempted_requests_back():
    s = Scheduler(num_kv_slots=200, max_running=4, max_batch_tokens=16)
    first, second = make_request(0, [1, 2, 3], max_new_tokens=6), make_request(1, [4, 5], max_new_tokens=6)
    s.add(first)
    runner = FakeRunner(4)
    out = s.schedule()
    s.postprocess(out, *runner.run(out))
    s.admit_new = False
    s.add(second)
    s.preempt(first)  # as under KV pressure: it ran before, so it may come back
    out = s.schedule()
    assert [e.request.request_id for e in out.entries] == [0]
    s.postprocess(out, *runner.run(out))
    while s.running:
        out = s.schedule()
        s.postprocess(out, *runner.run(out))
    assert first.output_token_ids == expected_output(first) and list(s.waiting) == [second]
    assert not s.schedule()  # nothing runs and nothing may start: an empty step
    s.admit_new = True
    drive(s, runner)
    assert second.output_token_ids == expected_output(second)
