"""Temperature / top-k / top-p / min-p sampling with the chosen token's logprob.

Randomness is one uniform number per sampled token, derived from
(seed, prompt_index, sample_index, position) by a counter-based hash, and
consumed by inverse-CDF sampling over the filtered distribution. Nothing
depends on which other requests share the batch, so the same command gives
the same tokens whatever the batch sizes, and a preempted request that
recomputes draws the same numbers again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64 finaliser: a bijective 64-bit mix."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _as_int64(value: int) -> int:
    """The int64 whose bits are value mod 2^64 (seeds may be any Python int)."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def sample_uniform(seed: int, prompt_index: int, sample_index: int, position: int) -> float:
    """A uniform number in [0, 1) fixed by its four keys."""
    h = _mix64(seed & _MASK64)
    for key in (prompt_index, sample_index, position):
        h = _mix64(h ^ (key & _MASK64))
    return (h >> 40) / float(1 << 24)  # 24 bits: exact in float32


@dataclass
class SamplingBatch:
    """Per-row sampling settings for B rows of logits, as device tensors."""

    temperature: torch.Tensor  # [B] float32, 0 for greedy rows
    top_p: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, 0 = off
    min_p: torch.Tensor  # [B] float32
    uniform: torch.Tensor | None  # [B] float32 in [0, 1), drawn on the host (torch path)
    raw_logprobs: torch.Tensor  # [B] bool: report log_softmax(logits) instead of after temperature
    needs_filter: bool  # any row uses top-p, top-k or min-p
    all_greedy: bool
    keys: torch.Tensor | None = None  # [4, B] int64 (seed, prompt_index, sample_index, position): device RNG

    @classmethod
    def build(cls, requests_and_positions, device, device_rng: bool = False) -> "SamplingBatch":
        """device_rng: pass the RNG keys to the Triton sampler instead of drawing uniforms here."""
        rows = list(requests_and_positions)
        params = [r.params for r, _ in rows]
        shared = params[0] if all(p is params[0] for p in params) else None  # one job: one params object
        distinct = [shared] if shared is not None else params

        def per_row(values_of, dtype):
            if shared is not None:  # a fill kernel instead of building and copying a list
                return torch.full((len(params),), values_of(shared), dtype=dtype, device=device)
            return torch.tensor([values_of(p) for p in params], dtype=dtype, device=device)

        uniform = keys = None
        if device_rng:
            keys = torch.tensor([[_as_int64(p.seed) for p in params], [r.prompt_index for r, _ in rows],
                                 [r.sample_index for r, _ in rows], [pos for _, pos in rows]],
                                dtype=torch.int64, device=device)
        else:
            uniform = torch.tensor([sample_uniform(p.seed, r.prompt_index, r.sample_index, pos)
                                    for (r, pos), p in zip(rows, params)], dtype=torch.float32, device=device)
        return cls(
            temperature=per_row(lambda p: p.temperature, torch.float32),
            top_p=per_row(lambda p: p.top_p, torch.float32),
            top_k=per_row(lambda p: p.top_k, torch.int64),
            min_p=per_row(lambda p: p.min_p, torch.float32),
            uniform=uniform,
            raw_logprobs=per_row(lambda p: p.logprobs_mode == "raw", torch.bool),
            needs_filter=any(p.top_p < 1.0 or p.top_k > 0 or p.min_p > 0.0 for p in distinct),
            all_greedy=all(p.temperature == 0.0 for p in distinct),
            keys=keys,
        )


def filter_probs(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Zero the tokens that top-k, top-p and min-p remove. probs [B, V] -> [B, V]."""
    vocab = probs.shape[-1]
    max_prob = probs.max(dim=-1, keepdim=True).values
    probs = torch.where(probs < batch.min_p[:, None] * max_prob, torch.zeros_like(probs), probs)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=probs.device)[None, :]
    top_k = torch.where(batch.top_k > 0, batch.top_k, torch.full_like(batch.top_k, vocab))
    drop = rank >= top_k[:, None]
    # nucleus on what top-k and min-p kept: drop a token once the mass before it reaches top_p
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= mass_before >= batch.top_p[:, None] * sorted_probs.sum(dim=-1, keepdim=True)
    drop[:, 0] = False  # the most likely token always survives
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] float32 -> (token ids [B] int64, logprob of each chosen token [B] float32)."""
    raw = torch.log_softmax(logits, dim=-1)
    greedy_rows = batch.temperature == 0.0
    if batch.all_greedy:
        tokens = logits.argmax(dim=-1)
        return tokens, raw.gather(-1, tokens[:, None]).squeeze(-1)
    temperature = torch.where(greedy_rows, torch.ones_like(batch.temperature), batch.temperature)
    processed = torch.log_softmax(logits / temperature[:, None], dim=-1)
    probs = processed.exp()
    if batch.needs_filter:
        probs = filter_probs(probs, batch)
    cdf = probs.cumsum(dim=-1)  # [B, V]
    target = batch.uniform[:, None] * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=logits.shape[-1] - 1)
    # float rounding can land past the last kept token: fall back to the last token with mass
    landed_on_zero = probs.gather(-1, tokens[:, None]).squeeze(-1) <= 0
    if bool(landed_on_zero.any()):
        last_kept = (probs > 0).long().cumsum(dim=-1).argmax(dim=-1)
        tokens = torch.where(landed_on_zero, last_kept, tokens)
    tokens = torch.where(greedy_rows, logits.argmax(dim=-1), tokens)
    chosen = torch.where(batch.raw_logprobs[:, None], raw, processed).gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, chosen
