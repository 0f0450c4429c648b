"""The decode kernel's KV-split choice: every value it returns is compiled up front (no compile
mid-run), and more requests never get more splits."""

import pytest

pytest.importorskip("triton")

from rollout_cli.engine.execution.triton_attention import DECODE_SPLIT_COUNTS, MAX_KV_SPLITS, decode_kv_splits  # noqa: E402


@pytest.mark.parametrize("num_kv_heads", [1, 2, 3, 4, 8, 16])
def test_split_counts_come_from_the_precompiled_set(num_kv_heads):
    previous = MAX_KV_SPLITS
    for batch in range(1, 513):
        splits = decode_kv_splits(batch, num_kv_heads)
        assert splits in DECODE_SPLIT_COUNTS
        assert splits <= previous
        previous = splits
    assert decode_kv_splits(1, 1) == MAX_KV_SPLITS
    assert decode_kv_splits(512, num_kv_heads) == 1
