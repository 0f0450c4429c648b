"""Gated delta rule (Gated DeltaNet's linear attention) over a pool of per-sequence recurrent states.

Per value head h, with S the state [k_dim, v_dim] and token t:

    S <- exp(g_t) * S                              (gating: decay, g_t <= 0)
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T      (delta rule: correct what S predicts for k_t)
    o_t = S^T (q_t * k_dim^-0.5)

q and k are L2-normalised first (`use_qk_l2norm`); each q/k head serves
num_v_heads // num_k_heads consecutive value heads. All math runs in float32
and the states are float32: ssm_states [num_slots, num_v_heads, k_dim, v_dim].

Prefill uses the chunked form (intra-chunk UT transform, state passed between
chunks), decode one recurrent step. Both read a sequence's state from its
slot and write it back, so a prompt prefilled in several engine steps carries
its state across them. The `_ref` functions are plain torch, the same math as
HF transformers' torch fallback (`torch_chunk_gated_delta_rule`,
`torch_recurrent_gated_delta_rule`), and what the engine runs on the torch path.
`recurrent_gated_delta_rule_update` is the Triton decode kernel (same
arguments as its reference); the Triton chunked prefill is
`chunk_gated_delta_rule.chunk_gated_delta_rule_varlen`, and
`recurrent_gated_delta_rule_varlen` the on-policy mode's prefill: the decode
kernel's step token after token, so a token's bits do not depend on whether it
was prefilled (in any chunks) or decoded.
triton is optional (the test extra): without it the references still import.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rollout_kernels.host_to_device import to_device

try:
    import triton
    import triton.language as tl
except ImportError:  # torch-only installs run the references
    triton = None


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, as FLA and HF compute it."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, use_qk_l2norm):
    """-> float32 q (normalised and scaled), k, v, g, beta with q/k heads repeated to the value heads."""
    num_k_heads, num_v_heads = q.shape[-2], v.shape[-2]
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if num_k_heads != num_v_heads:
        q = q.repeat_interleave(num_v_heads // num_k_heads, dim=-2)
        k = k.repeat_interleave(num_v_heads // num_k_heads, dim=-2)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def chunk_gated_delta_rule_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, initial_state: torch.Tensor, chunk_size: int = 64,
                               use_qk_l2norm: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, chunked: q/k [L, Hk, dk]; v [L, Hv, dv]; g/beta [L, Hv]; initial_state [Hv, dk, dv]
    -> (o [L, Hv, dv] in v's dtype, final_state [Hv, dk, dv] float32)."""
    out_dtype = v.dtype
    length = q.shape[0]
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm)
    # heads first: [Hv, L, d] and [Hv, L]
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    g, beta = g.t(), beta.t()
    pad = (chunk_size - length % chunk_size) % chunk_size
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    heads, num_chunks = q.shape[0], (length + pad) // chunk_size
    # [Hv, N, C, d]: N chunks of C positions
    q, k, v = (t.reshape(heads, num_chunks, chunk_size, -1) for t in (q, k, v))
    g, beta = g.reshape(heads, num_chunks, chunk_size), beta.reshape(heads, num_chunks, chunk_size)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(-1)  # [Hv, N, C] log decay from the chunk start to each position
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    # decay[i, j] = exp(cum_i - cum_j) for j <= i: what is left at i of a write made at j
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [Hv, N, C, C]
    # UT transform: (I + strictly-lower(diag(beta) K K^T * decay)) solves the C delta-rule writes at once
    system = (k_beta @ k.transpose(-1, -2)) * decay
    system = system.masked_fill(~torch.ones_like(upper).tril(-1), 0.0) + torch.eye(chunk_size, device=q.device)
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)  # [Hv, N, C, dv]
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False,
                                               unitriangular=True)  # [Hv, N, C, dk]
    intra = (q @ k.transpose(-1, -2)) * decay  # [Hv, N, C, C]
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]  # decay from each position to the chunk end
    chunk_decay = cum[..., -1].exp()  # [Hv, N]
    state = initial_state.float().clone()  # [Hv, dk, dv]
    out = torch.empty_like(v)
    for i in range(num_chunks):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ state  # [Hv, C, dv]: writes corrected by the old state
        out[:, i] = q_decayed[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i, None, None] + k_to_end[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(heads, -1, out.shape[-1])[:, :length].transpose(0, 1)
    return out.to(out_dtype), state


def recurrent_gated_delta_rule_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                   beta: torch.Tensor, initial_state: torch.Tensor,
                                   use_qk_l2norm: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token, batched over sequences: q/k [B, L, Hk, dk]; v [B, L, Hv, dv]; g/beta [B, L, Hv];
    initial_state [B, Hv, dk, dv] -> (o [B, L, Hv, dv] in v's dtype, final_state float32)."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm)
    state = initial_state.float().clone()
    out = torch.empty_like(v)
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        predicted = (state * k[:, t, :, :, None]).sum(-2)  # [B, Hv, dv] = S^T k
        delta = (v[:, t] - predicted) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = (state * q[:, t, :, :, None]).sum(-2)
    return out.to(out_dtype), state


def chunk_gated_delta_rule_varlen_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                      beta: torch.Tensor, ssm_states: torch.Tensor, state_indices: torch.Tensor,
                                      cu_seqlens: list[int], chunk_size: int = 64,
                                      use_qk_l2norm: bool = True) -> torch.Tensor:
    """Prefill of several sequences packed in one flat batch: q/k [T, Hk, dk]; v [T, Hv, dv]; g/beta [T, Hv];
    sequence b is rows cu_seqlens[b]:cu_seqlens[b+1] and starts from ssm_states[state_indices[b]]
    ([S, Hv, dk, dv], updated in place) -> o [T, Hv, dv]."""
    out = torch.empty_like(v)
    for b, slot in enumerate(state_indices.tolist()):
        s, e = cu_seqlens[b], cu_seqlens[b + 1]
        if e == s:
            continue
        out[s:e], final = chunk_gated_delta_rule_ref(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], ssm_states[slot],
                                                     chunk_size, use_qk_l2norm)
        ssm_states[slot] = final.to(ssm_states.dtype)
    return out


