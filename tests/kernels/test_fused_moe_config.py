"""Launch-config files of the fused MoE: the tuner's format, nearest bucket, w2 overrides, bad files refused;
and the benchmark's byte and FLOP bookkeeping."""

from __future__ import annotations

import json

import pytest
import torch

from rollout_kernels.fused_moe_config import CONFIG_DIR, config_file_name, get_config, load_configs, parse_configs
from rollout_kernels.fused_moe_bench import make_problem


def _entry(bm, bn, **extra):
    return dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4, num_stages=3, **extra)


def _write(tmp_path, buckets, shape=(8, 768, 2048), dtype=torch.bfloat16):
    path = tmp_path / config_file_name(*shape, dtype)
    path.write_text(json.dumps({"device": "test", "buckets": buckets}))
    load_configs.cache_clear()
    get_config.cache_clear()
    return str(tmp_path)


def test_nearest_bucket_and_w2_override(tmp_path):
    w2 = dict(BLOCK_SIZE_N=128, BLOCK_SIZE_K=32, GROUP_SIZE_M=8, num_warps=8, num_stages=4)
    cfg_dir = _write(tmp_path, {"1": _entry(16, 32), "64": _entry(32, 64, w2=w2), "1024": _entry(64, 128)})
    assert get_config(1, 8, 2, 768, 2048, torch.bfloat16, cfg_dir)[0]["BLOCK_SIZE_N"] == 32
    assert get_config(20, 8, 2, 768, 2048, torch.bfloat16, cfg_dir)[0]["BLOCK_SIZE_M"] == 16  # 1 is nearer than 64
    w13_cfg, w2_cfg = get_config(100, 8, 2, 768, 2048, torch.bfloat16, cfg_dir)
    assert w13_cfg == _entry(32, 64)
    assert w2_cfg == dict(w2, BLOCK_SIZE_M=32)  # everything but BLOCK_SIZE_M from "w2"
    assert get_config(5000, 8, 2, 768, 2048, torch.bfloat16, cfg_dir)[0]["BLOCK_SIZE_M"] == 64
    # another dtype or shape has no file: the default
    assert get_config(1, 8, 2, 768, 2048, torch.float16, cfg_dir)[0]["BLOCK_SIZE_K"] == 128


@pytest.mark.parametrize("bad,match", [
    ({"1": {"BLOCK_SIZE_M": 16}}, "missing"),
    ({"1": _entry(24, 32)}, "BLOCK_SIZE_M=24"),
    ({"1": _entry(16, 32, w2={"BLOCK_SIZE_N": 64})}, "w2: missing"),
    ({}, "no 'buckets'"),
])
def test_bad_files_are_refused_by_name(tmp_path, bad, match):
    cfg_dir = _write(tmp_path, bad)
    with pytest.raises(ValueError, match=match):
        get_config(1, 8, 2, 768, 2048, torch.bfloat16, cfg_dir)


def test_shipped_files_parse():
    paths = sorted(CONFIG_DIR.glob("*.json"))
    assert paths, f"no tuned configs in {CONFIG_DIR}: the package data did not install"
    for path in paths:
        assert parse_configs(json.loads(path.read_text()), str(path))


def test_benchmark_bookkeeping():
    p = make_problem(3, 8, 2, 32, 16, torch.float32, num_routings=2, device="cpu")
    touched = p.experts_touched()
    assert 2 <= touched <= 6
    assert p.bytes_per_call() == touched * 3 * 16 * 32 * 4 + 2 * 3 * 32 * 4
    assert p.flops_per_call() == 2 * 3 * 2 * 3 * 16 * 32
