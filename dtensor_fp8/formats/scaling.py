"""Scale rules shared by per-tensor current scaling and FP8 blockwise (TE's ``compute_scale_from_amax``)."""

from __future__ import annotations

import torch

# fp32 sign + exponent bits: masking a positive float with this rounds it down to a power of two.
_SIGN_EXPONENT_MASK = -8388608  # 0xFF800000 as int32


def pow2_floor(x: torch.Tensor) -> torch.Tensor:
    """Round positive fp32 values down to a power of two by clearing the mantissa bits.

    Written with bit operations because ``exp2(floor(log2(x)))`` is not exact at the edges
    (denormals, values just below a power of two after log2 rounding).
    """
    return (x.contiguous().view(torch.int32) & _SIGN_EXPONENT_MASK).view(torch.float32)


def quotient(numerator: float, denominator: torch.Tensor) -> torch.Tensor:
    """``numerator / denominator`` in fp32, rounded to nearest as an IEEE division (TE's CUDA
    ``/``) is, eager or compiled.

    [Note: exact scale division under torch.compile]
    Inductor lowers an fp32 division on CUDA to Triton's ``div.full.f32``, which may be 2 ulp off,
    and a scale one ulp off changes FP8 bytes. Its fp64 division is ``div.rn.f64`` (on CPU, C++
    ``double``), and an fp64 quotient of fp32 operands rounded once to fp32 is the correctly rounded
    fp32 quotient (53 >= 2 * 24 + 2 bits, so the double rounding cannot differ). The cost is nil:
    scales are one number per tensor or per block. (Inductor's ``eager_numerics.division_rounding``
    would do it too, but it is a process-wide switch that is the user's to set.)

    Args:
        numerator: an fp32-representable number (``fp8_max``, ``1.0``, ...).
        denominator: fp32 tensor.

    Example:
        >>> quotient(448.0, torch.tensor([3.0]))
        tensor([149.3333])
    """
    return (numerator / denominator.double()).float()


def scale_from_amax(
    amax: torch.Tensor,
    fp8_max: float,
    *,
    force_pow_2_scales: bool,
    amax_epsilon: float,
    value_for_inf: float = torch.finfo(torch.float32).max,
) -> torch.Tensor:
    """TE's ``compute_scale_from_amax`` (transformer_engine/common/recipe/recipe_common.cuh).

    In order: ``amax = max(amax, eps)``; an amax that is 0, Inf or NaN gives scale 1;
    ``scale = fp8_max / amax`` (fp32, round to nearest); an infinite quotient becomes
    ``value_for_inf``; then optionally the mantissa is cleared (power of two, rounded down).

    Args:
        amax: per-block amax, fp32.
        fp8_max: largest finite value of the FP8 format (448 for E4M3, 57344 for E5M2).
        force_pow_2_scales: round the scale down to a power of two.
        amax_epsilon: lower bound applied to amax before dividing.
        value_for_inf: replaces an overflowing scale: FLT_MAX for current scaling, the *input*
            dtype's max for blockwise (TE's ``compute_scale_from_types``).

    Example:
        >>> scale_from_amax(torch.tensor([2.0]), 448.0, force_pow_2_scales=True, amax_epsilon=0.0)
        tensor([128.])
    """
    amax = amax.float()
    amax = torch.where(amax < amax_epsilon, torch.full_like(amax, amax_epsilon), amax)
    scale = quotient(fp8_max, amax)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, value_for_inf), scale)
    if force_pow_2_scales:
        scale = pow2_floor(scale)
    degenerate = (amax == 0) | torch.isinf(amax) | torch.isnan(amax)
    return torch.where(degenerate, torch.ones_like(scale), scale)


def reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """``scale_inv = 1 / scale`` in fp32, as TE stores it (rounded to nearest, see :func:`quotient`)."""
    return quotient(1.0, scale.float())
