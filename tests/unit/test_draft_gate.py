"""The speculation gate (engine/scheduling/draft_gate.py): drafts only at the batch sizes where drafting
steps gained more tokens per request per second than plain steps. Fed synthetic step times here (no
clock), so every decision below is exact."""

from __future__ import annotations

from rollout_cli.engine.scheduling.draft_gate import (FIRST_RETRY, LAST_RETRY, OUTLIER, RETRY_STEPS, SMOOTHING,
                                                      DraftGate, StepAverage, batch_bucket)


def _step(gate: DraftGate, batch: int, plain_s: float, draft_s: float, accepted_per_request: float) -> bool:
    """One decode step as the engine runs it: ask, then report what the chosen kind cost and gained."""
    drafts = gate.should_draft(batch)
    tokens = batch * (1 + accepted_per_request) if drafts else batch
    gate.record(batch, drafts, round(tokens), draft_s if drafts else plain_s)
    return drafts


def test_buckets_are_about_sqrt2_wide():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 6, 8, 11, 12, 16, 256)] == [0, 2, 3, 4, 5, 5, 6, 7, 7, 8, 16]
    assert batch_bucket(0) == 0


def test_measures_plain_then_drafting_then_keeps_the_faster():
    gate = DraftGate()
    # small batch: a drafting step costs 1.2x a plain one and gains 2 tokens a request: drafting wins
    choices = [_step(gate, 8, plain_s=1.0, draft_s=1.2, accepted_per_request=1.0) for _ in range(12)]
    assert choices[:4] == [False, False, True, True]  # each kind: a warm-up step, then one kept
    assert all(choices[4:])
    # large batch, its own bucket: drafting costs 3x and gains 2 tokens a request: plain wins
    choices = [_step(gate, 256, plain_s=1.0, draft_s=3.0, accepted_per_request=1.0) for _ in range(12)]
    assert choices[:4] == [False, False, True, True] and not any(choices[4:])
    assert gate.should_draft(8) and not gate.should_draft(256)


def test_the_warm_up_step_is_not_kept():
    gate = DraftGate()
    gate.record(4, False, 4, 1.0)
    gate.record(4, False, 4, 1.0)
    gate.record(4, True, 8, 500.0)  # the first drafting step compiled its kernels: not held against drafts
    gate.record(4, True, 8, 1.5)
    assert gate.should_draft(4)


def test_the_loser_is_retried_less_often_while_it_keeps_losing():
    gate = DraftGate()
    choices = [_step(gate, 64, plain_s=1.0, draft_s=4.0, accepted_per_request=1.0) for _ in range(6000)]
    drafted = [i for i, d in enumerate(choices) if d][2:]  # after the two measuring steps
    starts = [i for i in drafted if i - 1 not in drafted]
    assert all(all(choices[i:i + RETRY_STEPS]) and not choices[i + RETRY_STEPS] for i in starts)  # 3 steps a re-try
    gaps = [b - a - RETRY_STEPS for a, b in zip(starts, starts[1:])]  # plain steps between re-tries
    assert starts[0] == 4 + FIRST_RETRY and gaps[0] == 2 * FIRST_RETRY
    assert gaps == sorted(gaps) and max(gaps) == LAST_RETRY


def test_a_retry_that_wins_turns_drafting_back_on():
    gate = DraftGate()
    for _ in range(4 + FIRST_RETRY - 1):  # the measuring steps, then plain until the first re-try is due
        _step(gate, 32, plain_s=1.0, draft_s=4.0, accepted_per_request=1.0)  # drafts lose: acceptance is poor
    assert not gate.should_draft(32)
    # acceptance grows (sibling drafts improve as samples finish): a retry finds drafting faster again
    choices = [_step(gate, 32, plain_s=1.0, draft_s=1.1, accepted_per_request=3.0) for _ in range(200)]
    first_draft = choices.index(True)
    after = choices[first_draft:]
    assert first_draft < 2 * FIRST_RETRY and all(after[:FIRST_RETRY])
    assert after.count(False) <= RETRY_STEPS * len(after) // FIRST_RETRY  # plain only in re-tries of the loser


def test_a_retry_keeps_no_transition_step():
    """A plain step right after drafting ones cannot be planned ahead of its predecessor: a lone slow step that
    must not keep plain the loser (the first step of each re-try is dropped)."""
    gate = DraftGate()
    gate.record(64, False, 64, 1.0)
    gate.record(64, False, 64, 4.0)  # plain measured slow: drafting (2 tokens a request at 3.0) looks faster
    gate.record(64, True, 128, 3.0)
    gate.record(64, True, 128, 3.0)
    for _ in range(FIRST_RETRY):
        assert gate.should_draft(64)
        gate.record(64, True, 128, 3.0)
    assert not gate.should_draft(64)  # the re-try of plain
    gate.record(64, False, 64, 9.0)  # its transition step
    gate.record(64, False, 64, 1.0)
    gate.record(64, False, 64, 1.0)
    assert not gate.should_draft(64)  # plain at 1.0 ms a token beats drafting's 1.5 ms


def test_a_lone_slow_step_moves_the_average_a_bounded_step():
    """A step where a wave of requests finishes costs 10x the others whichever option runs: it must not make
    plain the loser (an H100's siblings run showed plain at 13.6 ms a step against a 3.2 ms mean)."""
    gate = DraftGate()
    for seconds, drafted, tokens in ((1.0, False, 256), (1.0, False, 256), (1.0, True, 320), (1.2, True, 320)):
        gate.record(256, drafted, tokens, seconds)  # drafting: 1.25 tokens a request at 1.2x: it wins, barely
    assert gate.should_draft(256)
    gate.record(256, True, 320, 12.0)  # a wave of finishes
    average = gate.buckets[batch_bucket(256)].drafting
    assert average.seconds == 1.2 + SMOOTHING * (OUTLIER - 1) * 1.2  # not 1.2 + 0.3 x 10.8
    for _ in range(6):
        gate.record(256, True, 320, 1.2)
    assert gate.should_draft(256)  # back above plain's rate in 6 steps (unbounded, the spike would take 12)


def test_a_lasting_slowdown_still_moves_the_average():
    average = StepAverage()
    for _ in range(2):
        average.add(1.0, 1.0)
    for _ in range(20):
        average.add(10.0, 1.0)  # every step now costs 10x (say, contexts grew): the average follows
    assert 9.5 < average.seconds <= 10.0


def test_reports_without_time_or_batch_are_ignored():
    gate = DraftGate()
    gate.record(0, True, 0, 1.0)
    gate.record(8, True, 8, 0.0)
    assert not gate.buckets


def test_busiest_reports_the_bucket_with_the_most_steps():
    gate = DraftGate()
    assert gate.busiest() is None
    for _ in range(6):
        _step(gate, 32, plain_s=0.002, draft_s=0.003, accepted_per_request=1.0)
    _step(gate, 4, plain_s=0.001, draft_s=0.001, accepted_per_request=1.0)
    summary = gate.busiest()
    assert summary["batch"] == 27 and batch_bucket(27) == batch_bucket(32) != batch_bucket(26)
    assert summary["plain_steps"] == 2 and summary["drafting_steps"] == 4  # warm-up and kept step each, then drafts
    assert summary["plain_ms"] == 2.0 and summary["drafting_ms"] == 3.0 and summary["drafting_tokens"] == 2.0
