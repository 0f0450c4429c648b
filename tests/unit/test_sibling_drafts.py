"""SiblingDrafter: drafts from what the other samples of a prompt wrote after the same n-gram."""

from __future__ import annotations

from types import SimpleNamespace

from rollout_cli.engine.scheduling.sibling_drafts import SiblingDrafter


LEADER = SimpleNamespace(request_id=100)


def _request(request_id: int, prompt: list[int], output: list[int], leader=LEADER):
    """A sample of the prompt whose group leader is `leader` (another prompt: another leader)."""
    return SimpleNamespace(request_id=request_id, group_leader=leader, prompt_token_ids=prompt,
                           output_token_ids=output)


def test_a_sibling_continuation_after_the_same_ngram_is_proposed():
    drafter = SiblingDrafter(ngram=2)
    a = _request(0, [1, 2, 3], [10, 11, 12, 13, 14])
    b = _request(1, [1, 2, 3], [10])
    drafter.observe(a)
    drafter.observe(b)
    assert drafter.propose(b, 3) == [11, 12, 13]  # after (3, 10), as a wrote
    b.output_token_ids += [11, 99]
    drafter.observe(b)
    assert drafter.propose(b, 3) == []  # (11, 99): nobody wrote it but b
    assert drafter.propose(_request(2, [1, 2, 3], []), 2) == [10, 11]  # from the prompt's last 2 tokens


def test_its_own_earlier_text_and_the_prompt_are_sources_too():
    drafter = SiblingDrafter(ngram=1)
    a = _request(0, [5, 6, 8, 9], [6, 7, 6])
    drafter.observe(a)
    assert drafter.propose(a, 4) == [7, 6]  # its own past: (6,) last ended at 1, followed by 7, 6
    b = _request(1, [5, 6, 8, 9], [9, 5])
    drafter.observe(b)
    assert drafter.propose(b, 2) == [6, 8]  # (5,) only in the prompt: what followed it there
    b.output_token_ids.append(3)
    drafter.observe(b)
    assert drafter.propose(b, 4) == []  # (3,): in nobody's text but at its own end
    assert drafter.propose(_request(2, [9], [6], leader=SimpleNamespace(request_id=7)), 4) == []  # another prompt
    assert drafter.propose(_request(3, [5], [7]), 0) == []


def test_proposing_before_observing_reads_the_same_index():
    """The engine observes a request's new tokens before proposing; a request proposed for without that (a
    stale record, or none) looks its last n-gram up instead of taking its record's entry."""
    drafter = SiblingDrafter(ngram=2)
    a = _request(0, [1, 2], [3, 4, 5, 3, 4])
    drafter.observe(a)
    assert drafter.propose(a, 2) == [5, 3]  # the record: (3, 4) last ended at 2 (at 5 in a's own end)
    a.output_token_ids.append(5)  # not observed yet
    assert drafter.propose(a, 2) == [3, 4]  # (4, 5) looked up
    assert drafter.propose(_request(1, [1, 2], [2, 3]), 3) == [4, 5, 3]  # never observed: looked up too


def test_the_newest_occurrences_are_kept_and_groups_end_with_their_samples():
    drafter = SiblingDrafter(ngram=1, max_sources=2)
    drafter.expect(LEADER, 3)
    samples = [_request(i, [1], [4, i + 20]) for i in range(3)]
    for sample in samples:
        drafter.observe(sample)
    assert drafter.propose(_request(9, [1], [4]), 1) == [22]  # the most recent of the kept two
    for sample in samples[:2]:
        drafter.finished(sample)
    assert len(drafter) == 1  # finished samples stay sources while a sibling lives
    drafter.finished(samples[2])
    assert len(drafter) == 0


def test_the_index_catches_up_only_before_a_drafting_step():
    """The engine indexes nothing after plain steps; catch_up (before a drafting step) indexes what the running
    samples wrote since, and the last tokens of siblings that ended meanwhile; their records go once read."""
    drafter = SiblingDrafter(ngram=1)
    drafter.expect(LEADER, 3)
    a, b, c = (_request(i, [1], []) for i in range(3))
    drafter.catch_up([a, b, c])  # the first drafting step: each joins, nothing written yet
    a.output_token_ids += [4, 5, 6]  # plain steps: nothing indexed
    b.output_token_ids += [4, 5]
    c.output_token_ids += [7, 8, 9]
    assert drafter.propose(b, 2) == []  # (5,): not in the index yet, nor is a's text after it
    drafter.finished(a)  # a ends unindexed: kept for the group's next catch_up
    assert len(drafter._groups[LEADER.request_id].unindexed) == 1
    drafter.catch_up([b, c])
    assert drafter.propose(b, 2) == [6]  # a's last tokens, indexed now
    assert drafter.propose(c, 2) == []
    assert a.request_id not in drafter._samples and not drafter._groups[LEADER.request_id].unindexed
    drafter.finished(b)
    drafter.finished(c)
    assert len(drafter) == 0 and not drafter._samples  # the group and every record gone with its last sample