def recurrent_gated_delta_rule_update_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                          beta: torch.Tensor, ssm_states: torch.Tensor, state_indices: torch.Tensor,
                                          use_qk_l2norm: bool = True) -> torch.Tensor:
    """Decode, one token per sequence: q/k [B, Hk, dk]; v [B, Hv, dv]; g/beta [B, Hv];
    ssm_states [S, Hv, dk, dv] updated in place at state_indices [B] -> o [B, Hv, dv]."""
    out, final = recurrent_gated_delta_rule_ref(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                                                ssm_states[state_indices], use_qk_l2norm)
    ssm_states[state_indices] = final.to(ssm_states.dtype)
    return out[:, 0]


def recurrent_gated_delta_rule_verify_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                          beta: torch.Tensor, ssm_states: torch.Tensor, state_indices: torch.Tensor,
                                          cu_seqlens: list[int], fork_slots: torch.Tensor,
                                          use_qk_l2norm: bool = True) -> torch.Tensor:
    """A step verifying drafts: sequence b is rows cu_seqlens[b]:cu_seqlens[b+1] (its last token and its
    drafts), advanced token by token with the decode step from ssm_states[state_indices[b]]; after its
    token j the state is also copied to slot fork_slots[b, j] (where j < fork_slots.shape[1] and the slot
    is >= 0), so the state after any accepted prefix is at hand. -> o [T, Hv, dv]."""
    out = torch.empty_like(v)
    forks = fork_slots.tolist()
    for b, slot in enumerate(state_indices.tolist()):
        one = torch.tensor([slot], dtype=torch.long, device=q.device)
        for j, t in enumerate(range(cu_seqlens[b], cu_seqlens[b + 1])):
            out[t] = recurrent_gated_delta_rule_update_ref(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1],
                                                           beta[t:t + 1], ssm_states, one, use_qk_l2norm)[0]
            if j < len(forks[b]) and forks[b][j] >= 0:
                ssm_states[forks[b][j]] = ssm_states[slot]
    return out


