"""RequestMaker: the n samples of a prompt, scoring requests, and bad token ids refused in one line
whose fix fits the model (no "raise --max-model-len" past the model's positions)."""

from __future__ import annotations

import pytest

from rollout_cli.engine.scheduling.request_maker import RequestMaker, sample_slices
from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.engine.trajectory import NO_PROMPT_YET, PromptInput, ScoreInput
from rollout_cli.errors import RolloutError


def test_samples_follow_their_leader_and_skip_what_is_done():
    maker = RequestMaker(vocab_size=100, eos_token_ids=frozenset({2}), max_model_len=16, model_positions=32)
    requests = maker.samples(PromptInput(7, [5, 6, 7]), SamplingParams(n=3), skip={(7, 1)})
    assert [r.sample_index for r in requests] == [0, 2]
    assert requests[0].group_leader is None and requests[1].group_leader is requests[0]
    assert len({r.request_id for r in requests}) == 2


def test_a_prompt_of_many_samples_comes_in_slices_each_a_group_of_its_own():
    params = SamplingParams(n=5)
    rows = [PromptInput(0, [5, 6]), NO_PROMPT_YET, PromptInput(1, [7], params=SamplingParams(n=2))]
    sliced = list(sample_slices(rows, params, most=2))
    assert sliced[3] is NO_PROMPT_YET and sliced[4] is rows[2]  # live sources' marker; a prompt that fits
    assert [p.samples for p in sliced[:3]] == [range(0, 2), range(2, 4), range(4, 5)]
    maker = RequestMaker(vocab_size=100, eos_token_ids=frozenset(), max_model_len=16)
    requests = maker.samples(sliced[1], params, skip={(0, 3)})
    assert [r.sample_index for r in requests] == [2] and requests[0].group_leader is None
    # lazy: a slice is made when the step loop asks for it, whatever n is
    assert next(sample_slices([PromptInput(0, [5])], SamplingParams(n=10**12), most=512)).samples == range(512)


def test_scoring_request_scores_the_response():
    maker = RequestMaker(vocab_size=100, eos_token_ids=frozenset(), max_model_len=16)
    request = maker.scoring(ScoreInput(1, 2, [5, 6], [7, 8, 9]), SamplingParams())
    assert request.prompt_token_ids == [5, 6, 7, 8, 9] and request.score_from == 2
    assert request.scored_logprobs == [None, None, None]


@pytest.mark.parametrize("max_model_len,positions,fix", [
    (8, 32, "raise --max-model-len (the model allows up to 32)"),
    (8, 8, "that is all the positions the model has: filter long prompts"),
])
def test_a_prompt_too_long_names_the_fix_that_exists(max_model_len, positions, fix):
    maker = RequestMaker(vocab_size=100, eos_token_ids=frozenset(), max_model_len=max_model_len,
                         model_positions=positions)
    with pytest.raises(RolloutError, match="prompt 0 has 9 tokens") as err:
        maker.samples(PromptInput(0, list(range(9))), SamplingParams(), skip=set())
    assert fix in str(err.value) and "\n" not in str(err.value)


def test_bad_ids_are_refused():
    maker = RequestMaker(vocab_size=10, eos_token_ids=frozenset(), max_model_len=16)
    for ids, problem in (([], "is empty"), ([3, 10], "outside [0, 10)"), ([-1], "outside")):
        with pytest.raises(RolloutError, match=problem.replace("[", r"\[").replace(")", r"\)")):
            maker.samples(PromptInput(0, ids), SamplingParams(), skip=set())


def test_a_job_refuses_before_writing_exactly_what_the_engine_refuses(tmp_path):
    """run_job's PromptSource checks rows with the RequestMaker's limits (token_id_problem is the one rule):
    a row it lets through is never refused later, mid-run, with output already written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rollout_cli.io.prompts import PromptSource

    maker = RequestMaker(vocab_size=10, eos_token_ids=frozenset(), max_model_len=4)
    prompts = [[1, 2, 3], [1, 2, 3, 4], [9], [1, 10], [0, 0, 0, 0, 0]]
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": pa.array(prompts, pa.list_(pa.int64()))}), path)
    source = PromptSource(path, None, max_prompt_len=maker.max_prompt_len, vocab_size=maker.vocab_size,
                          skip_invalid=True)
    skipped = {s.prompt_index for s in source.validate()}
    refused = set()
    for index, ids in enumerate(prompts):
        try:
            maker.samples(PromptInput(index, ids), SamplingParams(), skip=set())
        except RolloutError:
            refused.add(index)
    assert skipped == refused == {1, 3, 4}
