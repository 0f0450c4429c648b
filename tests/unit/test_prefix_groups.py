"""engine/execution/prefix_groups.py: which decode requests share prefix slots, on plain request stand-ins."""

from __future__ import annotations

from types import SimpleNamespace

from rollout_cli.engine.execution.prefix_groups import group_shared_prefixes, shared_prefix_len


def request(prompt, slots, cached):
    return SimpleNamespace(prompt_index=prompt, slots=list(slots), num_cached_tokens=cached)


PROMPT = list(range(100, 164))  # 64 slots the tree holds for prompt 0


def test_shared_len_is_where_the_slots_part():
    a = request(0, PROMPT + [1, 2, 3], 67)
    b = request(0, PROMPT[:40] + [7] * 30, 70)  # the tree holds another branch after 40 keys
    assert shared_prefix_len(a, b) == 40
    assert shared_prefix_len(a, request(0, PROMPT + [9], 64)) == 64
    assert shared_prefix_len(a, request(0, PROMPT, 10)) == 10  # only cached slots count
    assert shared_prefix_len(a, request(0, [5] + PROMPT[1:], 64)) == 0
    assert shared_prefix_len(a, request(0, [], 0)) == 0


def test_groups_samples_of_a_prompt_and_leaves_the_rest_alone():
    other = list(range(500, 540))
    batch = [
        request(0, PROMPT + [1], 64),       # 0: prompt 0's first sample in the batch
        request(1, other + [2], 40),        # 1: prompt 1, alone in the batch
        request(0, PROMPT + [3, 4], 64),    # 2
        request(0, PROMPT[:50] + [8], 50),  # 3: shares 50 keys
        request(0, [9] * 65, 65),           # 4: prompt 0 again, other slots (recomputed after preemption)
        request(2, list(range(900, 1000)), 0),  # 5: nothing cached
        request(2, list(range(900, 1000)), 0),  # 6
    ]
    groups = group_shared_prefixes(batch, min_prefix=32)
    assert groups.order == [0, 2, 3, 1, 4, 5, 6]
    assert groups.group_starts == [0, 3, 7]
    assert groups.prefix_lens == [50, 0]  # the least any member shares with the first
    assert groups.shared_keys == 2 * 50
    order, starts, prefixes = groups.padded(batch=8, num_groups=4)
    assert order == [0, 2, 3, 1, 4, 5, 6, 7]  # the padding row joins the requests alone
    assert starts == [0, 3, 8, 8, 8] and prefixes == [50, 0, 0, 0]


def test_none_when_nothing_is_worth_sharing():
    assert group_shared_prefixes([request(0, PROMPT, 64), request(1, PROMPT, 64)]) is None  # other prompts
    short = [request(0, PROMPT[:20], 20), request(0, PROMPT[:20], 20)]
    assert group_shared_prefixes(short, min_prefix=32) is None
    assert group_shared_prefixes(short, min_prefix=16).prefix_lens == [20, 0]
