"""Tuned launch tables shared by the GEMM kernels: one JSON file per weight shape holding a reference
launch config and, optionally, configs by batch size.

    {"device": "NVIDIA H200", "triton": "3.6.0", "command": "...",
     "config": {"BLOCK_M": 128, "BLOCK_N": 128, ...},
     "by_batch": [{"max_m": 64, "config": {...}}, {"max_m": 256, "config": {...}}]}

`config` runs every M past the last `max_m`; `by_batch` is ascending in max_m. Each kernel names the
keys its configs hold (kernels/batch_invariant_config.py, kernels/fp8_blockwise_config.py) and may
check more (the batch-invariant matmul: one K-sum order per shape).
"""

from __future__ import annotations

Table = tuple[tuple[int | None, dict], ...]  # ((max_m, config), ..., (None, reference))


def parse_launch_config(config, keys: tuple[str, ...], where: str) -> dict:
    """One launch config holding `keys`, checked (ValueError naming `where`): positive ints, and
    BLOCK* sizes powers of 2 >= 16."""
    if not isinstance(config, dict):
        raise ValueError(f"{where}: no 'config' object")
    missing = [key for key in keys if key not in config]
    if missing:
        raise ValueError(f"{where}: missing {missing}")
    for key in keys:
        value = config[key]
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {key}={value!r} must be a positive int")
        if key.startswith("BLOCK") and (value < 16 or value & (value - 1)):
            raise ValueError(f"{where}: {key}={value} (block sizes are powers of 2 >= 16)")
    return {key: config[key] for key in keys}


def parse_table(data, keys: tuple[str, ...], where: str) -> Table:
    """A file's table, each config checked: ((max_m, config), ..., (None, reference)), max_m ascending."""
    reference = parse_launch_config(data.get("config") if isinstance(data, dict) else None, keys, where)
    table, last = [], 0
    for i, entry in enumerate(data.get("by_batch") or []):
        at = f"{where}: by_batch[{i}]"
        max_m = entry.get("max_m") if isinstance(entry, dict) else None
        if not isinstance(max_m, int) or max_m <= last:
            raise ValueError(f"{at}: max_m={max_m!r} must be an int above the previous entry's ({last})")
        table.append((max_m, parse_launch_config(entry.get("config"), keys, at)))
        last = max_m
    return (*table, (None, reference))


def config_for_rows(table: Table, m: int | None) -> dict:
    """A parsed table's config for M rows: the first entry whose max_m holds M, else the reference."""
    if m is not None:
        for max_m, config in table:
            if max_m is None or m <= max_m:
                return config
    return table[-1][1]
