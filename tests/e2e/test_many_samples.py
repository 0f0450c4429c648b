"""A prompt of far more samples than the step loop queues (`--n 10000000`): its requests (and, with --env, its
episodes) are made a slice at a time as there is room (request_maker.sample_slices), not all n before the first
step; the samples are those an unsliced run draws."""

from __future__ import annotations

from itertools import islice
from pathlib import Path

from rollout_cli.engine.engine import Engine
from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.engine.trajectory import PromptInput
from rollout_cli.episodes import EnvStep, EpisodeRunner

MODEL = Path(__file__).resolve().parents[2] / "recipes" / "example_model"


def _engine(max_running: int) -> Engine:
    return Engine(str(MODEL), device="cpu", max_running=max_running, max_model_len=64, kv_cache_tokens=2048)


def test_requests_are_made_as_the_queue_has_room():
    """n = 20,000 with --max-running 4: every request was made before the first step (20,000 waiting);
    now at most a slice (2 x max-running) beyond the queue target."""
    engine = _engine(max_running=4)
    stream = engine.stream([PromptInput(0, [5, 9, 17])], SamplingParams(n=20_000, max_new_tokens=2, seed=1))
    most = 0
    for _ in islice(stream, 40):
        most = max(most, len(engine.scheduler.waiting) + len(engine.scheduler.running))
    stream.close()
    assert 0 < most <= 2 * 8


def test_sliced_samples_are_the_samples_of_one_group():
    """Seeded samples are keyed by (seed, prompt, sample, position): slices of 2 (--max-running 1) draw the
    tokens one group of 6 draws (float32 on the CPU: exact)."""
    params = SamplingParams(n=6, max_new_tokens=5, temperature=1.0, seed=3, ignore_eos=True)
    prompts = [PromptInput(0, [5, 9, 17, 33]), PromptInput(1, [7, 7, 8])]

    def tokens(engine):
        return sorted((t.prompt_index, t.sample_index, t.response_token_ids) for t in engine.stream(prompts, params))

    sliced = tokens(_engine(max_running=1))
    assert [(p, s) for p, s, _ in sliced] == [(p, s) for p in (0, 1) for s in range(6)]
    assert sliced == tokens(_engine(max_running=8))


class _OneTurn:
    def step(self, turn) -> EnvStep:
        return EnvStep(done=True)


def test_episodes_open_a_slice_at_a_time():
    """--env with n = 40, --max-running 2: the row opened its 40 episodes (each with its environment) at once."""
    made = []
    runner = EpisodeRunner(_engine(max_running=2), lambda row: made.append(1) or _OneTurn(), max_turns=2)
    params = SamplingParams(n=40, max_new_tokens=2, seed=1)
    episodes = list(runner.stream([PromptInput(0, [5, 9, 17])], params))
    assert sorted(t.sample_index for t in episodes) == list(range(40)) and len(made) == 40
    assert runner.room.peak_open <= 2 * 4
