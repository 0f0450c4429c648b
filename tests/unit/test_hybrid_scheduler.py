"""Scheduler of hybrid (linear-attention) models without a model: a fake runner whose "state" in each
slot is the token prefix it has consumed checks every step's state slots, snapshot copies and forks."""

from __future__ import annotations

import random

import pytest

from rollout_cli.engine.scheduling.request import Request
from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.engine.scheduling.scheduler import Scheduler
from rollout_cli.engine.scheduling.state_slots import LinearStateSlots


def next_token(request: Request) -> int:
    return 100 + (request.prompt_index * 31 + request.sample_index * 7 + request.num_tokens * 3) % 50


class StateOracleRunner:
    """Applies the step's copies in order, zeroes slots of entries starting at 0, then checks that
    every entry's slot holds exactly the prefix before its first new token (what a recurrent state
    summarises) and advances it."""

    def __init__(self):
        self.state: dict[int, tuple] = {}
        self.entry_log = []  # (request_id, start, num_new_tokens)

    def run(self, out):
        for src, dst in out.state_copies:
            self.state[dst] = self.state.get(src)
        slots = [e.request.state_slot for e in out.entries]
        assert len(slots) == len(set(slots)) and all(s > 0 for s in slots), slots
        for e in out.entries:
            seq = e.request.all_token_ids
            if e.start == 0:
                self.state[e.request.state_slot] = ()
            assert self.state.get(e.request.state_slot) == tuple(seq[:e.start]), (e.request.request_id, e.start)
            self.state[e.request.state_slot] = tuple(seq[:e.start + e.num_new_tokens])
            self.entry_log.append((e.request.request_id, e.start, e.num_new_tokens))
        sampled = [e.request for e in out.entries if e.sample]
        return [next_token(r) for r in sampled], [-0.5] * len(sampled)


def add_prompt(sched: Scheduler, ids, prompt_index: int, prompt: list[int], params: SamplingParams):
    leader = None
    for k in range(params.n):
        request = Request(next(ids), prompt_index, k, list(prompt), params, group_leader=leader)
        leader = leader or request
        sched.add(request)


def drive(sched: Scheduler, runner: StateOracleRunner, limit: int = 5000) -> list[Request]:
    finished = []
    for _ in range(limit):
        if not sched.has_work():
            return finished
        out = sched.schedule()
        assert out, "empty step with work pending"
        tokens, logprobs = runner.run(out)
        finished += sched.postprocess(out, tokens, logprobs)
    raise AssertionError("did not finish")


def test_samples_fork_the_prompt_snapshot_and_chunks_stop_at_it():
    import itertools

    sched = Scheduler(num_kv_slots=400, max_running=8, max_batch_tokens=6, linear_state_slots=17)
    runner = StateOracleRunner()
    ids = itertools.count()
    prompt = list(range(1, 15))  # 14 tokens: the snapshot point is 13
    add_prompt(sched, ids, 0, prompt, SamplingParams(n=4, max_new_tokens=3))
    done = drive(sched, runner)
    assert len(done) == 4
    leader_chunks = [(s, n) for rid, s, n in runner.entry_log if rid == 0]
    assert leader_chunks[:4] == [(0, 6), (6, 6), (12, 1), (13, 1)]  # chunk cut at 13, then the last prompt token
    for rid in (1, 2, 3):  # each sample forks the snapshot and runs only the last prompt token
        assert [(s, n) for r, s, n in runner.entry_log if r == rid][0] == (13, 1)
    assert sched.stats.cached_prompt_tokens == 3 * 13 and sched.stats.prompt_tokens == 4 * 14
    linear = sched.linear
    assert list(linear.snapshots) == [tuple(prompt[:13])]
    assert linear.allocator.num_free == 16 - 1  # every request slot back; the snapshot keeps one