if triton is not None:

    @triton.jit
    def _token_step(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state, t, kh, h, rows, cols, mask_k, mask_v,
                    sq0, sq1, sk0, sk1, sv0, sv1, sg0, sb0, scale, L2NORM: tl.constexpr):
        """One token t's step of value head h on its state columns [BK, BV] float32 -> (state, o [BV]).
        The decode kernel and the recurrent prefill run exactly this, so a token's bits do not
        depend on which of them computed it."""
        q = tl.load(q_ptr + t * sq0 + kh * sq1 + rows, mask=mask_k, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * sk0 + kh * sk1 + rows, mask=mask_k, other=0.0).to(tl.float32)
        if L2NORM:
            q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)
            k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        q = q * scale
        v = tl.load(v_ptr + t * sv0 + h * sv1 + cols, mask=mask_v, other=0.0).to(tl.float32)
        decay = tl.exp(tl.load(g_ptr + t * sg0 + h).to(tl.float32))
        beta = tl.load(beta_ptr + t * sb0 + h).to(tl.float32)
        state = state * decay
        delta = (v - tl.sum(state * k[:, None], axis=0)) * beta  # [BV]
        state = state + k[:, None] * delta[None, :]
        return state, tl.sum(state * q[:, None], axis=0)

    @triton.jit
    def _state_tile(state_ptr, index_ptr, b, h, ss0, ss1, ss2, DK, DV, BK: tl.constexpr, BV: tl.constexpr):
        """This program's tile of sequence b's state for value head h: value columns [vb * BV, vb * BV + BV)
        (vb = program_id 2) -> (rows [BK], cols [BV], their masks, the tile's pointers and mask). A
        negative slot (padding) reads and writes nothing (one mask expression: interpreter-safe)."""
        cols = tl.program_id(2).to(tl.int64) * BV + tl.arange(0, BV)
        rows = tl.arange(0, BK)
        slot = tl.load(index_ptr + b).to(tl.int64)
        mask_v = cols < tl.where(slot >= 0, DV, 0)
        mask_k = rows < DK
        s_ptrs = state_ptr + slot * ss0 + h * ss1 + rows[:, None] * ss2 + cols[None, :]
        return rows, cols, mask_k, mask_v, s_ptrs, mask_k[:, None] & mask_v[None, :]

    @triton.jit
    def _recurrent_gated_delta_rule_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, index_ptr, cu_ptr, o_ptr,
        sq0, sq1, sk0, sk1, sv0, sv1, sg0, sb0, ss0, ss1, ss2, so0, so1,
        scale, DK, DV,
        fork_ptr, NF,
        GROUP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, VARLEN: tl.constexpr,
        FORKS: tl.constexpr,
    ):
        # one program: sequence b, value head h, value columns [vb * BV, vb * BV + BV). The state's
        # columns are independent (S^T k and the rank-1 write act per column), so v tiles split freely.
        # Decode: row b is the sequence's one token. VARLEN (the recurrent prefill): rows cu[b] ..
        # cu[b + 1] - 1, one after another with the state in registers; each the same _token_step.
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        rows, cols, mask_k, mask_v, s_ptrs, s_mask = _state_tile(state_ptr, index_ptr, b, h, ss0, ss1, ss2, DK, DV,
                                                                 BK, BV)
        state = tl.load(s_ptrs, mask=s_mask, other=0.0)  # [BK, BV] float32
        if VARLEN:
            first, end = tl.load(cu_ptr + b), tl.load(cu_ptr + b + 1)
        else:
            first, end = b, b + 1
        for t in range(first, end):
            state, out = _token_step(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state, t, h // GROUP, h, rows, cols,
                                     mask_k, mask_v, sq0, sq1, sk0, sk1, sv0, sv1, sg0, sb0, scale, L2NORM)
            tl.store(o_ptr + t * so0 + h * so1 + cols, out.to(o_ptr.dtype.element_ty), mask=mask_v)
            if FORKS:  # verifying drafts: the state after token j also goes to the sequence's fork slot j
                j = t - first
                fork = tl.load(fork_ptr + b * NF + tl.minimum(j, NF - 1)).to(tl.int64)
                fork = tl.where(j < NF, fork, -1)
                f_ptrs = state_ptr + fork * ss0 + h * ss1 + rows[:, None] * ss2 + cols[None, :]
                tl.store(f_ptrs, state, mask=s_mask & (rows[:, None] < tl.where(fork >= 0, DK, 0)))
        tl.store(s_ptrs, state, mask=s_mask)


