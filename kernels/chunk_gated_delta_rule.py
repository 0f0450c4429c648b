"""Triton chunked gated delta rule for prefill: varlen sequences over a pool of recurrent states.

Same contract as `gated_delta_rule.chunk_gated_delta_rule_varlen_ref`: several
sequences packed in one flat batch (rows cu_seqlens[b]:cu_seqlens[b+1]), each
starting from its slot of ssm_states [S, Hv, dk, dv] (float32, updated in place),
q/k L2-normalised in the kernels (`use_qk_l2norm`), q scaled by dk^-0.5, key
head h // (Hv // Hk) serving value head h. Float32 inputs: all math in float32. Half-precision
inputs: the intermediates in their dtype by default (`lowp_intermediates`, reference
`chunk_gated_delta_rule_lowp_ref.py`); the running and final states stay float32.

This module checks the inputs, plans the chunks and launches the four kernels of
`chunk_gated_delta_rule_kernels.py` (the chunked math is in its docstring); kernels 1
and 2 also launch alone, beside their plain-torch references, for their tests. The
benchmark and FLOP count are `chunk_gated_delta_rule_bench.py`.
"""

from __future__ import annotations

import torch

from rollout_kernels.gated_delta_rule import l2norm
from rollout_kernels.host_to_device import LastLayout, to_device

try:
    import triton
except ImportError:  # torch-only installs run the references
    triton = None
else:
    from rollout_kernels.chunk_gated_delta_rule_kernels import (
        _chunk_cumsum_kernel,
        _chunk_output_kernel,
        _chunk_state_kernel,
        _chunk_wy_kernel,
    )


def _chunk_plan(cu_seqlens: tuple[int, ...], chunk_size: int, device) -> tuple[torch.Tensor, ...]:
    starts, lens, offsets = [], [], [0]
    for b in range(len(cu_seqlens) - 1):
        s, e = cu_seqlens[b], cu_seqlens[b + 1]
        for c in range(s, e, chunk_size):
            starts.append(c)
            lens.append(min(chunk_size, e - c))
        offsets.append(len(starts))
    return (to_device(starts, torch.int64, device), to_device(lens, torch.int32, device),
            to_device(offsets, torch.int64, device))


# -> (chunk_starts [N] int64: first row of each chunk, chunk_lens [N] int32, chunk_offsets [B + 1] int64:
# sequence b owns chunks chunk_offsets[b]:chunk_offsets[b+1]); built once per step (every layer asks alike)
chunk_plan = LastLayout(_chunk_plan)


def chunk_local_cumsum_ref(g: torch.Tensor, cu_seqlens: list[int], chunk_size: int) -> torch.Tensor:
    """g [T, H] -> float32 [T, H]: cumulative sum restarting at every chunk start of every sequence."""
    out = torch.empty(g.shape, dtype=torch.float32, device=g.device)
    for b in range(len(cu_seqlens) - 1):
        for c in range(cu_seqlens[b], cu_seqlens[b + 1], chunk_size):
            e = min(c + chunk_size, cu_seqlens[b + 1])
            out[c:e] = g[c:e].float().cumsum(0)
    return out


