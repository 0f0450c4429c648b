"""Fused sampler: temperature / top-k / top-p / min-p, inverse-CDF draw and the chosen logprob.

Same semantics as `rollout_cli.engine.sampler.sample`; no host syncs and no value-dependent
allocation (CUDA-graph capturable).

Why two launches: one program per row streams the row serially (V 151936 bf16 = 300 KB), so at
B = 256 the GPU runs 256 programs at ~5x the bandwidth floor. Each row is therefore split into S
contiguous chunks, S = num_chunks from `chunk_layout`, which depends on V and fixed knobs only
(never on B: a row's bits do not depend on its batch), e.g. V 151936 -> 19 chunks of 8192:
  launch 1, grid (B, S): program (row, c) reads its chunk once and writes to the workspace
     [B, 4 S + cap] float32 the chunk's max of the raw logits, its first argmax (int32 bits),
     sum exp(l - chunk max) and sum exp((l - chunk max) / T) (pass 1's online scheme);
  launch 2, grid (B,): merges the S partials into the row's max m, first argmax (lowest index
     on ties), z1 = sum exp(l - m) and zt = sum exp(x - max x); greedy rows are then done.
     Unfiltered rows (the common RL case) walk the chunk masses (zt's terms) to the chunk where
     the running mass first exceeds u * zt and scan only that chunk, from the running mass
     before it (a rounding miss runs on into the next chunks). Filtered rows run the threshold
     search below and the draw over the whole row.

Per row, with x = logits / T (T = 1 for greedy rows) and e_i = exp(x_i - max x)
(the unnormalised probabilities, max e = 1):
  1. max, first argmax, sum exp(l - max l), sum exp(x - max x) (launch 1 per chunk, merged in launch 2);
  2. filtering without a sort (rows that filter): the kept set is always {e >= t} for a
     threshold t, found by a multi-way search over float32 bit patterns of t (NT thresholds
     per step, each step counting and summing e >= each threshold):
       - min-p keeps e >= min_p; top-k: the largest t >= min_p with count(e >= t) >= k;
       - top-p on what is left (mass S): the largest t with mass(e >= t) >= top_p * S,
         i.e. the smallest prefix of the sorted kept tokens whose mass reaches top_p * S;
     steps are passes over the row until the bracket holds <= CAP tokens, which one more
     pass copies to a per-row workspace; the search ends in registers once the bracket
     holds one token;
  3. a pass in vocab order (unfiltered rows: from the chunk found above), stopping at the first
     token whose running kept mass exceeds u * total (the last kept token, the last index with
     probability > 0, if rounding runs past the end, as the reference does).
Ties at the top-k boundary keep every tied token (the reference keeps exactly k, in
unspecified order). logprob = log_softmax(x)[token] ("processed") or
log_softmax(logits)[token] when raw_logprobs.

The uniform u is either given ([B] float32) or computed in the kernel from int64
keys (seed, prompt_index, sample_index, position) with the same splitmix64 hash as
`rollout_cli.engine.sampler.sample_uniform`, bit for bit. Keys are the Python ints
reduced mod 2^64 and reinterpreted as int64 (`as_int64_key`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MASK64 = (1 << 64) - 1
# Defaults from scripts/bench_decode_kernels.py on an H200 (B 256, V 151936, bf16): 8192-logit chunks
# stepped in blocks of 2048 with 4 warps in launch 1 gave temperature-only 79 us, greedy 71 us
# (4096 / 8 warps: 96 / 90 us; the one-program-per-row kernel before: ~250 us).
BLOCK_V = 2048
CHUNK = 8192


def as_int64_key(value: int) -> int:
    """A Python int (any sign or size) as the int64 whose bits are value mod 2^64."""
    value &= _MASK64
    return value - (1 << 64) if value >= (1 << 63) else value


@triton.jit
def _mix64(x):
    # splitmix64 finaliser on uint64 (wrapping arithmetic, logical shifts)
    x = x + 0x9E3779B97F4A7C15
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def _uniform_from_keys(seed, prompt_index, sample_index, position):
    """int64 keys (tensors of one shape) -> float32 uniforms in [0, 1), 24 bits."""
    h = _mix64(seed.to(tl.uint64, bitcast=True))
    h = _mix64(h ^ prompt_index.to(tl.uint64, bitcast=True))
    h = _mix64(h ^ sample_index.to(tl.uint64, bitcast=True))
    h = _mix64(h ^ position.to(tl.uint64, bitcast=True))
    return (h >> 40).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _sample_uniform_kernel(seed_ptr, pidx_ptr, sidx_ptr, pos_ptr, out_ptr, B, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < B
    u = _uniform_from_keys(tl.load(seed_ptr + i, mask=m, other=0), tl.load(pidx_ptr + i, mask=m, other=0),
                           tl.load(sidx_ptr + i, mask=m, other=0), tl.load(pos_ptr + i, mask=m, other=0))
    tl.store(out_ptr + i, u, mask=m)


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


@triton.jit
def _chunk_partials_kernel(
    logits_ptr, stride_row, V, temp_ptr, ws_ptr, ws_int_ptr, ws_stride, CHUNK, S,
    BLOCK_V: tl.constexpr,
):
    """Launch 1, grid (B, S): program (row, c) streams vocab [c * CHUNK, min((c + 1) * CHUNK, V))
    once with pass 1's per-lane online scheme and writes the chunk's max of the raw logits,
    its first argmax, sum exp(l - chunk max) and sum exp((l - chunk max) / T) to the row's
    workspace (columns [0, S), [S, 2S) as int32, [2S, 3S), [3S, 4S))."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    base = logits_ptr + row * stride_row
    temperature = tl.load(temp_ptr + row)
    T = tl.where(temperature == 0.0, 1.0, temperature)
    scale = tl.math.div_rn(1.4426950408889634, T)  # log2(e) / T
    cols = tl.arange(0, BLOCK_V)
    NEG_INF: tl.constexpr = float("-inf")
    lo = c * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    m_acc = tl.full((BLOCK_V,), NEG_INF, tl.float32)
    i_acc = tl.zeros((BLOCK_V,), tl.int32)
    z1_acc = tl.zeros((BLOCK_V,), tl.float32)  # sum exp(l - m_acc)
    zt_acc = tl.zeros((BLOCK_V,), tl.float32)  # sum exp((l - m_acc) / T)
    for start in range(lo, hi, BLOCK_V):
        idx = start + cols
        lg = tl.load(base + idx, mask=idx < hi, other=NEG_INF).to(tl.float32)
        i_acc = tl.where(lg > m_acc, idx, i_acc)  # strict: each lane keeps its first max
        new_m = tl.maximum(m_acc, lg)
        live = new_m > NEG_INF
        new_m = tl.where(live, new_m, 0.0)  # lanes that saw only -inf: keep -inf - (-inf) out
        z1_acc = tl.where(live, z1_acc * tl.math.exp2((m_acc - new_m) * 1.4426950408889634)
                          + tl.math.exp2((lg - new_m) * 1.4426950408889634), 0.0)
        zt_acc = tl.where(live, zt_acc * tl.math.exp2((m_acc - new_m) * scale)
                          + tl.math.exp2((lg - new_m) * scale), 0.0)
        m_acc = tl.where(live, new_m, NEG_INF)
    m_c = tl.max(m_acc, axis=0)
    # an all -inf chunk: every lane ties at -inf with index 0, so an all -inf row's argmax is 0 as before
    i_c = tl.min(tl.where(m_acc == m_c, i_acc, V), axis=0)
    z1_c = tl.sum(tl.where(m_acc > NEG_INF, z1_acc * tl.math.exp2((m_acc - m_c) * 1.4426950408889634), 0.0),
                  axis=0)
    zt_c = tl.sum(tl.where(m_acc > NEG_INF, zt_acc * tl.math.exp2((m_acc - m_c) * scale), 0.0), axis=0)
    out = ws_ptr + row * ws_stride
    tl.store(out + c, m_c)
    tl.store(ws_int_ptr + row * ws_stride + S + c, i_c)
    tl.store(out + 2 * S + c, z1_c)
    tl.store(out + 3 * S + c, zt_c)


