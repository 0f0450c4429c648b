"""Scheduler without a model: a fake runner checks every step's KV bookkeeping against a content oracle."""

from __future__ import annotations

import random

import pytest

from rollout_cli.engine.request import Request, RequestStatus
from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.engine.scheduler import PENDING, Scheduler
from rollout_cli.errors import RolloutError


def next_token(request: Request) -> int:
    """The fake model's choice: fixed by (prompt, sample, position), so recomputation reproduces it."""
    return 100 + (request.prompt_index * 31 + request.sample_index * 7 + request.num_tokens * 3) % 50


def next_token_after(request: Request, pending: list[int]) -> int:
    """next_token of `request` once `pending` (at most one token, not appended yet) is appended."""
    if not pending:
        return next_token(request)
    return 100 + (request.prompt_index * 31 + request.sample_index * 7 + (request.num_tokens + 1) * 3) % 50


def expected_output(request: Request, eos=frozenset(), max_model_len=1 << 30) -> list[int]:
    probe = Request(-1, request.prompt_index, request.sample_index, list(request.prompt_token_ids),
                    request.params, eos_token_ids=eos, max_model_len=max_model_len)
    while probe.finish_reason is None:
        probe.append_token(next_token(probe), -0.5)
    return probe.output_token_ids


class FakeRunner:
    """Mimics ModelRunner's req_to_token table; the "KV" of a slot is the token prefix it was computed for.

    Every context position a step attends to must hold the KV of exactly that prefix, so a wrong
    cached prefix, a stale table row or a slot reused while live fails here.
    """

    def __init__(self, max_running: int):
        self.table: dict[tuple[int, int], int] = {}
        self.kv: dict[int, tuple] = {}
        self.steps = []  # per step: [(request_id, start, num_new_tokens, sample)]

    def run(self, out, prev_tokens=None):
        """prev_tokens: the previous step's sampled tokens, for a step from schedule_ahead (whose
        requests do not hold those tokens yet: postprocess of the previous step comes after)."""
        if prev_tokens is not None:
            for e in out.entries:
                assert e.token_ids == [PENDING] and e.source_row >= 0
                e.token_ids = [prev_tokens[e.source_row]]
        pending = {e.request.request_id: [prev_tokens[e.source_row]] for e in out.entries} if prev_tokens else {}
        new = [s for e in out.entries for s in e.new_slots]
        assert len(new) == len(set(new)), "two tokens written to one slot in a step"
        assert 0 not in new, "slot 0 is padding"
        rows = [e.table_row for e in out.entries]
        assert len(rows) == len(set(rows)) and all(r >= 0 for r in rows)
        for e in out.entries:
            assert len(e.new_slots) == e.num_new_tokens
            assert e.table_start + len(e.table_slots) == e.start + e.num_new_tokens
            for i, s in enumerate(e.table_slots):
                self.table[e.table_row, e.table_start + i] = s
        for e in out.entries:
            seq = e.request.all_token_ids + pending.get(e.request.request_id, [])
            assert e.token_ids == seq[e.start : e.start + e.num_new_tokens]
            assert e.sample == (e.start + e.num_new_tokens == len(seq))
            for i, s in enumerate(e.new_slots):
                self.kv[s] = tuple(seq[: e.start + i + 1])
        for e in out.entries:
            seq = e.request.all_token_ids + pending.get(e.request.request_id, [])
            for pos in range(e.start + e.num_new_tokens):
                slot = self.table.get((e.table_row, pos))
                assert self.kv.get(slot) == tuple(seq[: pos + 1]), (e.request.request_id, pos, slot)
        self.steps.append([(e.request.request_id, e.start, e.num_new_tokens, e.sample) for e in out.entries])
        tokens = [next_token_after(e.request, pending.get(e.request.request_id, [])) for e in out.entries if e.sample]
        return tokens, [-0.5] * len(tokens)


def check_accounting(s: Scheduler, in_flight=None) -> None:
    cached = s.cache.total_size if s.cache else 0
    owned = sum(len(r.slots) - r.num_cached_tokens for r in s.running)
    assert s.allocator.num_free + cached + owned == s.allocator.num_slots - 1
    if in_flight is not None:  # a committed step ahead: its ghosts gave their slot back, the rest own theirs
        live = [e for e in in_flight.entries if not e.ghost]
        assert all(e.table_slots[0] in e.request.slots for e in live)
    assert len(s.running) <= s.max_running
    assert all(r.status is RequestStatus.RUNNING for r in s.running)
    assert all(r.status is RequestStatus.WAITING and not r.slots for r in s.waiting)
    if s.cache:
        assert s.cache.evictable_size >= 0 and s.cache.protected_size >= 0


