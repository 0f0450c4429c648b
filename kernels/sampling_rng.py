"""The sampler's counter-based random numbers: one uniform per sampled token, keyed by
(seed, prompt_index, sample_index, position).

A splitmix64 chain over the four keys, 24 bits of the result as a float32 in [0, 1) (exact in
float32). Nothing depends on which other rows share the batch, so the same command draws the same
numbers whatever the batch, and a preempted request that recomputes draws them again. The host
function (`sampling_ref.uniform_from_keys`, the reference) and the device one here
(`_uniform_from_keys`, called by the sampling kernel; `sample_uniform` launches it alone) agree
bit for bit. Keys are Python ints of any sign or size, reduced mod 2^64 and passed to the device
as the int64 with the same bits (`sampling_ref.as_int64_key`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

@triton.jit
def _mix64(x):
    # splitmix64 finaliser on uint64 (wrapping arithmetic, logical shifts)
    x = x + 0x9E3779B97F4A7C15
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def _uniform_from_keys(seed, prompt_index, sample_index, position):
    """int64 keys (tensors of one shape) -> float32 uniforms in [0, 1), 24 bits."""
    h = _mix64(seed.to(tl.uint64, bitcast=True))
    h = _mix64(h ^ prompt_index.to(tl.uint64, bitcast=True))
    h = _mix64(h ^ sample_index.to(tl.uint64, bitcast=True))
    h = _mix64(h ^ position.to(tl.uint64, bitcast=True))
    return (h >> 40).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _sample_uniform_kernel(seed_ptr, pidx_ptr, sidx_ptr, pos_ptr, out_ptr, B, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < B
    u = _uniform_from_keys(tl.load(seed_ptr + i, mask=m, other=0), tl.load(pidx_ptr + i, mask=m, other=0),
                           tl.load(sidx_ptr + i, mask=m, other=0), tl.load(pos_ptr + i, mask=m, other=0))
    tl.store(out_ptr + i, u, mask=m)


def check_row_param(name, x, batch, dtype, device):
    """Launcher check of a per-row input: [batch], `dtype`, on `device`, contiguous."""
    assert x.shape == (batch,), f"{name} must be [{batch}], got {tuple(x.shape)}"
    assert x.dtype == dtype, f"{name} must be {dtype}, got {x.dtype}"
    assert x.device == device, f"{name} is on {x.device}, logits on {device}"
    assert x.stride(0) == 1 or batch <= 1, f"{name} must be contiguous"


def sample_uniform(seed: torch.Tensor, prompt_index: torch.Tensor, sample_index: torch.Tensor,
                   position: torch.Tensor) -> torch.Tensor:
    """The device hash alone: int64 [B] keys -> [B] float32 uniforms."""
    n = seed.shape[0]
    for name, key in (("seed", seed), ("prompt_index", prompt_index), ("sample_index", sample_index),
                      ("position", position)):
        check_row_param(name, key, n, torch.int64, seed.device)
    out = torch.empty(n, dtype=torch.float32, device=seed.device)
    if n:
        block = min(1024, triton.next_power_of_2(n))
        _sample_uniform_kernel[(triton.cdiv(n, block),)](seed, prompt_index, sample_index, position, out, n,
                                                         BLOCK=block)
    return out