@triton.jit
def _sampling_kernel(
    logits_ptr, stride_row, V,
    temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, raw_ptr,
    u_ptr, seed_ptr, pidx_ptr, sidx_ptr, pos_ptr,
    tok_ptr, logprob_ptr, ws_ptr, ws_int_ptr, ws_stride, CHUNK, S,
    KEYED: tl.constexpr, S_BLOCK: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr,
    NT: tl.constexpr, CAP: tl.constexpr,
):
    """Launch 2, grid (B,): merge the row's S chunk partials, filter, draw, logprob."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    temperature = tl.load(temp_ptr + row)
    T = tl.where(temperature == 0.0, 1.0, temperature)
    scale = tl.math.div_rn(1.4426950408889634, T)  # log2(e) / T
    cols = tl.arange(0, BLOCK_V)
    NEG_INF: tl.constexpr = float("-inf")

    # ---- merge the chunk partials: max, first argmax (lowest index on ties), rescaled sums ----
    ws = ws_ptr + row * ws_stride
    s_idx = tl.arange(0, S_BLOCK)
    s_mask = s_idx < S
    m_c = tl.load(ws + s_idx, mask=s_mask, other=NEG_INF)  # [S_BLOCK]
    i_c = tl.load(ws_int_ptr + row * ws_stride + S + s_idx, mask=s_mask, other=V)
    z1_c = tl.load(ws + 2 * S + s_idx, mask=s_mask, other=0.0)
    zt_c = tl.load(ws + 3 * S + s_idx, mask=s_mask, other=0.0)
    m = tl.max(m_c, axis=0)
    argmax = tl.min(tl.where(m_c == m, i_c, V), axis=0)
    live_c = m_c > NEG_INF
    z1 = tl.sum(tl.where(live_c, z1_c * tl.math.exp2((m_c - m) * 1.4426950408889634), 0.0), axis=0)
    mass_c = tl.where(live_c, zt_c * tl.math.exp2((m_c - m) * scale), 0.0)  # [S_BLOCK] chunk masses of e
    zt = tl.sum(mass_c, axis=0)

    token = argmax
    if temperature != 0.0:
        top_k = tl.load(top_k_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        min_p = tl.load(min_p_ptr + row)
        use_k = (top_k > 0) & (top_k < V)
        HI: tl.constexpr = 0x3F800001  # just above 1.0 = max e
        thresh = tl.zeros((), tl.int32)  # bit pattern of the threshold; 0 keeps every token
        count = tl.zeros((), tl.int32) + V
        total = zt
        scratch = ws + 4 * S
        if use_k | (min_p > 0.0):
            # min-p, then top-k: the largest t >= min_p with count(e >= t) >= k
            lo = tl.where(min_p > 0.0, min_p, 0.0).to(tl.int32, bitcast=True)
            k_target = tl.where(use_k, top_k, V + 1).to(tl.int32)
            thresh, count, total = _threshold_search(
                base, V, m, scale, scratch, lo, tl.full((), HI, tl.int32), tl.full((), -1, tl.int32),
                tl.zeros((), tl.float32), tl.zeros((), tl.int32), tl.zeros((), tl.float32), k_target, 0.0,
                False, BLOCK_S, NT, CAP)
        if top_p < 1.0:
            # top-p on what is left (mass S): the largest t with mass(e >= t) >= top_p * S
            thresh, count, total = _threshold_search(
                base, V, m, scale, scratch, thresh, tl.full((), HI, tl.int32), count, total,
                tl.zeros((), tl.int32), tl.zeros((), tl.float32), 0, top_p * total, True, BLOCK_S, NT, CAP)
        thresh_f = thresh.to(tl.float32, bitcast=True)
        if KEYED:
            u = _uniform_from_keys(tl.load(seed_ptr + row), tl.load(pidx_ptr + row),
                                   tl.load(sidx_ptr + row), tl.load(pos_ptr + row))
        else:
            u = tl.load(u_ptr + row)
        target = u * total
        # ---- where the inverse-CDF scan starts: unfiltered rows (the kept mass of a chunk is its
        # partial) skip to the first chunk whose running mass exceeds u * total, or, if rounding
        # leaves u * total past the end, the last chunk with mass; filtered rows scan from 0 ----
        filtered = use_k | (min_p > 0.0) | (top_p < 1.0)
        cum = tl.cumsum(mass_c, axis=0)
        c_hit = tl.min(tl.where(s_mask & (cum > target), s_idx, S), axis=0)
        c_last = tl.max(tl.where(mass_c > 0.0, s_idx, 0), axis=0)
        c_first = tl.where(filtered, 0, tl.where(c_hit < S, c_hit, c_last))
        running = tl.sum(tl.where(s_idx < c_first, mass_c, 0.0), axis=0)  # mass before chunk c_first
        first = c_first * CHUNK
        # ---- inverse CDF in vocab order over the kept (unnormalised) probabilities ----
        # (from chunk c_first on; a rounding miss in that chunk runs on into the next ones)
        found = tl.zeros((), tl.int32) + V
        last = tl.zeros((), tl.int32) - 1
        start = first
        while (start < V) & (found == V):
            idx = start + cols
            mask = idx < V
            lg = tl.load(base + idx, mask=mask, other=float("-inf")).to(tl.float32)
            e = tl.minimum(tl.math.exp2((lg - m) * scale), 1.0)
            w = tl.where(mask & (e >= thresh_f), e, 0.0)
            cdf = running + tl.cumsum(w, axis=0)
            found = tl.min(tl.where(cdf > target, idx, V), axis=0)
            last = tl.maximum(last, tl.max(tl.where(w > 0.0, idx, -1), axis=0))
            running += tl.sum(w, axis=0)
            start += BLOCK_V
        if (found == V) & (last < 0) & (first > 0):
            # past the end with no kept token at or after chunk c_first: the last kept token before it
            for start2 in range(0, first, BLOCK_V):
                idx = start2 + cols
                lg = tl.load(base + idx, mask=idx < first, other=float("-inf")).to(tl.float32)
                e = tl.minimum(tl.math.exp2((lg - m) * scale), 1.0)
                last = tl.maximum(last, tl.max(tl.where((idx < first) & (e >= thresh_f) & (e > 0.0), idx, -1),
                                               axis=0))
        # rounding can leave u * total past the end: the last kept token, as the reference does
        token = tl.where(found < V, found, tl.maximum(last, 0))

    # ---- logprob of the chosen token, computed as torch's log_softmax does ----------------
    l_tok = tl.load(base + token).to(tl.float32)
    raw = tl.load(raw_ptr + row) != 0
    raw_lp = (l_tok - m) - tl.log(z1)
    processed_lp = (tl.math.div_rn(l_tok, T) - tl.math.div_rn(m, T)) - tl.log(zt)
    tl.store(tok_ptr + row, token.to(tl.int64))
    tl.store(logprob_ptr + row, tl.where(raw, raw_lp, processed_lp))


def _check_row_param(name, x, batch, dtype, device):
    assert x.shape == (batch,), f"{name} must be [{batch}], got {tuple(x.shape)}"
    assert x.dtype == dtype, f"{name} must be {dtype}, got {x.dtype}"
    assert x.device == device, f"{name} is on {x.device}, logits on {device}"
    assert x.stride(0) == 1 or batch <= 1, f"{name} must be contiguous"


# Launch 1 splits each row into at most this many chunks (more would make launch 2's merge wide
# and its workspace large for little gain; a huge vocab gets longer chunks instead)
MAX_CHUNKS = 64


def chunk_layout(vocab: int, block_v: int = BLOCK_V, chunk: int = CHUNK) -> tuple[int, int, int]:
    """(block, chunk_len, num_chunks) of a row of `vocab` logits: the block both launches step by,
    the chunk length (cdiv(V, S) rounded up to a multiple of the block, S = min(cdiv(V, chunk),
    MAX_CHUNKS)) and the number of chunks, cdiv(V, chunk_len). Depends on V and the knobs only,
    never on the batch, so a row's result does not depend on the batch it is sampled in."""
    assert vocab >= 1 and chunk >= 1
    block = min(block_v, triton.next_power_of_2(vocab))
    n = min(triton.cdiv(vocab, chunk), MAX_CHUNKS)
    chunk_len = triton.cdiv(triton.cdiv(vocab, n), block) * block
    return block, chunk_len, triton.cdiv(vocab, chunk_len)


