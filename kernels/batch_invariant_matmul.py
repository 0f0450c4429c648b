"""y = x W^T (+ b) whose every row has the same bits whatever the number of rows: the matmul of the
on-policy mode's GPU path (issue 19).

Why cuBLAS is not enough: it picks its algorithm (tile shape, split-K, the MMA instruction) from
the problem size, so a row computed in a batch of 1 and the same row in a batch of 256 may sum
their K products in another order, and bf16 rounding then tells them apart. Here the launch
config's reduction (BLOCK_K, SPLIT_K) comes from the weight's shape alone, its tiles from M too
(`batch_invariant_config.get_config(N, K, dtype, M)`, which says why tiles may follow M):
  - one program per [BLOCK_M, BLOCK_N] output tile and K split, grid (cdiv(M, BLOCK_M),
    cdiv(N, BLOCK_N), SPLIT_K);
  - split s sums K range [s C, (s + 1) C), C = cdiv(cdiv(K, SPLIT_K), BLOCK_K) BLOCK_K, in fixed
    BLOCK_K chunks from its start upward, accumulating in float32;
  - with SPLIT_K > 1 the splits' float32 partials are summed in split order by a second launch
    (split-K raises the program count of decode's few rows without tying the order to M);
so every output element sums its K products in the same order: its value depends on its own x row
and W only, not on which rows share its tile or how many tiles there are. Rows past M are loaded as zeros and
never stored. The bias is added in float32 before the one rounding to the output dtype.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .batch_invariant_config import get_config


@triton.jit
def _batch_invariant_matmul_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, M, N, K, k_chunk,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    ks = tl.arange(0, BLOCK_K)
    k_start = split * k_chunk
    k_end = tl.minimum(k_start + k_chunk, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :] * stride_xk,
                    mask=(rows[:, None] < M) & (k[None, :] < k_end), other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptr + cols[None, :] * stride_wn + k[:, None] * stride_wk,
                    mask=(cols[None, :] < N) & (k[:, None] < k_end), other=0.0)  # [BLOCK_K, BLOCK_N]
        if IEEE:  # float32 inputs: full float32 products, as torch's float32 matmul (no TF32)
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    _store_tile(acc, rows, cols, split, b_ptr, y_ptr, part_ptr, M, N, stride_ym, stride_yn, HAS_BIAS, SPLIT_K)


@triton.jit
def _batch_invariant_matmul_tma_kernel(
    x_desc, w_desc, b_ptr, y_ptr, part_ptr, M, N, K, k_chunk, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
):
    """The same sums as _batch_invariant_matmul_kernel, its tiles loaded by the Hopper TMA unit
    (x_desc: [M, K] in [BLOCK_M, BLOCK_K] boxes, w_desc: [N, K] in [BLOCK_N, BLOCK_K] boxes), which
    fills rows past M and columns past K with zeros as the masks do: 1.1-1.4x faster at decode and
    prefill shapes, bit for bit the same output (docs/benchmarks.md, session 24)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    k_start = split * k_chunk
    k_end = tl.minimum(k_start + k_chunk, K)  # a split's end is a multiple of BLOCK_K or K itself
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
        x = x_desc.load([pid_m * BLOCK_M, k0])  # [BLOCK_M, BLOCK_K]
        w = w_desc.load([pid_n * BLOCK_N, k0])  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(x, w.T, acc)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    _store_tile(acc, rows, cols, split, b_ptr, y_ptr, part_ptr, M, N, stride_ym, stride_yn, HAS_BIAS, SPLIT_K)


@triton.jit
def _store_tile(acc, rows, cols, split, b_ptr, y_ptr, part_ptr, M, N, stride_ym, stride_yn,
                HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] float32 -> y rounded once (+ bias), or split `split`'s float32 partials."""
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty),
                 mask=inside)
    else:  # partials [SPLIT_K, M, N] float32, summed by _split_sum_kernel
        tl.store(part_ptr + (split * M + rows[:, None]) * N + cols[None, :], acc, mask=inside)


