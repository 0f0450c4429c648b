"""Vision-language rollouts against HF transformers' own classes (issue 23), float32 on the CPU.

Tiny Qwen3-VL (deepstack) and Qwen3.5 (hybrid language model) checkpoints from tests/vlm_fixtures.py;
prompts hold one or two images of a few sizes, or none. Greedy tokens must equal HF's and logprobs
agree to 1e-4, through chunked prefill, the prefix cache (keyed by the images' pixels), the on-policy
mode's one-token forwards and a weight reload that changes the vision tower.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from rollout_cli import Engine, SamplingParams
from rollout_cli.engine.trajectory import PromptInput
from rollout_cli.errors import RolloutError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vlm_fixtures import HFVisionReference, ReferencePrompts, build_tiny_vlm, random_image  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"])
def vlm(request, tmp_path_factory):
    """(checkpoint dir, HF reference, prompt builder, arch) of one tiny VLM."""
    directory = build_tiny_vlm(tmp_path_factory.mktemp(request.param), request.param)
    return str(directory), HFVisionReference(str(directory)), ReferencePrompts(str(directory)), request.param


def _engine(model_dir: str, **options) -> Engine:
    options = {"device": "cpu", "dtype": "float32", "max_model_len": 512, "kv_cache_tokens": 4096, **options}
    return Engine(model_dir, **options)


def _run(engine: Engine, prompts, params=GREEDY, first_index: int = 0):
    inputs = [PromptInput(first_index + i, ids, images=images) for i, (ids, images) in enumerate(prompts)]
    return sorted(engine.stream(inputs, params), key=lambda t: (t.prompt_index, t.sample_index))


def _assert_matches_hf(results, prompts, ref: HFVisionReference) -> None:
    for result in results:
        ids, images = prompts[result.prompt_index]
        want = ref.greedy(ids, images, len(result.response_token_ids))
        assert result.response_token_ids == want, f"prompt {result.prompt_index}"
        assert result.response_logprobs == pytest.approx(ref.logprobs(ids, images, want), abs=1e-4)


def _prompts(build):
    return [build.build([random_image(20, 12, 1)]),  # one image, 16 x 16 after resizing: 4 tokens
            build.build([random_image(32, 24, 2), random_image(16, 40, 3)], "compare them"),  # two sizes
            build.build([], "text only")]


def test_images_match_hf(vlm):
    model_dir, ref, build, _ = vlm
    prompts = _prompts(build)
    assert len(prompts[1][1]) == 2 and prompts[1][1][0].grid_thw != prompts[1][1][1].grid_thw
    _assert_matches_hf(_run(_engine(model_dir), prompts), prompts, ref)


def test_chunked_prefill_that_cuts_images_matches_hf(vlm):
    """Chunks of 5 tokens start and stop inside the images' placeholder runs."""
    model_dir, ref, build, _ = vlm
    prompts = _prompts(build)[:2]
    _assert_matches_hf(_run(_engine(model_dir, max_batch_tokens=5), prompts), prompts, ref)


def test_a_shared_image_is_encoded_once_and_its_prefix_is_cached(vlm):
    model_dir, ref, build, _ = vlm
    picture = random_image(24, 24, 5)
    prompts = [build.build([picture], "first"), build.build([picture], "second")]
    engine = _engine(model_dir)
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True, n=2)
    first = _run(engine, prompts[:1], params)
    # the second sample reads the whole prompt but its last token from the cache
    assert [r.cached_prompt_tokens for r in first] == [0, len(prompts[0][0]) - 1]
    later = _run(engine, [prompts[1]], params, first_index=1)
    _assert_matches_hf(first + later, prompts, ref)
    assert engine.runner.encoder_cache.images_encoded == 1  # one image, four samples, two prompts
    if engine.linear_states is None:  # hybrid models cache a prompt's prefix at its snapshot point only
        # the other prompt shares the template's opening and the image's tokens
        assert later[0].cached_prompt_tokens >= prompts[1][0].index(770) + 4


def test_same_ids_with_other_pixels_share_no_image_tokens(vlm):
    """Two prompts whose token ids are equal but whose images differ: the cache must not serve the
    second image's tokens from the first (it keys them by the pixels)."""
    model_dir, ref, build, _ = vlm
    prompts = [build.build([random_image(16, 16, 7)], "same"), build.build([random_image(16, 16, 8)], "same")]
    assert prompts[0][0] == prompts[1][0]
    engine = _engine(model_dir)
    first = _run(engine, prompts[:1])
    second = _run(engine, [prompts[1]], first_index=1)
    image_start = prompts[1][0].index(770)
    assert second[0].cached_prompt_tokens <= image_start
    _assert_matches_hf(first, prompts[:1], ref)
    _assert_matches_hf(second, prompts, ref)
    assert first[0].response_token_ids != second[0].response_token_ids


def test_on_policy_one_token_forwards_equal_the_batched_run(vlm):
    """--deterministic on the torch path runs every token alone: image tokens get their [3, 1] positions
    and their embedding row one at a time; greedy tokens and logprobs equal the batched forward's."""
    model_dir, _, build, _ = vlm
    prompts = _prompts(build)[:2]
    batched = _run(_engine(model_dir), prompts)
    alone = _run(_engine(model_dir, deterministic=True), prompts)
    for a, b in zip(batched, alone):
        assert a.response_token_ids == b.response_token_ids
        # float32 noise only (the hybrids' recurrent one-token DeltaNet against the chunked one): 1e-4
        assert a.response_logprobs == pytest.approx(b.response_logprobs, abs=1e-4)


