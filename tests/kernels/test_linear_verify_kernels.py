"""The linear layers' verify kernels (speculative decoding on hybrid models): each sequence's last token and
drafts in one launch, the state after each draft position written to its fork slot. Against the torch
references, and bit for bit against the decode kernels run token by token with the forks copied after each
token (what a step verifying drafts ran before: a verified token must keep a decode's bits). Interpreter on
the CPU, compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from rollout_kernels.causal_conv1d import causal_conv1d_update, causal_conv1d_verify, causal_conv1d_verify_ref
from rollout_kernels.gated_delta_rule import (recurrent_gated_delta_rule_update, recurrent_gated_delta_rule_verify,
                                              recurrent_gated_delta_rule_verify_ref)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# sequence b verifies DRAFTS[b] drafts (1 + d tokens); the second has no fork slots (a hybrid short of them)
DRAFTS = [3, 2, 0, 1]
MAX_FORKS = 3


def _layout():
    """(cu_seqlens, own slots [B], fork slots [B, F], slots never written) over a pool of 16 slots."""
    cu = [0]
    for d in DRAFTS:
        cu.append(cu[-1] + 1 + d)
    own = torch.tensor([5, 1, 9, 12], device=DEV)
    forks = torch.full((len(DRAFTS), MAX_FORKS), -1, dtype=torch.long, device=DEV)
    free = iter([2, 3, 4, 6, 7, 8])
    for b, d in enumerate(DRAFTS):
        if b != 1:
            for j in range(d):
                forks[b, j] = next(free)
    used = set(own.tolist()) | {s for s in forks.flatten().tolist() if s >= 0}
    untouched = torch.tensor([s for s in range(16) if s not in used], device=DEV)
    return cu, own, forks, untouched


def _token_by_token(update, rows, own, forks, cu, states, **kw):
    """The decode kernel per token with the fork copies after each (the reference of the bits)."""
    out = []
    for b, slot in enumerate(own.tolist()):
        one = torch.tensor([slot], device=DEV)
        for j, t in enumerate(range(cu[b], cu[b + 1])):
            out.append(update(*(r[t:t + 1] for r in rows), states, one, **kw)[0])
            if j < MAX_FORKS and forks[b, j] >= 0:
                states[forks[b, j]] = states[slot]
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if DEV == "cuda" else [torch.float32])
def test_delta_rule_verify(dtype):
    cu, own, forks, untouched = _layout()
    T, hk, hv, dk, dv = cu[-1], 2, 4, 32, 24
    gen = torch.Generator(device=DEV).manual_seed(3)
    q, k = (torch.randn(T, hk, dk, generator=gen, device=DEV).to(dtype) for _ in range(2))
    v = torch.randn(T, hv, dv, generator=gen, device=DEV).to(dtype)
    g = -torch.rand(T, hv, generator=gen, device=DEV)
    beta = torch.rand(T, hv, generator=gen, device=DEV).to(dtype)
    pool = torch.full((16, hv, dk, dv), float("nan"), device=DEV)
    pool[own] = torch.randn(len(own), hv, dk, dv, generator=gen, device=DEV)
    rows = (q, k, v, g, beta)

    want_pool = pool.clone()
    want = recurrent_gated_delta_rule_verify_ref(*rows, want_pool, own, cu, forks)
    got_pool = pool.clone()
    got = recurrent_gated_delta_rule_verify(*rows, got_pool, own, cu, forks)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-5 if dtype == torch.float32 else 2e-2, rtol=1e-3)
    written = torch.tensor(sorted(set(range(16)) - set(untouched.tolist())), device=DEV)
    torch.testing.assert_close(got_pool[written], want_pool[written], atol=2e-5, rtol=2e-5)
    assert got_pool[untouched].isnan().all()

    bits_pool = pool.clone()
    bits = _token_by_token(recurrent_gated_delta_rule_update, rows, own, forks, cu, bits_pool)
    assert torch.equal(got, bits) and torch.equal(got_pool[written], bits_pool[written])


@pytest.mark.parametrize("width, bias", [(4, True), (3, False)])
def test_conv_verify(width, bias):
    cu, own, forks, untouched = _layout()
    T, C = cu[-1], 40
    gen = torch.Generator(device=DEV).manual_seed(5)
    x = torch.randn(T, C, generator=gen, device=DEV)
    weight = torch.randn(C, width, generator=gen, device=DEV)
    b = torch.randn(C, generator=gen, device=DEV) if bias else None
    pool = torch.full((16, C, width - 1), float("nan"), device=DEV)
    pool[own] = torch.randn(len(own), C, width - 1, generator=gen, device=DEV)

    want_pool = pool.clone()
    want = causal_conv1d_verify_ref(x, weight, b, want_pool, own, cu, forks)
    got_pool = pool.clone()
    got = causal_conv1d_verify(x, weight, b, got_pool, own, cu, forks)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    written = torch.tensor(sorted(set(range(16)) - set(untouched.tolist())), device=DEV)
    torch.testing.assert_close(got_pool[written], want_pool[written], atol=0, rtol=0)  # raw inputs, moved
    assert got_pool[untouched].isnan().all()

    bits_pool = pool.clone()
    bits = _token_by_token(lambda xt, states, one: causal_conv1d_update(xt, weight, b, states, one), (x,), own,
                           forks, cu, bits_pool)
    assert torch.equal(got, bits) and torch.equal(got_pool[written], bits_pool[written])


def _graph_layout(cu, own, forks, padding_slot: int, rows: int, entries: int):
    """The same step as a CUDA graph's static layout holds it: cu [entries + 1], slots and forks on the device;
    after the real sequences, each leftover row of the `rows` bucket is a one-row padding sequence on
    `padding_slot` (no forks), then sequences of no rows on slot -1."""
    real, T = len(own), cu[-1]
    padded_cu = cu + list(range(T + 1, rows + 1))
    padded_cu += [rows] * (entries + 1 - len(padded_cu))
    slots = torch.full((entries,), -1, dtype=torch.long, device=DEV)
    slots[:real] = own
    slots[real:real + rows - T] = padding_slot
    padded_forks = torch.full((entries, forks.shape[1]), -1, dtype=torch.long, device=DEV)
    padded_forks[:real] = forks
    return torch.tensor(padded_cu, dtype=torch.long, device=DEV), slots, padded_forks


def test_verify_kernels_on_a_graph_layout_write_what_the_host_layout_writes():
    """cu_seqlens as a device tensor (what a verify step's CUDA graph would pass, nothing read on the host): the
    real sequences' outputs, states and forks bit for bit those of the host layout; padding rows stay on
    their padding slot, empty sequences on slot -1 write nothing."""
    cu, own, forks, untouched = _layout()
    T, rows, entries, pad = cu[-1], cu[-1] + 3, len(DRAFTS) + 6, int(untouched[-1])
    untouched = untouched[untouched != pad]
    dev_cu, slots, padded_forks = _graph_layout(cu, own, forks, pad, rows, entries)
    gen = torch.Generator(device=DEV).manual_seed(7)
    hk, hv, dk, dv, C, width = 2, 4, 32, 24, 40, 4
    q, k = (torch.randn(rows, hk, dk, generator=gen, device=DEV) for _ in range(2))
    v = torch.randn(rows, hv, dv, generator=gen, device=DEV)
    g, beta = -torch.rand(rows, hv, generator=gen, device=DEV), torch.rand(rows, hv, generator=gen, device=DEV)
    x = torch.randn(rows, C, generator=gen, device=DEV)
    weight, bias = torch.randn(C, width, generator=gen, device=DEV), torch.randn(C, generator=gen, device=DEV)
    # pools with a guard slot in front: a write through slot -1 would land there
    guarded_states = torch.full((17, hv, dk, dv), float("nan"), device=DEV)
    guarded_conv = torch.full((17, C, width - 1), float("nan"), device=DEV)
    states, conv = guarded_states[1:], guarded_conv[1:]
    states[own], conv[own] = (torch.randn(len(own), *t.shape[1:], generator=gen, device=DEV) for t in (states, conv))
    states[pad], conv[pad] = 0.0, 0.0

    host_states, host_conv = states.clone(), conv.clone()
    want_o = recurrent_gated_delta_rule_verify(q[:T], k[:T], v[:T], g[:T], beta[:T], host_states, own, cu, forks)
    want_y = causal_conv1d_verify(x[:T], weight, bias, host_conv, own, cu, forks)
    got_o = recurrent_gated_delta_rule_verify(q, k, v, g, beta, states, slots, dev_cu, padded_forks)
    got_y = causal_conv1d_verify(x, weight, bias, conv, slots, dev_cu, padded_forks)
    assert torch.equal(got_o[:T], want_o) and torch.equal(got_y[:T], want_y)
    assert got_o[T:].isfinite().all() and got_y[T:].isfinite().all()  # padding rows: computed, on slot pad
    real = torch.tensor([s for s in range(16) if s != pad and s not in untouched.tolist()], device=DEV)
    assert torch.equal(states[real], host_states[real]) and torch.equal(conv[real], host_conv[real])
    assert states[untouched].isnan().all() and conv[untouched].isnan().all()
    assert guarded_states[0].isnan().all() and guarded_conv[0].isnan().all()
