"""Writing e4m3 (float8_e4m3fn) from a Triton kernel, the same compiled and under the interpreter.

Compiled, `x.to(tl.float8e4nv)` rounds to nearest even. Under Triton's interpreter the float32 -> e4m3
conversion is wrong (126.0 became 64.0), but values already on the e4m3 grid convert exactly: so a
kernel that writes e4m3 takes `EMULATE_E4M3=emulate_e4m3()` as a constexpr and, when it is set, rounds
with `round_to_e4m3_grid` before the store (kernels/kv_store.py, kernels/fp8_blockwise.py). The tests
check the rounding against torch's over every e4m3 value and every midpoint between two.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl


def emulate_e4m3() -> bool:
    """Whether kernels writing e4m3 must round to the grid themselves: under the interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def round_to_e4m3_grid(x):
    """x float32 in [-448, 448] -> the nearest e4m3 value (ties to even), still float32. Normal
    e4m3 (|x| >= 2^-6) keeps 3 mantissa bits: round the float32 bits at bit 20. Subnormal e4m3 is a
    multiple of 2^-9: adding and taking away 2^14 (whose float32 ulp is 2^-9) rounds to it."""
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    magnitude = tl.abs(x)
    subnormal = (magnitude + 16384.0) - 16384.0
    subnormal = tl.where(x < 0, -subnormal, subnormal)
    return tl.where(magnitude < 0.015625, subnormal, normal)


# The torch references' bits (kernels/fp8_blockwise_ref.py): a scale is amax times the float32
# reciprocal of 448, a value is divided by its scale with IEEE division (div_rn, as torch divides two
# tensors). Triton's `/` on float32 compiles to the approximate div.full, which can be an ulp off.

@triton.jit
def e4m3_scale(amax, FP8_MAX_C: tl.constexpr, MIN_AMAX: tl.constexpr):
    """amax float32 (any shape) -> the scale that maps it to e4m3's largest value: max(amax, MIN_AMAX) * (1 / FP8_MAX_C)."""
    return tl.maximum(amax, MIN_AMAX) * (1.0 / FP8_MAX_C)


@triton.jit
def scaled_to_e4m3_grid(x, scale, FP8_MAX_C, EMULATE_E4M3: tl.constexpr):
    """x float32, scale broadcastable to it -> x / scale clamped to e4m3's range, float32 that is on the e4m3
    grid once stored as e4m3 (rounded here under the interpreter, module docstring)."""
    q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX_C, FP8_MAX_C)
    if EMULATE_E4M3:
        q = round_to_e4m3_grid(q)
    return q


@triton.jit
def quantize_groups(x, FP8_MAX_C: tl.constexpr, MIN_AMAX: tl.constexpr, EMULATE_E4M3: tl.constexpr):
    """x [GROUPS, GROUP] float32 -> (q [GROUPS, GROUP] float32 on the e4m3 grid once stored as e4m3,
    scale [GROUPS] float32): one scale per group, x ~= q * scale (the rule of
    fp8_blockwise_ref.quantize_activation_ref). Shared by every kernel that writes FP8 activations."""
    scale = e4m3_scale(tl.max(tl.abs(x), axis=1), FP8_MAX_C, MIN_AMAX)
    return scaled_to_e4m3_grid(x, scale[:, None], FP8_MAX_C, EMULATE_E4M3), scale