def drive(s: Scheduler, runner: FakeRunner | None = None, max_steps: int = 10_000) -> list[Request]:
    runner = runner or FakeRunner(s.max_running)
    finished = []
    for _ in range(max_steps):
        if not s.has_work():
            break
        out = s.schedule()
        assert out, "empty step with work pending"
        assert out.num_tokens <= s.max_batch_tokens
        check_accounting(s)
        tokens, logprobs = runner.run(out)
        finished += s.postprocess(out, tokens, logprobs)
        check_accounting(s)
    else:
        raise AssertionError("scheduler did not finish")
    # nothing leaks once every request is done
    cached = s.cache.total_size if s.cache else 0
    assert s.allocator.num_free + cached == s.allocator.num_slots - 1
    if s.cache:
        assert s.cache.protected_size == 0
    assert sorted(s._free_rows) == list(range(s.max_running))
    return finished


def drive_overlapped(s: Scheduler, runner: FakeRunner | None = None, max_steps: int = 10_000):
    """drive() as the engine runs with overlap: while a step is "in flight", the next one is scheduled
    ahead of its results (schedule_ahead), then the step is post-processed and the next committed.
    Returns (finished requests, number of steps scheduled ahead)."""
    runner = runner or FakeRunner(s.max_running)
    finished, ahead_steps = [], 0
    inflight = None  # (out, tokens, logprobs)
    for _ in range(max_steps):
        ahead = s.schedule_ahead(inflight[0]) if inflight is not None else None
        if ahead is not None:
            ahead_steps += 1
            result = runner.run(ahead, prev_tokens=inflight[1])
            finished += s.postprocess(*inflight)
            s.commit_ahead(ahead)
            check_accounting(s, in_flight=ahead)
            inflight = (ahead, *result)
            continue
        if inflight is not None:
            finished += s.postprocess(*inflight)
            check_accounting(s)
            inflight = None
        if not s.has_work():
            break
        out = s.schedule()
        assert out, "empty step with work pending"
        inflight = (out, *runner.run(out))
    else:
        raise AssertionError("scheduler did not finish")
    cached = s.cache.total_size if s.cache else 0
    assert s.allocator.num_free + cached == s.allocator.num_slots - 1
    assert sorted(s._free_rows) == list(range(s.max_running))
    return finished, ahead_steps


def make_request(rid, prompt, max_new_tokens=4, prompt_index=None, sample_index=0, leader=None, **kw):
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    return Request(rid, rid if prompt_index is None else prompt_index, sample_index, list(prompt), params,
                   group_leader=leader, **kw)


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


def random_workload(seed):
    """(scheduler, requests, eos, max_model_len, num_slots) of a random workload."""
    rng = random.Random(seed)
    prefix_cache = seed % 2 == 0
    max_running = rng.choice([1, 2, 3, 8])
    max_model_len = rng.choice([40, 64])
    num_slots = rng.choice([max_model_len + 1, max_model_len + 20, 200])
    s = Scheduler(num_kv_slots=num_slots, max_running=max_running,
                  max_batch_tokens=rng.choice([1, 3, 8, 64]), enable_prefix_cache=prefix_cache)
    eos = frozenset(rng.sample(range(100, 150), 2))
    system = [rng.randrange(20) for _ in range(12)]
    requests, rid = [], 0
    for p in range(8):
        prompt = (system if rng.random() < 0.6 else []) + [rng.randrange(20) for _ in range(rng.randrange(1, 15))]
        leader = None
        for sample in range(rng.choice([1, 1, 3])):
            r = make_request(rid, prompt, max_new_tokens=rng.randrange(1, 20), prompt_index=p,
                             sample_index=sample, leader=leader, eos_token_ids=eos, max_model_len=max_model_len)
            leader = leader or r
            requests.append(r)
            rid += 1
    for r in requests:
        s.add(r)
    return s, requests, eos, max_model_len, num_slots


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
    ahead = s.schedule_ahead(out)
    assert [(e.request, e.start, e.token_ids, e.source_row) for e in ahead.entries] == [
        (a, 4, [PENDING], 0), (b, 3, [PENDING], 1)]
    next_result = runner.run(ahead, prev_tokens=result[0])
    free_before = s.allocator.num_free
    assert s.postprocess(out, *result) == [a] and a.finish_reason == "stop"
    s.commit_ahead(ahead)
    assert [e.ghost for e in ahead.entries] == [True, False]
    assert s.allocator.num_free > free_before  # a's slots (its ghost slot included) are back
    assert b.slots[-1] == ahead.entries[1].table_slots[0] and ahead.entries[1].token_ids == [b.output_token_ids[-1]]
    a_output = list(a.output_token_ids)
    assert s.postprocess(ahead, *next_result) == []
    assert a.output_token_ids == a_output and len(b.output_token_ids) == 3  # the ghost's token is dropped


def test_step_ahead_leaves_out_length_finishes_and_yields_to_admissions():
    s, runner, a, b, out, result = _decoding_pair(max_new_tokens=(2, 6))
    ahead = s.schedule_ahead(out)  # a ends by length in the running step; nobody waits
    assert [e.request for e in ahead.entries] == [b]
    s.cancel_ahead(ahead)
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