def workspace_columns(vocab: int, block_v: int = BLOCK_V, chunk: int = CHUNK, cap: int = 512) -> int:
    """Columns of `sample`'s float32 workspace per row: 4 per chunk (max, argmax as int32 bits,
    the two exp sums), then `cap` for the filtered rows' threshold search."""
    return 4 * chunk_layout(vocab, block_v, chunk)[2] + cap


def sample_workspace(batch: int, vocab: int, device, block_v: int = BLOCK_V, chunk: int = CHUNK,
                     cap: int = 512) -> torch.Tensor:
    """A preallocated workspace for `sample` on [batch, vocab] logits with the same knobs."""
    return torch.empty((batch, workspace_columns(vocab, block_v, chunk, cap)), dtype=torch.float32, device=device)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    raw_logprobs: torch.Tensor,
    uniform: torch.Tensor | None = None,
    keys: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    workspace: torch.Tensor | None = None,
    block_v: int = BLOCK_V,
    block_s: int = 1024,
    num_thresholds: int = 8,
    cap: int = 512,
    num_warps: int = 8,
    chunk: int = CHUNK,
    num_warps_partials: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] float32 / bfloat16 / float16 (row stride free) -> (tokens [B] int64, logprobs [B] float32).

    Per row: temperature [B] float32 (0 = greedy), top_k [B] int64 (0 = off),
    top_p [B] float32 (1 = off), min_p [B] float32 (0 = off), raw_logprobs [B] bool.
    Randomness: exactly one of `uniform` [B] float32 in [0, 1), or
    `keys` = (seed, prompt_index, sample_index, position), each [B] int64.
    `out` = (tokens, logprobs) and `workspace` [>= B, workspace_columns(V, block_v, chunk, cap)]
    float32 (`sample_workspace`) may be preallocated (otherwise allocated here; sizes depend on
    shapes only, so CUDA-graph capture works either way).
    The tuning knobs (block_v, block_s, num_thresholds, cap, num_warps, chunk, num_warps_partials)
    change speed, not results beyond float rounding; `chunk` is the target chunk length of launch 1
    (see `chunk_layout`), num_warps_partials its warps, num_warps launch 2's.
    """
    # bf16/fp16 logits are read and upcast in the kernel: the same numbers as a float32 copy, without
    # a cast kernel writing [B, V] float32 first (at B 256 x V 151936: 112 us of a 7.3 ms step)
    assert logits.dim() == 2 and logits.dtype in (torch.float32, torch.bfloat16, torch.float16), \
        "logits must be [B, V] float32, bfloat16 or float16"
    assert logits.stride(1) == 1 or logits.shape[1] == 1, "logits must be contiguous in V"
    batch, vocab = logits.shape
    assert 1 <= vocab < 2**31 - 2**16
    dev = logits.device
    _check_row_param("temperature", temperature, batch, torch.float32, dev)
    _check_row_param("top_k", top_k, batch, torch.int64, dev)
    _check_row_param("top_p", top_p, batch, torch.float32, dev)
    _check_row_param("min_p", min_p, batch, torch.float32, dev)
    _check_row_param("raw_logprobs", raw_logprobs, batch, torch.bool, dev)
    assert (uniform is None) != (keys is None), "pass exactly one of uniform= or keys="
    if keys is not None:
        assert len(keys) == 4
        for name, key in zip(("seed", "prompt_index", "sample_index", "position"), keys):
            _check_row_param(name, key, batch, torch.int64, dev)
        u_arg, key_args = temperature, tuple(keys)  # u_arg is unused when keyed
    else:
        _check_row_param("uniform", uniform, batch, torch.float32, dev)
        u_arg, key_args = uniform, (top_k,) * 4  # key args unused
    if out is None:
        tokens = torch.empty(batch, dtype=torch.int64, device=dev)
        logprobs = torch.empty(batch, dtype=torch.float32, device=dev)
    else:
        tokens, logprobs = out
        _check_row_param("out tokens", tokens, batch, torch.int64, dev)
        _check_row_param("out logprobs", logprobs, batch, torch.float32, dev)
    for name, n in (("block_v", block_v), ("block_s", block_s), ("num_thresholds", num_thresholds), ("cap", cap)):
        assert n >= 2 and n & (n - 1) == 0, f"{name} must be a power of two >= 2"
    assert chunk >= 1, "chunk must be positive"
    block, chunk_len, num_chunks = chunk_layout(vocab, block_v, chunk)
    cols = 4 * num_chunks + cap
    if workspace is None:
        workspace = torch.empty((batch, cols), dtype=torch.float32, device=dev)
    assert workspace.dtype == torch.float32 and workspace.is_contiguous() and workspace.device == dev
    assert workspace.dim() == 2 and workspace.shape[0] >= batch and workspace.shape[1] == cols, \
        f"workspace must be [>= {batch}, {cols}] (workspace_columns(V, block_v, chunk, cap))"
    if batch == 0:
        return tokens, logprobs
    ws_int = workspace.view(torch.int32)  # the same memory: the argmax columns are stored as int32
    _chunk_partials_kernel[(batch, num_chunks)](
        logits, logits.stride(0), vocab, temperature, workspace, ws_int, cols, chunk_len, num_chunks,
        BLOCK_V=block, num_warps=num_warps_partials,
    )
    _sampling_kernel[(batch,)](
        logits, logits.stride(0), vocab,
        temperature, top_k, top_p, min_p, raw_logprobs,
        u_arg, *key_args,
        tokens, logprobs, workspace, ws_int, cols, chunk_len, num_chunks,
        KEYED=keys is not None, S_BLOCK=max(2, triton.next_power_of_2(num_chunks)), BLOCK_V=block,
        BLOCK_S=min(block_s, triton.next_power_of_2(vocab)), NT=num_thresholds, CAP=cap,
        num_warps=num_warps,
    )
    return tokens, logprobs


def sample_batch(logits: torch.Tensor, batch, keys=None, out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` with the settings of a `rollout_cli.engine.sampler.SamplingBatch` (its `uniform`
    unless `keys` are given)."""
    return sample(logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.raw_logprobs,
                  uniform=None if keys is not None else batch.uniform, keys=keys, out=out)


