"""Teacher forcing on the fused sampler: the logprob `sampling.sample` reports for a GIVEN token.

`score_tokens` runs the sampler's own two launches (`sampling.py`), launch 2 with its FORCED flag:
the merge of the chunk partials and the top-k / top-p / min-p threshold search run as when sampling,
the draw is skipped, and the given token's logprob comes from the very expressions that report a
drawn token's. So a token scored from the same logits row, with the same settings and knobs, gets
the bits the sampler reported when it drew it (the on-policy mode's requirement); the plain-torch
`sampling_ref.token_logprobs_ref` agrees up to float rounding.
"""

from __future__ import annotations

import torch

from rollout_kernels.sampling import BLOCK_V, CHUNK, _check_settings, _launch
from rollout_kernels.sampling_rng import check_row_param


def score_tokens(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    raw_logprobs: torch.Tensor,
    workspace: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_v: int = BLOCK_V,
    block_s: int = 1024,
    num_thresholds: int = 8,
    cap: int = 512,
    num_warps: int = 8,
    chunk: int = CHUNK,
    num_warps_partials: int = 4,
) -> torch.Tensor:
    """logits [B, V] float32 / bfloat16 / float16, targets [B] int64 in [0, V) -> logprobs [B] float32:
    per row, the logprob `sample` reports when it draws targets[row] with these settings.

    Settings as `sample`'s: temperature [B] float32 (0 = greedy), top_k [B] int64 (0 = off),
    top_p [B] float32 (1 = off), min_p [B] float32 (0 = off), raw_logprobs [B] bool.
      - raw rows: log_softmax(logits)[target];
      - processed rows: log_softmax(logits / T)[target] renormalised over the kept set of the
        top-k / top-p / min-p filter; a target outside it (filtered out, or a probability that
        underflows to 0) gets -inf, as `token_logprobs_ref` gives;
      - greedy rows (T = 0): T = 1 and no filter, as the sampler reports its greedy token (so the
        argmax gets the sampler's bits, any other target its log_softmax).
    Bits equal the sampler's for the same logits (same dtype), settings and tuning knobs (block_v,
    block_s, num_thresholds, cap, num_warps, chunk, num_warps_partials, see `sample`); they do not
    depend on the batch a row is in. A target outside [0, V) reads as a -inf logit (logprob -inf;
    no host check, so no sync). `workspace` (`sample_workspace`, same knobs) and `out` [B] float32
    may be preallocated.
    """
    settings = (temperature, top_k, top_p, min_p, raw_logprobs)
    batch, _ = _check_settings(logits, *settings)
    dev = logits.device
    check_row_param("targets", targets, batch, torch.int64, dev)
    if out is None:
        out = torch.empty(batch, dtype=torch.float32, device=dev)
    check_row_param("out", out, batch, torch.float32, dev)
    # no draw: the uniform and key arguments are never read (any [B] tensors do)
    _launch(logits, settings, temperature, (top_k,) * 4, targets, out, workspace, False, True,
            block_v, block_s, num_thresholds, cap, num_warps, chunk, num_warps_partials)
    return out
