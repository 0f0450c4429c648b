"""Torch reference of the chunked gated delta rule prefill with half-precision intermediates.

What `chunk_gated_delta_rule_varlen(..., tuning={"lowp_intermediates": True})` computes on bf16 (or
fp16) inputs, rounding exactly where its kernels store or cast to the inputs' dtype (`r` below); every
product in between is a float32 matmul on such rounded operands, which is what a bf16 tensor-core dot
with float32 accumulation computes up to the order of its sums. Per chunk of C positions, with gc the
chunk-local cumulative log decay, k and q L2-normalised in float32 and q scaled by dk^-0.5:

    A      = (r(k) r(k)^T) * beta_i * exp(gc_i - gc_j), strictly lower     float32
    inv    = r((I + A)^-1)                         (the inverse itself in float32)
    w      = r(inv r(k * beta * exp(gc)))         u = r(inv r(v * beta))
    h      = r(S)                                  (S, the running state, stays float32)
    v_new  = r(u - w h)
    S     <- exp(gc_last) S + r(k * exp(gc_last - gc))^T v_new
    o      = r(q exp(gc)) h + r(lower(r(q) r(k)^T * exp(gc_i - gc_j))) v_new

The final state is float32. flash-linear-attention keeps its intermediates in bf16 the same way (its
rounding points differ in places: scripts/gdn_bf16_intermediates.py emulates FLA's own);
docs/gdn_bf16_intermediates.md measured what this precision costs against the float32 path.
"""

from __future__ import annotations

import torch

from rollout_kernels.gated_delta_rule import _prepare


def chunk_gated_delta_rule_lowp_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                    beta: torch.Tensor, initial_state: torch.Tensor, chunk_size: int = 64,
                                    use_qk_l2norm: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q/k [L, Hk, dk]; v [L, Hv, dv] (bf16 or fp16: the intermediates' dtype); g/beta [L, Hv];
    initial_state [Hv, dk, dv] -> (o [L, Hv, dv] in v's dtype, final_state [Hv, dk, dv] float32)."""
    low = v.dtype

    def r(x: torch.Tensor) -> torch.Tensor:
        return x.to(low).float()

    q, k, v, g, beta = (t.transpose(0, 1) for t in _prepare(q, k, v, g, beta, use_qk_l2norm))  # [Hv, L, ...]
    state = initial_state.float().clone()  # [Hv, dk, dv]
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for c in range(0, q.shape[1], chunk_size):
        qc, kc, vc = q[:, c:c + chunk_size], k[:, c:c + chunk_size], v[:, c:c + chunk_size]  # [Hv, n, d]
        bc, gc = beta[:, c:c + chunk_size], g[:, c:c + chunk_size].cumsum(-1)  # [Hv, n]
        n = qc.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        diff = gc[:, :, None] - gc[:, None, :]
        strict = diff.masked_fill(~causal.tril(-1), float("-inf")).exp()  # [Hv, n, n], 0 on and above the diagonal
        a = (r(kc) @ r(kc).transpose(-1, -2)) * bc[:, :, None] * strict
        eye = torch.eye(n, device=q.device).expand_as(a)
        inv = r(torch.linalg.solve_triangular(a + eye, eye, upper=False, unitriangular=True))
        w = r(inv @ r(kc * (bc * gc.exp())[..., None]))  # [Hv, n, dk]
        u = r(inv @ r(vc * bc[..., None]))  # [Hv, n, dv]
        h = r(state)
        v_new = r(u - w @ h)
        scores = r((r(qc) @ r(kc).transpose(-1, -2)) * diff.masked_fill(~causal, float("-inf")).exp())
        out[:, c:c + n] = r(qc * gc.exp()[..., None]) @ h + scores @ v_new
        g_last = gc[:, -1]
        state = state * g_last.exp()[:, None, None] + \
            r(kc * (g_last[:, None] - gc).exp()[..., None]).transpose(-1, -2) @ v_new
    return out.transpose(0, 1).to(low), state


def chunk_gated_delta_rule_lowp_varlen_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                           beta: torch.Tensor, ssm_states: torch.Tensor,
                                           state_indices: torch.Tensor, cu_seqlens: list[int],
                                           chunk_size: int = 64, use_qk_l2norm: bool = True) -> torch.Tensor:
    """Several sequences packed in one batch, as chunk_gated_delta_rule_varlen_ref (states updated in
    place at state_indices) -> o [T, Hv, dv] in v's dtype."""
    out = torch.empty_like(v)
    for b, slot in enumerate(state_indices.tolist()):
        s, e = cu_seqlens[b], cu_seqlens[b + 1]
        if e == s:
            continue
        out[s:e], final = chunk_gated_delta_rule_lowp_ref(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e],
                                                          ssm_states[slot], chunk_size, use_qk_l2norm)
        ssm_states[slot] = final.to(ssm_states.dtype)
    return out
