"""The sampler's support (sampling_support.kept_mask, sampling_ref.kept_mask_ref): the tokens a row could
have drawn. Every drawn token is inside it, and the logprob the sampler reported is the token's
log-probability renormalised over it, so a trainer replaying the mask gets the engine's logprobs; the
Triton set equals the reference's away from top-k ties."""

from __future__ import annotations

import pytest
import torch

from rollout_kernels.sampling import sample
from rollout_kernels.sampling_ref import kept_mask_ref, sample_ref
from rollout_kernels.sampling_support import kept_mask

from test_sampling_score import BLOCKS, CHUNKED, DEV, ROWS, _keys, _logits, _params  # noqa: E402

REPLAY_TOL = 2e-5  # the replay sums e over the mask in another order than the sampler's partial sums


def _replayed(logits, mask, tokens, temperature):
    """What a trainer computes from the mask: log_softmax(logits / T) over the masked tokens, at `tokens`
    (T = 1 for greedy rows)."""
    t = torch.where(temperature == 0, torch.ones_like(temperature), temperature)
    scaled = (logits.float() / t[:, None]).masked_fill(~mask, float("-inf"))
    return torch.log_softmax(scaled, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)


@pytest.mark.parametrize("vocab, knobs", [(769, BLOCKS), (3001, CHUNKED)], ids=["one-chunk", "chunked"])
def test_drawn_tokens_lie_in_the_mask_and_replay_their_logprobs(vocab, knobs):
    processed = [(s, False) for s, _ in ROWS[::2]]
    params = _params(processed)
    batch = len(processed)
    logits = _logits(batch, vocab, seed=vocab + 1)
    mask = kept_mask(logits, *params[:4], **knobs)
    assert mask.dtype == torch.bool and mask.shape == (batch, vocab)
    filtered = (params[0] > 0) & ((params[1] > 0) | (params[2] < 1) | (params[3] > 0))
    assert bool((mask.sum(-1)[filtered] < vocab - 3).all())  # the filters cut something in every such row
    for position in (0, 1000, 2000):
        tokens, logprobs = sample(logits, *params, keys=_keys(batch, position), **knobs)
        assert bool(mask.gather(-1, tokens[:, None]).all())
        torch.testing.assert_close(_replayed(logits, mask, tokens, params[0]), logprobs, atol=REPLAY_TOL, rtol=0)


def test_the_reference_mask_replays_the_reference_sampler():
    processed = [(s, False) for s, _ in ROWS[::2]]
    params = _params(processed, device="cpu")
    batch = len(processed)
    logits = _logits(batch, 769, seed=3, device="cpu")
    mask = kept_mask_ref(logits, *params[:4])
    for position in (0, 1000, 2000):
        tokens, logprobs = sample_ref(logits, *params, keys=_keys(batch, position, device="cpu"))
        assert bool(mask.gather(-1, tokens[:, None]).all())
        torch.testing.assert_close(_replayed(logits, mask, tokens, params[0]), logprobs, atol=REPLAY_TOL, rtol=0)
    # the unfiltered rows keep every finite logit; -inf logits are never drawn
    unfiltered = (params[1] == 0) & (params[2] == 1) & (params[3] == 0) | (params[0] == 0)
    assert torch.equal(mask[unfiltered], ~torch.isneginf(logits[unfiltered]))


def test_kernel_and_reference_keep_the_same_tokens():
    """Random float32 logits have no ties: the two filters keep the same sets (min-p, top-k, top-p)."""
    params = _params([(s, False) for s, _ in ROWS[::2]])
    logits = _logits(len(ROWS[::2]), 769, seed=9)
    got = kept_mask(logits, *params[:4], **BLOCKS)
    want = kept_mask_ref(logits.cpu(), *(p.cpu() for p in params[:4]))
    assert torch.equal(got.cpu(), want)


def test_top_k_ties_are_kept_whole():
    """A tie across the top-k cut: the kernel keeps every tied token (its documented rule), and its mask
    still holds every token it draws."""
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0, -1.0, -2.0]], device=DEV)
    settings = (torch.tensor([1.0], device=DEV), torch.tensor([2], device=DEV), torch.tensor([1.0], device=DEV),
                torch.tensor([0.0], device=DEV))
    mask = kept_mask(logits, *settings, **BLOCKS)
    assert mask[0].tolist() == [True, True, True, True, False, False, False, False]
    raw = torch.tensor([False], device=DEV)
    drawn = {int(sample(logits, *settings, raw, uniform=torch.tensor([u], device=DEV), **BLOCKS)[0])
             for u in (0.0, 0.3, 0.6, 0.99)}
    assert drawn <= {0, 1, 2, 3} and len(drawn) > 1
