"""Radix tree over token ids mapping computed prefixes to their KV slots.

Page size 1: every token owns one slot. Nodes held by running requests are
locked (`lock_ref` > 0 on the node and all its ancestors); unlocked leaves are
evicted least-recently-used first when the pool needs slots. The tree owns
the slots of its nodes; requests own only the slots past their cached prefix.
"""

from __future__ import annotations

import heapq
import itertools

from rollout_cli.engine.scheduling.kv_slots import SlotAllocator


class RadixNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access")

    def __init__(self, parent: "RadixNode | None", key: list[int], value: list[int]):
        self.children: dict[int, RadixNode] = {}
        self.parent = parent
        self.key = key  # token ids on the edge from the parent
        self.value = value  # their KV slots
        self.lock_ref = 0
        self.last_access = 0

    def __lt__(self, other: "RadixNode") -> bool:  # for the eviction heap
        return self.last_access < other.last_access


def _common_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RadixCache:
    def __init__(self, allocator: SlotAllocator):
        self.allocator = allocator
        self._clock = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        """Drop the whole tree (only when no request holds a lock)."""
        root = getattr(self, "root", None)
        if root is not None:
            self.allocator.free([s for node in self._nodes() for s in node.value])
        self.root = RadixNode(None, [], [])
        self.root.lock_ref = 1  # never evicted
        self.evictable_size = 0  # slots in unlocked nodes
        self.protected_size = 0  # slots in locked nodes

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _split(self, node: RadixNode, length: int) -> RadixNode:
        """Cut node's edge after `length` tokens; return the new upper node."""
        upper = RadixNode(node.parent, node.key[:length], node.value[:length])
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        upper.children = {node.key[length]: node}
        node.parent.children[upper.key[0]] = upper
        node.parent = upper
        node.key = node.key[length:]
        node.value = node.value[length:]
        return upper

    def _walk(self, tokens: list[int], now: int):
        """Follow `tokens` down the tree as far as it holds them, splitting the last node matched part
        way: yields each node passed (its last access set to `now`) and the position after it."""
        node, pos = self.root, 0
        while pos < len(tokens) and tokens[pos] in node.children:
            child = node.children[tokens[pos]]
            length = _common_length(child.key, tokens[pos:])
            if length < len(child.key):
                child = self._split(child, length)
            child.last_access = now
            pos += length
            node = child
            yield node, pos

    def match_prefix(self, tokens: list[int]) -> tuple[list[int], RadixNode]:
        """Longest cached prefix of `tokens`: (its slots, the node where it ends)."""
        node, slots = self.root, []
        now = next(self._clock)
        node.last_access = now
        for node, _ in self._walk(tokens, now):
            slots.extend(node.value)
        return slots, node

    def cached_length(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` the tree holds: a look only (no split, no access time)."""
        node, pos = self.root, 0
        while pos < len(tokens) and tokens[pos] in node.children:
            child = node.children[tokens[pos]]
            length = _common_length(child.key, tokens[pos:])
            pos += length
            if length < len(child.key):
                break
            node = child
        return pos

    def insert(self, tokens: list[int], slots: list[int]) -> int:
        """Add a computed sequence; return how many leading tokens were already cached.

        For those leading tokens the tree keeps its own slots; the caller must
        free its duplicates. The tree takes ownership of slots[returned:].
        """
        assert len(tokens) == len(slots)
        node, pos = self.root, 0
        now = next(self._clock)
        for node, pos in self._walk(tokens, now):
            pass
        if pos < len(tokens):
            leaf = RadixNode(node, tokens[pos:], slots[pos:])
            leaf.last_access = now
            node.children[tokens[pos]] = leaf
            self.evictable_size += len(leaf.value)
        return pos

    def lock(self, node: RadixNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.value)
                self.protected_size += len(node.value)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, "radix cache lock underflow"
            if node.lock_ref == 0:
                self.evictable_size += len(node.value)
                self.protected_size -= len(node.value)
            node = node.parent

    def evict(self, num_slots: int) -> int:
        """Free at least `num_slots` slots from unlocked leaves, LRU first; return freed."""
        leaves = [n for n in self._nodes() if not n.children and n.lock_ref == 0 and n is not self.root]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_slots and leaves:
            leaf = heapq.heappop(leaves)
            self.allocator.free(leaf.value)
            freed += len(leaf.value)
            self.evictable_size -= len(leaf.value)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        return freed