def test_seeded_samples_do_not_depend_on_the_batch(vlm):
    model_dir, _, build, _ = vlm
    prompts = _prompts(build)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, n=2, seed=3)
    together = _run(_engine(model_dir), prompts, params)
    alone = _run(_engine(model_dir), prompts[1:2], params, first_index=1)  # the same random streams
    pick = [t for t in together if t.prompt_index == 1]
    assert [t.response_token_ids for t in pick] == [t.response_token_ids for t in alone]


def test_reloaded_vision_weights_change_the_images_embeddings(vlm, tmp_path):
    """A reload with another vision tower: the encoder cache is dropped with the old weights."""
    model_dir, _, build, arch = vlm
    other = build_tiny_vlm(tmp_path / "other", arch, seed=99)
    prompts = _prompts(build)[:1]
    engine = _engine(model_dir)
    _run(engine, prompts)
    engine.reload_weights(str(other))
    _assert_matches_hf(_run(engine, prompts), prompts, HFVisionReference(str(other)))


def test_images_for_a_text_model_or_wrong_placeholders_are_refused(vlm, example_model_dir):
    model_dir, _, build, _ = vlm
    ids, images = build.build([random_image(16, 16, 1)])
    with pytest.raises(RolloutError, match="text-only model"):
        _run(_engine(example_model_dir), [([t % 700 for t in ids], images)])
    engine = _engine(model_dir)
    with pytest.raises(RolloutError, match="placeholder tokens"):
        _run(engine, [(ids[:-3] + [770] + ids[-3:], images)])
    assert torch.equal(torch.tensor(0), torch.tensor(engine.scheduler.has_work()))


def test_placeholders_without_their_images_are_refused(vlm):
    """A VL model would read image tokens without their pictures as text: generating, scoring and continuing
    such a prompt is refused in one line, never answered with wrong logprobs."""
    from rollout_cli.engine.trajectory import PartialSample, ScoreInput

    model_dir, _, build, _ = vlm
    ids, _ = build.build([random_image(16, 16, 1)])
    engine = _engine(model_dir)
    with pytest.raises(RolloutError, match="placeholder tokens but no images"):
        _run(engine, [(ids, ())])
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    with pytest.raises(RolloutError, match="rollout score"):
        list(engine.score([ScoreInput(0, 0, ids, [5, 6])], params))
    with pytest.raises(RolloutError, match="placeholder tokens but no images"):
        list(engine.stream([PartialSample(0, 0, ids, [5], [-1.0], ["v0"])], params))
    assert not engine.scheduler.has_work()


class _Observer:
    """An environment answering every model turn with the same tokens; done after three turns. It notes how
    many tokens its session has pinned when it is asked (after the turn's pin moved)."""

    def __init__(self, runner, session_id: str):
        self.runner, self.session_id = runner, session_id
        self.turns = 0
        self.pinned: list[int] = []

    def step(self, turn):
        from rollout_cli.episodes import EnvStep

        self.turns += 1
        self.pinned.append(self.runner.sessions._open[self.session_id].pin.num_tokens)
        return EnvStep(observation=[11, 12, 13], reward=1.0, done=self.turns == 3)


def test_episode_turns_keep_the_images(vlm):
    """An episode's later turns carry the first turn's images: each model turn's tokens are what the engine
    samples for the conversation so far sent as one prompt with them, and the pinned conversation (its
    image tokens keyed by their pixels) serves the later turns' prefill."""
    from rollout_cli.episodes import EpisodeRunner

    model_dir, _, build, _ = vlm
    ids, images = build.build([random_image(20, 12, 1)])
    engine = _engine(model_dir)
    params = SamplingParams(n=2, max_new_tokens=4, temperature=1.0, seed=9, ignore_eos=True)
    envs = []

    def make_env(row):
        envs.append(_Observer(runner, f"episode-0-{len(envs)}"))
        return envs[-1]

    runner = EpisodeRunner(engine, make_env, max_turns=5)
    episodes = sorted(runner.stream([PromptInput(0, ids, images=images)], params), key=lambda t: t.sample_index)
    assert len(episodes) == 2
    for episode, env in zip(episodes, envs):
        # the pin holds the conversation's KV, image tokens included (keyed by their pixels, not their ids)
        spans = episode.episode["model_turns"]
        hybrid = engine.linear_states is not None  # a hybrid turn pins its prompt but the last token
        assert env.pinned == [len(ids) + (start - 1 if hybrid else end - 1) for start, end in spans]
        spans = episode.episode["model_turns"]
        assert len(spans) == 3 and episode.image_grid_thw == [list(images[0].grid_thw)]
        for start, end in spans:
            conversation = PromptInput(0, episode.prompt_token_ids + episode.response_token_ids[:start], images=images,
                                       params=dataclasses.replace(params, n=episode.sample_index + 1))
            alone = [t for t in engine.stream([conversation], params) if t.sample_index == episode.sample_index][0]
            assert alone.response_token_ids == episode.response_token_ids[start:end]
            assert alone.response_logprobs == pytest.approx(episode.response_logprobs[start:end], abs=1e-4)
        assert all(cached > len(ids) // 2 for cached in episode.episode["turn_cached_tokens"][1:])
