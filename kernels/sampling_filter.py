"""Threshold search of the fused sampler's filtering step (top-k, top-p, min-p without a sort).

The kept set of a filtered row is always {e >= t} for a threshold t over e = exp((l - max l) / T)
(the unnormalised probabilities, max e = 1). `_threshold_search` finds t by a multi-way search over
float32 bit patterns (NT candidate thresholds per step, each step counting and summing e >= each
candidate), first by passes over the row, then, once the bracket holds <= CAP tokens, in registers
on a copy of them. Called by `rollout_kernels.sampling._sampling_kernel`; see that module's
docstring for the whole algorithm.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _narrow(j, span, cnt_j, mass_j, ok, lo, hi, c_hi, m_hi, NT: tl.constexpr):
    """ok[j] = pred(lo + span * j // NT), a prefix of j (counts and masses are non-increasing
    in j: float rounding is monotone). Moves [lo, hi) onto the last true / first false candidate."""
    n_ok = tl.sum(ok.to(tl.int32), axis=0)
    best = tl.maximum(n_ok - 1, 0)
    c_lo = tl.sum(tl.where(j == best, cnt_j, 0), axis=0)
    m_lo = tl.sum(tl.where(j == best, mass_j, 0.0), axis=0)
    has_next = (n_ok > 0) & (best + 1 < NT)  # the first failing candidate is the new upper end
    nxt = j == best + 1
    c_hi = tl.where(has_next, tl.sum(tl.where(nxt, cnt_j, 0), axis=0), c_hi)
    m_hi = tl.where(has_next, tl.sum(tl.where(nxt, mass_j, 0.0), axis=0), m_hi)
    hi = tl.where(has_next, lo + ((span * (best + 1)) // NT).to(tl.int32), hi)
    lo = lo + ((span * best) // NT).to(tl.int32)
    # {e >= lo} is final once pred(lo) fails (n_ok == 0: lo stays), lo and hi are adjacent
    # bit patterns, or [lo, hi) holds a single token
    done = ((n_ok == 0) | (hi - lo <= 1) | (c_lo - c_hi <= 1)).to(tl.int32)
    return lo, hi, c_lo, m_lo, c_hi, m_hi, done


@triton.jit
def _threshold_search(base, V, m, scale, scratch, lo, hi, c_lo, m_lo, c_hi, m_hi, k_target, mass_target,
                      BY_MASS: tl.constexpr, BLOCK_S: tl.constexpr, NT: tl.constexpr, CAP: tl.constexpr):
    """Largest threshold bit pattern t in [lo, hi) with pred(t), where pred(t) is
    count(e >= t) >= k_target (BY_MASS False) or mass(e >= t) >= mass_target (BY_MASS True);
    pred is true at and below the answer, false above (if false at lo, the answer is lo).
    (c_hi, m_hi) = count / mass at hi; (c_lo, m_lo) at lo, c_lo < 0 when not yet known.
    Returns (t, count(e >= t), mass(e >= t)); only the set {e >= t} matters, so the search
    stops once [lo, hi) holds a single token.

    Each step evaluates NT thresholds spread over [lo, hi) in bit-pattern space (log-spaced
    in value) and keeps the sub-bracket where pred flips. Phase 1: while [lo, hi) holds more
    than CAP tokens, a step is a pass over the row. Phase 2: one pass copies the bracket's e
    into this row's scratch (in vocab order: deterministic), the remaining steps run on them
    in registers."""
    j = tl.arange(0, NT)
    cols = tl.arange(0, BLOCK_S)
    done = tl.zeros((), tl.int32)
    while (done == 0) & ((c_lo < 0) | (c_lo - c_hi > CAP)):
        span = (hi - lo).to(tl.int64)
        cand_f = (lo + ((span * j) // NT).to(tl.int32)).to(tl.float32, bitcast=True)  # [NT], cand[0] = lo
        # per-lane accumulators [BLOCK_S, NT], reduced once after the row
        cnt = tl.zeros((BLOCK_S, NT), tl.int32)
        mass = tl.zeros((BLOCK_S, NT), tl.float32)
        for start in range(0, V, BLOCK_S):
            idx = start + cols
            mask = idx < V
            # e = exp((l - max) / T) as exp2((l - m) * log2(e) / T), clamped to <= 1, 0 where
            # masked; written out identically in every pass so that all passes agree bit for bit
            lg = tl.load(base + idx, mask=mask, other=float("-inf")).to(tl.float32)
            e = tl.minimum(tl.math.exp2((lg - m) * scale), 1.0)
            ge = (e[:, None] >= cand_f[None, :]) & mask[:, None]
            cnt += ge.to(tl.int32)
            mass += tl.where(ge, e[:, None], 0.0)
        cnt_j = tl.sum(cnt, axis=0)
        mass_j = tl.sum(mass, axis=0)
        if BY_MASS:
            ok = mass_j >= mass_target
        else:
            ok = cnt_j >= k_target
        lo, hi, c_lo, m_lo, c_hi, m_hi, done = _narrow(j, span, cnt_j, mass_j, ok, lo, hi, c_hi, m_hi, NT)
    if done == 0:
        lo_f = lo.to(tl.float32, bitcast=True)
        hi_f = hi.to(tl.float32, bitcast=True)
        n = tl.zeros((), tl.int32)
        for start in range(0, V, BLOCK_S):
            idx = start + cols
            mask = idx < V
            lg = tl.load(base + idx, mask=mask, other=float("-inf")).to(tl.float32)
            e = tl.minimum(tl.math.exp2((lg - m) * scale), 1.0)
            take = mask & (e >= lo_f) & (e < hi_f)
            pos = n + tl.cumsum(take.to(tl.int32), axis=0) - 1
            tl.store(scratch + pos, e, mask=take)
            n += tl.sum(take.to(tl.int32), axis=0)
        tl.debug_barrier()  # the whole program reads back what its threads wrote
        slots = tl.arange(0, CAP)
        vals = tl.load(scratch + slots, mask=slots < n, other=-1.0)  # [CAP]; -1 is below every threshold
        c_base = c_hi
        m_base = m_hi
        while done == 0:
            span = (hi - lo).to(tl.int64)
            cand_f = (lo + ((span * j) // NT).to(tl.int32)).to(tl.float32, bitcast=True)
            ge = vals[:, None] >= cand_f[None, :]  # [CAP, NT]
            cnt_j = c_base + tl.sum(ge.to(tl.int32), axis=0)
            mass_j = m_base + tl.sum(tl.where(ge, vals[:, None], 0.0), axis=0)
            if BY_MASS:
                ok = mass_j >= mass_target
            else:
                ok = cnt_j >= k_target
            lo, hi, c_lo, m_lo, c_hi, m_hi, done = _narrow(j, span, cnt_j, mass_j, ok, lo, hi, c_hi, m_hi, NT)
    return lo, c_lo, m_lo
