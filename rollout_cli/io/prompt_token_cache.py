"""The token ids `PromptSource.validate()` computed, kept compactly so that iteration need not tokenize again.

Each row is tokenized once: validate() keeps the ids it computed here and iteration
hands them out. Keeping them all would cost memory that grows with the file (1M
prompts x 1k tokens is 4 GB even as int32, and some 36 GB as Python ints), so the
cache holds them compactly (int32, 4 bytes a token) up to a budget (`cache_bytes`,
256 MiB by default: 100k prompts of 600 tokens) and iteration frees them as it
passes; the rows past the budget are tokenized again by iteration, as every row was
before. The other designs weighed: spilling the ids to a temporary file (tokenized
once at any size, but gigabytes of disk to manage and clean up), or checking rows
during the run with the output held back until the last row was seen (the writer
would hold every trajectory of the run: not streaming).

Separate from the reader (`prompts.py`): a memory budget and its bookkeeping, with no
knowledge of Parquet or tokenizers.
"""

from __future__ import annotations

import itertools
from collections import deque

import numpy as np


class TokenIdCache:
    """The token ids validate() computed, kept for iteration so that no row is tokenized twice.

    One entry per batch of validate(): its first row, row offsets [rows + 1] (int64) and the ids of all
    its rows end to end [tokens] (int32; int64 for a token-id column past 2**31): 4 bytes a token and 8 a
    row, where Python lists of ints cost ~36 bytes a token. Once a batch would go past `budget` bytes
    nothing more is kept, so memory stays bounded on a file of any size; iteration tokenizes those later
    rows again. Iteration asks for rows in file order and frees every batch it has passed.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.nbytes = 0
        self.full = False  # a batch did not fit: this batch and every later one are not kept
        self._batches: deque[tuple[int, np.ndarray, np.ndarray]] = deque()

    def add(self, start: int, rows: list[list[int] | None]) -> None:
        """Keep the ids of the batch whose first row is `start` (None: a row that is not valid)."""
        if self.full:
            return
        lengths = np.fromiter((0 if r is None else len(r) for r in rows), dtype=np.int64, count=len(rows))
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = int(offsets[-1])
        if self.nbytes + offsets.nbytes + 4 * tokens > self.budget:  # cheap early out: int32 at best
            self.full = True
            return
        ids = np.fromiter(itertools.chain.from_iterable(r for r in rows if r is not None), dtype=np.int64,
                          count=tokens)
        if tokens and int(ids.max()) < 2**31:  # token ids of any real vocabulary
            ids = ids.astype(np.int32)
        if self.nbytes + offsets.nbytes + ids.nbytes > self.budget:  # ids past int32 take 8 bytes
            self.full = True
            return
        self._batches.append((start, offsets, ids))
        self.nbytes += offsets.nbytes + ids.nbytes

    def pop(self, index: int) -> list[int] | None:
        """The ids of row `index`, or None when they were not kept; the rows up to `index` are freed."""
        while self._batches:
            start, offsets, ids = self._batches[0]
            if index < start:
                return None
            row = index - start
            end = len(offsets) - 1  # rows in the batch
            if row >= end - 1:  # the batch's last row, or past it: the batch is done with
                self._batches.popleft()
                self.nbytes -= offsets.nbytes + ids.nbytes
            if row < end:
                return ids[offsets[row]:offsets[row + 1]].tolist()
        return None
