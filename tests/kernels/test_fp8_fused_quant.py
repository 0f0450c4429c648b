"""FP8 rows written by the kernel before the layer (issue 20): RMSNorm (with and without the residual add)
and SiLU-and-mul quantize their output for the FP8 linear layer that reads it, bit for bit what the plain
kernel then quantize_activation give; the layer takes the rows as they come (interpreter on the CPU,
compiled on a GPU). The model wiring: each producer hands its reader rows, and the model's logits stay."""

from __future__ import annotations

import pytest
import torch

from rollout_cli.models import layers
from rollout_cli.models.layers import RMSNorm, SiluAndMul
from rollout_kernels.fp8_blockwise import FP8Rows, fp8_blockwise_matmul, fp8_linear, quantize_activation
from rollout_kernels.fp8_blockwise_ref import quantize_weight_blockwise
from rollout_kernels.rmsnorm import fused_add_rms_norm, rms_norm, rms_norm_fp8
from rollout_kernels.silu_mul import silu_and_mul, silu_and_mul_fp8

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.bfloat16, torch.float32]


def _randn(*shape, seed=0, scale=1.0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(DEV, dtype)


def _same(got: tuple, want: tuple) -> None:
    (q, scale), (want_q, want_scale) = got, want
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))  # e4m3 bits
    assert torch.equal(scale, want_scale) and scale.stride() == want_scale.stride()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("outer_major", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("t,n", [(5, 384), (1, 128), (3, 2560)])
def test_rms_norm_fp8_is_the_norm_then_quantize_activation(t, n, with_residual, outer_major, dtype):
    x, residual = _randn(t, n, seed=n, dtype=dtype), _randn(t, n, seed=n + 1, dtype=dtype)
    weight = (1.0 + 0.2 * _randn(n, seed=2)).to(dtype)
    x[0, 0] = 40.0  # an outlier owns its group's scale
    if with_residual:
        normed, want_residual = fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
    else:
        normed, want_residual = rms_norm(x, weight, 1e-6), None
    residual_in = residual.clone()
    q, scale, new_residual = rms_norm_fp8(x, weight, 1e-6, residual_in if with_residual else None,
                                          scale_outer_major=outer_major)
    _same((q, scale), quantize_activation(normed, 128, outer_major))
    if with_residual:
        assert new_residual is residual_in and torch.equal(new_residual, want_residual)  # added in place
    else:
        assert new_residual is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("outer_major", [False, True])
@pytest.mark.parametrize("t,inter", [(4, 128), (2, 384), (3, 2304)])  # 2304: a last program of 2 groups
def test_silu_and_mul_fp8_is_silu_and_mul_then_quantize_activation(t, inter, outer_major, dtype):
    x = _randn(t, 2 * inter, seed=inter, scale=3.0, dtype=dtype)
    _same(silu_and_mul_fp8(x, scale_outer_major=outer_major), quantize_activation(silu_and_mul(x), 128, outer_major))


def test_fp8_linear_takes_rows_quantized_ahead():
    """FP8Rows for our GEMM give what fp8_linear gives when it quantizes itself on the same path."""
    x = _randn(6, 256, seed=3, dtype=torch.bfloat16)
    w_q, w_scale = quantize_weight_blockwise(_randn(384, 256, seed=4, scale=0.05))
    bias = _randn(384, seed=5, dtype=torch.bfloat16)
    x_q, x_scale = quantize_activation(x)
    got = fp8_linear(FP8Rows(x_q, x_scale, torch.bfloat16, cublas=False), w_q, w_scale, bias)
    assert torch.equal(got, fp8_blockwise_matmul(x_q, x_scale, w_q, w_scale, torch.bfloat16, bias))
    assert torch.equal(got, fp8_linear(x, w_q, w_scale, bias, use_triton=True))


class _TinyMLPBlock(torch.nn.Module):
    """norm -> gate_up -> SiLU-and-mul -> down, the dense decoder layer's MLP half, FP8 layers."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.norm = RMSNorm(hidden, 1e-6)
        self.gate_up = layers.Linear(hidden, 2 * inter)
        self.act = SiluAndMul()
        self.down = layers.Linear(inter, hidden)

    def forward(self, x, residual):
        h, residual = self.norm(x, residual)
        return self.down(self.act(self.gate_up(h))), residual


def test_wired_producers_hand_their_fp8_readers_rows(monkeypatch):
    """feed_fp8_rows: the norm and SiLU-and-mul hand their FP8 readers FP8Rows on the GPU path (run here
    in the interpreter by patching the path test): the same bits as each kernel then fp8_linear
    quantizing for itself on that path."""
    from rollout_cli.models.fp8 import quantize_layer

    torch.manual_seed(0)
    block = _TinyMLPBlock(256, 384).to(DEV, torch.bfloat16)
    for module in (block.gate_up, block.down):
        module.weight.data.normal_(0, 0.05)
        quantize_layer(module)
    block.norm.use_triton = block.act.use_triton = True
    monkeypatch.setattr(layers, "_on_gpu", lambda x: True)
    x, residual = _randn(7, 256, seed=8, dtype=torch.bfloat16), _randn(7, 256, seed=9, dtype=torch.bfloat16)

    def fp8(module, a):
        return fp8_linear(a, module.weight, module.weight_scale_inv, None, module.fp8_block, use_triton=True)

    h, want_residual = fused_add_rms_norm(x.clone(), residual.clone(), block.norm.weight, 1e-6)
    want = fp8(block.down, silu_and_mul(fp8(block.gate_up, h)))
    layers.feed_fp8_rows(block.norm, block.gate_up)
    layers.feed_fp8_rows(block.act, block.down)
    seen = []
    for module in (block.gate_up, block.down):
        module.register_forward_pre_hook(lambda module, args: seen.append(type(args[0])))
    got, got_residual = block(x.clone(), residual.clone())
    assert seen == [FP8Rows, FP8Rows]
    assert torch.equal(got, want) and torch.equal(got_residual, want_residual)
    assert len(list(block.named_parameters())) == 5  # the readers got no second name in the module tree
