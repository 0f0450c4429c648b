"""A failure another rank claimed, as the error this rank reports for its consequence.

Under torchrun a rank that fails first claims the failure, with its one line, in the launcher's store
(cli/rank_failure.py). The other ranks see only its consequence: gloo's "connection closed" where they
waited for the rank that left (rank 0 of --tp in the forward's all-reduce, a --dp replica in the final
gather, rank 0 of `serve --tp` loading its engine), or nothing at all (a --dp replica goes on with its
own share). What they record (the job's manifest, the daemon's load error) must name the cause, and
none of them prints it: the claimer does, once. The job and the daemon know nothing of the store, so
rank_failures (cli) tells this module (`watch`, and the watchdog's `seen`) and they ask it:

- `caused_by_peer(err)`: the error to record for `err`: the claimed failure when another rank claimed
  one (the first claim wins), else `err` itself;
- `stop_if_a_peer_failed()`: between engine steps, raises the claimed failure once the watchdog saw it,
  so a rank that waits for no other (a --dp replica) ends its job and closes its files there.

Outside torchrun, or without its agent store, nothing is watched and both return as if no rank failed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass

from rollout_cli.errors import JobInterrupted, RolloutError


class PeerFailed(RolloutError):
    """Another rank failed first: its one line (which that rank prints, so this one stays silent)."""


class PeerInterrupted(JobInterrupted):
    """Another rank was interrupted first (Ctrl-C, SIGTERM): this rank's job ends as interrupted too."""


@dataclass(frozen=True)
class Claim:
    """The first failure, as its rank claimed it (the value of the claim key in the store)."""

    rank: int  # torchrun's RANK of the claimer
    code: int  # the exit code it leaves with
    error: str | None  # its one line; None where it printed a traceback, or said it elsewhere
    interrupted: bool = False

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Claim:
        return cls(**json.loads(raw))

    def as_error(self) -> BaseException:
        """The exception that stands for this claim in another rank."""
        if self.interrupted:
            return PeerInterrupted(f"rank {self.rank} was interrupted")
        return PeerFailed(self.error or f"rank {self.rank} failed (exit {self.code}); its error is in its output")


# lookup() -> the standing claim or None (rank_failures installs it; None: nothing is watched)
_lookup: Callable[[], Claim | None] | None = None
_seen: Claim | None = None  # another rank's claim, once the watchdog saw it


def watch(lookup: Callable[[], Claim | None] | None) -> None:
    """Start (a lookup) or stop (None) answering from the store; forgets a claim seen before."""
    global _lookup, _seen
    _lookup, _seen = lookup, None


def seen(claim: Claim) -> None:
    """The watchdog saw `claim` (of another rank): the next step boundary raises it."""
    global _seen
    _seen = claim


def _peers(claim: Claim | None) -> Claim | None:
    # this rank's own claim (it claims only on its way out) is never a peer's
    return claim if claim is not None and claim.rank != int(os.environ.get("RANK", "-1")) else None


def caused_by_peer(err: BaseException) -> BaseException:
    """`err`, or, when another rank claimed a failure first, that failure (`err` as its cause): asked where
    a rank records its error. It asks the store itself: a gloo error can come before the watchdog's poll."""
    claim = _peer_claim()
    if claim is None:
        return err
    failure = claim.as_error()
    failure.__cause__ = err
    return failure


def _peer_claim() -> Claim | None:
    """Another rank's standing claim: the one the watchdog saw, else the store's (None: nothing watched)."""
    claim = _peers(_seen)
    if claim is None and _lookup is not None:
        claim = _peers(_lookup())
    return claim


def a_peer_failed() -> bool:
    """Whether another rank claimed a failure (asks the store, as caused_by_peer does): then the ranks it
    leaves behind must not wait for it in a collective (rank 0's "stop" to its followers)."""
    return _peer_claim() is not None


def stop_if_a_peer_failed() -> None:
    """Between engine steps: raise another rank's claimed failure once the watchdog saw it (no store call
    here: this runs every step)."""
    claim = _peers(_seen)
    if claim is not None:
        raise claim.as_error()