def sample_uniform(seed: torch.Tensor, prompt_index: torch.Tensor, sample_index: torch.Tensor,
                   position: torch.Tensor) -> torch.Tensor:
    """Device version of `rollout_cli.engine.sampler.sample_uniform`: int64 [B] keys -> [B] float32."""
    n = seed.shape[0]
    for name, key in (("seed", seed), ("prompt_index", prompt_index), ("sample_index", sample_index),
                      ("position", position)):
        _check_row_param(name, key, n, torch.int64, seed.device)
    out = torch.empty(n, dtype=torch.float32, device=seed.device)
    if n:
        block = min(1024, triton.next_power_of_2(n))
        _sample_uniform_kernel[(triton.cdiv(n, block),)](seed, prompt_index, sample_index, position, out, n,
                                                         BLOCK=block)
    return out


def sample_ref(logits, temperature, top_k, top_p, min_p, raw_logprobs, uniform):
    """`rollout_cli.engine.sampler.sample` on the same per-row settings (plain torch)."""
    from rollout_cli.engine.sampler import SamplingBatch
    from rollout_cli.engine.sampler import sample as torch_sample

    batch = SamplingBatch(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, uniform=uniform,
        raw_logprobs=raw_logprobs,
        needs_filter=bool(((top_p < 1.0) | (top_k > 0) | (min_p > 0.0)).any()),
        all_greedy=bool((temperature == 0.0).all()),
    )
    return torch_sample(logits, batch)


