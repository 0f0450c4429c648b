"""The decode graphs' sizes (engine/execution/cuda_graphs.py): decode steps, and with speculation on a model
without linear layers the verify steps' 1 + d rows per request (graph capture itself needs the GPU)."""

from __future__ import annotations

from rollout_cli.engine.execution.graph_buckets import MAX_VERIFY_ROWS, batch_buckets, verify_graph_rows


def test_decode_buckets_then_coarser_verify_buckets_above_them():
    decode = batch_buckets(256)
    assert decode == [1, 2, 4, 8] + list(range(16, 257, 16))
    wide = batch_buckets(256, 1024)
    assert wide[:len(decode)] == decode and wide[len(decode):] == list(range(320, 1025, 64))
    assert batch_buckets(4, 20) == [1, 2, 4, 20]
    assert batch_buckets(256, 200) == batch_buckets(256, None) == decode  # nothing wider than the decode batch


def test_verify_rows_follow_the_drafts_and_the_drafting_batch():
    assert verify_graph_rows(256, 0, None) is None  # no speculation
    assert verify_graph_rows(64, 4, None) == 64 * 5
    assert verify_graph_rows(256, 4, None) == MAX_VERIFY_ROWS == 256 * 5  # the defaults of --speculative siblings
    assert verify_graph_rows(256, 7, None) == MAX_VERIFY_ROWS  # wider steps run eagerly
    assert verify_graph_rows(256, 3, 32) == 32 * 4  # --speculative-max-batch 32: no wider step drafts
