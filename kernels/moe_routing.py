"""Top-k softmax routing of a mixture-of-experts layer: router logits -> (topk_weights, topk_ids).

The rule, shared with `TopKRouter` (rollout_cli/models/moe.py) so both paths route identically:

  - experts are ranked by their logit, highest first, ties to the lower expert id. Softmax is
    monotone, so this is the top-k of the probabilities; ranking the logits (exact values, not
    rounded exp) makes the choice identical across exp implementations, and the tie rule makes it
    identical across torch.topk builds (whose tie order is unspecified);
  - weight = softmax(logits in float32)[expert]; with `renormalize` divided by the sum of the
    k chosen weights (float32); then, when `weight_dtype` is narrower, rounded to it (the Qwen
    routers hand the experts weights in the activation dtype) and returned as float32.

One program owns BLOCK_T tokens and all E_P2 >= E experts of them: k rounds of (max, lowest id
holding it, mark taken). E is at most a few hundred, so a token's logits sit in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_ROUND_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the kernel's ROUND_TO


@triton.jit(do_not_specialize=["T"])  # one compile for every batch size
def _topk_softmax_kernel(
    Logits, Weights, Ids,
    T, E, stride_lt,
    TOP_K: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr, BLOCK_T: tl.constexpr,
    RENORMALIZE: tl.constexpr, ROUND_TO: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < T
    offs_e = tl.arange(0, E_P2)
    mask_e = offs_e < E
    rows = offs_t.to(tl.int64)
    x = tl.load(Logits + rows[:, None] * stride_lt + offs_e[None, :],
                mask=mask_t[:, None] & mask_e[None, :], other=float("-inf")).to(tl.float32)  # [BLOCK_T, E_P2]

    # softmax denominator over the real experts (padded columns hold -inf: exp gives 0)
    row_max = tl.max(x, 1)
    row_max = tl.where(row_max > float("-inf"), row_max, 0.0)  # an all -inf row: no -inf - -inf
    denom = tl.sum(tl.where(mask_e[None, :], tl.exp(x - row_max[:, None]), 0.0), 1)  # [BLOCK_T]
    denom = tl.where(mask_t, denom, 1.0)  # rows past T: no 0 / 0

    avail = mask_e[None, :] & mask_t[:, None]  # [BLOCK_T, E_P2] experts not chosen yet
    offs_k = tl.arange(0, K_P2)  # choices, padded to a power of 2
    mask_k = offs_k < TOP_K
    chosen = tl.zeros([BLOCK_T, K_P2], dtype=tl.int32)
    picked = tl.full([BLOCK_T, K_P2], float("-inf"), dtype=tl.float32)  # logit of each choice
    for j in tl.static_range(TOP_K):
        best = tl.max(tl.where(avail, x, float("-inf")), 1)  # [BLOCK_T]
        hit = avail & (x == best[:, None])
        idx = tl.min(tl.where(hit, offs_e[None, :], E_P2), 1)  # lowest id holding the max
        avail = avail & (offs_e[None, :] != idx[:, None])
        chosen = tl.where(offs_k[None, :] == j, idx[:, None], chosen)
        picked = tl.where(offs_k[None, :] == j, best[:, None], picked)

    w = tl.exp(picked - row_max[:, None]) / denom[:, None]  # [BLOCK_T, K_P2] float32, 0 in padded columns
    if RENORMALIZE:
        w = w / tl.where(mask_t, tl.sum(w, 1), 1.0)[:, None]
    if ROUND_TO == 1:  # to bfloat16, round to nearest even on the bits: the interpreter's cast truncates
        bits = w.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        w = bits.to(tl.float32, bitcast=True)
    elif ROUND_TO == 2:
        w = w.to(tl.float16).to(tl.float32)
    out = rows[:, None] * TOP_K + offs_k[None, :]
    mask = mask_t[:, None] & mask_k[None, :]
    tl.store(Weights + out, w, mask=mask)
    tl.store(Ids + out, chosen, mask=mask)


def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool, weight_dtype: torch.dtype = torch.float32,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (rows may be strided) -> (weights [T, top_k] float32, ids [T, top_k] int32).

    `weight_dtype`: weights are rounded to it (float32: not rounded). `out`: (weights, ids) to write.
    """
    assert logits.dim() == 2, f"logits must be [T, E], got {tuple(logits.shape)}"
    assert logits.dtype in _DTYPES, f"unsupported logits dtype {logits.dtype}"
    assert weight_dtype in _DTYPES, f"unsupported weight dtype {weight_dtype}"
    num_tokens, num_experts = logits.shape
    assert 1 <= top_k <= num_experts, f"top_k {top_k} must be in [1, num_experts={num_experts}]"
    assert logits.stride(1) == 1 or num_experts == 1, "logits must be contiguous in the expert dim"
    if out is None:
        out = (torch.empty((num_tokens, top_k), dtype=torch.float32, device=logits.device),
               torch.empty((num_tokens, top_k), dtype=torch.int32, device=logits.device))
    weights, ids = out
    for t, dtype in ((weights, torch.float32), (ids, torch.int32)):
        assert t.shape == (num_tokens, top_k) and t.dtype == dtype and t.is_contiguous(), (
            f"output {tuple(t.shape)} {t.dtype}: want contiguous [{num_tokens}, {top_k}] {dtype}")
        assert t.device == logits.device
    if num_tokens == 0:
        return weights, ids
    e_p2 = triton.next_power_of_2(num_experts)
    block_t = max(1, min(16, 2048 // e_p2))  # keeps BLOCK_T * E_P2 logits in registers
    _topk_softmax_kernel[(triton.cdiv(num_tokens, block_t),)](
        logits, weights, ids, num_tokens, num_experts, logits.stride(0),
        TOP_K=top_k, K_P2=triton.next_power_of_2(top_k), E_P2=e_p2, BLOCK_T=block_t,
        RENORMALIZE=renormalize, ROUND_TO=_ROUND_CODES[weight_dtype],
        num_warps=4 if e_p2 >= 128 else 2,
    )
    return weights, ids


def topk_softmax_ref(logits: torch.Tensor, top_k: int, renormalize: bool,
                     weight_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's rule in plain torch: stable sort of the logits (ties to the lower id)."""
    x = logits.float()  # [T, E]
    probs = torch.softmax(x, dim=-1)
    ids = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :top_k]  # [T, k]
    weights = probs.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weight_dtype).float(), ids.to(torch.int32)
