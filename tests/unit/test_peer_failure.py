"""rollout_cli/peer_failure.py: another rank's claim as the error this rank records (no store, no ranks:
the lookup stands in for rank_failure's)."""

from __future__ import annotations

import pytest

from rollout_cli import peer_failure
from rollout_cli.job_manifest import final_state
from rollout_cli.peer_failure import Claim, PeerFailed, caused_by_peer, stop_if_a_peer_failed


@pytest.fixture(autouse=True)
def rank_0(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    yield
    peer_failure.watch(None)


def test_a_claim_travels_as_bytes():
    claim = Claim(1, 2, "row 3: empty prompt; fix it")
    assert Claim.decode(claim.encode()) == claim


def test_unwatched_or_unclaimed_keeps_the_error():
    gloo = RuntimeError("Connection closed by peer")
    assert caused_by_peer(gloo) is gloo
    peer_failure.watch(lambda: None)
    assert caused_by_peer(gloo) is gloo
    stop_if_a_peer_failed()  # nothing seen: no-op


def test_a_peers_claim_becomes_the_error_with_gloos_as_its_cause():
    gloo = RuntimeError("Connection closed by peer")
    peer_failure.watch(lambda: Claim(1, 2, "bad shard on rank 1"))
    failure = caused_by_peer(gloo)
    assert isinstance(failure, PeerFailed) and failure.__cause__ is gloo
    assert final_state(failure, None) == ("failed", "bad shard on rank 1")


def test_this_ranks_own_claim_is_no_peers():
    own = ValueError("mine")
    peer_failure.watch(lambda: Claim(0, 2, "mine"))
    assert caused_by_peer(own) is own


def test_an_interrupt_claim_ends_the_job_as_interrupted():
    peer_failure.watch(lambda: None)
    peer_failure.seen(Claim(1, 130, None, interrupted=True))
    with pytest.raises(Exception) as raised:
        stop_if_a_peer_failed()
    assert final_state(raised.value, None) == ("interrupted", None)


def test_a_claim_without_a_line_names_the_rank_and_code():
    peer_failure.seen(Claim(1, 1, None))
    with pytest.raises(PeerFailed, match=r"rank 1 failed \(exit 1\)"):
        stop_if_a_peer_failed()


def test_a_peer_failed_only_on_another_ranks_claim():
    """What the daemon's engine thread asks before it stops its followers (a "stop" to a rank that is gone
    raised gloo's "connection closed" traceback)."""
    assert not peer_failure.a_peer_failed()  # unwatched
    peer_failure.watch(lambda: None)
    assert not peer_failure.a_peer_failed()
    peer_failure.watch(lambda: Claim(0, 2, "mine"))
    assert not peer_failure.a_peer_failed()
    peer_failure.watch(lambda: Claim(1, 2, "bad shard on rank 1"))
    assert peer_failure.a_peer_failed()
    peer_failure.watch(lambda: None)
    peer_failure.seen(Claim(1, 130, None, interrupted=True))
    assert peer_failure.a_peer_failed()
