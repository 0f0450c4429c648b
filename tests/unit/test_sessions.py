"""Sessions (server/sessions.py) over a real Scheduler and the scheduler tests' fake model: a session's
pin keeps its conversation's KV through cache pressure that evicts everything else, pins together stay
under their budget, and pins end with the session, its retention time, or a cache flush."""

from __future__ import annotations

import pytest

from rollout_cli.engine.scheduling.scheduler import Scheduler
from rollout_cli.errors import RolloutError
from rollout_cli.engine.scheduling.sessions import Sessions

from scheduler_oracle import FakeRunner, make_request


RUNNERS: dict[int, FakeRunner] = {}  # one fake model per scheduler: it remembers what each slot holds


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _turn(s: Scheduler, rid: int, prompt: list[int]) -> list[int]:
    """Run one request to the end; -> the tokens whose KV it computed (prompt + response but the last)."""
    request = make_request(rid, prompt, max_new_tokens=4)
    s.add(request)
    runner = RUNNERS.setdefault(id(s), FakeRunner(s.max_running))  # checks each step's KV against its tokens
    while s.has_work():  # drive() would also insist that no prefix stays locked: pins do
        out = s.schedule()
        s.postprocess(out, *runner.run(out))
    return request.all_token_ids[:-1]


def _pressure(s: Scheduler, first_rid: int) -> None:
    """Requests with prompts of their own that need most of the pool: unpinned prefixes are evicted."""
    for k in range(4):
        _turn(s, first_rid + k, [50 + k] * 30)


def _cached(s: Scheduler, tokens: list[int]) -> int:
    return len(s.cache.match_prefix(tokens)[0])


def test_a_pinned_conversation_survives_cache_pressure_and_an_unpinned_one_does_not():
    s = Scheduler(num_kv_slots=64, max_running=2, max_batch_tokens=64)
    sessions = Sessions(60.0, clock=Clock())
    pinned = _turn(s, 0, list(range(1, 21)))
    stats = sessions.turn_finished(s, "pinned", pinned[:20], pinned[20:] + [0], cached_tokens=0)
    assert stats == {"session_id": "pinned", "turns": 1, "prompt_tokens": 20, "cached_tokens": 0, "hit_rate": 0.0,
                     "pinned_tokens": len(pinned)}
    loose = _turn(s, 1, list(range(21, 31)))  # cached too, but no session holds it
    _pressure(s, 10)
    assert _cached(s, pinned) == len(pinned)
    assert _cached(s, loose) == 0
    # the next turn starts from the pinned KV, and the pin moves to it
    second = _turn(s, 20, pinned + [1, 2])
    assert _cached(s, second) == len(second)
    stats = sessions.turn_finished(s, "pinned", pinned + [1, 2], second[len(pinned) + 2:] + [0],
                                   cached_tokens=len(pinned))
    assert stats["turns"] == 2 and stats["hit_rate"] == pytest.approx(len(pinned) / (20 + len(pinned) + 2), abs=1e-4)
    closed = sessions.close(s, "pinned")
    assert closed["turns"] == 2 and len(sessions) == 0
    assert s.cache.protected_size == 0  # nothing holds the conversation now
    _pressure(s, 30)
    assert _cached(s, second) < len(second)
    assert sessions.close(s, "pinned") is None


def test_pins_stay_under_their_budget_oldest_released_first():
    s = Scheduler(num_kv_slots=200, max_running=2, max_batch_tokens=64)
    sessions = Sessions(60.0, clock=Clock())
    sessions.max_pinned_tokens = 50
    first = _turn(s, 0, list(range(1, 21)))
    sessions.turn_finished(s, "a", first[:20], first[20:] + [0], 0)
    second = _turn(s, 1, list(range(30, 50)))
    sessions.turn_finished(s, "b", second[:20], second[20:] + [0], 0)
    third = _turn(s, 2, list(range(60, 80)))
    stats = sessions.turn_finished(s, "c", third[:20], third[20:] + [0], 0)  # 3 x 23 > 50: "a", the oldest, lets go
    assert stats["pinned_tokens"] == 23
    assert sessions.close(s, "a")["pinned_tokens"] == 0
    assert sessions.close(s, "b")["pinned_tokens"] == 23
    assert s.cache.protected_size == 23


def test_sessions_expire_after_their_retention_time_and_a_flush_drops_their_pins():
    s = Scheduler(num_kv_slots=200, max_running=2, max_batch_tokens=64)
    clock = Clock()
    sessions = Sessions(10.0, clock=clock)
    old = _turn(s, 0, list(range(1, 11)))
    sessions.turn_finished(s, "old", old[:10], old[10:] + [0], 0)
    clock.now = 6.0
    new = _turn(s, 1, list(range(20, 31)))
    sessions.turn_finished(s, "new", new[:11], new[11:] + [0], 0)
    clock.now = 11.0
    assert sessions.expire(s) == 1 and len(sessions) == 1
    assert s.cache.protected_size == 14  # only "new" is pinned: 11 prompt + 4 response tokens - 1
    s.flush_cache()  # a weight update: the KV of old weights goes, pins with it
    assert sessions.close(s, "new")["pinned_tokens"] == 0  # and unpinning it is harmless
    assert s.cache.protected_size == 0


def test_retention_must_be_positive():
    with pytest.raises(RolloutError, match="must be > 0"):
        Sessions(0)


def test_a_hybrid_session_pins_its_prompt_where_the_next_turn_resumes():
    """Hybrid models: the next turn resumes from the turn's prompt state snapshot, so the pin keeps
    the KV of the prompt but its last token (the snapshot's point), not the response."""
    s = Scheduler(num_kv_slots=200, max_running=2, max_batch_tokens=64, linear_state_slots=8)
    sessions = Sessions(60.0, clock=Clock())
    computed = _turn(s, 0, list(range(1, 21)))
    assert sessions.previous_prompt_len("h") == 0
    stats = sessions.turn_finished(s, "h", computed[:20], computed[20:] + [0], cached_tokens=0)
    assert stats["pinned_tokens"] == 19 and s.cache.protected_size == 19
    assert sessions.previous_prompt_len("h") == 20
