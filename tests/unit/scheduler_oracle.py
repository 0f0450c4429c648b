"""The scheduler tests' fake model: a runner that checks every step's KV bookkeeping against a
content oracle, drivers for sequential and overlapped loops, and a random workload generator."""

from __future__ import annotations

import random

from rollout_cli.engine.scheduling.request import Request, RequestStatus
from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.engine.scheduling.schedule_output import PENDING
from rollout_cli.engine.scheduling.scheduler import Scheduler


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
        self.next_token: dict[int, int] = {}  # the runner's token table: each row's last sampled token
        self.kv: dict[int, tuple] = {}
        self.steps = []  # per step: [(request_id, start, num_new_tokens, sample)]

    def run(self, out):
        """One step. An entry from schedule_ahead (token PENDING: its request does not hold the token yet,
        the previous step's postprocess comes after) reads its row's last sampled token, as the runner's
        token table gives it on the device."""
        assert all((e.token_ids == [PENDING]) == e.ahead for e in out.entries)
        pending = {e.request.request_id: [self.next_token[e.table_row]] for e in out.entries if e.ahead}
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
            assert pending.get(e.request.request_id, e.token_ids) == seq[e.start : e.start + e.num_new_tokens]
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
        for e, token in zip([e for e in out.entries if e.sample], tokens):
            self.next_token[e.table_row] = token
        return tokens, [-0.5] * len(tokens)


def check_accounting(s: Scheduler, in_flight=None) -> None:
    cached = s.cache.total_size if s.cache else 0
    owned = sum(len(r.slots) - r.num_cached_tokens for r in s.running)
    assert s.allocator.num_free + cached + owned == s.allocator.num_slots - 1
    if in_flight is not None:  # a step ahead: ended requests gave their slot back, the others own theirs
        live = [e for e in in_flight.entries if e.request.status is RequestStatus.RUNNING]
        assert all(e.table_slots[0] in e.request.slots for e in live)
    assert len(s.running) <= s.max_running
    assert all(r.status is RequestStatus.RUNNING for r in s.running)
    assert all(r.status is RequestStatus.WAITING and not r.slots for r in s.waiting)
    if s.cache:
        assert s.cache.evictable_size >= 0 and s.cache.protected_size >= 0


def drive(s: Scheduler, runner: FakeRunner | None = None, max_steps: int = 10_000, on_step=None) -> list[Request]:
    """Schedule, run, post-process until every request is done; on_step(out) after each post-process."""
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
        if on_step is not None:
            on_step(out)
    else:
        raise AssertionError("scheduler did not finish")
    # nothing leaks once every request is done
    cached = s.cache.total_size if s.cache else 0
    assert s.allocator.num_free + cached == s.allocator.num_slots - 1
    if s.cache:
        assert s.cache.protected_size == 0
    assert sorted(s._free_rows) == list(range(s.max_running))
    return finished


def drive_overlapped(s: Scheduler, runner: FakeRunner | None = None, max_steps: int = 10_000, on_step=None):
    """drive() as the engine runs with overlap: while a step is "in flight", the next one is scheduled
    ahead of its results (schedule_ahead) and run, then the step in flight is post-processed.
    Returns (finished requests, number of steps scheduled ahead); on_step(out) after each post-process."""
    runner = runner or FakeRunner(s.max_running)
    finished, ahead_steps = [], 0
    inflight = None  # (out, tokens, logprobs)
    for _ in range(max_steps):
        ahead = s.schedule_ahead(inflight[0]) if inflight is not None else None
        if ahead is not None:
            ahead_steps += 1
            result = runner.run(ahead)
            finished += s.postprocess(*inflight)
            if on_step is not None:
                on_step(inflight[0])
            check_accounting(s, in_flight=ahead)
            inflight = (ahead, *result)
            continue
        if inflight is not None:
            finished += s.postprocess(*inflight)
            check_accounting(s)
            if on_step is not None:
                on_step(inflight[0])
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
