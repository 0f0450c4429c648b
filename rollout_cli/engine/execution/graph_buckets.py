"""Which step sizes the decode and verify graphs are captured for (engine/execution/cuda_graphs.py). Plain
Python: the scheduler-side sizing and its tests need no Triton."""

from __future__ import annotations

# the widest step a graph replays: verify steps of a model without linear layers run as 1 + d one-token rows
# per request (256 running x 1 + 4 sibling drafts, the defaults: 1,280); wider ones run eagerly. The graphs'
# pool keeps the widest step's activations, logits [rows, vocab] among them (about 1.2 GB at a 150k vocab,
# what such a step allocates eagerly too).
MAX_VERIFY_ROWS = 1280


def verify_graph_rows(max_batch: int, draft_tokens: int, drafting_batch: int | None) -> int | None:
    """The widest verify step graphs replay for a model without linear layers, with up to draft_tokens
    drafts per request in steps of up to `drafting_batch` running requests (--speculative-max-batch; None:
    any); None without speculation (draft_tokens 0)."""
    if not draft_tokens:
        return None
    return min(min(max_batch, drafting_batch or max_batch) * (1 + draft_tokens), MAX_VERIFY_ROWS)


def batch_buckets(max_batch: int, widest: int | None = None) -> list[int]:
    """Graph sizes: 1, 2, 4, 8, then every 16 up to max_batch (decode steps); above it every 64 up to
    `widest` (verify steps' rows, which decode steps never reach)."""
    buckets = [b for b in (1, 2, 4, 8) if b < max_batch]
    buckets += list(range(16, max_batch, 16))
    buckets = sorted(set(buckets + [max_batch]))
    if widest is not None and widest > max_batch:
        buckets += list(range(max_batch + 64, widest, 64)) + [widest]
    return buckets
