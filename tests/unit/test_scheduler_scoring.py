"""Scoring requests in the scheduler (Engine.score): which rows each step scores, cache reuse that
stops before the first scored row, and preemption that recomputes without scoring a token twice."""

from __future__ import annotations

from rollout_cli.engine.scheduling.request import Request
from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.engine.scheduling.scheduler import Scheduler


def scoring_request(request_id, prompt, response, **kwargs):
    return Request(request_id, request_id, 0, list(prompt) + list(response), SamplingParams(),
                   score_from=len(prompt), scored_logprobs=[None] * len(response), **kwargs)


def fake_scores(out):
    """One number per scored row that names the position of the token it scores."""
    return [float(e.start + e.score_first_row + 1 + i) for e in out.entries for i in range(len(e.score_targets or ()))]


def drive(s: Scheduler, steps: list):
    finished = []
    while s.has_work():
        out = s.schedule()
        steps.append([(e.request.request_id, e.start, e.num_new_tokens, e.score_first_row, e.score_targets)
                      for e in out.entries])
        assert not any(e.sample for e in out.entries)
        finished += s.postprocess(out, [], [], fake_scores(out))
    return finished


def test_chunks_score_the_rows_from_the_last_prompt_token_on():
    s = Scheduler(num_kv_slots=64, max_running=4, max_batch_tokens=4)
    r = scoring_request(0, [10, 11, 12, 13, 14], [20, 21, 22, 23])
    s.add(r)
    steps = []
    [done] = drive(s, steps)
    # positions 0-3, 4-7, 8: row 4 (the last prompt token) scores token 20, row 7 scores 23; row 8 scores nothing
    assert steps == [[(0, 0, 4, 0, None)], [(0, 4, 4, 0, [20, 21, 22, 23])], [(0, 8, 1, 0, None)]]
    assert done is r and r.finish_reason == "scored"
    assert r.scored_logprobs == [5.0, 6.0, 7.0, 8.0]  # each target's position, once
    assert r.output_token_ids == []


def test_the_prefix_cache_serves_the_prompt_but_no_scored_row():
    s = Scheduler(num_kv_slots=64, max_running=4, max_batch_tokens=64)
    first = scoring_request(0, [1, 2, 3, 4, 5, 6], [7, 8, 9])
    s.add(first)
    drive(s, [])
    again = scoring_request(1, [1, 2, 3, 4, 5, 6], [7, 8, 9])  # the whole sequence is cached now
    s.add(again)
    steps = []
    drive(s, steps)
    # 5 prompt tokens from the cache; the forward starts at the last prompt token, whose logits score token 7
    assert steps == [[(1, 5, 4, 0, [7, 8, 9])]]
    assert again.scored_logprobs == [6.0, 7.0, 8.0]


def test_preemption_recomputes_and_scores_every_token_once():
    s = Scheduler(num_kv_slots=64, max_running=4, max_batch_tokens=3, enable_prefix_cache=False)
    r = scoring_request(0, [1, 2, 3], [4, 5, 6, 7, 8])
    s.add(r)
    out = s.schedule()
    s.postprocess(out, [], [], fake_scores(out))  # positions 0-2: row 2 scores token 4
    out = s.schedule()
    s.postprocess(out, [], [], fake_scores(out))  # positions 3-5
    assert r.scored_logprobs == [3.0, 4.0, 5.0, 6.0, None]
    s.preempt(r)
    r.scored_logprobs = [-1.0] * 5  # recomputed rows must overwrite, not append
    drive(s, [])
    assert r.num_preemptions == 1 and r.finish_reason == "scored"
    assert r.scored_logprobs == [3.0, 4.0, 5.0, 6.0, 7.0]
