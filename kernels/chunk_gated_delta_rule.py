"""Triton chunked gated delta rule for prefill: varlen sequences over a pool of recurrent states.

Same contract as `gated_delta_rule.chunk_gated_delta_rule_varlen_ref`: several
sequences packed in one flat batch (rows cu_seqlens[b]:cu_seqlens[b+1]), each
starting from its slot of ssm_states [S, Hv, dk, dv] (float32, updated in place),
q/k L2-normalised in the kernels (`use_qk_l2norm`), q scaled by dk^-0.5, key
head h // (Hv // Hk) serving value head h, all math in float32.

Each sequence is cut into chunks of C positions (the last one shorter). With
gc the chunk-local cumulative log decay and, inside one chunk,

    A  = strictly_lower(diag(beta) K K^T * exp(gc_i - gc_j))      [C, C]
    T  = (I + A)^-1                       (the UT transform of the C delta-rule writes)
    w  = T (beta * exp(gc) * K)           [C, dk]
    u  = T (beta * V)                     [C, dv]

a chunk starting from state S (what came before it) does

    v_new = u - w S                                             (writes corrected by the old state)
    o     = (Q * exp(gc)) S + lower(Q K^T * exp(gc_i - gc_j)) v_new
    S    <- exp(gc_last) S + (K * exp(gc_last - gc))^T v_new

Four kernels, in the structure of flash-linear-attention's chunk_gated_delta_rule
(our own code):
  1. `_chunk_cumsum_kernel`     chunk-local cumsum of g                 grid (chunks, head blocks)
  2. `_chunk_wy_kernel`         A, its inverse (blocked forward substitution), w and u  grid (chunks, Hv)
  3. `_chunk_state_kernel`      sequential pass over a sequence's chunks: the state
                                at each chunk start (h), v_new (over u, in place), final state
                                back to the slot                        grid (sequences, Hv, dv blocks)
  4. `_chunk_output_kernel`     o per chunk, all chunks in parallel     grid (chunks, Hv, dv blocks)
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # torch-only installs run the references
    triton = None


def chunk_plan(cu_seqlens: list[int], chunk_size: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (chunk_starts [N] int64: first row of each chunk, chunk_lens [N] int32,
    chunk_offsets [B + 1] int64: sequence b owns chunks chunk_offsets[b]:chunk_offsets[b+1])."""
    starts, lens, offsets = [], [], [0]
    for b in range(len(cu_seqlens) - 1):
        s, e = cu_seqlens[b], cu_seqlens[b + 1]
        for c in range(s, e, chunk_size):
            starts.append(c)
            lens.append(min(chunk_size, e - c))
        offsets.append(len(starts))
    return (torch.tensor(starts, dtype=torch.int64, device=device),
            torch.tensor(lens, dtype=torch.int32, device=device),
            torch.tensor(offsets, dtype=torch.int64, device=device))


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
    from rollout_kernels.gated_delta_rule import l2norm

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


