"""The Triton kernels of the chunked gated delta rule prefill (`chunk_gated_delta_rule.py` launches them).

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

LOWP (the launcher's `lowp_intermediates`): w, u / v_new and the chunk-start states h are stored
in the inputs' dtype (bf16) and every dot but the inverse's takes operands in that dtype with float32
accumulation (flash-linear-attention's precision policy; docs/gdn_bf16_intermediates.md measured its
cost). The running state stays float32 in registers and the final state is float32. The roundings are
those of `chunk_gated_delta_rule_lowp_ref.py`, the torch reference. Without LOWP every intermediate is
float32 and the dots take DOT_PRECISION.

Separate from the launcher: this module needs triton, which torch-only installs lack; the
launcher's module (with the references) imports it only when triton is there.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
                     INV_PRECISION: tl.constexpr, BATCHED_DIAG: tl.constexpr, LOWP: tl.constexpr):
    # one program: chunk c, value head h. k [T, Hk, dk] (row stride sk0), v [T, Hv, dv], beta/gc [T, Hv]
    # -> w [T, Hv, dk], u [T, Hv, dv] in w's dtype (head stride = head dim: contiguous per row)
    lowp = w_ptr.dtype.element_ty  # float32 unless LOWP
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
    # rows past the chunk's end (gc loaded as 0) get no decay either: their gc_i - gc_j is -gc_j, which
    # overflows exp once the chunk's gates sum below -88 (a trained model's strong decay), and inf times
    # their zero keys is NaN, which the inverse's dots would carry into every row of the chunk
    strictly_lower = (ri[:, None] > ri[None, :]) & mask_r[:, None]
    decay = tl.exp(tl.where(strictly_lower, gc[:, None] - gc[None, :], float("-inf")))  # [BT, BT], 0 on/above diag
    if LOWP:
        k_low = k.to(lowp)
        a = tl.dot(k_low, tl.trans(k_low)) * beta[:, None] * decay  # [BT, BT]
    else:
        a = tl.dot(k * beta[:, None], tl.trans(k), input_precision=DOT_PRECISION) * decay
    inv = _unit_lower_inverse(a, ri, BT, SB, INV_PRECISION, BATCHED_DIAG)  # (I + A)^-1 [BT, BT] float32
    if LOWP:
        inv = inv.to(lowp)
        w = tl.dot(inv, (k * (beta * tl.exp(gc))[:, None]).to(lowp))  # [BT, BK]
    else:
        w = tl.dot(inv, k * (beta * tl.exp(gc))[:, None], input_precision=DOT_PRECISION)
    tl.store(w_ptr + rows[:, None] * sw0 + h * DK + kcols[None, :], w.to(lowp),
             mask=mask_r[:, None] & (kcols[None, :] < DK))
    for v0 in range(0, DV, BV):
        vcols = v0 + tl.arange(0, BV)
        mask_v = mask_r[:, None] & (vcols[None, :] < DV)
        v = tl.load(v_ptr + rows[:, None] * sv0 + h * DV + vcols[None, :], mask=mask_v, other=0.0).to(tl.float32)
        if LOWP:
            u = tl.dot(inv, (v * beta[:, None]).to(lowp))  # [BT, BV]
        else:
            u = tl.dot(inv, v * beta[:, None], input_precision=DOT_PRECISION)
        tl.store(u_ptr + rows[:, None] * su0 + h * DV + vcols[None, :], u.to(lowp), mask=mask_v)


@triton.jit
def _chunk_state_kernel(k_ptr, w_ptr, u_ptr, gc_ptr, hs_ptr, state_ptr, index_ptr, start_ptr, len_ptr, off_ptr,
                        sk0, sw0, su0, sgc0, sh0, ss0, ss1, ss2, DK, DV,
                        GROUP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr, LOWP: tl.constexpr):
    # one program: sequence b, value head h, state columns [vb * BV, vb * BV + BV) (columns are
    # independent). Walks the sequence's chunks in order: hs[chunk, h] = the state at the chunk start
    # [dk, dv] (in hs's dtype); u is overwritten by v_new; the final float32 state goes back to the slot.
    lowp = u_ptr.dtype.element_ty  # float32 unless LOWP
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
        tl.store(hs_ptr + c * sh0 + h * DK * DV + kcols[:, None] * DV + vcols[None, :], state.to(lowp), mask=mask_s)
        w = tl.load(w_ptr + rows[:, None] * sw0 + h * DK + kcols[None, :],
                    mask=mask_r[:, None] & (kcols[None, :] < DK), other=0.0)  # [BT, BK]
        mask_v = mask_r[:, None] & (vcols[None, :] < DV)
        u_ptrs = u_ptr + rows[:, None] * su0 + h * DV + vcols[None, :]
        if LOWP:  # w h with h as stored (the output kernel reads the same rounded h)
            predicted = tl.dot(w, state.to(lowp))
        else:
            predicted = tl.dot(w, state, input_precision=DOT_PRECISION)
        v_new = tl.load(u_ptrs, mask=mask_v, other=0.0).to(tl.float32) - predicted  # [BT, BV]
        tl.store(u_ptrs, v_new.to(lowp), mask=mask_v)
        gc = tl.load(gc_ptr + rows * sgc0 + h, mask=mask_r, other=0.0)  # [BT]
        g_last = tl.load(gc_ptr + (start + n - 1) * sgc0 + h)
        k = _load_keys(k_ptr, rows, mask_r, sk0, h // GROUP, kcols, DK, L2NORM)  # [BT, BK], 0 past n
        k = k * tl.exp(g_last - gc)[:, None]  # decay from each position to the chunk end
        if LOWP:
            state = state * tl.exp(g_last) + tl.dot(tl.trans(k.to(lowp)), v_new.to(lowp))
        else:
            state = state * tl.exp(g_last) + tl.dot(tl.trans(k), v_new, input_precision=DOT_PRECISION)
    tl.store(s_ptrs, state, mask=mask_s)


@triton.jit
def _chunk_output_kernel(q_ptr, k_ptr, u_ptr, gc_ptr, hs_ptr, o_ptr, start_ptr, len_ptr,
                         sq0, sk0, su0, sgc0, sh0, so0, so1, scale, DK, DV,
                         GROUP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                         L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr, LOWP: tl.constexpr):
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
    lower = (ri[:, None] >= ri[None, :]) & mask_r[:, None]  # no inf in rows past the end (as in the wy kernel)
    decay = tl.exp(tl.where(lower, gc[:, None] - gc[None, :], float("-inf")))  # [BT, BT]
    if LOWP:  # state and v_new arrive in the inputs' dtype (o's)
        lowp = o_ptr.dtype.element_ty
        scores = tl.dot(q.to(lowp), tl.trans(k.to(lowp))) * decay
        out = tl.dot((q * tl.exp(gc)[:, None]).to(lowp), state)
        out += tl.dot(scores.to(lowp), v_new)  # [BT, BV]
    else:
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * decay
        out = tl.dot(q * tl.exp(gc)[:, None], state, input_precision=DOT_PRECISION)
        out += tl.dot(scores, v_new, input_precision=DOT_PRECISION)
    tl.store(o_ptr + rows[:, None] * so0 + h * so1 + vcols[None, :], out.to(o_ptr.dtype.element_ty), mask=mask_v)
