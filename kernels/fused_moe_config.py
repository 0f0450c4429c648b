"""Launch configurations of the fused MoE GEMMs: tuned JSON files, nearest batch bucket, a default.

A file `configs/fused_moe/E={E},N={N},K={K},dtype={dtype}.json` (N: the experts' intermediate
size, K: the hidden size; written by scripts/tune_fused_moe.py) holds

    {"device": "NVIDIA H200", "triton": "3.6.0", "command": "...",
     "buckets": {"1": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
                       "num_warps": 4, "num_stages": 4,
                       "w2": {"BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1,
                              "num_warps": 4, "num_stages": 3}},
                 "2": {...}, ...}}

Bucket keys are token counts; a batch of T tokens takes the bucket nearest to T. The top level
of an entry launches the gate/up GEMM; its optional "w2" entry overrides all but BLOCK_SIZE_M
(shared: both GEMMs walk the same expert-sorted blocks) for the down GEMM.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import triton

CONFIG_DIR = Path(__file__).resolve().parent / "configs" / "fused_moe"
KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
W2_KEYS = KEYS[1:]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def config_file_name(num_experts: int, inter: int, hidden: int, dtype: torch.dtype) -> str:
    return f"E={num_experts},N={inter},K={hidden},dtype={dtype_name(dtype)}.json"


def _check_entry(entry: dict, keys: tuple[str, ...], where: str) -> None:
    missing = [k for k in keys if k not in entry]
    if missing:
        raise ValueError(f"{where}: missing {missing}")
    for k in keys:
        v = entry[k]
        if not isinstance(v, int) or v < 1 or (k.startswith("BLOCK_SIZE") and (v < 16 or v & (v - 1))):
            raise ValueError(f"{where}: {k}={v!r} (block sizes are powers of 2 >= 16, the rest positive ints)")


def parse_configs(data: dict, where: str) -> dict[int, dict]:
    """The file's buckets as {num_tokens: entry}, every entry checked (ValueError naming `where`)."""
    buckets = data.get("buckets")
    if not isinstance(buckets, dict) or not buckets:
        raise ValueError(f"{where}: no 'buckets' object")
    out = {}
    for key, entry in buckets.items():
        _check_entry(entry, KEYS, f"{where} bucket {key}")
        if "w2" in entry:
            _check_entry(entry["w2"], W2_KEYS, f"{where} bucket {key} w2")
        out[int(key)] = entry
    return out


@functools.lru_cache(maxsize=None)
def load_configs(num_experts: int, inter: int, hidden: int, dtype: torch.dtype,
                 config_dir: str | None = None) -> dict[int, dict] | None:
    """The tuned buckets for this shape, or None when no file exists."""
    path = Path(config_dir or CONFIG_DIR) / config_file_name(num_experts, inter, hidden, dtype)
    if not path.is_file():
        return None
    return parse_configs(json.loads(path.read_text()), str(path))


def default_config(num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype) -> dict:
    """Untuned but sane: small M blocks when each expert sees few tokens (decode: the GEMMs only
    stream weights), bigger tiles once experts see enough rows to reuse a weight tile."""
    rows_per_expert = num_tokens * top_k / num_experts
    if rows_per_expert <= 8:
        cfg = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=4)
    elif rows_per_expert <= 48:
        cfg = dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=4, num_stages=4)
    else:
        cfg = dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=8, num_stages=3)
    if dtype == torch.float32:  # 4-byte tiles: keep shared memory in bounds
        cfg.update(BLOCK_SIZE_K=32, num_stages=2)
    return cfg


def fit_to_shape(cfg: dict, n: int, k: int) -> dict:
    """Clamp N/K tiles to the problem (tiny test shapes), never below tl.dot's 16."""
    cfg = dict(cfg)
    cfg["BLOCK_SIZE_N"] = max(16, min(cfg["BLOCK_SIZE_N"], triton.next_power_of_2(n)))
    cfg["BLOCK_SIZE_K"] = max(16, min(cfg["BLOCK_SIZE_K"], triton.next_power_of_2(k)))
    return cfg


@functools.lru_cache(maxsize=4096)  # called per MoE layer per eager step: pure host overhead otherwise
def get_config(num_tokens: int, num_experts: int, top_k: int, inter: int, hidden: int, dtype: torch.dtype,
               config_dir: str | None = None) -> tuple[dict, dict]:
    """(gate/up config, down config) for a batch of `num_tokens`: the nearest tuned bucket, else the default.

    Both share BLOCK_SIZE_M; the gate/up GEMM has N = inter, K = hidden, the down GEMM N = hidden, K = inter.
    Cached: treat the returned dicts as read-only.
    """
    buckets = load_configs(num_experts, inter, hidden, dtype, config_dir)
    if buckets:
        entry = buckets[min(buckets, key=lambda b: (abs(b - num_tokens), b))]
        w13 = {k: entry[k] for k in KEYS}
        w2 = {**w13, **entry.get("w2", {})}
    else:
        w13 = w2 = default_config(num_tokens, num_experts, top_k, dtype)
    return fit_to_shape(w13, inter, hidden), fit_to_shape(w2, hidden, inter)