def _check_delta_args(q, k, v, g, beta, ssm_states) -> tuple[int, int, int, int, int]:
    """The checks both Triton launchers share -> (rows, Hk, dk, Hv, dv)."""
    assert triton is not None, "the Triton gated delta rule needs triton"
    T, Hk, dk = q.shape
    Hv, dv = v.shape[1], v.shape[2]
    assert k.shape == q.shape and v.shape[0] == T, f"q/k [T, Hk, dk], v [T, Hv, dv]: {q.shape}, {k.shape}, {v.shape}"
    assert Hv % Hk == 0, f"value heads {Hv} must be a multiple of key heads {Hk}"
    assert g.shape == beta.shape == (T, Hv), f"g/beta must be [T, Hv], got {tuple(g.shape)}, {tuple(beta.shape)}"
    assert g.stride(1) == 1 and beta.stride(1) == 1 or Hv == 1
    assert ssm_states.dim() == 4 and ssm_states.shape[1:] == (Hv, dk, dv), f"states [S, Hv, dk, dv]: {ssm_states.shape}"
    assert ssm_states.dtype == torch.float32 and ssm_states.stride(3) == 1, "states must be float32, contiguous in v_dim"
    for name, x in (("q", q), ("k", k), ("v", v)):
        assert x.stride(2) == 1, f"{name} must be contiguous in its head dim"
    return T, Hk, dk, Hv, dv


