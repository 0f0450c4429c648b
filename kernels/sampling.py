"""Fused sampler: temperature / top-k / top-p / min-p, inverse-CDF draw and the chosen logprob.

Same semantics as `sampling_ref.sample_ref` (plain torch, the reference); no host syncs and no
value-dependent allocation (CUDA-graph capturable). The random numbers: `sampling_rng.py`; the
threshold search of the filtering step: `sampling_filter.py`; the chunking and workspace sizes:
`sampling_layout.py`; timing: `sampling_bench.py`.

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
unspecified order). logprob = log_softmax(x)[token] renormalised over the kept set ("processed":
x - max x - log(kept mass of e)) or log_softmax(logits)[token] when raw_logprobs.

Teacher forcing (`sampling_score.score_tokens`) runs the same two launches with launch 2's FORCED
flag: steps 1 and 2 as above, no step 3, the given token's logprob by the same expressions (a
processed logprob of a token outside the kept set is -inf), so its bits equal the sampler's.

The uniform u is either given ([B] float32) or computed in the kernel from int64
keys (seed, prompt_index, sample_index, position) with the hash of `sampling_rng.py`, equal bit for
bit to the host's `uniform_from_keys`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout_kernels.sampling_filter import _threshold_search
from rollout_kernels.sampling_layout import BLOCK_V, CHUNK, chunk_layout
from rollout_kernels.sampling_rng import _uniform_from_keys, check_row_param


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
def _draw(base, V, m, scale, thresh_f, total, mass_c, s_idx, s_mask, filtered,
          u_ptr, seed_ptr, pidx_ptr, sidx_ptr, pos_ptr, row, CHUNK, S, KEYED: tl.constexpr, BLOCK_V: tl.constexpr):
    """Launch 2's draw (step 3 of the module docstring) of a non-greedy row -> the token (int32 scalar):
    the first token in vocab order whose running kept mass (e >= thresh_f) exceeds u * total.
    mass_c [S_BLOCK]: the chunk masses of e (s_idx, s_mask their indices and validity)."""
    cols = tl.arange(0, BLOCK_V)
    if KEYED:
        u = _uniform_from_keys(tl.load(seed_ptr + row), tl.load(pidx_ptr + row),
                               tl.load(sidx_ptr + row), tl.load(pos_ptr + row))
    else:
        u = tl.load(u_ptr + row)
    target = u * total
    # ---- where the inverse-CDF scan starts: unfiltered rows (the kept mass of a chunk is its
    # partial) skip to the first chunk whose running mass exceeds u * total, or, if rounding
    # leaves u * total past the end, the last chunk with mass; filtered rows scan from 0 ----
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
    return tl.where(found < V, found, tl.maximum(last, 0))


@triton.jit
def _sampling_kernel(
    logits_ptr, stride_row, V,
    temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, raw_ptr,
    u_ptr, seed_ptr, pidx_ptr, sidx_ptr, pos_ptr,
    tok_ptr, logprob_ptr, ws_ptr, ws_int_ptr, ws_stride, CHUNK, S, support_ptr,
    KEYED: tl.constexpr, S_BLOCK: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr,
    NT: tl.constexpr, CAP: tl.constexpr, FORCED: tl.constexpr, STORE_SUPPORT: tl.constexpr,
):
    """Launch 2, grid (B,): merge the row's S chunk partials, filter, draw, logprob.
    FORCED (`sampling_score.score_tokens`): no draw; the token is tok_ptr[row] (int64, read, not
    written) and the logprob is reported by the very expressions below that report a drawn one.
    STORE_SUPPORT (`sampling_support.kept_mask`): support_ptr [B, 3] float32 gets the row's
    (threshold t, max logit m, scale log2(e) / T): its kept set is {e >= t, e > 0}."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    temperature = tl.load(temp_ptr + row)
    T = tl.where(temperature == 0.0, 1.0, temperature)
    scale = tl.math.div_rn(1.4426950408889634, T)  # log2(e) / T
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
    kept = zt  # mass of the tokens the draw keeps (the whole row unless a filter cuts it)
    support_t = tl.zeros((), tl.float32)  # the filters' threshold on e (0: nothing cut)
    dropped = tl.zeros((), tl.int1)  # FORCED: the given token is outside the kept set
    if FORCED:
        forced = tl.load(tok_ptr + row)
        in_vocab = (forced >= 0) & (forced < V)  # out of range reads as a -inf logit: no stray load
        token = tl.where(in_vocab, forced, 0).to(tl.int32)
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
        kept = total
        support_t = thresh_f
        if FORCED:
            # kept iff e >= t, e as the draw's pass computes it, and e > 0 (such a token is never drawn;
            # the reference's kept probability is 0); which rows report over a kept set is the
            # reference's rule (top_k >= V counts: only e > 0 is kept there)
            lg = tl.load(base + token, mask=in_vocab, other=NEG_INF).to(tl.float32)
            e = tl.minimum(tl.math.exp2((lg - m) * scale), 1.0)
            dropped = ((top_k > 0) | (min_p > 0.0) | (top_p < 1.0)) & ~((e >= thresh_f) & (e > 0.0))
        else:
            filtered = use_k | (min_p > 0.0) | (top_p < 1.0)
            token = _draw(base, V, m, scale, thresh_f, total, mass_c, s_idx, s_mask, filtered,
                          u_ptr, seed_ptr, pidx_ptr, sidx_ptr, pos_ptr, row, CHUNK, S, KEYED, BLOCK_V)

    # ---- logprob of the chosen (FORCED: the given) token, computed as torch's log_softmax does ----
    if FORCED:
        l_tok = tl.load(base + token, mask=in_vocab, other=NEG_INF).to(tl.float32)
    else:
        l_tok = tl.load(base + token).to(tl.float32)
    raw = tl.load(raw_ptr + row) != 0
    raw_lp = (l_tok - m) - tl.log(z1)
    # processed: over the kept set, the distribution the token was drawn from (= zt when nothing is cut)
    processed_lp = (tl.math.div_rn(l_tok, T) - tl.math.div_rn(m, T)) - tl.log(kept)
    if FORCED:
        processed_lp = tl.where(dropped, NEG_INF, processed_lp)  # a token the filters cut is never drawn
    else:
        tl.store(tok_ptr + row, token.to(tl.int64))
    tl.store(logprob_ptr + row, tl.where(raw, raw_lp, processed_lp))
    if STORE_SUPPORT:
        tl.store(support_ptr + row * 3, support_t)
        tl.store(support_ptr + row * 3 + 1, m)
        tl.store(support_ptr + row * 3 + 2, scale)


