"""silu_and_mul against SiluAndMul: odd widths, strided rows, given out."""

from __future__ import annotations

import pytest
import torch

from rollout_cli.models.layers import SiluAndMul
from rollout_kernels.silu_mul import silu_and_mul, silu_and_mul_ref

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
CPU_DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # one rounding of the result
TOL_MODULE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}  # module rounds twice


def _close(a, b, tol):
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("inter", [1, 63, 127, 769, 1500])
@pytest.mark.parametrize("t", [1, 7])
def test_silu_and_mul(t, inter, dtype):
    torch.manual_seed(t + inter)
    x = (3 * torch.randn(t, 2 * inter + 5, device=DEV)).to(dtype)[:, : 2 * inter]  # strided rows
    out = torch.full((t, inter), float("nan"), dtype=dtype, device=DEV)
    got = silu_and_mul(x, out=out)
    assert got is out
    _close(got, silu_and_mul_ref(x), TOL[dtype])
    _close(got, SiluAndMul()(x), TOL_MODULE[dtype])


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's numpy exp(100)
def test_strided_out_and_extremes():
    x = torch.tensor([[-100.0, 0.0, 100.0, 2.0, 3.0, -4.0]], device=DEV)
    wide = torch.full((1, 8), float("nan"), device=DEV)
    got = silu_and_mul(x, out=wide[:, 2:5])
    _close(got, silu_and_mul_ref(x), 1e-6)
    assert wide[:, :2].isnan().all() and wide[:, 5:].isnan().all()  # nothing written outside out
    assert silu_and_mul(torch.empty(0, 6, device=DEV)).shape == (0, 3)
    with pytest.raises(AssertionError):
        silu_and_mul(torch.randn(2, 5, device=DEV))  # odd width


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inter", [768, 3072, 6144, 25600])
def test_gpu_silu_and_mul(inter, dtype):
    torch.manual_seed(inter)
    x = (3 * torch.randn(257, 2 * inter, device=DEV)).to(dtype)
    out = torch.full((257, inter), float("nan"), dtype=dtype, device=DEV)
    _close(silu_and_mul(x, out=out), silu_and_mul_ref(x), TOL[dtype])
    _close(out, SiluAndMul()(x), TOL_MODULE[dtype])


@pytest.mark.gpu
def test_gpu_silu_and_mul_cuda_graph():
    x = torch.randn(64, 2 * 1024, device=DEV, dtype=torch.bfloat16)
    out = torch.empty(64, 1024, device=DEV, dtype=torch.bfloat16)
    silu_and_mul(x, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        silu_and_mul(x, out=out)
    x.copy_(torch.randn_like(x))
    graph.replay()
    _close(out, silu_and_mul_ref(x), TOL[torch.bfloat16])
