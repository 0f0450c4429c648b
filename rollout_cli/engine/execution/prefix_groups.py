"""Which decode requests of a step share their first KV slots: the groups that shared-prefix decode
attention (kernels/shared_prefix_decode_attention.py) reads the prefix of once.

The prefix cache gives the n samples of a prompt the same slots for the prompt: a request adopts the
radix tree's slots for its first `num_cached_tokens` tokens, and the sample that computed them hands
them to the tree once its prompt is computed, counting them as cached from then on
(scheduling/prefix_reuse.py). Two running requests hold the same slot only through the tree, and a
tree slot belongs to one tree position, whose path from the root is unique, so two requests whose
slots agree at position i agree at every position before it: their shared length is found by
bisection on slot equality, within what the anchor counts as cached (its cached slots are tree
slots), whatever the other counts. Candidates are the samples of one prompt (same prompt_index),
compared with the first of them that counts min_prefix keys as cached (the anchor); a sample that
shares too little stays alone.

The same groups give `rollout bench` its rule for what a decode step must read (bench_limits.py:
a group's prefix once, model_runner.distinct_context_tokens).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefixGroups:
    """The kernel's group arguments as host lists. Groups of requests sharing a prefix come first,
    then one group of prefix 0 holding every request alone."""

    order: list[int]  # [B] batch indices, group by group
    group_starts: list[int]  # [NG + 1] offsets into order
    prefix_lens: list[int]  # [NG] shared keys of each group (0: the requests alone)
    shared_keys: int  # keys a plain kernel would read again: sum over groups of (members - 1) * prefix

    @classmethod
    def everyone_alone(cls) -> "PrefixGroups":
        """No group: padded() puts every row in the one group of prefix 0."""
        return cls([], [0, 0], [0], 0)

    def padded(self, batch: int, num_groups: int) -> tuple[list[int], list[int], list[int]]:
        """(order, group_starts, prefix_lens) for a fixed-size launch of `batch` requests and
        `num_groups` group slots (a CUDA graph's bucket): requests past the step's (padding rows) join
        the group of prefix 0, which is the last one; unused slots are empty groups."""
        assert num_groups >= len(self.prefix_lens)
        order = self.order + list(range(len(self.order), batch))
        starts = self.group_starts[:-1] + [batch] * (num_groups + 1 - len(self.prefix_lens))
        return order, starts, self.prefix_lens + [0] * (num_groups - len(self.prefix_lens))


def shared_prefix_len(anchor, other) -> int:
    """Keys at the start of requests `anchor` and `other` held in the same slots, within the keys the
    anchor read from the cache (0 if none); Requests."""
    hi = min(anchor.num_cached_tokens, len(anchor.slots), len(other.slots))
    if hi == 0 or anchor.slots[0] != other.slots[0]:
        return 0
    lo = 1  # the slots agree at [0, lo); they differ at hi or beyond
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if anchor.slots[mid - 1] == other.slots[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


MIN_SHARED_PREFIX = 32  # keys: below this a group's prefix pass costs about what it saves


def group_shared_prefixes(requests, min_prefix: int = MIN_SHARED_PREFIX,
                          max_groups: int | None = None) -> PrefixGroups | None:
    """Groups over a decode step's requests (batch order); None when no two share min_prefix keys,
    and the plain kernel is the right one. A group's prefix is the least any member shares with its
    first: prefixes of different lengths in one group would need more than one prefix pass. At most
    max_groups groups in all (the requests alone included): the rest stay alone."""
    by_prompt: dict[int, list[int]] = {}
    for i, request in enumerate(requests):
        if len(request.slots) >= min_prefix:
            by_prompt.setdefault(request.prompt_index, []).append(i)
    order, starts, prefix_lens, shared = [], [0], [], 0
    grouped: set[int] = set()
    for members in by_prompt.values():
        if len(members) < 2 or (max_groups is not None and len(prefix_lens) >= max_groups - 1):
            continue
        cached = [i for i in members if requests[i].num_cached_tokens >= min_prefix]
        if not cached:
            continue
        anchor = requests[cached[0]]
        prefix = min(requests[i].num_cached_tokens for i in cached)
        probe = anchor.slots[prefix - 1]
        if all(len(requests[i].slots) >= prefix and requests[i].slots[prefix - 1] == probe for i in members):
            keep = members  # the usual case (the owner of the prompt's slots too): one compare each
        else:  # someone holds other slots (recomputed after a preemption, another branch): bisect
            lengths = {i: shared_prefix_len(anchor, requests[i]) for i in members}
            keep = [i for i in members if lengths[i] >= min_prefix]
            if len(keep) < 2:
                continue
            prefix = min(lengths[i] for i in keep)
        order += keep
        starts.append(len(order))
        prefix_lens.append(prefix)
        grouped.update(keep)
        shared += (len(keep) - 1) * prefix
    if not grouped:
        return None
    order += [i for i in range(len(requests)) if i not in grouped]
    starts.append(len(order))
    prefix_lens.append(0)
    return PrefixGroups(order, starts, prefix_lens, shared)
