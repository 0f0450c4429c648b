"""batch_invariant_matmul: against its reference over odd sizes, strided inputs, bias, with and without
a K split; batch invariance: a row's bits do not depend on how many rows run with it or which; the
tuned config files: read per weight shape, bad ones refused with the file's name."""

from __future__ import annotations

import json

import pytest
import torch

from rollout_kernels.batch_invariant_config import CONFIG_DIR, DEFAULT, config_file_name, get_config, shape_table
from rollout_kernels.batch_invariant_matmul import batch_invariant_matmul, batch_invariant_matmul_ref

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# the interpreter's tl.dot is wrong on bf16 operands (shared/DESIGN.md): float32 / float16 there
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
BLOCK_M = DEFAULT["BLOCK_M"]
# small tiles and K in 3 splits of 64: the split-K path on test-sized shapes
SPLIT = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 3, "num_warps": 4, "num_stages": 2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (1, 63, 31), (7, 257, 127), (65, 129, 300), (130, 64, 65)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("config", [None, SPLIT], ids=["default", "split-k"])
def test_matches_the_reference(dtype, m, n, k, bias, config):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k + 3, generator=gen)[:, 1:k + 1].to(DEV, dtype)  # strided rows, offset start
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEV, dtype)
    b = torch.randn(n, generator=gen).to(DEV, dtype) if bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)  # unwritten elements would stay NaN
    got = batch_invariant_matmul(x, w, b, out=out, config=config)
    assert got is out and not got.isnan().any()
    want = batch_invariant_matmul_ref(x, w, b)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [None, SPLIT], ids=["default", "split-k"])
def test_a_row_has_the_same_bits_in_any_batch(dtype, config, row_invariant_dot):
    """Alone, in a full tile, in a partial tile, at another position, after a shuffle: bit for bit."""
    m, n, k = 2 * BLOCK_M + 5, 200, 150
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(DEV, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEV, dtype)
    full = batch_invariant_matmul(x, w, config=config)
    for row in (0, 1, BLOCK_M - 1, BLOCK_M, m - 1):
        assert torch.equal(batch_invariant_matmul(x[row:row + 1], w, config=config)[0], full[row]), row
    assert torch.equal(batch_invariant_matmul(x[3:9], w, config=config), full[3:9])
    order = torch.randperm(m, generator=gen).to(DEV)
    assert torch.equal(batch_invariant_matmul(x[order], w, config=config), full[order])


def test_shapes_are_checked():
    x, w = torch.randn(3, 8, device=DEV), torch.randn(5, 8, device=DEV)
    assert batch_invariant_matmul(x[:0], w).shape == (0, 5)
    with pytest.raises(AssertionError):
        batch_invariant_matmul(x, torch.randn(5, 7, device=DEV))
    with pytest.raises(AssertionError):
        batch_invariant_matmul(x, w.half())


def test_tuned_files_are_read_per_weight_shape(tmp_path):
    tuned = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 4, "num_warps": 8, "num_stages": 3}
    (tmp_path / config_file_name(300, 128, torch.bfloat16)).write_text(json.dumps({"config": tuned}))
    assert get_config(300, 128, torch.bfloat16, config_dir=str(tmp_path)) == tuned
    assert get_config(300, 128, torch.bfloat16, 7, config_dir=str(tmp_path)) == tuned  # no table: every M
    assert get_config(300, 128, torch.float16, config_dir=str(tmp_path)) == DEFAULT  # no file for this dtype
    bad = {**tuned, "BLOCK_N": 48}
    (tmp_path / config_file_name(64, 64, torch.bfloat16)).write_text(json.dumps({"config": bad}))
    with pytest.raises(ValueError, match=r"N=64,K=64,dtype=bfloat16.json: BLOCK_N=48"):
        get_config(64, 64, torch.bfloat16, config_dir=str(tmp_path))


