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