def _check_settings(logits, temperature, top_k, top_p, min_p, raw_logprobs) -> tuple[int, int]:
    """Launcher checks of logits [B, V] and the per-row settings (`sample`'s docstring) -> (B, V)."""
    # bf16/fp16 logits are read and upcast in the kernel: the same numbers as a float32 copy, without
    # a cast kernel writing [B, V] float32 first (at B 256 x V 151936: 112 us of a 7.3 ms step)
    assert logits.dim() == 2 and logits.dtype in (torch.float32, torch.bfloat16, torch.float16), \
        "logits must be [B, V] float32, bfloat16 or float16"
    assert logits.stride(1) == 1 or logits.shape[1] == 1, "logits must be contiguous in V"
    batch, vocab = logits.shape
    assert 1 <= vocab < 2**31 - 2**16
    dev = logits.device
    check_row_param("temperature", temperature, batch, torch.float32, dev)
    check_row_param("top_k", top_k, batch, torch.int64, dev)
    check_row_param("top_p", top_p, batch, torch.float32, dev)
    check_row_param("min_p", min_p, batch, torch.float32, dev)
    check_row_param("raw_logprobs", raw_logprobs, batch, torch.bool, dev)
    return batch, vocab


def _launch(logits, settings, u_arg, key_args, tokens, logprobs, workspace, keyed: bool, forced: bool,
            block_v, block_s, num_thresholds, cap, num_warps, chunk, num_warps_partials, support=None) -> None:
    """The two launches of `sample` (forced False) and `sampling_score.score_tokens` (forced True:
    `tokens` [B] int64 is read, the given tokens), with the same knobs so that both run the same
    chunking and the same arithmetic. settings: (temperature, top_k, top_p, min_p, raw_logprobs),
    checked; logprobs [B] float32 is written; workspace None or `sample_workspace`'s shape;
    support None or [B, 3] float32, written with each row's kept-set parameters (`_sampling_kernel`)."""
    batch, vocab = logits.shape
    for name, n in (("block_v", block_v), ("block_s", block_s), ("num_thresholds", num_thresholds), ("cap", cap)):
        assert n >= 2 and n & (n - 1) == 0, f"{name} must be a power of two >= 2"
    assert chunk >= 1, "chunk must be positive"
    block, chunk_len, num_chunks = chunk_layout(vocab, block_v, chunk)
    cols = 4 * num_chunks + cap
    dev = logits.device
    if workspace is None:
        workspace = torch.empty((batch, cols), dtype=torch.float32, device=dev)
    assert workspace.dtype == torch.float32 and workspace.is_contiguous() and workspace.device == dev
    assert workspace.dim() == 2 and workspace.shape[0] >= batch and workspace.shape[1] == cols, \
        f"workspace must be [>= {batch}, {cols}] (workspace_columns(V, block_v, chunk, cap))"
    if batch == 0:
        return
    ws_int = workspace.view(torch.int32)  # the same memory: the argmax columns are stored as int32
    _chunk_partials_kernel[(batch, num_chunks)](
        logits, logits.stride(0), vocab, settings[0], workspace, ws_int, cols, chunk_len, num_chunks,
        BLOCK_V=block, num_warps=num_warps_partials,
    )
    _sampling_kernel[(batch,)](
        logits, logits.stride(0), vocab, *settings, u_arg, *key_args,
        tokens, logprobs, workspace, ws_int, cols, chunk_len, num_chunks,
        support if support is not None else logprobs,  # not read unless STORE_SUPPORT
        KEYED=keyed, S_BLOCK=max(2, triton.next_power_of_2(num_chunks)), BLOCK_V=block,
        BLOCK_S=min(block_s, triton.next_power_of_2(vocab)), NT=num_thresholds, CAP=cap, FORCED=forced,
        STORE_SUPPORT=support is not None, num_warps=num_warps,
    )


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
    `sampling_score.score_tokens` with the same knobs reports the same logprob bits for these tokens.
    """
    settings = (temperature, top_k, top_p, min_p, raw_logprobs)
    batch, _ = _check_settings(logits, *settings)
    dev = logits.device
    assert (uniform is None) != (keys is None), "pass exactly one of uniform= or keys="
    if keys is not None:
        assert len(keys) == 4
        for name, key in zip(("seed", "prompt_index", "sample_index", "position"), keys):
            check_row_param(name, key, batch, torch.int64, dev)
        u_arg, key_args = temperature, tuple(keys)  # u_arg is unused when keyed
    else:
        check_row_param("uniform", uniform, batch, torch.float32, dev)
        u_arg, key_args = uniform, (top_k,) * 4  # key args unused
    if out is None:
        tokens = torch.empty(batch, dtype=torch.int64, device=dev)
        logprobs = torch.empty(batch, dtype=torch.float32, device=dev)
    else:
        tokens, logprobs = out
        check_row_param("out tokens", tokens, batch, torch.int64, dev)
        check_row_param("out logprobs", logprobs, batch, torch.float32, dev)
    _launch(logits, settings, u_arg, key_args, tokens, logprobs, workspace, keys is not None, False,
            block_v, block_s, num_thresholds, cap, num_warps, chunk, num_warps_partials)
    return tokens, logprobs
