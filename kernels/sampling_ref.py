"""The sampler in plain torch: the reference of the fused Triton sampler (`sampling.py`) and the
host side of its random numbers (`sampling_rng.py` computes the same on the device).

No triton import here: the engine's torch path (the CPU default) samples with `sample_ref`, and
triton is optional there.

Randomness is one uniform number per sampled token, derived from (seed, prompt_index,
sample_index, position) by a counter-based hash (splitmix64), and consumed by inverse-CDF
sampling over the filtered distribution. Nothing depends on which other rows share the batch.
"""

from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1


def as_int64_key(value: int) -> int:
    """A Python int (any sign or size) as the int64 whose bits are value mod 2^64."""
    value &= MASK64
    return value - (1 << 64) if value >= (1 << 63) else value


def _mix64_host(x: int) -> int:
    """splitmix64 finaliser: a bijective 64-bit mix."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def uniform_from_keys(seed: int, prompt_index: int, sample_index: int, position: int) -> float:
    """A uniform number in [0, 1) fixed by its four keys (host reference of the device hash)."""
    h = _mix64_host(seed & MASK64)
    for key in (prompt_index, sample_index, position):
        h = _mix64_host(h ^ (key & MASK64))
    return (h >> 40) / float(1 << 24)  # 24 bits: exact in float32


def sample_uniform_ref(seed, prompt_index, sample_index, position) -> torch.Tensor:
    """`uniform_from_keys` over int64 key tensors [B] -> [B] float32 (on the keys' device)."""
    values = [uniform_from_keys(*k) for k in zip(seed.tolist(), prompt_index.tolist(), sample_index.tolist(),
                                                 position.tolist())]
    return torch.tensor(values, dtype=torch.float32, device=seed.device)


def filter_probs_ref(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     min_p: torch.Tensor) -> torch.Tensor:
    """Zero the tokens that min-p, then top-k, then top-p (on what is left) remove.
    probs [B, V]; top_k [B] int64 (0 = off), top_p [B] (1 = off), min_p [B] (0 = off) -> [B, V]."""
    vocab = probs.shape[-1]
    max_prob = probs.max(dim=-1, keepdim=True).values
    probs = torch.where(probs < min_p[:, None] * max_prob, torch.zeros_like(probs), probs)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=probs.device)[None, :]
    top_k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    drop = rank >= top_k[:, None]
    # nucleus on what top-k and min-p kept: drop a token once the mass before it reaches top_p
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= mass_before >= top_p[:, None] * sorted_probs.sum(dim=-1, keepdim=True)
    drop[:, 0] = False  # the most likely token always survives
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def _distributions(logits, temperature, top_k, top_p, min_p):
    """What the sampler draws from and reports with, computed once for both:
    (raw log_softmax(logits) [B, V], processed log_softmax(logits / T) [B, V] (T = 1 for greedy rows),
    the probabilities the filters keep [B, V] (None when no row filters), which rows report over the
    kept set [B] bool (filtering and not greedy; None likewise))."""
    logits = logits.float()
    raw = torch.log_softmax(logits, dim=-1)
    greedy = temperature == 0.0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    processed = torch.log_softmax(logits / t[:, None], dim=-1)
    if top_k is None:
        return raw, processed, None, None
    filters = (top_p < 1.0) | (top_k > 0) | (min_p > 0.0)
    if not bool(filters.any()):
        return raw, processed, None, None
    return raw, processed, filter_probs_ref(processed.exp(), top_k, top_p, min_p), filters & ~greedy


def _reported(raw, processed, kept, renormalise, raw_logprobs):
    """Every token's reported logprob [B, V]: raw rows raw; processed rows processed, renormalised over
    the kept set where `renormalise` (-inf outside it)."""
    if kept is not None and bool(renormalise.any()):
        renormalised = torch.where(kept > 0, processed - kept.sum(dim=-1, keepdim=True).log(),
                                   torch.full_like(processed, float("-inf")))
        processed = torch.where(renormalise[:, None], renormalised, processed)
    return torch.where(raw_logprobs[:, None], raw, processed)


