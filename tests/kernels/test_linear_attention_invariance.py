"""The on-policy mode's Gated DeltaNet path: a token's conv output, delta-rule output and the states it
leaves have the same bits whether it was prefilled (in one call or in chunks) or decoded one token at
a time (interpreter on the CPU, compiled on a GPU)."""

from __future__ import annotations

import pytest
import torch

from rollout_kernels.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen
from rollout_kernels.gated_delta_rule import (chunk_gated_delta_rule_varlen_ref, recurrent_gated_delta_rule_update,
                                              recurrent_gated_delta_rule_varlen)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])
LENGTHS = [7, 1, 20]


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def _rows(lengths, t):
    """(flat row, sequence) of token t of every sequence that has one."""
    cu = _cu(lengths)
    return [(cu[b] + t, b) for b, n in enumerate(lengths) if t < n]


def _delta_inputs(dtype, hk=2, hv=4, dk=32, dv=24, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    total = sum(LENGTHS)
    q = torch.randn(total, hk, dk, generator=gen, device=DEV).to(dtype)
    k = torch.randn(total, hk, dk, generator=gen, device=DEV).to(dtype)
    v = torch.randn(total, hv, dv, generator=gen, device=DEV).to(dtype)
    g = -torch.rand(total, hv, generator=gen, device=DEV)
    beta = torch.rand(total, hv, generator=gen, device=DEV).to(dtype)
    states = torch.randn(len(LENGTHS) + 2, hv, dk, dv, generator=gen, device=DEV)
    return (q, k, v, g, beta), states


@pytest.mark.parametrize("dtype", DTYPES)
def test_delta_rule_prefill_equals_decoding_token_by_token(dtype):
    inputs, states = _delta_inputs(dtype)
    index = torch.tensor([3, 0, 4], device=DEV)
    prefilled_states = states.clone()
    prefilled = recurrent_gated_delta_rule_varlen(*inputs, prefilled_states, index, _cu(LENGTHS))
    # the chunked reference (other arithmetic): close, not equal
    ref_states = states.clone()
    want = chunk_gated_delta_rule_varlen_ref(*inputs, ref_states, index, _cu(LENGTHS))
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(prefilled.float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(prefilled_states, ref_states, atol=1e-4, rtol=1e-4)
    # decoded one token per call: bit for bit
    decoded_states, decoded = states.clone(), torch.empty_like(prefilled)
    for t in range(max(LENGTHS)):
        rows, seqs = zip(*_rows(LENGTHS, t))
        rows = torch.tensor(rows, device=DEV)
        decoded[rows] = recurrent_gated_delta_rule_update(*(x[rows] for x in inputs), decoded_states, index[list(seqs)])
    assert torch.equal(decoded, prefilled) and torch.equal(decoded_states, prefilled_states)
    # the long sequence prefilled in two chunks (5 + 15 tokens): the same bits again
    chunked_states = states.clone()
    start = _cu(LENGTHS)[2]
    first = recurrent_gated_delta_rule_varlen(*(x[start:start + 5] for x in inputs), chunked_states, index[2:], [0, 5])
    rest = recurrent_gated_delta_rule_varlen(*(x[start + 5:] for x in inputs), chunked_states, index[2:], [0, 15])
    assert torch.equal(torch.cat((first, rest)), prefilled[start:])
    assert torch.equal(chunked_states[4], prefilled_states[4])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [2, 4])
def test_conv_prefill_equals_decoding_token_by_token(dtype, width):
    gen = torch.Generator(device=DEV).manual_seed(width)
    channels, total = 37, sum(LENGTHS)
    x = torch.randn(total, channels, generator=gen, device=DEV).to(dtype)
    weight = torch.randn(channels, width, generator=gen, device=DEV).to(dtype)
    bias = torch.randn(channels, generator=gen, device=DEV).to(dtype)
    states = torch.randn(len(LENGTHS) + 1, channels, width - 1, generator=gen, device=DEV).to(dtype)
    index = torch.tensor([1, 3, 0], device=DEV)
    prefilled_states = states.clone()
    prefilled = causal_conv1d_varlen(x, weight, bias, prefilled_states, index, _cu(LENGTHS))
    decoded_states, decoded = states.clone(), torch.empty_like(prefilled)
    for t in range(max(LENGTHS)):
        rows, seqs = zip(*_rows(LENGTHS, t))
        rows = torch.tensor(rows, device=DEV)
        decoded[rows] = causal_conv1d_update(x[rows], weight, bias, decoded_states, index[list(seqs)])
    assert torch.equal(decoded, prefilled) and torch.equal(decoded_states, prefilled_states)