@pytest.mark.parametrize("prompt_len", [2, 3, 5])
def test_short_prompts_still_share_their_state(prompt_len):
    """No block size hides short prompts: a 2-token prompt's samples fork the state after its first token,
    so the hit rate counts every sample but the first however short the prompt."""
    import itertools

    sched = Scheduler(num_kv_slots=400, max_running=8, max_batch_tokens=64, linear_state_slots=17)
    runner = StateOracleRunner()
    ids = itertools.count()
    add_prompt(sched, ids, 0, list(range(3, 3 + prompt_len)), SamplingParams(n=4, max_new_tokens=2))
    assert len(drive(sched, runner)) == 4
    for rid in (1, 2, 3):
        assert [(s, n) for r, s, n in runner.entry_log if r == rid][0] == (prompt_len - 1, 1)
    assert sched.stats.cached_prompt_tokens == 3 * (prompt_len - 1)
    assert sched.stats.prefix_hit_rate > 0


def test_n1_prompts_take_no_snapshot_and_state_slots_bound_running():
    import itertools

    sched = Scheduler(num_kv_slots=400, max_running=8, max_batch_tokens=64, linear_state_slots=3)
    runner = StateOracleRunner()
    ids = itertools.count()
    for i in range(5):
        add_prompt(sched, ids, i, [7 + i] * (5 + i), SamplingParams(n=1, max_new_tokens=4))
    out = sched.schedule()
    assert len(out.entries) == 2  # two usable state slots (slot 0 is padding), though max_running is 8
    sched.postprocess(out, *runner.run(out))
    assert len(drive(sched, runner)) == 5
    assert [(s, n) for rid, s, n in runner.entry_log if rid == 4][0] == (0, 9)  # n = 1: no cut before the last token
    assert not sched.linear.snapshots and sched.linear.allocator.num_free == 2


@pytest.mark.parametrize("seed", range(4))
def test_random_workload_with_preemption_keeps_states_exact(seed):
    """n > 1, shared and distinct prompts, chunked prefill, a KV pool small enough to preempt, few
    state slots: every step's states match the oracle and all slots come back."""
    import itertools

    rng = random.Random(seed)
    sched = Scheduler(num_kv_slots=90, max_running=6, max_batch_tokens=rng.choice([5, 8, 16]),
                      linear_state_slots=rng.choice([4, 7, 13]))
    runner = StateOracleRunner()
    ids = itertools.count()
    base = [rng.randrange(1, 50) for _ in range(12)]
    expected = 0
    for i in range(8):
        prompt = (base[: rng.randrange(1, 12)] if i % 2 else []) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 20))]
        n = rng.choice([1, 2, 4])
        add_prompt(sched, ids, i, prompt, SamplingParams(n=n, max_new_tokens=rng.randrange(1, 25)))
        expected += n
    done = drive(sched, runner)
    assert len(done) == expected
    for r in done:  # outputs as the fake model dictates, whatever was preempted or forked
        probe = Request(-1, r.prompt_index, r.sample_index, list(r.prompt_token_ids), r.params)
        while probe.finish_reason is None:
            probe.append_token(next_token(probe), -0.5)
        assert r.output_token_ids == probe.output_token_ids
    linear = sched.linear
    assert linear.allocator.num_free + len(linear.snapshots) == linear.num_slots - 1
    assert all(r.state_slot == -1 for r in done)


def test_stale_snapshot_is_dropped_not_used():
    slots = LinearStateSlots(4)
    node_a, node_b = object(), object()
    assert slots.snapshot([1, 2, 3], src_slot=1, node=node_a)
    (copy,) = slots.take_copies()
    assert copy[0] == 1 and slots.lookup([1, 2, 3], node_a) == copy[1]
    assert slots.lookup([1, 2, 3], node_b) is None  # the KV of that prefix is another node now
    assert slots.lookup([1, 2, 3], node_a) is None and not slots.snapshots
    assert slots.allocator.num_free == 3
    slots.snapshot([4], src_slot=1, node=node_a)
    slots.clear()
    assert not slots.snapshots and slots.allocator.num_free == 3 and slots.lookup([4], node_a) is None


def test_running_requests_evict_snapshots_lru():
    slots = LinearStateSlots(4)  # 3 usable
    nodes = [object() for _ in range(3)]
    for i, node in enumerate(nodes):
        assert slots.snapshot([i], src_slot=0, node=node)
    assert not slots.snapshot([9], src_slot=0, node=object())  # a snapshot never evicts another
    slots.lookup([0], nodes[0])  # touch: [1] is now the oldest
    assert slots.num_available == 3
    slots.allocate()
    assert list(slots.snapshots) == [(2,), (0,)]
