"""Blockwise FP8 (e4m3) linear layers, the layout of the hub's `*-FP8` checkpoints (issue 20).

Weights: W [N, K] is stored as W_q [N, K] float8_e4m3fn and `weight_scale_inv` [ceil(N / BN),
ceil(K / BK)] float32, one scale per BN x BK block (128 x 128 on the hub), W ~= W_q * scale. The
scale of a block is amax / 448 (e4m3's largest finite value), so the block's largest entry maps to
448 and nothing saturates.

Activations: quantized inside the layer per token and per group of BK channels (the weights' K
block): x [M, K] -> x_q [M, K] e4m3 and x_scale [M, ceil(K / BK)] float32, the same amax rule.

The GEMM: y[m, n] = sum over K blocks kb of (x_q[m, kb] . W_q[n, kb]) * x_scale[m, kb] *
scale[n // BN, kb]: each K block's e4m3 products are summed exactly enough on the tensor cores
(float32 accumulation) and scaled once per block, then the blocks are added in K order in float32.
On Hopper the e4m3 dot runs at twice the bf16 rate (`tl.dot` on float8e4nv operands).

Each kernel has its torch reference beside it (`*_ref`), computing the same quantities in float32;
the CPU and any device without the Triton path run the references (`fp8_linear` picks). The weights'
quantization and the references are plain torch, in fp8_blockwise_ref.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rollout_kernels.e4m3 import e4m3_scale, emulate_e4m3, quantize_groups, scaled_to_e4m3_grid
from rollout_kernels.fp8_blockwise_config import get_config
from rollout_kernels.fp8_blockwise_ref import (BLOCK, FP8_DTYPE, FP8_MAX, _MIN_AMAX, empty_activation_scales,
                                               fp8_blockwise_matmul_ref, quantize_activation_ref,
                                               quantize_weight_blockwise)

# ---- activations ------------------------------------------------------------------------------

@triton.jit
def _quantize_activation_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm, stride_sg,
                                GROUP: tl.constexpr, GROUPS: tl.constexpr, FP8_MAX_C: tl.constexpr,
                                MIN_AMAX: tl.constexpr, EMULATE_E4M3: tl.constexpr):
    """One program per token, all its channel groups at once ([GROUPS, GROUP], GROUPS a power of 2
    covering K): amax per group, scale, e4m3 values. (A program per group was 8 us at [256, 4096] on
    the H100: 8,192 one-warp programs of 128 values.)"""
    row = tl.program_id(0).to(tl.int64)
    groups = tl.arange(0, GROUPS)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [GROUPS, GROUP]
    inside = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=inside, other=0.0).to(tl.float32)
    q, scale = quantize_groups(x, FP8_MAX_C, MIN_AMAX, EMULATE_E4M3)  # [GROUPS, GROUP], [GROUPS]
    tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=inside)
    tl.store(s_ptr + row * stride_sm + groups * stride_sg, scale, mask=groups * GROUP < K)


def quantize_activation(x: torch.Tensor, group: int = BLOCK, scale_outer_major: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) -> (x_q [M, K] float8_e4m3fn, x_scale [M, ceil(K / group)] float32).
    scale_outer_major: x_scale laid out with strides (1, M), as cuBLASLt's blockwise GEMM reads it."""
    assert x.dim() == 2 and x.stride(1) == 1, f"x must be [M, K] with contiguous rows, got {tuple(x.shape)}"
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    groups_k = triton.cdiv(k, group)
    scale = empty_activation_scales(m, groups_k, x.device, scale_outer_major)
    if m and k:
        groups = triton.next_power_of_2(groups_k)
        _quantize_activation_kernel[(m,)](
            x, q, scale, k, x.stride(0), q.stride(0), scale.stride(0), scale.stride(1),
            GROUP=group, GROUPS=groups, FP8_MAX_C=FP8_MAX, MIN_AMAX=_MIN_AMAX, EMULATE_E4M3=emulate_e4m3(),
            num_warps=max(1, min(8, groups * group // 512)))
    return q, scale


# ---- weights ----------------------------------------------------------------------------------

@triton.jit
def _quantize_weight_kernel(w_ptr, q_ptr, s_ptr, N, K, stride_wn, stride_wk, stride_qn, stride_sn,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8_MAX_C: tl.constexpr,
                            MIN_AMAX: tl.constexpr, EMULATE_E4M3: tl.constexpr):
    """One program per BLOCK_N x BLOCK_K block of W [N, K] (any strides): its amax, scale and e4m3
    values in one pass. The rule and the roundings of fp8_blockwise_ref.quantize_weight_blockwise (float32
    math, kernels/e4m3.e4m3_scale and scaled_to_e4m3_grid), ties to even at the e4m3 store."""
    nb = tl.program_id(0)
    kb = tl.program_id(1)
    rows = (nb * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    cols = (kb * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    inside = (rows[:, None] < N) & (cols[None, :] < K)
    w = tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :] * stride_wk, mask=inside, other=0.0)
    w = w.to(tl.float32)
    amax = tl.max(tl.max(tl.abs(w), axis=1), axis=0)
    scale = e4m3_scale(amax, FP8_MAX_C, MIN_AMAX)
    q = scaled_to_e4m3_grid(w, scale, FP8_MAX_C, EMULATE_E4M3)
    tl.store(q_ptr + rows[:, None] * stride_qn + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=inside)
    tl.store(s_ptr + nb * stride_sn + kb, scale)


def quantize_weight(w: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_weight_blockwise (its reference) in one launch: W [N, K] in any float dtype and strides ->
    (W_q [N, K] float8_e4m3fn, scale [ceil(N/BN), ceil(K/BK)] float32), the same bits. Weight loads and
    every weight update of an FP8 model run it on the GPU: the reference's float32 copies of the weight
    (several passes, each the size of the weight twice over) were the update's extra memory and time."""
    assert w.dim() == 2, f"a weight is [N, K], got {tuple(w.shape)}"
    n, k = w.shape
    block_n, block_k = block
    q = torch.empty((n, k), dtype=FP8_DTYPE, device=w.device)
    scale = torch.empty((triton.cdiv(n, block_n), triton.cdiv(k, block_k)), dtype=torch.float32, device=w.device)
    if n and k:
        _quantize_weight_kernel[scale.shape](
            w, q, scale, n, k, w.stride(0), w.stride(1), q.stride(0), scale.stride(0),
            BLOCK_N=block_n, BLOCK_K=block_k, FP8_MAX_C=FP8_MAX, MIN_AMAX=_MIN_AMAX, EMULATE_E4M3=emulate_e4m3(),
            num_warps=8 if block_n * block_k >= 128 * 128 else 4)
    return q, scale


# ---- the GEMM ---------------------------------------------------------------------------------
# Measured on the H100 (docs/benchmarks.md, session 29): quantizing x inside this GEMM, tile by tile,
# took 1.6-2x the time of quantize_activation plus this kernel at every 8B shape and batch size, so
# activations are quantized by their own launch.

@triton.jit
def _fp8_blockwise_matmul_kernel(
    xq_ptr, xs_ptr, wq_ptr, ws_ptr, b_ptr, y_ptr, M, N, K,
    stride_xm, stride_xsm, stride_wn, stride_wsn, stride_ym,
    HAS_BIAS: tl.constexpr, SCALE_BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program per [BLOCK_M, BLOCK_N] output tile; K in steps of BLOCK_K (= the scale block, so
    each step has one activation scale per row and one weight scale per SCALE_BLOCK_N rows)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    ks = tl.arange(0, BLOCK_K)
    row_in, col_in = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + ks
        a = tl.load(xq_ptr + rows[:, None] * stride_xm + k[None, :],
                    mask=row_in[:, None] & (k[None, :] < K), other=0.0)  # [BLOCK_M, BLOCK_K] e4m3
        b = tl.load(wq_ptr + cols[None, :] * stride_wn + k[:, None],
                    mask=col_in[None, :] & (k[:, None] < K), other=0.0)  # [BLOCK_K, BLOCK_N] e4m3
        x_scale = tl.load(xs_ptr + rows * stride_xsm + kb, mask=row_in, other=0.0)  # [BLOCK_M]
        w_scale = tl.load(ws_ptr + (cols // SCALE_BLOCK_N) * stride_wsn + kb, mask=col_in, other=0.0)  # [BLOCK_N]
        acc += tl.dot(a, b, out_dtype=tl.float32) * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_in, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_in[:, None] & col_in[None, :])


def fp8_blockwise_matmul(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                         out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                         block: tuple[int, int] = (BLOCK, BLOCK), config: dict | None = None) -> torch.Tensor:
    """x_q [M, K] e4m3 with x_scale [M, KB], w_q [N, K] e4m3 with w_scale [NB, KB] (blocks `block`)
    (+ bias [N]) -> y [M, N] in out_dtype. The K step is the scale block's K; an output tile spans at
    most one weight scale row (BLOCK_N is cut to block[0], which it must divide). config: {BLOCK_M,
    BLOCK_N, num_warps, num_stages}; None: the tuned table's for this shape and M
    (kernels/fp8_blockwise_config.py)."""
    m, k = x_q.shape
    n = w_q.shape[0]
    scale_n, scale_k = block
    assert w_q.shape[1] == k and x_q.dtype == w_q.dtype == FP8_DTYPE, "x_q and w_q must be e4m3 with one K"
    assert x_scale.shape == (m, triton.cdiv(k, scale_k)) and w_scale.shape == (triton.cdiv(n, scale_n), x_scale.shape[1]), \
        f"scales must be [M, KB] and [NB, KB], got {tuple(x_scale.shape)} and {tuple(w_scale.shape)}"
    assert x_q.stride(1) == 1 and w_q.stride(1) == 1, "x_q and w_q need contiguous rows"
    config = config or get_config(m, n, k)
    block_m, block_n = config["BLOCK_M"], min(config["BLOCK_N"], scale_n)
    assert scale_n % block_n == 0, f"block_n {block_n} must divide the weight scale block {scale_n}"
    y = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    if m == 0 or n == 0:
        return y
    _fp8_blockwise_matmul_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x_q, x_scale, w_q, w_scale, bias if bias is not None else x_scale, y, m, n, k,
        x_q.stride(0), x_scale.stride(0), w_q.stride(0), w_scale.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, SCALE_BLOCK_N=scale_n,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=scale_k,
        num_warps=config["num_warps"], num_stages=config["num_stages"])
    return y


def cublas_blockwise_matmul(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                            out_dtype: torch.dtype) -> torch.Tensor:
    """fp8_blockwise_matmul's product through cuBLASLt's blockwise-scaled FP8 GEMM (torch._scaled_mm with
    1x128 activation and 128x128 weight scales; Hopper, CUDA >= 12.9). cuBLAS reads the activation scales
    outer-dim-major ([M, KB] with strides (1, M): quantize_activation(..., scale_outer_major=True) writes
    them so; others are copied) and the weight scales as [KB, NB], K-major. cuBLAS reads 128x128 scales in
    groups of 4 K-blocks (its docs: [KB rounded up to 4, NB]), so KB must be a multiple of 4: with KB = 2 it
    returned products a thousand times too large on the H100, hence CUBLAS_K_BLOCKS in takes_cublas; and it
    refuses (CUBLAS_STATUS_NOT_SUPPORTED) row counts that are not a multiple of CUBLAS_ROW_MULTIPLE, so other
    row counts run padded with zero rows (pad_rows_for_cublas) and the padding's products are dropped."""
    assert x_scale.shape[1] % CUBLAS_K_BLOCKS == 0, f"cuBLAS needs K in multiples of {CUBLAS_K_BLOCKS * BLOCK}"
    m = x_q.shape[0]
    x_q, x_scale = pad_rows_for_cublas(x_q, x_scale)
    return torch._scaled_mm(x_q, w_q.t(), x_scale, w_scale.t(), out_dtype=out_dtype)[:m]


def pad_rows_for_cublas(x_q: torch.Tensor, x_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q [M, K], x_scale [M, KB]) -> the same rows with zero rows (scale 1) appended up to a multiple of
    CUBLAS_ROW_MULTIPLE, the scales outer-dim-major as cuBLAS reads them. Without the padding a prefill chunk
    of, say, 8,191 tokens ran our Triton GEMM, about 1.9x slower than cuBLAS's at that size (session 29); the
    copy costs one pass over the [M, K] e4m3 rows, under 2% of that GEMM's time."""
    m = x_q.shape[0]
    padded = -m % CUBLAS_ROW_MULTIPLE
    if padded == 0:
        return x_q, (x_scale if x_scale.stride(0) == 1 else x_scale.t().contiguous().t())
    q = torch.zeros((m + padded, x_q.shape[1]), dtype=x_q.dtype, device=x_q.device)
    q[:m] = x_q
    scale = empty_activation_scales(m + padded, x_scale.shape[1], x_scale.device, outer_major=True)
    scale[:m] = x_scale
    scale[m:] = 1.0
    return q, scale


# cuBLASLt's blockwise GEMM against ours on the H100 (docs/benchmarks.md, session 29): 1.3-1.5x faster at
# M = 256 on the 8B's gate/up and down shapes, about 1.9x at an 8,192-token prefill, level or slower at
# M = 64. From CUBLAS_MIN_ROWS rows on, a layer whose shape is whole 128-blocks runs it, where it works.
CUBLAS_MIN_ROWS = 128
CUBLAS_K_BLOCKS = 4  # K in whole groups of 4 scale blocks (see cublas_blockwise_matmul)
CUBLAS_ROW_MULTIPLE = 4  # M = 1, 77, 129 were refused on the H100 (the [M, KB] scales' leading dimension)


@functools.cache
def _cublas_blockwise_works(device_index: int) -> bool:
    """Whether this build's blockwise _scaled_mm runs here, eagerly and replayed from a CUDA graph (the
    engine's decode steps), with the reference's answer. Probed once per device, never during a capture."""
    device = torch.device("cuda", device_index)
    gen = torch.Generator(device=device).manual_seed(0)
    x_q, x_scale = quantize_activation(torch.randn(128, 4 * BLOCK, device=device, generator=gen), BLOCK, True)
    w_q, w_scale = quantize_weight_blockwise(torch.randn(256, 4 * BLOCK, device=device, generator=gen) * 0.05)
    try:
        eager = cublas_blockwise_matmul(x_q, x_scale, w_q, w_scale, torch.bfloat16)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = cublas_blockwise_matmul(x_q, x_scale, w_q, w_scale, torch.bfloat16)
        graph.replay()
        torch.cuda.synchronize(device)
    except RuntimeError:  # no blockwise scaling in this torch / cuBLAS, or not on this GPU
        return False
    want = fp8_blockwise_matmul_ref(x_q, x_scale, w_q, w_scale, torch.float32)
    return torch.equal(eager, replayed) and torch.allclose(eager.float(), want, atol=2e-2, rtol=2e-2)


def probe_cublas_blockwise(device: torch.device) -> bool:
    """Run the once-per-device probe now, eagerly (-> whether cuBLASLt's blockwise GEMM is used there). The
    engine calls it when an FP8 model is built: its decode graphs are captured before any eager step of
    CUBLAS_MIN_ROWS rows, and a capture cannot probe, so without this every graph ran our Triton GEMM."""
    return device.type == "cuda" and _cublas_blockwise_works(
        device.index if device.index is not None else torch.cuda.current_device())


def takes_cublas(rows: int, k: int, dtype: torch.dtype, device: torch.device, w_q: torch.Tensor,
                 block: tuple[int, int]) -> bool:
    """Whether an FP8 layer (w_q, its scale block) runs cuBLASLt's blockwise GEMM on `rows` activations
    of width k and `dtype` on `device` (else our Triton GEMM): from CUBLAS_MIN_ROWS rows (any count: other
    than multiples of CUBLAS_ROW_MULTIPLE they run padded), whole 128-blocks, K in whole groups of CUBLAS_K_BLOCKS."""
    if device.type != "cuda" or rows < CUBLAS_MIN_ROWS or block != (BLOCK, BLOCK) \
            or k % (CUBLAS_K_BLOCKS * BLOCK) or w_q.shape[0] % BLOCK:
        return False
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    if torch.cuda.is_current_stream_capturing() and _cublas_blockwise_works.cache_info().currsize == 0:
        return False  # no probing inside a capture (build_model probes before the graphs are captured)
    return probe_cublas_blockwise(device)


@dataclass
class FP8Rows:
    """Activations quantized for an FP8 linear layer by the kernel that produced them (the RMSNorm before
    it: rmsnorm.rms_norm_fp8; SiLU-and-mul: silu_mul.silu_and_mul_fp8), so the layer skips its quantize
    launch. q [M, K] e4m3, scale [M, K / BLOCK] float32: outer-dim-major (strides (1, M)) when `cublas`
    (takes_cublas chose cuBLASLt's GEMM for the layer), row-major for our Triton GEMM; dtype: what the
    activations were (the layer's output dtype)."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype
    cublas: bool


def fp8_linear(x: torch.Tensor | FP8Rows, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
               block: tuple[int, int] = (BLOCK, BLOCK), use_triton: bool | None = None) -> torch.Tensor:
    """y = x W^T (+ b) with W blockwise e4m3 and x quantized per token and K group inside: x [..., K]
    -> [..., N] in x's dtype. On CUDA (or when use_triton): cuBLASLt's blockwise GEMM from CUBLAS_MIN_ROWS
    rows on where it works, else our Triton GEMM; the torch references elsewhere. x may come quantized
    already (FP8Rows [M, K] -> [M, N]: the GEMM its producer chose)."""
    if isinstance(x, FP8Rows):
        if x.cublas:
            y = cublas_blockwise_matmul(x.q, x.scale, w_q, w_scale, x.dtype)
            return y if bias is None else y.add_(bias)
        return fp8_blockwise_matmul(x.q, x.scale, w_q, w_scale, x.dtype, bias, block)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    triton_path = x.is_cuda if use_triton is None else use_triton
    if triton_path and takes_cublas(x2.shape[0], x2.shape[1], x2.dtype, x2.device, w_q, block):
        x_q, x_scale = quantize_activation(x2, block[1], scale_outer_major=True)
        y = cublas_blockwise_matmul(x_q, x_scale, w_q, w_scale, x.dtype)
        if bias is not None:
            y += bias
    elif triton_path:
        x_q, x_scale = quantize_activation(x2, block[1])
        y = fp8_blockwise_matmul(x_q, x_scale, w_q, w_scale, x.dtype, bias, block)
    else:
        x_q, x_scale = quantize_activation_ref(x2, block[1])
        y = fp8_blockwise_matmul_ref(x_q, x_scale, w_q, w_scale, x.dtype, bias, block)
    return y.view(*shape[:-1], w_q.shape[0])
