"""Triton device functions shared by the recipe kernels: the reference's scale and cast rules.

Each function mirrors one reference rule, bit for bit (see ``triton_kernels.py``):

* :func:`encode_fp8`: ``Recipe.encode``'s saturating round-to-nearest-even cast, NaN -> 0x7F, as
  bytes (the hardware conversion, or integer operations under the interpreter);
* :func:`e8m0_up` / :func:`e8m0_reciprocal`: ``mxfp8.float_to_e8m0`` / ``e8m0_reciprocal``;
* :func:`scale_from_amax`: ``scaling.scale_from_amax`` (TE's ``compute_scale_from_amax``), with an
  IEEE-rounded division.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _software_fp8(v, MBITS: tl.constexpr, BIAS: tl.constexpr):
    """Byte of a finite fp32 ``v`` already clamped to the format's range, round to nearest even."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    mag = bits & 0x7FFFFFFF
    a = mag.to(tl.float32, bitcast=True)
    # Normal FP8 values: round the fp32 mantissa to MBITS bits, ties to even (the carry moves
    # into the exponent by itself).
    drop: tl.constexpr = 23 - MBITS
    rounded = mag + ((1 << (drop - 1)) - 1) + ((mag >> drop) & 1)
    exp8 = (rounded >> 23) - 127 + BIAS
    normal = (exp8 << MBITS) | ((rounded >> drop) & ((1 << MBITS) - 1))
    # Subnormal FP8 values (below 2^(1-BIAS)): multiples of 2^(1-BIAS-MBITS); scale up exactly
    # and round to an integer with the fp32 adder (ties to even).
    q = tl.minimum(a, 2.0 ** (1 - BIAS)) * (2.0 ** (BIAS - 1 + MBITS))  # min: no int overflow below
    q = (q + 8388608.0) - 8388608.0
    sub = q.to(tl.int32)
    code = tl.where(a < 2.0 ** (1 - BIAS), sub, normal)
    return ((sign << 7) | code).to(tl.uint8)


@triton.jit
def encode_fp8(x, scale, FP8_MAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
               SOFTWARE: tl.constexpr):
    """``saturate(x * scale)`` as FP8 bytes (uint8), NaN -> 0x7F (TE's canonical NaN)."""
    v = x * scale
    c = tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX)
    if SOFTWARE:
        byte = _software_fp8(tl.where(v != v, 0.0, c), MBITS, BIAS)
    else:
        if MBITS == 3:
            byte = c.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            byte = c.to(tl.float8e5).to(tl.uint8, bitcast=True)
    return tl.where(v != v, 0x7F, byte).to(tl.uint8)


@triton.jit
def abs_no_nan(x):
    """``|x|`` with NaN -> 0 (TE's fmaxf amax reduction ignores NaN; Inf is kept)."""
    a = tl.abs(x)
    return tl.where(a != a, 0.0, a)


@triton.jit
def e8m0_up(v):
    """E8M0 byte (int32) of a non-negative fp32 ``v`` rounded up to a power of two (satfinite)."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    exponent = exponent + up.to(tl.int32)
    exponent = tl.where(v == float("inf"), 0xFE, exponent)
    exponent = tl.where(v != v, 0xFF, exponent)
    return tl.where(v == 0.0, 0, exponent)


@triton.jit
def e8m0_reciprocal(e):
    """``2^(127 - e)`` as fp32 (TE's ``exp2f_rcp``): e == 254 -> 2^-127 (denormal), 255 -> NaN."""
    bits = (254 - e) << 23
    bits = tl.where(e == 254, 0x00400000, bits)
    bits = tl.where(e == 255, 0x7FFFFFFF, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def scale_from_amax(amax, FP8_MAX: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr,
                    VALUE_FOR_INF: tl.constexpr):
    """TE's ``compute_scale_from_amax``: ``fp8_max / max(amax, eps)``, Inf -> VALUE_FOR_INF,
    optionally rounded down to a power of two; amax 0 / Inf / NaN -> 1."""
    a = tl.where(amax < EPS, EPS, amax)
    scale = tl.math.div_rn(tl.full(a.shape, FP8_MAX, tl.float32), a)
    scale = tl.where(scale == float("inf"), VALUE_FOR_INF, scale)
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)
    degenerate = (a == 0.0) | (a == float("inf")) | (a != a)
    return tl.where(degenerate, 1.0, scale)


@triton.jit
def reciprocal(scale):
    """``1 / scale`` in fp32, IEEE-rounded (the stored scale_inv)."""
    return tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