def chunk_wy_repr_ref(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, gcum: torch.Tensor,
                      cu_seqlens: list[int], chunk_size: int, use_qk_l2norm: bool = True):
    """k [T, Hk, dk]; v [T, Hv, dv]; beta [T, Hv]; gcum [T, Hv] (chunk-local cumsum of g)
    -> (w [T, Hv, dk], u [T, Hv, dv]) float32, per chunk as in the module docstring."""
    Hv = v.shape[1]
    k = k.float().repeat_interleave(Hv // k.shape[1], dim=1)
    k = l2norm(k) if use_qk_l2norm else k
    v, beta = v.float(), beta.float()
    w = torch.empty(k.shape, dtype=torch.float32, device=k.device)
    u = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for b in range(len(cu_seqlens) - 1):
        for c in range(cu_seqlens[b], cu_seqlens[b + 1], chunk_size):
            e = min(c + chunk_size, cu_seqlens[b + 1])
            kc, gc, bc = k[c:e].transpose(0, 1), gcum[c:e].t(), beta[c:e].t()  # [Hv, n, dk], [Hv, n]
            n = e - c
            lower = torch.ones(n, n, dtype=torch.bool, device=k.device).tril(-1)
            diff = (gc[:, :, None] - gc[:, None, :]).masked_fill(~lower, float("-inf"))
            system = (bc[..., None] * kc) @ kc.transpose(-1, -2) * diff.exp() + torch.eye(n, device=k.device)
            rhs_w = kc * (bc * gc.exp())[..., None]
            rhs_u = v[c:e].transpose(0, 1) * bc[..., None]
            w[c:e] = torch.linalg.solve_triangular(system, rhs_w, upper=False, unitriangular=True).transpose(0, 1)
            u[c:e] = torch.linalg.solve_triangular(system, rhs_u, upper=False, unitriangular=True).transpose(0, 1)
    return w, u



def _check_rows(name: str, x: torch.Tensor, heads: int, dim: int) -> None:
    """[T, heads, dim] with heads packed contiguously in a row (a view of a fused projection is fine)."""
    assert x.dim() == 3 and x.shape[1:] == (heads, dim), f"{name} must be [T, {heads}, {dim}], got {tuple(x.shape)}"
    assert x.stride(2) == 1 and (x.stride(1) == dim or heads == 1), f"{name} must be contiguous per row"


def chunk_gated_delta_rule_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                  beta: torch.Tensor, ssm_states: torch.Tensor, state_indices: torch.Tensor,
                                  cu_seqlens: list[int], chunk_size: int = 64,
                                  use_qk_l2norm: bool = True, tuning: dict | None = None) -> torch.Tensor:
    """Triton prefill, as chunk_gated_delta_rule_varlen_ref: q/k [T, Hk, dk]; v [T, Hv, dv]; g/beta [T, Hv];
    sequence b is rows cu_seqlens[b]:cu_seqlens[b+1] and starts from ssm_states[state_indices[b]]
    ([S, Hv, dk, dv] float32, updated in place; state_indices [B] int64, distinct, >= 0)
    -> o [T, Hv, dv] in v's dtype. q/k/v may be row-strided views (a fused projection's output).
    tuning (for the benchmark's sweeps; None: the defaults below) may set inv_precision ("ieee" or
    "tf32x3"), warps (every kernel), wy_warps / state_warps / output_warps (one kernel's), block_v (state
    and output kernels), state_block_v / output_block_v (one kernel's), state_stages (the state walk's
    software pipelining depth: its loads do not wait on the state), sub_block (SB),
    batched_diag (the inverse's diagonal blocks as batched dots; needs SB >= 16 on the GPU),
    lowp_intermediates (half-precision inputs only, on by default: w, u / v_new and the chunk-start states
    in the inputs' dtype, dots on those operands; chunk_gated_delta_rule_lowp_ref is its reference)."""
    assert triton is not None, "chunk_gated_delta_rule_varlen needs triton"
    T, Hk, dk = q.shape
    Hv, dv = v.shape[1], v.shape[2]
    _check_rows("q", q, Hk, dk)
    _check_rows("k", k, Hk, dk)
    _check_rows("v", v, Hv, dv)
    assert k.shape[0] == T and v.shape[0] == T, "q, k, v must have the same number of rows"
    assert Hv % Hk == 0, f"value heads {Hv} must be a multiple of key heads {Hk}"
    for name, x in (("g", g), ("beta", beta)):
        assert x.shape == (T, Hv) and (x.stride(1) == 1 or Hv == 1), f"{name} must be [T, Hv] contiguous per row"
    assert ssm_states.dim() == 4 and ssm_states.shape[1:] == (Hv, dk, dv), f"states [S, Hv, dk, dv]: {ssm_states.shape}"
    assert ssm_states.dtype == torch.float32 and ssm_states.stride(3) == 1, "states must be float32, contiguous in v_dim"
    B = len(cu_seqlens) - 1
    assert state_indices.shape == (B,) and state_indices.dtype == torch.int64, "state_indices must be [B] int64"
    assert cu_seqlens[0] == 0 and cu_seqlens[-1] == T, f"cu_seqlens must run from 0 to T={T}, got {cu_seqlens}"
    assert chunk_size in (16, 32, 64), "chunk_size must be 16, 32 or 64"
    assert dk <= 256, "k_dim above 256 does not fit the register tiles"
    out = torch.empty((T, Hv, dv), dtype=v.dtype, device=v.device)
    if T == 0:
        return out
    device = v.device
    starts, lens, offsets = chunk_plan(cu_seqlens, chunk_size, device)
    num_chunks = starts.shape[0]
    BT, BK = chunk_size, max(16, triton.next_power_of_2(dk))
    knobs = tuning or {}
    precision = "ieee" if v.dtype == torch.float32 else "tf32"
    # bf16/fp16 inputs take the half-precision intermediates by default (flash-linear-attention's precision,
    # docs/gdn_bf16_intermediates.md: acceptable for the default mode; the on-policy mode prefills with the
    # recurrent kernel instead), the inverse in one tf32 pass (it is rounded to bf16 after), 128-wide
    # value blocks and 8 warps for the state walk: 2,896 -> 1,276 us at 4 x 4096 tokens, 883 -> 471 us at
    # 16 x 256 on the H200 (scripts/bench_gdn_vs_fla.py, session 32). With lowp_intermediates False: float32
    # intermediates, tf32 dots, the inverse in tf32x3, 4 warps. Float32 inputs (the CPU reference runs)
    # keep full float32 with 8 warps at dk 128.
    low_precision = v.dtype != torch.float32
    lowp = low_precision and bool(knobs.get("lowp_intermediates", True))
    inv_precision = knobs.get("inv_precision", "tf32" if lowp else "tf32x3" if low_precision else "ieee")
    warps = knobs.get("warps", 4 if low_precision or BK < 128 else 8)
    state_warps = knobs.get("state_warps", 8 if lowp else warps)
    BV = knobs.get("block_v", min(max(16, triton.next_power_of_2(dv)), 128 if lowp else 64))
    state_bv, output_bv = knobs.get("state_block_v", BV), knobs.get("output_block_v", BV)
    stages = {"num_stages": knobs["state_stages"]} if "state_stages" in knobs else {}
    inter = v.dtype if lowp else torch.float32  # w, u / v_new and the chunk-start states
    common = dict(GROUP=Hv // Hk, BT=BT, BK=BK, L2NORM=use_qk_l2norm, DOT_PRECISION=precision, LOWP=lowp)
    gcum = torch.empty((T, Hv), dtype=torch.float32, device=device)
    block_h = min(triton.next_power_of_2(Hv), 64)
    _chunk_cumsum_kernel[(num_chunks, triton.cdiv(Hv, block_h))](g, gcum, starts, lens, g.stride(0), gcum.stride(0),
                                                                  Hv, BT=BT, BH=block_h)
    w = torch.empty((T, Hv, dk), dtype=inter, device=device)
    u = torch.empty((T, Hv, dv), dtype=inter, device=device)  # then v_new, in place
    sub_block = min(knobs.get("sub_block", 16), BT)
    _chunk_wy_kernel[(num_chunks, Hv)](k, v, beta, gcum, w, u, starts, lens, k.stride(0), v.stride(0),
                                       beta.stride(0), gcum.stride(0), w.stride(0), u.stride(0), dk, dv,
                                       BV=BV, SB=sub_block, INV_PRECISION=inv_precision,
                                       BATCHED_DIAG=knobs.get("batched_diag", sub_block >= 16), **common,
                                       num_warps=knobs.get("wy_warps", warps))
    hs = torch.empty((num_chunks, Hv, dk, dv), dtype=inter, device=device)  # state at each chunk start
    _chunk_state_kernel[(B, Hv, triton.cdiv(dv, state_bv))](
        k, w, u, gcum, hs, ssm_states, state_indices, starts, lens, offsets,
        k.stride(0), w.stride(0), u.stride(0), gcum.stride(0), hs.stride(0),
        ssm_states.stride(0), ssm_states.stride(1), ssm_states.stride(2), dk, dv, BV=state_bv, **common,
        num_warps=state_warps, **stages)
    _chunk_output_kernel[(num_chunks, Hv, triton.cdiv(dv, output_bv))](
        q, k, u, gcum, hs, out, starts, lens, q.stride(0), k.stride(0), u.stride(0), gcum.stride(0), hs.stride(0),
        out.stride(0), out.stride(1), dk ** -0.5, dk, dv, BV=output_bv, **common,
        num_warps=knobs.get("output_warps", warps))
    return out


def chunk_local_cumsum(g: torch.Tensor, cu_seqlens: list[int], chunk_size: int = 64) -> torch.Tensor:
    """Kernel 1 alone (for its test), as chunk_local_cumsum_ref: g [T, H] -> float32 [T, H]."""
    assert triton is not None and g.dim() == 2 and (g.stride(1) == 1 or g.shape[1] == 1)
    T, H = g.shape
    out = torch.empty((T, H), dtype=torch.float32, device=g.device)
    starts, lens, _ = chunk_plan(cu_seqlens, chunk_size, g.device)
    if starts.numel():
        block_h = min(triton.next_power_of_2(H), 64)
        _chunk_cumsum_kernel[(starts.shape[0], triton.cdiv(H, block_h))](g, out, starts, lens, g.stride(0),
                                                                          out.stride(0), H, BT=chunk_size, BH=block_h)
    return out


def chunk_wy_repr(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, gcum: torch.Tensor, cu_seqlens: list[int],
                  chunk_size: int = 64, use_qk_l2norm: bool = True,
                  batched_diag: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel 2 alone (for its test), as chunk_wy_repr_ref -> (w [T, Hv, dk], u [T, Hv, dv]) float32."""
    assert triton is not None
    T, Hk, dk = k.shape
    Hv, dv = v.shape[1], v.shape[2]
    _check_rows("k", k, Hk, dk)
    _check_rows("v", v, Hv, dv)
    w = torch.empty((T, Hv, dk), dtype=torch.float32, device=k.device)
    u = torch.empty((T, Hv, dv), dtype=torch.float32, device=k.device)
    starts, lens, _ = chunk_plan(cu_seqlens, chunk_size, k.device)
    if starts.numel():
        _chunk_wy_kernel[(starts.shape[0], Hv)](
            k, v, beta, gcum, w, u, starts, lens, k.stride(0), v.stride(0), beta.stride(0), gcum.stride(0),
            w.stride(0), u.stride(0), dk, dv, GROUP=Hv // Hk, BT=chunk_size, BK=max(16, triton.next_power_of_2(dk)),
            BV=min(max(16, triton.next_power_of_2(dv)), 64), SB=min(16, chunk_size), L2NORM=use_qk_l2norm,
            DOT_PRECISION="ieee" if v.dtype == torch.float32 else "tf32", INV_PRECISION="ieee",
            BATCHED_DIAG=batched_diag, LOWP=False, num_warps=4)
    return w, u
