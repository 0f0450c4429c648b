"""Launch configurations of the batch-invariant matmul: one reduction per weight shape (N, K) and dtype,
tiles per batch size M.

What a row's bits depend on is the order of its K sum: the split boundaries (SPLIT_K and the
chunk length C = cdiv(cdiv(K, SPLIT_K), BLOCK_K) BLOCK_K) and, inside a split, the tensor cores'
16-deep MMA steps taken in K order. Those come from the weight alone, so every M runs the same
reduction. The tile shape (BLOCK_M, BLOCK_N), BLOCK_K (so long as C stays the same), warps,
pipeline stages and the load path (TMA or pointers) decide which rows and columns share a program
and how operands reach the tensor cores, not the order of any output element's sum: they may
change with M, as a tuned file's `by_batch` table does, which lets decode batches and prefill
chunks each run their fastest tiles. Measured on the H100: none of 2,816 runs of (tile, BLOCK_K,
stages, load path) configs changed a bit at 8 weight shapes and 4 batch sizes (docs/benchmarks.md,
session 24); the tuner still accepts a tile only after checking its output bit for bit against the shape's
reference config at that M, and a GPU test re-checks every shipped file at batch sizes between the
buckets (tests/kernels/test_batch_invariant_matmul.py).

A tuned file, written on the GPU by scripts/tune_batch_invariant_matmul.py, is
`configs/batch_invariant_matmul/N={N},K={K},dtype={dtype}.json`:

    {"device": "NVIDIA H200", "triton": "3.6.0", "command": "...",
     "config": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 1, "num_warps": 8, "num_stages": 4},
     "by_batch": [{"max_m": 64, "config": {"BLOCK_M": 64, ...}}, {"max_m": 256, "config": {...}}]}

`config` runs every M past the last `max_m` (and is the reference the table's tiles were checked
against); `by_batch` (optional, ascending max_m) must keep the reference's SPLIT_K and chunk C.
A config changes a model's bits (not whether they are batch-invariant): the rollout and the trainer
must read the same files to agree bit for bit, as they do when they run from one install.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from .launch_table import Table, config_for_rows, parse_table

CONFIG_DIR = Path(__file__).resolve().parent / "configs" / "batch_invariant_matmul"
KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages")
# untuned: one [64, 128] tile per program, K in chunks of 64, no split
DEFAULT = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 1, "num_warps": 4, "num_stages": 3}


def config_file_name(n: int, k: int, dtype: torch.dtype) -> str:
    return f"N={n},K={k},dtype={str(dtype).removeprefix('torch.')}.json"


def split_chunk(k: int, config: dict) -> int:
    """C: the K length of each split (the last may be shorter), a multiple of BLOCK_K."""
    return -(-(-(-k // config["SPLIT_K"])) // config["BLOCK_K"]) * config["BLOCK_K"]


def parse_config(data: dict, k: int, where: str) -> Table:
    """A file's table for K = k, checked: ((max_m, config), ..., (None, reference)), max_m ascending,
    every config splitting K as the reference does."""
    table = parse_table(data, KEYS, where)
    reference = table[-1][1]
    for i, (_, config) in enumerate(table[:-1]):
        if config["SPLIT_K"] != reference["SPLIT_K"] or split_chunk(k, config) != split_chunk(k, reference):
            raise ValueError(f"{where}: by_batch[{i}]: SPLIT_K={config['SPLIT_K']}, BLOCK_K={config['BLOCK_K']} "
                             f"split K={k} otherwise than the reference config (the K-sum order must be one per "
                             f"weight shape)")
    return table


@functools.lru_cache(maxsize=None)
def shape_table(n: int, k: int, dtype: torch.dtype, config_dir: str | None = None) -> Table:
    """The launch configs of x [M, k] @ W[n, k]^T by M: the tuned file's table, else DEFAULT for all M.
    Cached: treat the returned dicts as read-only."""
    path = Path(config_dir or CONFIG_DIR) / config_file_name(n, k, dtype)
    if not path.is_file():
        return ((None, DEFAULT),)
    return parse_config(json.loads(path.read_text()), k, str(path))


def get_config(n: int, k: int, dtype: torch.dtype, m: int | None = None, config_dir: str | None = None) -> dict:
    """The launch config for M rows (None: the reference, the config past the table's last max_m)."""
    return config_for_rows(shape_table(n, k, dtype, config_dir), m)
