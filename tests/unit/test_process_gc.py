"""freeze_long_lived_objects: what exists now leaves the collector's scans, small collections get rarer."""

from __future__ import annotations

import gc

from rollout_cli.process_gc import FIRST_GENERATION_THRESHOLD, freeze_long_lived_objects


def test_freeze_moves_objects_out_and_raises_the_threshold():
    threshold = gc.get_threshold()
    try:
        gc.unfreeze()
        before = gc.get_freeze_count()
        freeze_long_lived_objects()
        assert gc.get_freeze_count() > before + 1000  # the imported modules and their objects at least
        assert gc.get_threshold()[0] >= FIRST_GENERATION_THRESHOLD
        assert gc.get_threshold()[1:] == threshold[1:]
        assert gc.isenabled()  # reference cycles made later are still collected
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def test_collection_is_paused_inside_the_block_after_collecting_what_is_dead():
    """garbage_collection_paused (around CUDA graph capture): a dead reference cycle is freed on entry, none
    inside the block, and the collector's earlier state comes back."""
    import weakref

    from rollout_cli.process_gc import garbage_collection_paused

    class Node:
        pass

    def dead_cycle():
        node = Node()
        node.me = node
        return weakref.ref(node)

    before = dead_cycle()
    with garbage_collection_paused():
        assert before() is None
        assert not gc.isenabled()
        inside = dead_cycle()
        for _ in range(3000):  # far past the first generation's threshold
            Node().me = None
        assert inside() is not None
    assert gc.isenabled()
    gc.disable()
    try:
        with garbage_collection_paused():
            pass
        assert not gc.isenabled()  # left as the caller had it
    finally:
        gc.enable()
