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

CONFIG_DIR = Path(__file__).resolve().parent / "configs" / "batch_invariant_matmul"
KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages")
# untuned: one [64, 128] tile per program, K in chunks of 64, no split
DEFAULT = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 1, "num_warps": 4, "num_stages": 3}


def config_file_name(n: int, k: int, dtype: torch.dtype) -> str:
    return f"N={n},K={k},dtype={str(dtype).removeprefix('torch.')}.json"


def parse_launch_config(config, where: str) -> dict:
    """One launch config, checked (ValueError naming `where`)."""
    if not isinstance(config, dict):
        raise ValueError(f"{where}: no 'config' object")
    missing = [key for key in KEYS if key not in config]
    if missing:
        raise ValueError(f"{where}: missing {missing}")
    for key in KEYS:
        value = config[key]
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {key}={value!r} must be a positive int")
        if key.startswith("BLOCK") and (value < 16 or value & (value - 1)):
            raise ValueError(f"{where}: {key}={value} (block sizes are powers of 2 >= 16)")
    return {key: config[key] for key in KEYS}


def split_chunk(k: int, config: dict) -> int:
    """C: the K length of each split (the last may be shorter), a multiple of BLOCK_K."""
    return -(-(-(-k // config["SPLIT_K"])) // config["BLOCK_K"]) * config["BLOCK_K"]


def parse_config(data: dict, k: int, where: str) -> tuple[tuple[int | None, dict], ...]:
    """A file's table for K = k, checked: ((max_m, config), ..., (None, reference)), max_m ascending."""
    reference = parse_launch_config(data.get("config") if isinstance(data, dict) else None, where)
    table, last = [], 0
    for i, entry in enumerate(data.get("by_batch") or []):
        at = f"{where}: by_batch[{i}]"
        max_m = entry.get("max_m") if isinstance(entry, dict) else None
        if not isinstance(max_m, int) or max_m <= last:
            raise ValueError(f"{at}: max_m={max_m!r} must be an int above the previous entry's ({last})")
        config = parse_launch_config(entry.get("config"), at)
        if config["SPLIT_K"] != reference["SPLIT_K"] or split_chunk(k, config) != split_chunk(k, reference):
            raise ValueError(f"{at}: SPLIT_K={config['SPLIT_K']}, BLOCK_K={config['BLOCK_K']} split K={k} "
                             f"otherwise than the reference config (the K-sum order must be one per weight shape)")
        table.append((max_m, config))
        last = max_m
    return (*table, (None, reference))


@functools.lru_cache(maxsize=None)
def shape_table(n: int, k: int, dtype: torch.dtype, config_dir: str | None = None) -> tuple[tuple[int | None, dict], ...]:
    """The launch configs of x [M, k] @ W[n, k]^T by M: the tuned file's table, else DEFAULT for all M.
    Cached: treat the returned dicts as read-only."""
    path = Path(config_dir or CONFIG_DIR) / config_file_name(n, k, dtype)
    if not path.is_file():
        return ((None, DEFAULT),)
    return parse_config(json.loads(path.read_text()), k, str(path))


def get_config(n: int, k: int, dtype: torch.dtype, m: int | None = None, config_dir: str | None = None) -> dict:
    """The launch config for M rows (None: the reference, the config past the table's last max_m)."""
    return config_for_rows(shape_table(n, k, dtype, config_dir), m)


def config_for_rows(table: tuple[tuple[int | None, dict], ...], m: int | None) -> dict:
    """A parsed table's config for M rows: the first entry whose max_m holds M, else the reference."""
    if m is not None:
        for max_m, config in table:
            if max_m is None or m <= max_m:
                return config
    return table[-1][1]
