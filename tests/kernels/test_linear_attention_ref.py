"""The torch references of the Gated DeltaNet recurrences (kernels/gated_delta_rule.py, kernels/causal_conv1d.py):
chunked == token-by-token across chunk boundaries and odd lengths, state carried across split prefills,
the pooled varlen / decode entry points == the single-sequence functions, and == HF's torch fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rollout_kernels.causal_conv1d import causal_conv1d_update_ref, causal_conv1d_varlen_ref
from rollout_kernels.gated_delta_rule import (
    chunk_gated_delta_rule_ref,
    chunk_gated_delta_rule_varlen_ref,
    recurrent_gated_delta_rule_ref,
    recurrent_gated_delta_rule_update_ref,
)

HK, HV, DK, DV = 2, 4, 16, 8  # two key heads serve four value heads
TOL = 2e-5


def inputs(length: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(length, HK, DK, generator=gen)
    k = torch.randn(length, HK, DK, generator=gen)
    v = torch.randn(length, HV, DV, generator=gen)
    g = -0.3 * torch.rand(length, HV, generator=gen)  # slow decay: old tokens still matter
    beta = torch.rand(length, HV, generator=gen)
    state = torch.randn(HV, DK, DV, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("length", [1, 5, 15, 16, 17, 63, 64, 65, 130])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunked_equals_token_by_token(length, chunk_size):
    q, k, v, g, beta, state = inputs(length, seed=length)
    out, final = chunk_gated_delta_rule_ref(q, k, v, g, beta, state, chunk_size=chunk_size)
    want, want_final = recurrent_gated_delta_rule_ref(q[None], k[None], v[None], g[None], beta[None], state[None])
    assert out.shape == (length, HV, DV)
    torch.testing.assert_close(out, want[0], atol=TOL, rtol=TOL)
    torch.testing.assert_close(final, want_final[0], atol=TOL, rtol=TOL)


@pytest.mark.parametrize("cuts", [[7], [1, 2, 3], [16, 32], [63, 64, 65], [5, 77, 99]])
def test_state_carries_across_split_prefill(cuts):
    """Prefill in engine-step pieces (any boundaries) == one pass: the chunked prefill of the engine."""
    q, k, v, g, beta, state = inputs(130, seed=3)
    whole, whole_final = chunk_gated_delta_rule_ref(q, k, v, g, beta, state)
    pieces, s = [], state
    for a, b in zip([0] + cuts, cuts + [130]):
        out, s = chunk_gated_delta_rule_ref(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], s)
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces), whole, atol=TOL, rtol=TOL)
    torch.testing.assert_close(s, whole_final, atol=TOL, rtol=TOL)


def test_pooled_varlen_and_decode_update_states_in_place():
    lengths, slots = [3, 64, 1, 70], [5, 2, 7, 1]
    q, k, v, g, beta, _ = inputs(sum(lengths), seed=11)
    pool = torch.randn(8, HV, DK, DV)
    before = pool.clone()
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    out = chunk_gated_delta_rule_varlen_ref(q, k, v, g, beta, pool, torch.tensor(slots), cu, chunk_size=16)
    for b, slot in enumerate(slots):
        s, e = cu[b], cu[b + 1]
        want, final = chunk_gated_delta_rule_ref(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], before[slot])
        torch.testing.assert_close(out[s:e], want, atol=TOL, rtol=TOL)
        torch.testing.assert_close(pool[slot], final, atol=TOL, rtol=TOL)
    untouched = [i for i in range(8) if i not in slots]
    assert torch.equal(pool[untouched], before[untouched])

    step = inputs(3, seed=12)  # one decode token for slots 5, 0 and 7
    index = torch.tensor([5, 0, 7])
    before = pool.clone()
    out = recurrent_gated_delta_rule_update_ref(*step[:5], pool, index)
    want, final = recurrent_gated_delta_rule_ref(*(t[:, None] for t in step[:5]), before[index])
    torch.testing.assert_close(out, want[:, 0], atol=TOL, rtol=TOL)
    torch.testing.assert_close(pool[index], final, atol=TOL, rtol=TOL)


def test_equals_hf_torch_fallback():
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    q, k, v, g, beta, state = inputs(77, seed=5)
    out, final = chunk_gated_delta_rule_ref(q, k, v, g, beta, state, chunk_size=16)
    fallback = getattr(hf.torch_chunk_gated_delta_rule, "__wrapped__", hf.torch_chunk_gated_delta_rule)
    want, want_final = fallback(q[None], k[None], v[None], g[None], beta[None], chunk_size=64,
                                initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, want[0], atol=TOL, rtol=TOL)
    torch.testing.assert_close(final, want_final[0], atol=TOL, rtol=TOL)


@pytest.mark.parametrize("cuts", [[], [1], [2, 3], [5, 40], [1, 2, 3, 4]])
def test_causal_conv1d_pieces_and_steps_equal_one_pass(cuts):
    """Varlen pieces with carried state, then single-token updates == one causal conv over everything
    (HF's causal_conv1d_fn: zero left padding), including pieces shorter than the kernel."""
    channels, width, length = 12, 4, 50
    gen = torch.Generator().manual_seed(len(cuts))
    x = torch.randn(length, channels, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    bias = torch.randn(channels, generator=gen)
    want = F.silu(F.conv1d(x.t()[None], weight[:, None], bias, padding=width - 1, groups=channels)[0, :, :length]).t()
    states = torch.zeros(3, channels, width - 1)
    slot = torch.tensor([2])
    prefill_end, pieces = length - 4, []
    for a, b in zip([0] + cuts, cuts + [prefill_end]):
        pieces.append(causal_conv1d_varlen_ref(x[a:b], weight, bias, states, slot, [0, b - a]))
    for t in range(prefill_end, length):
        pieces.append(causal_conv1d_update_ref(x[t:t + 1], weight, bias, states, slot))
    torch.testing.assert_close(torch.cat(pieces), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(states[2], x[-(width - 1):].t())  # the state is the last K-1 inputs
    assert not states[:2].any()
