"""Radix prefix cache: match / insert / split / lock / evict, with slot accounting after every operation."""

from __future__ import annotations

import random

import pytest

from rollout_cli.engine.scheduling.kv_slots import SlotAllocator
from rollout_cli.engine.scheduling.radix_cache import RadixCache


class Harness:
    """A cache plus the slots "requests" own outside it; checks the accounting invariant."""

    def __init__(self, num_slots: int):
        self.allocator = SlotAllocator(num_slots)
        self.cache = RadixCache(self.allocator)
        self.owned: set[int] = set()
        self.content: dict[int, tuple] = {}  # slot -> the token prefix whose last token's KV it holds
        self.evicted = 0

    def alloc(self, tokens: list[int], start: int) -> list[int]:
        """Slots for tokens[start:], as a request computing them would take."""
        count = len(tokens) - start
        if self.allocator.num_free < count:
            self.evicted += self.cache.evict(count - self.allocator.num_free)
        slots = self.allocator.allocate(count)
        for i, s in enumerate(slots):
            self.content[s] = tuple(tokens[: start + i + 1])
        self.owned.update(slots)
        self.check()
        return slots

    def insert(self, tokens: list[int], slots: list[int]) -> int:
        """Insert like the scheduler does: the tree takes slots[already:], duplicates are freed."""
        already = self.cache.insert(tokens, slots)
        tree_slots, _ = self.cache.match_prefix(tokens)
        assert len(tree_slots) == len(tokens)
        assert tree_slots[already:] == slots[already:]
        dup = [s for s, t in zip(slots[:already], tree_slots[:already]) if s != t and s in self.owned]
        self.allocator.free(dup)
        self.owned.difference_update(dup)
        self.owned.difference_update(slots[already:])
        self.check()
        return already

    def tree_slots(self) -> list[int]:
        return [s for node in self.cache._nodes() for s in node.value]

    def check(self) -> None:
        cache, alloc = self.cache, self.allocator
        assert alloc.num_free + cache.total_size + len(self.owned) == alloc.num_slots - 1
        tree = self.tree_slots()
        free = list(alloc._free)
        everything = tree + free + list(self.owned)
        assert len(everything) == len(set(everything)), "a slot is held twice"
        assert set(everything) == set(range(1, alloc.num_slots)), "slot 0 used or a slot lost"
        assert len(tree) == cache.total_size
        evictable = protected = 0
        for node in cache._nodes():
            if node is cache.root:
                continue
            assert len(node.key) == len(node.value) > 0
            assert node.parent.children[node.key[0]] is node
            assert node.parent is cache.root or node.parent.lock_ref >= node.lock_ref
            if node.lock_ref:
                protected += len(node.value)
            else:
                evictable += len(node.value)
        assert (evictable, protected) == (cache.evictable_size, cache.protected_size)

    def check_content(self, tokens: list[int]) -> list[int]:
        slots, _ = self.cache.match_prefix(tokens)
        for i, s in enumerate(slots):
            assert self.content[s] == tuple(tokens[: i + 1]), (i, s)
        self.check()
        return slots


def test_insert_match_and_split():
    h = Harness(64)
    a = [1, 2, 3, 4, 5, 6]
    slots_a = h.alloc(a, 0)
    assert h.insert(a, slots_a) == 0
    assert h.cache.total_size == 6 and h.cache.evictable_size == 6
    # exact, longer and shorter queries
    assert h.check_content(a) == slots_a
    assert h.check_content(a + [9, 9]) == slots_a
    assert h.check_content([7]) == []
    # a query ending inside the edge splits it
    slots, node = h.cache.match_prefix([1, 2, 3])
    assert slots == slots_a[:3]
    assert node.key == [1, 2, 3] and node.value == slots_a[:3]
    assert list(node.children) == [4] and node.children[4].key == [4, 5, 6]
    assert h.cache.total_size == 6
    h.check()
    # a diverging sequence shares the first three
    b = [1, 2, 3, 8, 9]
    slots_b = h.check_content(b) + h.alloc(b, 3)
    assert h.insert(b, slots_b) == 3
    assert h.cache.total_size == 8
    assert h.check_content(b) == slots_b
    assert h.check_content(a) == slots_a
    # divergence in the middle of an edge (split inside insert)
    c = [1, 2, 3, 4, 7]
    slots_c = h.check_content(c[:4]) + h.alloc(c, 4)
    assert h.insert(c, slots_c) == 4
    assert h.check_content(c) == slots_c
    assert h.check_content(a) == slots_a
    assert h.cache.total_size == 9


def test_insert_of_duplicate_sequence_frees_callers_copy():
    h = Harness(32)
    a = [4, 4, 5, 6]
    first = h.alloc(a, 0)
    h.insert(a, first)
    second = h.alloc(a, 0)  # computed again by another request
    free_before = h.allocator.num_free
    assert h.insert(a, second) == 4
    assert h.allocator.num_free == free_before + 4
    assert h.check_content(a) == first
    assert h.cache.total_size == 4


