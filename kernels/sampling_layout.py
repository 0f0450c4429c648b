"""How the fused sampler (`sampling.py`) cuts a row of logits into chunks, and the workspace that needs.

Both depend on the vocabulary size and the tuning knobs only, never on the batch, so a row's result
does not depend on the batch it is sampled in. No kernel here: the launchers and the benchmark share it.
"""

from __future__ import annotations

import torch
import triton

# Defaults from scripts/bench_decode_kernels.py on an H200 (B 256, V 151936, bf16): 8192-logit chunks
# stepped in blocks of 2048 with 4 warps in launch 1 gave temperature-only 79 us, greedy 71 us
# (4096 / 8 warps: 96 / 90 us; the one-program-per-row kernel before: ~250 us).
BLOCK_V = 2048
CHUNK = 8192

# Launch 1 splits each row into at most this many chunks (more would make launch 2's merge wide
# and its workspace large for little gain; a huge vocab gets longer chunks instead)
MAX_CHUNKS = 64


def chunk_layout(vocab: int, block_v: int = BLOCK_V, chunk: int = CHUNK) -> tuple[int, int, int]:
    """(block, chunk_len, num_chunks) of a row of `vocab` logits: the block both launches step by,
    the chunk length (cdiv(V, S) rounded up to a multiple of the block, S = min(cdiv(V, chunk),
    MAX_CHUNKS)) and the number of chunks, cdiv(V, chunk_len). Depends on V and the knobs only,
    never on the batch, so a row's result does not depend on the batch it is sampled in."""
    assert vocab >= 1 and chunk >= 1
    block = min(block_v, triton.next_power_of_2(vocab))
    n = min(triton.cdiv(vocab, chunk), MAX_CHUNKS)
    chunk_len = triton.cdiv(triton.cdiv(vocab, n), block) * block
    return block, chunk_len, triton.cdiv(vocab, chunk_len)


def workspace_columns(vocab: int, block_v: int = BLOCK_V, chunk: int = CHUNK, cap: int = 512) -> int:
    """Columns of `sample`'s float32 workspace per row: 4 per chunk (max, argmax as int32 bits,
    the two exp sums), then `cap` for the filtered rows' threshold search."""
    return 4 * chunk_layout(vocab, block_v, chunk)[2] + cap


def sample_workspace(batch: int, vocab: int, device, block_v: int = BLOCK_V, chunk: int = CHUNK,
                     cap: int = 512) -> torch.Tensor:
    """A preallocated workspace for `sample` on [batch, vocab] logits with the same knobs."""
    return torch.empty((batch, workspace_columns(vocab, block_v, chunk, cap)), dtype=torch.float32, device=device)
