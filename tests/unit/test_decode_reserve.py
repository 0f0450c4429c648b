"""The decode reserve (engine/scheduling/decode_reserve.py): once a step had to preempt, admission keeps room for
the running requests' remaining tokens, so a long-output workload on a small pool stops thrashing."""

from __future__ import annotations

import random

import pytest

from rollout_cli.engine.scheduling import decode_reserve
from rollout_cli.engine.scheduling.decode_reserve import CLIP_NEW_TOKENS, DecodeReserve, remaining_tokens
from rollout_cli.engine.scheduling.scheduler import Scheduler

from scheduler_oracle import drive, drive_overlapped, expected_output, make_request


def _long_outputs(seed: int) -> tuple[Scheduler, list]:
    """24 requests, 8-token prompts, 40 to 160 new tokens each, 16 seats over a 700-slot pool (a quarter of
    what running them all at once needs): the running requests outgrow the pool."""
    rng = random.Random(seed)
    s = Scheduler(num_kv_slots=700, max_running=16, max_batch_tokens=256, enable_prefix_cache=seed % 2 == 0)
    requests = [make_request(i, [rng.randrange(20) for _ in range(8)], max_new_tokens=rng.randrange(40, 161))
                for i in range(24)]
    for r in requests:
        s.add(r)
    return s, requests


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlapped"])
@pytest.mark.parametrize("seed", range(4))
def test_a_pool_that_ran_short_stops_thrashing(seed, overlap, monkeypatch):
    """Same outputs (the oracle checks every step's KV), and far fewer preemptions and recomputed tokens than
    optimistic admission (the reserve turned off) on the same workload."""
    runs = {}
    for reserve in (True, False):
        if not reserve:
            monkeypatch.setattr(DecodeReserve, "preempted", lambda self, running: None)
        s, requests = _long_outputs(seed)
        finished = drive_overlapped(s)[0] if overlap else drive(s)
        assert len(finished) == len(requests)
        assert all(r.output_token_ids == expected_output(r) for r in requests)
        runs[reserve] = (s.stats.preemptions, s.stats.recomputed_tokens)
    assert runs[False][0] > 0, "the workload must outgrow the pool"
    assert runs[True][0] <= runs[False][0] // 3 and runs[True][1] <= runs[False][1] // 3, runs


def test_the_ratio_follows_the_used_share_and_decays_to_optimistic():
    reserve = DecodeReserve()
    running = [make_request(i, [1, 2], max_new_tokens=100) for i in range(4)]
    for r in running:
        r.output_token_ids.extend([7] * 30)
    assert reserve.reserved(running) == 0 and reserve.admits(running[0], 10**9, 0, 0)  # optimistic until a preemption
    reserve.preempted(running)
    used = (4 * 30 + decode_reserve.MARGIN_STEPS * 4) / 400
    assert reserve.ratio == pytest.approx(used)
    assert reserve.reserved(running) == int(4 * 70 * used)  # 70 tokens left each
    assert not reserve.admits(running[0], 1, reserve.reserved(running), reserve.reserved(running))
    for _ in range(decode_reserve.DECAY_STEPS):
        reserve.decode_step_done()
    assert reserve.ratio == pytest.approx(0.0, abs=1e-12) and reserve.reserved(running) == 0


def test_remaining_tokens_are_clipped_and_bounded_by_the_model_length():
    r = make_request(0, [1] * 10, max_new_tokens=10 * CLIP_NEW_TOKENS)
    assert remaining_tokens(r) == CLIP_NEW_TOKENS
    r = make_request(0, [1] * 10, max_new_tokens=500, max_model_len=100)
    assert remaining_tokens(r) == 90