def test_lock_protects_path_and_unlock_restores():
    h = Harness(64)
    a, b = [1, 2, 3, 4], [1, 2, 9]
    h.insert(a, h.alloc(a, 0))
    h.insert(b, h.check_content(b) + h.alloc(b, 2))
    _, node_b = h.cache.match_prefix(b)
    h.cache.lock(node_b)
    h.check()
    assert h.cache.protected_size == 3 and h.cache.evictable_size == 2
    _, node_a = h.cache.match_prefix(a)
    h.cache.lock(node_a)  # shares [1, 2] with b: counted once
    h.check()
    assert h.cache.protected_size == 5 and h.cache.evictable_size == 0
    assert h.cache.evict(10) == 0  # everything locked
    h.check()
    h.cache.unlock(node_a)
    h.check()
    assert h.cache.protected_size == 3
    h.cache.unlock(node_b)
    h.check()
    assert h.cache.protected_size == 0 and h.cache.evictable_size == 5
    with pytest.raises(AssertionError):
        h.cache.unlock(node_b)


def test_split_of_locked_node_keeps_lock_accounting():
    h = Harness(32)
    a = [1, 2, 3, 4, 5]
    h.insert(a, h.alloc(a, 0))
    _, node = h.cache.match_prefix(a)
    h.cache.lock(node)
    h.cache.match_prefix([1, 2])  # split while locked
    h.check()
    assert h.cache.protected_size == 5
    h.cache.unlock(node)  # unlocks both halves through the parent chain
    h.check()
    assert h.cache.protected_size == 0 and h.cache.evictable_size == 5


def test_evict_lru_leaves_first_and_parents_after_children():
    h = Harness(64)
    seqs = {"a": [1, 2, 3], "b": [1, 2, 7, 8], "c": [5, 6]}
    for s in seqs.values():
        h.insert(s, h.check_content(s) + h.alloc(s, len(h.check_content(s))))
    h.check_content(seqs["c"])  # touch: c most recent
    h.check_content(seqs["b"])  # then b
    # oldest leaf is a's [3]
    assert h.cache.evict(1) == 1
    h.check()
    assert h.check_content(seqs["a"]) == h.check_content([1, 2])
    assert len(h.check_content(seqs["b"])) == 4
    # next: c (older than b), then b's tail, then the shared [1, 2] once it is a leaf
    assert h.cache.evict(2) == 2
    assert h.check_content(seqs["c"]) == []
    assert len(h.check_content(seqs["b"])) == 4
    freed = h.cache.evict(100)
    assert freed == 4
    h.check()
    assert h.cache.total_size == 0 and h.allocator.num_free == 63


def test_evict_skips_locked_branch():
    h = Harness(64)
    a, b = [1, 2, 3], [1, 4, 5]
    h.insert(a, h.alloc(a, 0))
    h.insert(b, h.check_content(b) + h.alloc(b, 1))
    _, node_a = h.cache.match_prefix(a)
    h.cache.lock(node_a)
    assert h.cache.evict(100) == 2  # only b's own [4, 5]
    h.check()
    assert h.check_content(a) != [] and len(h.check_content(a)) == 3
    h.cache.unlock(node_a)
    assert h.cache.evict(100) == 3
    h.check()


def test_reset_returns_all_slots():
    h = Harness(32)
    for s in ([1, 2, 3], [1, 5], [9, 9, 9, 9]):
        h.insert(s, h.check_content(s) + h.alloc(s, len(h.check_content(s))))
    h.cache.reset()
    h.check()
    assert h.cache.total_size == 0 and h.allocator.num_free == 31


@pytest.mark.parametrize("seed", range(6))
def test_random_request_workload_keeps_accounting(seed):
    """Requests that match, lock, compute, publish and finish in random interleavings, like the scheduler."""
    rng = random.Random(seed)
    h = Harness(48)
    prefixes = [[rng.randrange(4) for _ in range(rng.randrange(1, 8))] for _ in range(4)]
    live = []  # [tokens, node, slots]
    hits = 0
    for _ in range(300):
        if live and (rng.random() < 0.45 or len(live) >= 4):
            tokens, node, slots = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.7:  # finish: publish everything, as _release does
                h.insert(tokens, slots)
                _, new = h.cache.match_prefix(tokens)
                h.cache.lock(new)
                h.cache.unlock(node)
                h.cache.unlock(new)
            else:  # preempted before publishing: give back own slots
                h.cache.unlock(node)
                mine = [s for s in slots if s in h.owned]  # past the locked cached prefix
                h.allocator.free(mine)
                h.owned.difference_update(mine)
            h.check()
            continue
        tokens = rng.choice(prefixes) + [rng.randrange(4) for _ in range(rng.randrange(0, 6))]
        cached, node = h.cache.match_prefix(tokens[:-1])
        hits += bool(cached)
        h.cache.lock(node)
        h.check()
        need = len(tokens) - len(cached)
        if h.allocator.num_free + h.cache.evictable_size < need:
            h.cache.unlock(node)
            h.check()
            continue
        slots = list(cached) + h.alloc(tokens, len(cached))
        for i, s in enumerate(slots):
            assert h.content[s] == tuple(tokens[: i + 1])
        live.append([tokens, node, slots])
    for tokens, node, slots in live:
        h.insert(tokens, slots)
        h.cache.unlock(node)
    h.check()
    assert h.cache.protected_size == 0 and not h.owned
    assert hits > 20 and h.evicted > 0  # the workload did reuse prefixes and run out of slots
    assert h.allocator.num_free + h.cache.total_size == h.allocator.num_slots - 1