def reported_logprobs_ref(logits, temperature, raw_logprobs, top_k=None, top_p=None, min_p=None):
    """Every token's logprob [B, V] as the sampler reports a drawn one. Raw rows: log_softmax(logits).
    Processed rows: log_softmax(logits / T) renormalised over the tokens top-k / top-p / min-p keep
    (the distribution the token was drawn from; -inf outside it), so that truncated sampling stays
    on-policy for a trainer's importance weights. Greedy rows (T = 0): T = 1, no filter.
    top_k [B] int64, top_p / min_p [B] float32, or None for no filters."""
    return _reported(*_distributions(logits, temperature, top_k, top_p, min_p), raw_logprobs)


def kept_mask_ref(logits, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """bool [B, V]: the tokens `sample_ref` can draw from each row (probability > 0 in the distribution
    it draws from: the filters' kept set, or the whole softmax when nothing filters) - the set its
    processed logprob is renormalised over. Greedy rows: T = 1 and no filter, as their logprob is
    reported. The Triton sampler's own set: `sampling_support.kept_mask`."""
    _, processed, kept, renormalise = _distributions(logits, temperature, top_k, top_p, min_p)
    support = processed.exp() > 0
    if kept is not None:
        support = torch.where(renormalise[:, None], kept > 0, support)
    return support


def sample_ref(logits, temperature, top_k, top_p, min_p, raw_logprobs, uniform=None, keys=None):
    """`sample` in plain torch, same arguments (uniform [B] float32, or keys: four int64 [B]).
    logits [B, V] -> (token ids [B] int64, logprob of each chosen token [B] float32)."""
    assert (uniform is None) != (keys is None), "pass exactly one of uniform= or keys="
    greedy_rows = temperature == 0.0
    if bool(greedy_rows.all()):
        logits = logits.float()
        tokens = logits.argmax(dim=-1)
        return tokens, torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    if uniform is None:
        uniform = sample_uniform_ref(*keys)
    distributions = _distributions(logits, temperature, top_k, top_p, min_p)
    raw, processed, kept, _ = distributions
    probs = processed.exp() if kept is None else kept
    cdf = probs.cumsum(dim=-1)  # [B, V]
    target = uniform[:, None] * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=logits.shape[-1] - 1)
    # float rounding can land past the last kept token: fall back to the last token with mass
    landed_on_zero = probs.gather(-1, tokens[:, None]).squeeze(-1) <= 0
    if bool(landed_on_zero.any()):
        last_kept = (probs > 0).long().cumsum(dim=-1).argmax(dim=-1)
        tokens = torch.where(landed_on_zero, last_kept, tokens)
    tokens = torch.where(greedy_rows, logits.float().argmax(dim=-1), tokens)
    # the reported logprob from the same tensors the draw used (token_logprobs_ref computes the same)
    return tokens, _reported(*distributions, raw_logprobs).gather(-1, tokens[:, None]).squeeze(-1)


def token_logprobs_ref(logits, tokens, temperature, raw_logprobs, top_k=None, top_p=None, min_p=None,
                       num_top: int = 0):
    """The logprob `sample_ref` reports when it draws `tokens` [B] from logits [B, V] with these settings
    (see reported_logprobs_ref): teacher forcing through the sampler's own expressions, so a token scored
    from the same logits row gets the same bits it was sampled with. -> [B] float32; with num_top > 0,
    also the num_top most likely tokens' ids [B, num_top] int64 and logprobs (the most likely first)."""
    reported = reported_logprobs_ref(logits, temperature, raw_logprobs, top_k, top_p, min_p)  # [B, V]
    chosen = reported.gather(-1, tokens[:, None]).squeeze(-1)
    if num_top <= 0:
        return chosen
    top = reported.topk(min(num_top, logits.shape[-1]), dim=-1)
    return chosen, top.indices, top.values
