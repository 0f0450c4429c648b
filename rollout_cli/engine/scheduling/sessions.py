"""Multi-turn conversations: a conversation's KV kept in the prefix cache between its turns.

Used by the daemon's online requests (a request with a `session_id` is one turn of that
conversation) and by `rollout run --env` (every episode is one). When its sample finishes, the KV of
everything computed (prompt and response but its last token) is already in the prefix cache; the
session pins it there (Scheduler.pin_prefix), so no other request evicts it before the next turn,
whose prompt starts with it: the next turn's prefill is only its new tokens (and the last response
token, whose KV was never computed). The pin moves to each new turn, and ends when the session is
closed, when its retention time runs out, or when a flush empties the cache (a weight update or a
memory release: KV of old weights is of no use).

Pinned KV cannot make room for new requests, so pins together hold at most `max_pinned_tokens`
(half the KV pool by default): a new pin past that releases the oldest sessions' pins first.
Hybrid models need the Gated DeltaNet state beside the KV, and the state at a turn's end is not
snapshotted (with overlap scheduling the step that last advanced it is not known when the turn ends).
A turn's prompt state is (engine/scheduling/prefix_reuse.py): the pin keeps the KV of the prompt but its last
token, and the next turn resumes there, recomputing the last prompt token, the response and its
new tokens.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from rollout_cli.errors import RolloutError

DEFAULT_RETENTION_SECONDS = 600.0


@dataclass
class Session:
    session_id: str
    turns: int = 0
    prompt_tokens: int = 0  # over all turns
    cached_tokens: int = 0  # of those, served by the prefix cache
    pin: object = None  # Scheduler's PrefixPin of the last turn, or None
    last_prompt_len: int = 0
    expires_at: float = field(default=0.0)

    def stats(self, scheduler) -> dict:
        return {"session_id": self.session_id, "turns": self.turns, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens,
                "hit_rate": round(self.cached_tokens / self.prompt_tokens, 4) if self.prompt_tokens else 0.0,
                "pinned_tokens": self.pin.num_tokens if _live(self.pin, scheduler) else 0}


class Sessions:
    """The open sessions (engine thread only, but `len()`). Ordered oldest use first."""

    def __init__(self, retention_seconds: float = DEFAULT_RETENTION_SECONDS, clock=time.monotonic):
        if retention_seconds <= 0:
            raise RolloutError("--session-retention-seconds must be > 0")
        self.retention_seconds = retention_seconds
        self.max_pinned_tokens: int | None = None  # set by fit_pool once the engine knows its pool size
        self._clock = clock
        # oldest turn first: expiry times rise along it (one retention time for all)
        self._open: OrderedDict[str, Session] = OrderedDict()
        # tokens the live pins hold, kept as they change (not summed per turn); a flush (a new cache
        # epoch) drops every pin, and with them this count
        self._pinned_tokens = 0
        self._pinned_epoch: int | None = None

    def fit_pool(self, num_kv_slots: int) -> None:
        """Pins together may hold half the KV pool: the rest stays for new requests."""
        self.max_pinned_tokens = num_kv_slots // 2

    def __len__(self) -> int:
        return len(self._open)

    def turn_finished(self, scheduler, session_id: str, prompt: list[int], response: list[int],
                      cached_tokens: int) -> dict:
        """A turn's sample finished: move the session's pin to the KV its next turn starts from: prompt +
        response but its last token (hybrid models: the prompt but its last token, where the turn's state
        snapshot is). -> the session's statistics after this turn."""
        session = self._open.pop(session_id, None) or Session(session_id)
        self._open[session_id] = session  # now the most recently used
        session.turns += 1
        session.prompt_tokens += len(prompt)
        session.last_prompt_len = len(prompt)
        session.cached_tokens += cached_tokens
        session.expires_at = self._clock() + self.retention_seconds
        self._unpin(scheduler, session)
        kept = prompt + response[:-1] if scheduler.linear is None else prompt[:-1]
        self._make_room(scheduler, len(kept))
        session.pin = scheduler.pin_prefix(kept)
        if session.pin is not None:
            self._pinned_tokens = self._pinned(scheduler) + session.pin.num_tokens
        return session.stats(scheduler)

    def previous_prompt_len(self, session_id: str) -> int:
        """The last turn's prompt length (0: a new session): a hybrid turn resumes at its snapshot."""
        session = self._open.get(session_id)
        return session.last_prompt_len if session is not None else 0

    def close(self, scheduler, session_id: str) -> dict | None:
        """End a session and release its pin; -> its statistics, None if no such session is open."""
        session = self._open.pop(session_id, None)
        if session is None:
            return None
        stats = session.stats(scheduler)
        self._unpin(scheduler, session)
        return stats

    def expire(self, scheduler) -> int:
        """Close every session past its retention time; -> how many. Called on every online request:
        it reads only the expired sessions and the first one that is not (expiry follows the order)."""
        now = self._clock()
        stale = []
        for sid, session in self._open.items():
            if session.expires_at > now:
                break
            stale.append(sid)
        for sid in stale:
            self.close(scheduler, sid)
        return len(stale)

    def _pinned(self, scheduler) -> int:
        """Tokens the live pins hold now."""
        if scheduler.cache_epoch != self._pinned_epoch:  # flushed since: no pin holds anything
            self._pinned_tokens, self._pinned_epoch = 0, scheduler.cache_epoch
        return self._pinned_tokens

    def _unpin(self, scheduler, session: Session) -> None:
        if _live(session.pin, scheduler):
            self._pinned_tokens = self._pinned(scheduler) - session.pin.num_tokens
        scheduler.unpin(session.pin)
        session.pin = None

    def _make_room(self, scheduler, wanted: int) -> None:
        """Unpin the oldest sessions until `wanted` more pinned tokens fit under max_pinned_tokens."""
        if self.max_pinned_tokens is None:
            return
        for session in self._open.values():
            if self._pinned(scheduler) + wanted <= self.max_pinned_tokens:
                return
            self._unpin(scheduler, session)


def _live(pin, scheduler) -> bool:
    """A pin that still holds KV (not one from before a flush)."""
    return pin is not None and pin.epoch == scheduler.cache_epoch
