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
    # the same slots are the same keys whatever the other cached: it may be the sample that computed them
    assert shared_prefix_len(a, request(0, PROMPT, 10)) == 64
    assert shared_prefix_len(a, request(0, PROMPT + [5], 0)) == 64
    assert shared_prefix_len(request(0, PROMPT, 20), a) == 20  # within what the anchor read from the cache
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


def test_slots_not_counted_as_cached_still_share():
    """A sample holding the slots its siblings read from the cache but counting none as cached (the sample
    that computed them, before it hands them to the tree): one group of all of them, whichever comes
    first in the batch; a sample that recomputed the prompt in slots of its own stays alone."""
    owner = request(0, PROMPT + [1], 0)
    readers = [request(0, PROMPT + [2], 64), request(0, PROMPT[:63] + [3, 4], 63)]  # the second computed key 63
    recomputed = request(0, [9] * 65, 0)
    groups = group_shared_prefixes([owner, *readers, recomputed])
    assert groups.order == [0, 1, 2, 3] and groups.group_starts == [0, 3, 4]
    assert groups.prefix_lens == [63, 0] and groups.shared_keys == 2 * 63
    assert group_shared_prefixes([owner, *readers]).prefix_lens == [63, 0]  # one compare each
    assert group_shared_prefixes([recomputed, readers[0], owner]).order == [1, 2, 0]
    assert group_shared_prefixes([owner, request(0, PROMPT + [5], 0)]) is None  # nobody read the cache


def test_none_when_nothing_is_worth_sharing():
    assert group_shared_prefixes([request(0, PROMPT, 64), request(1, PROMPT, 64)]) is None  # other prompts
    short = [request(0, PROMPT[:20], 20), request(0, PROMPT[:20], 20)]
    assert group_shared_prefixes(short, min_prefix=32) is None
    assert group_shared_prefixes(short, min_prefix=16).prefix_lens == [20, 0]


def test_the_graph_group_buffer_pads_every_bucket():
    """cuda_graphs.DecodeGraphs._group_rows: the rows a replay's static group buffer gets (importable on the
    CPU: it is plain torch on host tensors)."""
    from rollout_cli.engine.execution.cuda_graphs import MAX_SHARED_GROUPS, DecodeGraphs, group_slots

    assert [group_slots(b) for b in (1, 2, 16, 256)] == [1, 2, 9, MAX_SHARED_GROUPS + 1]
    alone = DecodeGraphs._group_rows(None, 4, 6)  # every row alone: one group of prefix 0, the rest empty
    assert alone[0, :4].tolist() == [0, 1, 2, 3] and alone[1, :4].tolist() == [0, 4, 4, 4]
    assert alone[2, :3].tolist() == [0, 0, 0]
    batch = [request(0, PROMPT + [1], 64), request(1, PROMPT[:5], 5), request(0, PROMPT + [2], 64)]
    rows = DecodeGraphs._group_rows(group_shared_prefixes(batch), 4, 5)  # 3 requests in a bucket of 4
    assert rows[0, :4].tolist() == [0, 2, 1, 3] and rows[1, :4].tolist() == [0, 2, 4, 4]
    assert rows[2, :3].tolist() == [64, 0, 0]


def test_groups_beyond_the_cap_stay_alone():
    prompts = [list(range(1000 * p, 1000 * p + 40)) for p in range(3)]
    batch = [request(p, prompts[p] + [s], 40) for p in range(3) for s in range(2)]
    groups = group_shared_prefixes(batch, max_groups=3)  # two sharing groups, then the requests alone
    assert groups.prefix_lens == [40, 40, 0] and groups.order == [0, 1, 2, 3, 4, 5]
    assert groups.group_starts == [0, 2, 4, 6]