if triton is not None:

    @triton.jit
    def _load_keys(ptr, rows, mask_r, s0, head, cols, DK, L2NORM: tl.constexpr):
        """[BT, BK] float32 q or k rows of one key head, zero outside the chunk, optionally L2-normalised."""
        mask = mask_r[:, None] & (cols[None, :] < DK)
        x = tl.load(ptr + rows[:, None] * s0 + head * DK + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if L2NORM:
            x = x / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]
        return x

    @triton.jit
    def _unit_lower_inverse(a, ri, BT: tl.constexpr, SB: tl.constexpr, PRECISION: tl.constexpr,
                            BATCHED_DIAG: tl.constexpr):
        """(I + a)^-1 for a [BT, BT] strictly lower triangular, in blocks of SB rows (SB divides BT).

        First the SB x SB diagonal blocks, by forward substitution run on all blocks at once (row r of
        every block per step: r = 1 .. SB-1); then, with D that block-diagonal inverse and F the part of
        a below the diagonal blocks, T = D - D F T block row by block row (F T of block row i only reads
        block rows < i, already final). SB - 1 + 2 (BT / SB - 1) dots instead of BT - 1 row steps, in
        PRECISION: "ieee" (full float32 on the CUDA cores) or "tf32x3" (three tf32 tensor-core passes,
        float32-level error); not plain tf32: errors of the inverse carry into every later chunk.
        BATCHED_DIAG: the substitution's dots on the [BT / SB, SB, SB] diagonal blocks alone (batched
        dots, SB >= 16 on the GPU) instead of on the whole [BT, BT] tile, most of it zeros: at BT 64,
        SB 16 they were 15 of the 21 dots and 4x the work each."""
        same_block = (ri[:, None] // SB) == (ri[None, :] // SB)
        if BATCHED_DIAG:
            bi = tl.arange(0, BT // SB)
            same_block4 = bi[:, None, None, None] == bi[None, None, :, None]  # [NB, 1, NB, 1]
            blocks = tl.sum(tl.where(same_block4, tl.reshape(a, (BT // SB, SB, BT // SB, SB)), 0.0), axis=2)
            si = tl.arange(0, SB)
            # one SB x SB identity per block ((bi >= 0) is all true: it only gives the block axis)
            eye3 = tl.where((si[:, None] == si[None, :])[None, :, :] & (bi >= 0)[:, None, None], 1.0, 0.0)
            inv3 = eye3  # [NB, SB, SB]
            for r in range(1, SB):
                step3 = eye3 - tl.dot(blocks, inv3, input_precision=PRECISION)
                inv3 = tl.where((si == r)[None, :, None], step3, inv3)
            inv = tl.reshape(tl.where(same_block4, inv3[:, :, None, :], 0.0), (BT, BT))
        else:
            eye = tl.where(ri[:, None] == ri[None, :], 1.0, 0.0)
            diag_part = tl.where(same_block, a, 0.0)
            inv = eye
            for r in range(1, SB):
                step = eye - tl.dot(diag_part, inv, input_precision=PRECISION)
                inv = tl.where((ri % SB == r)[:, None], step, inv)
        below = tl.where(same_block, 0.0, a)
        full = inv
        for blk in range(1, BT // SB):
            step = inv - tl.dot(inv, tl.dot(below, full, input_precision=PRECISION), input_precision=PRECISION)
            full = tl.where((ri // SB == blk)[:, None], step, full)
        return full

    @triton.jit
    def _chunk_cumsum_kernel(g_ptr, out_ptr, start_ptr, len_ptr, sg0, so0, H,
                             BT: tl.constexpr, BH: tl.constexpr):
        # one program: chunk c, heads [hb * BH, hb * BH + BH); g [T, H] -> out [T, H] float32
        c = tl.program_id(0)
        heads = tl.program_id(1) * BH + tl.arange(0, BH)
        start = tl.load(start_ptr + c).to(tl.int64)
        n = tl.load(len_ptr + c)
        rows = tl.arange(0, BT)
        mask = (rows[:, None] < n) & (heads[None, :] < H)
        rows64 = start + rows.to(tl.int64)
        g = tl.load(g_ptr + rows64[:, None] * sg0 + heads[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows64[:, None] * so0 + heads[None, :], tl.cumsum(g, axis=0), mask=mask)

    @triton.jit
    def _chunk_wy_kernel(k_ptr, v_ptr, beta_ptr, gc_ptr, w_ptr, u_ptr, start_ptr, len_ptr,
                         sk0, sv0, sb0, sgc0, sw0, su0, DK, DV,
                         GROUP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                         SB: tl.constexpr, L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         INV_PRECISION: tl.constexpr, BATCHED_DIAG: tl.constexpr):
        # one program: chunk c, value head h. k [T, Hk, dk] (row stride sk0), v [T, Hv, dv], beta/gc [T, Hv]
        # -> w [T, Hv, dk], u [T, Hv, dv] float32 (head stride = head dim: contiguous per row)
        c = tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)
        start = tl.load(start_ptr + c).to(tl.int64)
        n = tl.load(len_ptr + c)
        ri = tl.arange(0, BT)
        mask_r = ri < n
        rows = start + ri.to(tl.int64)
        kcols = tl.arange(0, BK)
        k = _load_keys(k_ptr, rows, mask_r, sk0, h // GROUP, kcols, DK, L2NORM)  # [BT, BK]
        beta = tl.load(beta_ptr + rows * sb0 + h, mask=mask_r, other=0.0).to(tl.float32)  # [BT]
        gc = tl.load(gc_ptr + rows * sgc0 + h, mask=mask_r, other=0.0)  # [BT]
        strictly_lower = ri[:, None] > ri[None, :]
        decay = tl.exp(tl.where(strictly_lower, gc[:, None] - gc[None, :], float("-inf")))  # [BT, BT], 0 on/above diag
        a = tl.dot(k * beta[:, None], tl.trans(k), input_precision=DOT_PRECISION) * decay  # [BT, BT]
        inv = _unit_lower_inverse(a, ri, BT, SB, INV_PRECISION, BATCHED_DIAG)  # (I + A)^-1 [BT, BT]
        w = tl.dot(inv, k * (beta * tl.exp(gc))[:, None], input_precision=DOT_PRECISION)  # [BT, BK]
        tl.store(w_ptr + rows[:, None] * sw0 + h * DK + kcols[None, :], w, mask=mask_r[:, None] & (kcols[None, :] < DK))
        for v0 in range(0, DV, BV):
            vcols = v0 + tl.arange(0, BV)
            mask_v = mask_r[:, None] & (vcols[None, :] < DV)
            v = tl.load(v_ptr + rows[:, None] * sv0 + h * DV + vcols[None, :], mask=mask_v, other=0.0).to(tl.float32)
            u = tl.dot(inv, v * beta[:, None], input_precision=DOT_PRECISION)  # [BT, BV]
            tl.store(u_ptr + rows[:, None] * su0 + h * DV + vcols[None, :], u, mask=mask_v)

    @triton.jit
    def _chunk_state_kernel(k_ptr, w_ptr, u_ptr, gc_ptr, hs_ptr, state_ptr, index_ptr, start_ptr, len_ptr, off_ptr,
                            sk0, sw0, su0, sgc0, sh0, ss0, ss1, ss2, DK, DV,
                            GROUP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                            L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr):
        # one program: sequence b, value head h, state columns [vb * BV, vb * BV + BV) (columns are
        # independent). Walks the sequence's chunks in order: hs[chunk, h] = the state at the chunk start
        # [dk, dv]; u is overwritten by v_new; the final state goes back to the sequence's slot.
        b = tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)
        vcols = tl.program_id(2).to(tl.int64) * BV + tl.arange(0, BV)
        kcols = tl.arange(0, BK)
        ri = tl.arange(0, BT)
        slot = tl.load(index_ptr + b).to(tl.int64)
        c0 = tl.load(off_ptr + b)
        c1 = tl.load(off_ptr + b + 1)
        mask_s = (kcols[:, None] < DK) & (vcols[None, :] < DV)
        s_ptrs = state_ptr + slot * ss0 + h * ss1 + kcols[:, None] * ss2 + vcols[None, :]
        state = tl.load(s_ptrs, mask=mask_s, other=0.0)  # [BK, BV] float32
        for c in range(c0, c1):
            start = tl.load(start_ptr + c).to(tl.int64)
            n = tl.load(len_ptr + c)
            mask_r = ri < n
            rows = start + ri.to(tl.int64)
            tl.store(hs_ptr + c * sh0 + h * DK * DV + kcols[:, None] * DV + vcols[None, :], state, mask=mask_s)
            w = tl.load(w_ptr + rows[:, None] * sw0 + h * DK + kcols[None, :],
                        mask=mask_r[:, None] & (kcols[None, :] < DK), other=0.0)  # [BT, BK]
            mask_v = mask_r[:, None] & (vcols[None, :] < DV)
            u_ptrs = u_ptr + rows[:, None] * su0 + h * DV + vcols[None, :]
            v_new = tl.load(u_ptrs, mask=mask_v, other=0.0) - tl.dot(w, state, input_precision=DOT_PRECISION)
            tl.store(u_ptrs, v_new, mask=mask_v)  # [BT, BV]
            gc = tl.load(gc_ptr + rows * sgc0 + h, mask=mask_r, other=0.0)  # [BT]
            g_last = tl.load(gc_ptr + (start + n - 1) * sgc0 + h)
            k = _load_keys(k_ptr, rows, mask_r, sk0, h // GROUP, kcols, DK, L2NORM)  # [BT, BK], 0 past n
            k = k * tl.exp(g_last - gc)[:, None]  # decay from each position to the chunk end
            state = state * tl.exp(g_last) + tl.dot(tl.trans(k), v_new, input_precision=DOT_PRECISION)
        tl.store(s_ptrs, state, mask=mask_s)

    @triton.jit
    def _chunk_output_kernel(q_ptr, k_ptr, u_ptr, gc_ptr, hs_ptr, o_ptr, start_ptr, len_ptr,
                             sq0, sk0, su0, sgc0, sh0, so0, so1, scale, DK, DV,
                             GROUP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                             L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr):
        # one program: chunk c, value head h, output columns [vb * BV, vb * BV + BV); u holds v_new
        c = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        vcols = tl.program_id(2).to(tl.int64) * BV + tl.arange(0, BV)
        kcols = tl.arange(0, BK)
        start = tl.load(start_ptr + c).to(tl.int64)
        n = tl.load(len_ptr + c)
        ri = tl.arange(0, BT)
        mask_r = ri < n
        rows = start + ri.to(tl.int64)
        q = _load_keys(q_ptr, rows, mask_r, sq0, h // GROUP, kcols, DK, L2NORM) * scale  # [BT, BK]
        k = _load_keys(k_ptr, rows, mask_r, sk0, h // GROUP, kcols, DK, L2NORM)  # [BT, BK]
        gc = tl.load(gc_ptr + rows * sgc0 + h, mask=mask_r, other=0.0)  # [BT]
        state = tl.load(hs_ptr + c * sh0 + h * DK * DV + kcols[:, None] * DV + vcols[None, :],
                        mask=(kcols[:, None] < DK) & (vcols[None, :] < DV), other=0.0)  # [BK, BV]
        mask_v = mask_r[:, None] & (vcols[None, :] < DV)
        v_new = tl.load(u_ptr + rows[:, None] * su0 + h * DV + vcols[None, :], mask=mask_v, other=0.0)  # [BT, BV]
        lower = ri[:, None] >= ri[None, :]
        decay = tl.exp(tl.where(lower, gc[:, None] - gc[None, :], float("-inf")))  # [BT, BT]
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * decay
        out = tl.dot(q * tl.exp(gc)[:, None], state, input_precision=DOT_PRECISION)
        out += tl.dot(scores, v_new, input_precision=DOT_PRECISION)  # [BT, BV]
        tl.store(o_ptr + rows[:, None] * so0 + h * so1 + vcols[None, :], out.to(o_ptr.dtype.element_ty), mask=mask_v)


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
    "tf32x3"), warps (every kernel), state_warps, block_v (state and output kernels), sub_block (SB),
    batched_diag (the inverse's diagonal blocks as batched dots; needs SB >= 16 on the GPU)."""
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
    BV = knobs.get("block_v", min(max(16, triton.next_power_of_2(dv)), 64))
    precision = "ieee" if v.dtype == torch.float32 else "tf32"
    # bf16/fp16 inputs: the inverse on tensor cores (tf32x3) with 4 warps per program: 6.0 -> 3.5 ms at
    # 4 x 4096 tokens on the H200 (scripts/bench_gdn_vs_fla.py), 1e-4 from the "ieee" output; float32
    # inputs (the CPU reference runs) keep full float32 with 8 warps at dk 128
    low_precision = v.dtype != torch.float32
    inv_precision = knobs.get("inv_precision", "tf32x3" if low_precision else "ieee")
    warps = knobs.get("warps", 4 if low_precision or BK < 128 else 8)
    state_warps = knobs.get("state_warps", warps)
    common = dict(GROUP=Hv // Hk, BT=BT, BK=BK, L2NORM=use_qk_l2norm, DOT_PRECISION=precision)
    gcum = torch.empty((T, Hv), dtype=torch.float32, device=device)
    block_h = min(triton.next_power_of_2(Hv), 64)
    _chunk_cumsum_kernel[(num_chunks, triton.cdiv(Hv, block_h))](g, gcum, starts, lens, g.stride(0), gcum.stride(0),
                                                                  Hv, BT=BT, BH=block_h)
    w = torch.empty((T, Hv, dk), dtype=torch.float32, device=device)
    u = torch.empty((T, Hv, dv), dtype=torch.float32, device=device)  # then v_new, in place
    sub_block = min(knobs.get("sub_block", 16), BT)
    _chunk_wy_kernel[(num_chunks, Hv)](k, v, beta, gcum, w, u, starts, lens, k.stride(0), v.stride(0),
                                       beta.stride(0), gcum.stride(0), w.stride(0), u.stride(0), dk, dv,
                                       BV=BV, SB=sub_block, INV_PRECISION=inv_precision,
                                       BATCHED_DIAG=knobs.get("batched_diag", sub_block >= 16), **common,
                                       num_warps=warps)
    hs = torch.empty((num_chunks, Hv, dk, dv), dtype=torch.float32, device=device)  # state at each chunk start
    _chunk_state_kernel[(B, Hv, triton.cdiv(dv, BV))](
        k, w, u, gcum, hs, ssm_states, state_indices, starts, lens, offsets,
        k.stride(0), w.stride(0), u.stride(0), gcum.stride(0), hs.stride(0),
        ssm_states.stride(0), ssm_states.stride(1), ssm_states.stride(2), dk, dv, BV=BV, **common,
        num_warps=state_warps)
    _chunk_output_kernel[(num_chunks, Hv, triton.cdiv(dv, BV))](
        q, k, u, gcum, hs, out, starts, lens, q.stride(0), k.stride(0), u.stride(0), gcum.stride(0), hs.stride(0),
        out.stride(0), out.stride(1), dk ** -0.5, dk, dv, BV=BV, **common, num_warps=warps)
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
            BATCHED_DIAG=batched_diag, num_warps=4)
    return w, u


def chunk_gated_delta_rule_flops(num_tokens: int, num_v_heads: int, k_dim: int, v_dim: int, chunk_size: int) -> int:
    """Matmul FLOPs of the chunked form (the count FLA-style TFLOP/s figures use; the triangular
    inverse is left out): per token and value head, K K^T, w, Q K^T (C dk each), u and the intra-chunk
    output (C dv each), w S, the state update and Q S (dk dv each), 2 FLOPs per multiply-add."""
    C = chunk_size
    return 2 * num_tokens * num_v_heads * (3 * C * k_dim + 2 * C * v_dim + 3 * k_dim * v_dim)


def benchmark_chunk_gated_delta_rule(num_seqs: int = 4, seq_len: int = 4096, num_k_heads: int = 16,
                                     num_v_heads: int = 32, k_dim: int = 128, v_dim: int = 128,
                                     dtype=torch.bfloat16, chunk_size: int = 64) -> dict:
    """Time one chunk_gated_delta_rule_varlen call on CUDA (triton.testing.do_bench, median): num_seqs
    prompts of seq_len tokens packed in one batch, each from its own state slot (Qwen3-Next's linear
    layer shape by default: 16 key heads, 32 value heads, 128 x 128). TFLOP/s counts
    chunk_gated_delta_rule_flops; the states keep advancing from call to call (the decay keeps them bounded)."""
    assert torch.cuda.is_available(), "benchmark_chunk_gated_delta_rule needs a CUDA device"
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    T = num_seqs * seq_len
    q = torch.randn((T, num_k_heads, k_dim), dtype=dtype, device=device, generator=gen)
    k = torch.randn((T, num_k_heads, k_dim), dtype=dtype, device=device, generator=gen)
    v = torch.randn((T, num_v_heads, v_dim), dtype=dtype, device=device, generator=gen)
    g = -0.1 * torch.rand((T, num_v_heads), device=device, generator=gen)
    beta = torch.rand((T, num_v_heads), dtype=dtype, device=device, generator=gen)
    states = torch.randn((num_seqs + 1, num_v_heads, k_dim, v_dim), device=device, generator=gen) * 0.01
    index = torch.arange(1, num_seqs + 1, device=device)
    cu_seqlens = [i * seq_len for i in range(num_seqs + 1)]

    def step():
        chunk_gated_delta_rule_varlen(q, k, v, g, beta, states, index, cu_seqlens, chunk_size)

    step()
    seconds = triton.testing.do_bench(step, return_mode="median") * 1e-3
    flops = chunk_gated_delta_rule_flops(T, num_v_heads, k_dim, v_dim, chunk_size)
    return {
        "num_seqs": num_seqs, "seq_len": seq_len, "num_k_heads": num_k_heads, "num_v_heads": num_v_heads,
        "k_dim": k_dim, "v_dim": v_dim, "dtype": str(dtype).removeprefix("torch."), "chunk_size": chunk_size,
        "time_us": seconds * 1e6, "flops": flops, "tflop_per_s": flops / seconds / 1e12,
        "tokens_per_s": T / seconds,
    }
