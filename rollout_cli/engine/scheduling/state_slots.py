"""Scheduler-side bookkeeping of the linear-state pool: slots, prompt snapshots, pending copies.

Plain Python over ints, like the rest of the scheduler. Every running request
of a hybrid model owns one state slot. The prefix cache of hybrid models
(first version) shares one thing: the state after a prompt's first P =
len(prompt) - 1 tokens, the same prefix the KV radix cache serves (the last
prompt token always runs, to produce the first sample's logits). The sample
that computes a prompt stops a prefill chunk at P, snapshots its state into
a free slot, and the other samples of that prompt fork the snapshot (copy it
into their own slot) instead of recomputing the prompt. A turn of a multi-turn
conversation snapshots its prompt the same way, and the next turn forks that
snapshot (the previous turn's prompt but its last token, engine/scheduling/prefix_reuse.py).
Any other prefix hit (a shorter shared system prompt) is recomputed for hybrid
models: the KV alone does not give the linear layers their state.

A snapshot pairs with the radix node holding the KV of the same P tokens;
it is used only while the tree still holds that very node (so a flushed or
evicted prefix, or new weights, never meet an old state). Snapshots are
evicted least-recently-used when a running request needs a slot.

Copies are queued, in order, and applied by the model runner at the start
of the next step, before its forward: a snapshot taken after step t is
copied before a fork of it in step t + 1, and before a slot freed meanwhile
is written again.
"""

from __future__ import annotations

from collections import OrderedDict

from rollout_cli.engine.scheduling.kv_slots import SlotAllocator


class LinearStateSlots:
    def __init__(self, num_slots: int):
        self.allocator = SlotAllocator(num_slots)  # slot 0 is padding, never handed out
        self.num_slots = num_slots
        # prompt prefix (tuple of P token ids) -> (state slot, radix node of its KV); LRU order, oldest first
        self.snapshots: OrderedDict[tuple[int, ...], tuple[int, object]] = OrderedDict()
        self._copies: list[tuple[int, int]] = []

    @property
    def num_available(self) -> int:
        """Slots a new request can get: free ones plus those held by snapshots (evictable)."""
        return self.allocator.num_free + len(self.snapshots)

    def allocate(self) -> int | None:
        if self.allocator.num_free == 0 and self.snapshots:
            _, (slot, _) = self.snapshots.popitem(last=False)
            self.allocator.free([slot])
        if self.allocator.num_free == 0:
            return None
        return self.allocator.allocate(1)[0]

    def free(self, slot: int) -> None:
        self.allocator.free([slot])

    def allocate_forks(self, count: int) -> list[int] | None:
        """`count` free slots for a verify step's per-draft states (engine/scheduling/speculation.py), or
        None: drafts never evict a prefix snapshot, which saves a whole prompt's recompute."""
        if self.allocator.num_free < count:
            return None
        return self.allocator.allocate(count)

    def snapshot(self, prefix: list[int], src_slot: int, node) -> bool:
        """Keep a copy of `src_slot` (the state after `prefix`) for later forks; False if no slot is free."""
        key = tuple(prefix)
        old = self.snapshots.pop(key, None)
        if old is not None:  # a sample that recomputed the prefix replaces the stale or evicted one
            self.allocator.free([old[0]])
        if self.allocator.num_free == 0:
            return False  # never evict another snapshot for a new one: the running requests need slots more
        slot = self.allocator.allocate(1)[0]
        self._copies.append((src_slot, slot))
        self.snapshots[key] = (slot, node)
        return True

    def lookup(self, prefix: list[int], node) -> int | None:
        """The snapshot slot of `prefix` if it pairs with the radix node now holding its KV."""
        key = tuple(prefix)
        found = self.snapshots.get(key)
        if found is None:
            return None
        if found[1] is not node:  # its KV was evicted or flushed since: the state may not match any more
            del self.snapshots[key]
            self.allocator.free([found[0]])
            return None
        self.snapshots.move_to_end(key)
        return found[0]

    def clear(self) -> None:
        """Drop every snapshot (prefix-cache flush, weight reload)."""
        self.allocator.free([slot for slot, _ in self.snapshots.values()])
        self.snapshots.clear()

    def fork(self, src_slot: int, dst_slot: int) -> None:
        self._copies.append((src_slot, dst_slot))

    def take_copies(self) -> list[tuple[int, int]]:
        """The queued (src, dst) copies, in order; the runner applies them before the next forward."""
        copies, self._copies = self._copies, []
        return copies