def test_tiles_follow_the_batch_size_and_the_reduction_does_not(tmp_path):
    """by_batch: the first entry whose max_m holds M, the reference past the last; an entry that would
    change BLOCK_K or SPLIT_K (the K-sum order) or is out of order is refused with the file's name."""
    reference = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 2, "num_warps": 8, "num_stages": 4}
    small = {**reference, "BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4}
    middle = {**reference, "BLOCK_M": 64}
    name = config_file_name(512, 256, torch.bfloat16)
    (tmp_path / name).write_text(json.dumps({"config": reference, "by_batch": [
        {"max_m": 16, "config": small}, {"max_m": 256, "config": middle}]}))
    chosen = {m: get_config(512, 256, torch.bfloat16, m, config_dir=str(tmp_path)) for m in (1, 16, 17, 256, 257)}
    assert chosen == {1: small, 16: small, 17: middle, 256: middle, 257: reference}
    assert get_config(512, 256, torch.bfloat16, config_dir=str(tmp_path)) == reference
    # BLOCK_K 128 keeps K = 256 in two splits of 128: the same sums, allowed
    (tmp_path / name).write_text(json.dumps({"config": reference, "by_batch": [
        {"max_m": 16, "config": {**small, "BLOCK_K": 128}}]}))
    shape_table.cache_clear()
    assert get_config(512, 256, torch.bfloat16, 2, config_dir=str(tmp_path))["BLOCK_K"] == 128
    for entries, message in (([{"max_m": 16, "config": {**small, "SPLIT_K": 1}}], r"by_batch\[0\]: SPLIT_K=1, BLOCK_K=64"),
                             ([{"max_m": 16, "config": {**small, "BLOCK_K": 256}}], r"BLOCK_K=256 split K=256 otherwise"),
                             ([{"max_m": 64, "config": small}, {"max_m": 16, "config": small}],
                              r"by_batch\[1\]: max_m=16 must be an int above the previous entry's \(64\)")):
        bad = config_file_name(1024, 256, torch.bfloat16)
        (tmp_path / bad).write_text(json.dumps({"config": reference, "by_batch": entries}))
        shape_table.cache_clear()
        with pytest.raises(ValueError, match=message):
            get_config(1024, 256, torch.bfloat16, 1, config_dir=str(tmp_path))


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(path.name for path in CONFIG_DIR.glob("*.json")))
def test_gpu_shipped_tables_keep_every_rows_bits(name):
    """Every shipped file: a batch of M rows, whichever tile its bucket picks, equals the same rows of a
    2,048-row matmul on the reference config bit for bit, at M on both sides of every bucket edge (the
    tuner checked one M per bucket; this checks the M between)."""
    n, k, dtype = (int(name.split(",")[0][2:]), int(name.split(",")[1][2:]),
                   getattr(torch, name.split("dtype=")[1].removesuffix(".json")))
    table = shape_table(n, k, dtype)
    edges = [max_m for max_m, _ in table if max_m is not None]
    sizes = sorted({1, 2048, *edges, *(edge + 1 for edge in edges), 100, 700})
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(max(sizes), k, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype)
    full = batch_invariant_matmul(x, w, config=table[-1][1])
    for m in sizes:
        assert torch.equal(batch_invariant_matmul(x[-m:], w), full[-m:]), (name, m, get_config(n, k, dtype, m))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4096, 4096), (151936, 1024), (12288, 4096)])
def test_gpu_bf16_batch_invariance_at_model_shapes(n, k):
    """The H200 claim: every row of a 256-row matmul equals the same row computed alone and in a batch of 7."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(256, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    full = batch_invariant_matmul(x, w)
    for rows in (slice(0, 1), slice(100, 107), slice(255, 256)):
        assert torch.equal(batch_invariant_matmul(x[rows], w), full[rows])
    torch.testing.assert_close(full.float(), batch_invariant_matmul_ref(x, w).float(), atol=3e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,config", [
    (4096, 4096, None), (24576, 4096, None),
    (1000, 12288, {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 4, "num_warps": 4, "num_stages": 4})])
def test_gpu_tma_loads_give_the_pointer_kernels_bits(n, k, config):
    """The TMA kernel (aligned operands) against the pointer kernel (the same rows one element off the
    16-byte alignment, which TMA cannot load): equal bit for bit at decode and prefill sizes, with bias."""
    from rollout_kernels.batch_invariant_matmul import tma_loads_fit

    gen = torch.Generator(device="cuda").manual_seed(4)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    b = torch.randn(n, device="cuda", generator=gen).bfloat16()
    for m in (1, 77, 256, 1500):
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        shifted = torch.empty(m * k + 1, dtype=x.dtype, device="cuda")[1:].view(m, k)
        shifted.copy_(x)
        assert tma_loads_fit(x, w) and not tma_loads_fit(shifted, w)
        assert torch.equal(batch_invariant_matmul(x, w, b, config=config),
                           batch_invariant_matmul(shifted, w, b, config=config)), m


@pytest.mark.gpu
def test_gpu_split_k_partials_past_two_to_the_31():
    """An LM head's N with a prefill chunk's M and 8 splits: the partials span 2.5e9 floats, past int32
    (the tuner hit an illegal address here when the split sum indexed them in int32)."""
    m, n, k = 2048, 151936, 1024
    config = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 8, "num_warps": 4, "num_stages": 3}
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    got = batch_invariant_matmul(x, w, config=config)
    torch.cuda.synchronize()
    rows = torch.tensor([0, 1000, m - 1], device="cuda")  # the last row's partials lie past 2^31 in split 7
    torch.testing.assert_close(got[rows].float(), batch_invariant_matmul_ref(x[rows], w).float(),
                               atol=3e-2, rtol=2e-2)
