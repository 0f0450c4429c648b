"""The support of the fused sampler's distribution: the tokens each row could have drawn (a "sampling mask").

A trainer that samples with top-k / top-p / min-p must renormalise its logprobs over the same kept set
the engine drew from (DeepSeek-V3.2's "keep sampling mask"); recomputing the set from its own logits
can move tokens at the cut (other logit bits, ties), so the engine reports the set itself.

The set is the sampler's own: {i : e_i >= t and e_i > 0}, e = min(exp2((l - m) * scale), 1) as the
sampler's draw computes it (m the row's max logit, scale = log2(e) / T, T = 1 for greedy rows), t the
threshold its filter search found (0 when nothing is cut). `kept_mask` runs the sampler's two launches
in teacher-forcing mode (steps 1 and 2 of `sampling.py` as when drawing: the same t, m and scale bits
for the same logits and knobs) storing each row's (t, m, scale), then one pass writes the mask with
the draw's expression for e. The plain-torch reference is `sampling_ref.kept_mask_ref`; the two agree
except at ties on a top-k cut (the kernel keeps every tied token, the reference exactly k).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout_kernels.sampling import BLOCK_V, CHUNK, _check_settings, _launch


@triton.jit
def _kept_mask_kernel(logits_ptr, stride_row, V, support_ptr, mask_ptr, BLOCK: tl.constexpr):
    """Grid (B, cdiv(V, BLOCK)): mask[row, i] = e_i >= t and e_i > 0 with the row's (t, m, scale)."""
    row = tl.program_id(0).to(tl.int64)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = idx < V
    t = tl.load(support_ptr + row * 3)
    m = tl.load(support_ptr + row * 3 + 1)
    scale = tl.load(support_ptr + row * 3 + 2)
    lg = tl.load(logits_ptr + row * stride_row + idx, mask=inside, other=float("-inf")).to(tl.float32)
    e = tl.minimum(tl.math.exp2((lg - m) * scale), 1.0)  # the draw's expression (sampling._draw)
    tl.store(mask_ptr + row * V + idx, ((e >= t) & (e > 0.0)).to(tl.int8), mask=inside)


# `sampling.sample`'s tuning knobs and their defaults: the mask is the draw's only with the draw's knobs
SAMPLE_KNOBS = dict(block_v=BLOCK_V, block_s=1024, num_thresholds=8, cap=512, num_warps=8, chunk=CHUNK,
                    num_warps_partials=4)


def kept_mask(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
              min_p: torch.Tensor, **knobs) -> torch.Tensor:
    """logits [B, V] float32 / bfloat16 / float16, settings as `sampling.sample`'s -> bool [B, V]: the
    tokens `sample` can draw from each row with these settings and knobs (the ones its processed
    logprob is renormalised over; greedy rows: T = 1 and no filter, as their logprob is reported).
    `knobs`: any of SAMPLE_KNOBS, as passed to `sample`."""
    unknown = set(knobs) - set(SAMPLE_KNOBS)
    assert not unknown, f"unknown knobs {sorted(unknown)}"
    knobs = {**SAMPLE_KNOBS, **knobs}
    batch, vocab = _check_settings(logits, temperature, top_k, top_p, min_p,
                                   torch.zeros(temperature.shape, dtype=torch.bool, device=logits.device))
    dev = logits.device
    support = torch.empty((batch, 3), dtype=torch.float32, device=dev)
    mask = torch.empty((batch, vocab), dtype=torch.int8, device=dev)
    if batch == 0:
        return mask.bool()
    targets = torch.zeros(batch, dtype=torch.int64, device=dev)  # forced mode reads a token; any will do
    logprobs = torch.empty(batch, dtype=torch.float32, device=dev)
    settings = (temperature, top_k, top_p, min_p, torch.zeros(batch, dtype=torch.bool, device=dev))
    _launch(logits, settings, temperature, (top_k,) * 4, targets, logprobs, None, False, True,
            *(knobs[name] for name in SAMPLE_KNOBS), support=support)
    block = min(2048, triton.next_power_of_2(vocab))
    _kept_mask_kernel[(batch, triton.cdiv(vocab, block))](logits, logits.stride(0), vocab, support, mask,
                                                          BLOCK=block)
    return mask.bool()
