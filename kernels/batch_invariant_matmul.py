"""y = x W^T (+ b) whose every row has the same bits whatever the number of rows: the matmul of the
on-policy mode's GPU path (issue 19).

Why cuBLAS is not enough: it picks its algorithm (tile shape, split-K, the MMA instruction) from
the problem size, so a row computed in a batch of 1 and the same row in a batch of 256 may sum
their K products in another order, and bf16 rounding then tells them apart. Here:
  - one program per [BLOCK_M, BLOCK_N] output tile, grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N));
  - the K loop walks fixed BLOCK_K chunks from 0 upward, accumulating in float32 (no split-K);
  - the launch config depends on nothing but the fixed knobs (never on M), so every row runs the
    same instruction sequence: its value depends on its own x row and W only, not on which rows
    share its tile or how many tiles there are.
Rows past M are loaded as zeros and never stored. The bias is added in float32 before the one
rounding to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Fixed for every M (batch invariance); change them only for all callers at once.
BLOCK_M, BLOCK_N, BLOCK_K = 64, 128, 64
NUM_WARPS, NUM_STAGES = 4, 3


@triton.jit
def _batch_invariant_matmul_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :] * stride_xk,
                    mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptr + cols[None, :] * stride_wn + k[:, None] * stride_wk,
                    mask=(cols[None, :] < N) & (k[:, None] < K), other=0.0)  # [BLOCK_K, BLOCK_N]
        if IEEE:  # float32 inputs: full float32 products, as torch's float32 matmul (no TF32)
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def batch_invariant_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (any strides) @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype (new, or `out`)."""
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
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _batch_invariant_matmul_kernel[grid](
        x, weight, bias if bias is not None else weight, out, m, n, k,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return out


def batch_invariant_matmul_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's math in plain torch: float32 products and sums, one rounding to x's dtype."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
