"""garbage_collection_paused (engine/execution/graph_replay.py): no collection while CUDA graphs are captured."""

from __future__ import annotations

import gc
import weakref

from rollout_cli.engine.execution.graph_replay import garbage_collection_paused


def test_collection_is_paused_inside_the_block_after_collecting_what_is_dead():
    """garbage_collection_paused (around CUDA graph capture): a dead reference cycle is freed on entry, none
    inside the block, and the collector's earlier state comes back."""
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
