"""Launch configurations of the blockwise FP8 GEMM (kernels/fp8_blockwise.py), tuned per weight shape.

A file `configs/fp8_blockwise/N={N},K={K}.json`, written on the GPU by `scripts/bench_fp8_gemm.py
--write`, holds a launch table (kernels/launch_table.py) of {BLOCK_M, BLOCK_N, num_warps, num_stages}:
decode batches (M <= 256) and prefill chunks want different tiles. BLOCK_K is not a choice: it is the
scale block's K (128), one activation and one weight scale per step. Shapes without a file run DEFAULT.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from .launch_table import Table, config_for_rows, parse_table

CONFIG_DIR = Path(__file__).resolve().parent / "configs" / "fp8_blockwise"
KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
DEFAULT = {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3}  # untuned


def config_file_name(n: int, k: int) -> str:
    return f"N={n},K={k}.json"


@functools.lru_cache(maxsize=None)
def shape_table(n: int, k: int, config_dir: str | None = None) -> Table:
    """The launch configs of x [M, k] @ W_q[n, k]^T by M: the tuned file's table, else DEFAULT for all M.
    Cached: treat the returned dicts as read-only."""
    path = Path(config_dir or CONFIG_DIR) / config_file_name(n, k)
    if not path.is_file():
        return ((None, DEFAULT),)
    return parse_table(json.loads(path.read_text()), KEYS, str(path))


def get_config(m: int, n: int, k: int, config_dir: str | None = None) -> dict:
    """The launch config for an [m, k] x [n, k]^T product."""
    return config_for_rows(shape_table(n, k, config_dir), m)
