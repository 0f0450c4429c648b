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
its state across them. These are the plain-torch references, the same math as
HF transformers' torch fallback (`torch_chunk_gated_delta_rule`,
`torch_recurrent_gated_delta_rule`); the Triton kernels will take the same arguments.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
