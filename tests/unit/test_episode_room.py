"""EpisodeRoom (rollout_cli/episode_room.py): which prompt rows may start their episodes, from the open
episodes' KV projected to their last turn against the pool."""

from __future__ import annotations

from rollout_cli.engine.sampling_params import SamplingParams
from rollout_cli.engine.trajectory import PromptInput
from rollout_cli.episode_room import FILL, MIN_ENDED, EpisodeRoom


def test_before_any_turn_an_episode_is_projected_at_max_new_tokens_a_turn():
    room = EpisodeRoom(pool_tokens=1000, max_turns=4, max_len=10_000)  # room for 900 tokens
    room.opened((0, 0), 100, max_new_tokens=50)  # 100 + 4 x 50 = 300
    assert room.fits(100, 1, 50)  # 600 <= 900
    room.opened((1, 0), 100, max_new_tokens=50)
    assert room.fits(100, 1, 50)  # 900
    room.opened((2, 0), 100, max_new_tokens=50)
    assert not room.fits(100, 1, 50)  # 1200


def test_a_group_shares_its_prompt_and_the_first_row_always_starts():
    room = EpisodeRoom(pool_tokens=100, max_turns=2, max_len=10_000)
    assert room.fits(5_000, 8, 100)  # nothing open: a row larger than the pool still starts (else nothing runs)
    for k in range(8):
        room.opened((0, k), 10 / 8, max_new_tokens=100)
    room.closed((0, 0), 2)
    assert not room.fits(10, 1, 1)
    # a prompt of 400 shared by 4 episodes counts 400 once: 4 x (100 + 2 x 10)
    room = EpisodeRoom(pool_tokens=int(480 / FILL) + 1, max_turns=2, max_len=10_000)
    room.opened((9, 9), 0, max_new_tokens=0)
    assert room.fits(400, 4, 10) and not room.fits(404, 4, 10)


def test_the_projection_learns_each_turns_growth_and_the_episodes_length():
    room = EpisodeRoom(pool_tokens=10_000, max_turns=10, max_len=100_000)
    room.opened((0, 0), 100, max_new_tokens=10)
    assert room._projection(room._open[(0, 0)]) == 100 + 10 * 10
    room.continued((0, 0), 30)  # a 10-token response and a 20-token observation
    assert room._projection(room._open[(0, 0)]) == 130 + 9 * 30
    for k in range(1, MIN_ENDED + 1):  # episodes that ended after 2 turns: the rest are projected at 2
        room.opened((k, 0), 100, max_new_tokens=10)
        room.closed((k, 0), 2)
    assert room._projection(room._open[(0, 0)]) == 130 + 1 * 30
    # --max-model-len caps a projection
    short = EpisodeRoom(pool_tokens=10_000, max_turns=10, max_len=150)
    short.opened((0, 0), 100, max_new_tokens=10)
    assert short._projection(short._open[(0, 0)]) == 150


def test_rows_are_read_with_their_own_sampling_settings():
    room = EpisodeRoom(pool_tokens=1000, max_turns=2, max_len=10_000)
    room.opened((0, 0), 100, max_new_tokens=100)  # 300
    job = SamplingParams(n=1, max_new_tokens=100)
    assert room.fits_row(PromptInput(1, [1] * 100), job)  # 600 <= 900
    assert not room.fits_row(PromptInput(1, [1] * 100, params=SamplingParams(n=2, max_new_tokens=200)), job)
    assert room.summary() == {"peak_open_episodes": 1, "episode_rows_held_for_kv": 1}