def _launch_delta(q, k, v, g, beta, ssm_states, state_indices, cu_seqlens: list[int] | torch.Tensor | None,
                  use_qk_l2norm: bool, fork_slots: torch.Tensor | None = None) -> torch.Tensor:
    """Check, then launch grid (sequences, Hv, value-column blocks) -> o [T, Hv, dv] in v's dtype. Decode
    (cu_seqlens None: row b is sequence b's one token) and the recurrent prefill (sequence b is rows
    cu_seqlens[b]:cu_seqlens[b+1]) run one kernel with block sizes from the head dims only, so they
    tile a state alike. cu_seqlens may be a device tensor [B + 1] int64 (a CUDA graph's static layout,
    nothing read on the host): rows past cu_seqlens[B] are left unwritten."""
    T, Hk, dk, Hv, dv = _check_delta_args(q, k, v, g, beta, ssm_states)
    on_device = isinstance(cu_seqlens, torch.Tensor)
    sequences = T if cu_seqlens is None else (cu_seqlens.shape[0] if on_device else len(cu_seqlens)) - 1
    name = "B" if cu_seqlens is None else "len(cu_seqlens) - 1"
    assert state_indices.shape == (sequences,) and state_indices.dtype == torch.int64, \
        f"state_indices must be [{name}] int64"
    if cu_seqlens is not None and not on_device:
        assert cu_seqlens[0] == 0 and cu_seqlens[-1] == T, f"cu_seqlens must run from 0 to T={T}, got {cu_seqlens}"
    out = torch.empty((T, Hv, dv), dtype=v.dtype, device=v.device)
    if T == 0 or sequences == 0:
        return out
    if on_device:
        assert cu_seqlens.dtype == torch.int64, "a device cu_seqlens must be int64"
        cu = cu_seqlens
    else:
        cu = to_device(cu_seqlens, torch.int64, q.device) if cu_seqlens is not None else state_indices
    if fork_slots is not None:
        assert fork_slots.dim() == 2 and fork_slots.shape[0] == sequences and fork_slots.dtype == torch.int64 \
            and fork_slots.is_contiguous(), f"fork_slots must be [{sequences}, F] int64, contiguous"
    block_k = triton.next_power_of_2(dk)
    block_v = min(triton.next_power_of_2(dv), max(16, 8192 // block_k))  # a [BK, BV] float32 tile in registers
    _recurrent_gated_delta_rule_kernel[(sequences, Hv, triton.cdiv(dv, block_v))](
        q, k, v, g, beta, ssm_states, state_indices, cu, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        ssm_states.stride(0), ssm_states.stride(1), ssm_states.stride(2), out.stride(0), out.stride(1),
        dk ** -0.5, dk, dv,
        fork_slots if fork_slots is not None else state_indices, fork_slots.shape[1] if fork_slots is not None else 1,
        GROUP=Hv // Hk, BK=block_k, BV=block_v, L2NORM=use_qk_l2norm, VARLEN=cu_seqlens is not None,
        FORKS=fork_slots is not None and fork_slots.shape[1] > 0, num_warps=4,
    )
    return out


def recurrent_gated_delta_rule_update(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                      beta: torch.Tensor, ssm_states: torch.Tensor, state_indices: torch.Tensor,
                                      use_qk_l2norm: bool = True) -> torch.Tensor:
    """Triton decode step, as recurrent_gated_delta_rule_update_ref: q/k [B, Hk, dk]; v [B, Hv, dv];
    g/beta [B, Hv]; ssm_states [S, Hv, dk, dv] float32 updated in place at state_indices [B] int64
    (a negative index skips the row: its output is left unwritten) -> o [B, Hv, dv] in v's dtype.
    q/k/v may be strided views (a fused projection's output) but contiguous in the head dim."""
    return _launch_delta(q, k, v, g, beta, ssm_states, state_indices, None, use_qk_l2norm)


def recurrent_gated_delta_rule_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                      beta: torch.Tensor, ssm_states: torch.Tensor, state_indices: torch.Tensor,
                                      cu_seqlens: list[int], use_qk_l2norm: bool = True) -> torch.Tensor:
    """Prefill token by token (the on-policy mode's prefill), the arguments and result of
    chunk_gated_delta_rule_varlen_ref: every token runs the decode kernel's step, so its output and
    the state it leaves have the bits a decode of it would give, however the prompt was chunked.
    Slower than the chunked kernel: one program walks a sequence's tokens in order."""
    return _launch_delta(q, k, v, g, beta, ssm_states, state_indices, cu_seqlens, use_qk_l2norm)


def recurrent_gated_delta_rule_verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                      beta: torch.Tensor, ssm_states: torch.Tensor, state_indices: torch.Tensor,
                                      cu_seqlens: list[int] | torch.Tensor, fork_slots: torch.Tensor,
                                      use_qk_l2norm: bool = True) -> torch.Tensor:
    """A step verifying drafts in one launch, as recurrent_gated_delta_rule_verify_ref: each sequence's
    tokens run the decode kernel's step in order (the bits a decode of each gives), and the state after
    token j is also stored at fork_slots[b, j] ([B, F] int64, -1: none). cu_seqlens may be a device tensor
    (a CUDA graph's static layout): a sequence of no rows may then have state slot -1."""
    return _launch_delta(q, k, v, g, beta, ssm_states, state_indices, cu_seqlens, use_qk_l2norm, fork_slots)
