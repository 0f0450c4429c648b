"""Allocator of KV-pool token slots (page size 1): a free list of ints."""

from __future__ import annotations


class SlotAllocator:
    """Hands out slot indices of the KV pool; slot 0 is reserved as padding.

    Padding entries of attention gathers point at slot 0, so it must never
    hold a live token.
    """

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        # Pop from the end: low slots are handed out first (stable, easy to read in tests).
        self._free = list(range(num_slots - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise MemoryError(f"asked for {count} KV slots, {len(self._free)} free")
        if count == 0:
            return []
        taken = self._free[-count:]
        del self._free[-count:]
        taken.reverse()
        return taken

    def free(self, slots: list[int]) -> None:
        self._free.extend(slots)