@triton.jit
def _split_sum_kernel(part_ptr, b_ptr, y_ptr, numel, N, stride_ym, stride_yn,
                      HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """y = sum of the SPLIT_K partials in split order (+ bias), rounded once; BLOCK elements per program.
    numel = M N; the partials' split s starts at s numel, stepped in 64-bit pointers: s M N passes
    2^31 at an LM head's N with a prefill chunk's M (151936 x 2048 x 7), where int32 wrapped."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    part = part_ptr + offs
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part, mask=inside, other=0.0)
        part += numel
    cols = offs % N
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + (offs // N) * stride_ym + cols * stride_yn, acc.to(y_ptr.dtype.element_ty), mask=inside)


@functools.lru_cache(maxsize=None)
def _has_tma(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def tma_loads_fit(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the TMA kernel can load x and weight: a Hopper-or-later GPU, 16-bit operands (float32
    keeps the pointer kernel's IEEE products), rows with unit column stride, and base addresses and
    row strides on 16 bytes (the TMA unit's alignment)."""
    if not x.is_cuda or x.dtype == torch.float32 or not _has_tma(x.device.index or 0):
        return False
    size = x.element_size()
    return all(t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * size) % 16 == 0
               for t in (x, weight))


def batch_invariant_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                           out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """x [M, K] (any strides) @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype (new, or `out`).
    `config` (batch_invariant_config.KEYS) overrides the shape's tuned or default one (the tuner)."""
    assert x.dim() == 2 and weight.dim() == 2, f"x must be [M, K] and weight [N, K], got {tuple(x.shape)}, " \
                                               f"{tuple(weight.shape)}"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), f"unsupported dtype {x.dtype}"
    assert weight.dtype == x.dtype and x.device == weight.device, "x and weight must share dtype and device"
    (m, k), n = x.shape, weight.shape[0]
    assert weight.shape[1] == k, f"x has K={k}, weight has K={weight.shape[1]}"
    if bias is not None:
        assert bias.shape == (n,) and bias.device == x.device, f"bias must be [{n}] on {x.device}"
        assert bias.stride(0) == 1 or n <= 1, "bias must be contiguous"
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    assert out.shape == (m, n) and out.dtype == x.dtype and out.device == x.device, \
        f"out must be [{m}, {n}] {x.dtype} on {x.device}"
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand(m, n) if bias is not None else torch.zeros_like(out))
    cfg = config or get_config(n, k, x.dtype, m)
    block_m, block_n, block_k, split_k = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    k_chunk = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k  # from K and the config only
    split_k = triton.cdiv(k, k_chunk)  # splits that hold some K (a short K may need fewer)
    # sized from shapes only: CUDA-graph capturable
    partials = torch.empty((split_k, m, n) if split_k > 1 else (1,), dtype=torch.float32, device=x.device)
    bias_arg = bias if bias is not None else weight
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    if tma_loads_fit(x, weight):
        _batch_invariant_matmul_tma_kernel[grid](
            TensorDescriptor.from_tensor(x, [block_m, block_k]), TensorDescriptor.from_tensor(weight, [block_n, block_k]),
            bias_arg, out, partials, m, n, k, k_chunk, out.stride(0), out.stride(1),
            HAS_BIAS=bias is not None, SPLIT_K=split_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            STAGES=cfg["num_stages"], num_warps=cfg["num_warps"],
        )
    else:
        _batch_invariant_matmul_kernel[grid](
            x, weight, bias_arg, out, partials, m, n, k, k_chunk,
            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
            HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, SPLIT_K=split_k,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    if split_k > 1:
        block = 1024
        _split_sum_kernel[(triton.cdiv(m * n, block),)](
            partials, bias_arg, out, m * n, n, out.stride(0), out.stride(1),
            HAS_BIAS=bias is not None, SPLIT_K=split_k, BLOCK=block, num_warps=4,
        )
    return out


def batch_invariant_matmul_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's math in plain torch: float32 products and sums, one rounding to x's dtype."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