def sample_uniform_ref(seed, prompt_index, sample_index, position) -> torch.Tensor:
    """The Python hash over int64 key tensors."""
    from rollout_cli.engine.sampler import sample_uniform as py_uniform

    values = [py_uniform(*k) for k in zip(seed.tolist(), prompt_index.tolist(), sample_index.tolist(),
                                          position.tolist())]
    return torch.tensor(values, dtype=torch.float32)



def benchmark_sample(batch: int = 256, vocab: int = 151936, dtype=torch.bfloat16, setting: str = "plain",
                     hbm_bytes_per_s: float | None = None, **knobs) -> dict:
    """Time `sample` on CUDA (triton.testing.do_bench, median) for one step of keyed draws.

    setting: "plain" (temperature 1, no filtering), "filtered" (top_k 20, top_p 0.95, min_p 0.01)
    or "greedy" (temperature 0). Logits are standard normal times 4. GB/s counts the logits
    read once (the floor: the filtered path reads them several times); `hbm_fraction` divides
    by `hbm_bytes_per_s` when given. `knobs` go to `sample`.
    """
    assert torch.cuda.is_available(), "benchmark_sample needs a CUDA device"
    import triton.testing
    settings = {"plain": (1.0, 0, 1.0, 0.0), "filtered": (1.0, 20, 0.95, 0.01), "greedy": (0.0, 0, 1.0, 0.0)}
    assert setting in settings, f"setting must be one of {sorted(settings)}"
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn((batch, vocab), device=device, generator=gen) * 4.0).to(dtype)
    t, k, p, mp = settings[setting]
    temperature = torch.full((batch,), t, dtype=torch.float32, device=device)
    top_k = torch.full((batch,), k, dtype=torch.int64, device=device)
    top_p = torch.full((batch,), p, dtype=torch.float32, device=device)
    min_p = torch.full((batch,), mp, dtype=torch.float32, device=device)
    raw = torch.zeros(batch, dtype=torch.bool, device=device)
    keys = tuple(torch.randint(0, 2**62, (batch,), device=device, generator=gen) for _ in range(4))
    out = (torch.empty(batch, dtype=torch.int64, device=device), torch.empty(batch, device=device))
    ws = sample_workspace(batch, vocab, device, knobs.get("block_v", BLOCK_V), knobs.get("chunk", CHUNK),
                          knobs.get("cap", 512))

    def step():
        sample(logits, temperature, top_k, top_p, min_p, raw, keys=keys, out=out, workspace=ws, **knobs)

    step()
    seconds = triton.testing.do_bench(step, return_mode="median") * 1e-3
    total = logits.numel() * logits.element_size()
    block, chunk_len, num_chunks = chunk_layout(vocab, knobs.get("block_v", BLOCK_V), knobs.get("chunk", CHUNK))
    result = {
        "batch": batch, "vocab": vocab, "dtype": str(dtype).removeprefix("torch."), "setting": setting,
        "num_chunks": num_chunks, "chunk_len": chunk_len, "time_us": seconds * 1e6, "bytes": total,
        "gb_per_s": total / seconds / 1e9,
    }
    if hbm_bytes_per_s is not None:
        result["hbm_fraction"] = total / seconds / hbm_bytes_per_s
    return result
