"""The blockwise FP8 GEMM's launch tables: read per weight shape, chosen by M, checked, followed."""

from __future__ import annotations

import json

import pytest
import torch

from rollout_kernels import fp8_blockwise_config
from rollout_kernels.fp8_blockwise_config import CONFIG_DIR, DEFAULT, config_file_name, get_config
from rollout_kernels.launch_table import parse_table

SMALL = {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4}
LARGE = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}


def test_tables_are_read_per_weight_shape_and_chosen_by_batch(tmp_path):
    (tmp_path / config_file_name(256, 384)).write_text(json.dumps(
        {"config": LARGE, "by_batch": [{"max_m": 64, "config": SMALL}]}))
    where = str(tmp_path)
    assert {m: get_config(m, 256, 384, where) for m in (1, 64, 65, 8192)} == {1: SMALL, 64: SMALL, 65: LARGE,
                                                                              8192: LARGE}
    assert get_config(64, 256, 128, where) == DEFAULT  # no file for this K
    (tmp_path / config_file_name(128, 128)).write_text(json.dumps({"config": {**LARGE, "BLOCK_N": 96}}))
    with pytest.raises(ValueError, match=r"N=128,K=128.json: BLOCK_N=96"):
        get_config(1, 128, 128, where)
    (tmp_path / config_file_name(64, 64)).write_text(json.dumps({"config": {"BLOCK_M": 64}}))
    with pytest.raises(ValueError, match=r"missing \['BLOCK_N', 'num_warps', 'num_stages'\]"):
        get_config(1, 64, 64, where)


def test_shipped_tables_parse():
    """Every shipped table is well formed, and the tables installed with the package."""
    paths = sorted(CONFIG_DIR.glob("*.json"))
    assert paths, f"no FP8 GEMM tables in {CONFIG_DIR}: the package data did not install"
    for path in paths:
        table = parse_table(json.loads(path.read_text()), fp8_blockwise_config.KEYS, str(path))
        assert table[-1][0] is None and all(c["BLOCK_N"] <= 128 for _, c in table)  # a tile spans one scale row


def test_the_kernel_looks_up_its_batch_and_shape(monkeypatch):
    """fp8_linear asks the table for its own (M, N, K): a decode batch gets the decode tile."""
    from rollout_kernels import fp8_blockwise
    from rollout_kernels.fp8_blockwise_ref import quantize_weight_blockwise
    seen = []
    real = fp8_blockwise.get_config
    monkeypatch.setattr(fp8_blockwise, "get_config", lambda m, n, k: seen.append((m, n, k)) or real(m, n, k))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    w_q, w_scale = quantize_weight_blockwise(torch.randn(128, 256, device=dev) * 0.05)
    fp8_blockwise.fp8_linear(torch.randn(3, 256, device=dev), w_q, w_scale, use_triton=True)
    assert seen == [(3, 128, 256)]
