"""Launch configurations of the batch-invariant matmul: one per weight shape (N, K) and dtype, never per M.

The tile shapes and the K split are part of every row's arithmetic, so the batch-invariance rule
allows them to depend on the weight alone. A tuned file, written on the GPU by
scripts/tune_batch_invariant_matmul.py, is `configs/batch_invariant_matmul/N={N},K={K},dtype={dtype}.json`:

    {"device": "NVIDIA H200", "triton": "3.6.0", "command": "...",
     "config": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 1, "num_warps": 4, "num_stages": 3}}

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


def parse_config(data: dict, where: str) -> dict:
    """The file's config, checked (ValueError naming `where`)."""
    config = data.get("config") if isinstance(data, dict) else None
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


@functools.lru_cache(maxsize=None)
def get_config(n: int, k: int, dtype: torch.dtype, config_dir: str | None = None) -> dict:
    """The launch config of x [M, k] @ W[n, k]^T for every M: the tuned file's, else DEFAULT.
    Cached: treat the returned dict as read-only."""
    path = Path(config_dir or CONFIG_DIR) / config_file_name(n, k, dtype)
    if not path.is_file():
        return DEFAULT
    return parse_config(json.loads(path.read_text()), str(path))
