"""Per-tensor FP8 scaling kernels (Triton): the amax of a tensor, and the cast with one scale
that writes the FP8 bytes and, in the same pass, their transpose (TE's ``_transpose``, what the
backward GEMMs read).

The scale is read from device memory (an amax reduced across shards, a delayed-scaling history),
or computed in the cast kernel from an amax in device memory with the recipe's rule, and the cast
also writes ``scale_inv``: a current-scaling quantization is two kernels (amax, cast) after one
zero fill, with nothing computed on or waited for by the host. Rules as ``Recipe.encode`` /
``Recipe.block_amax`` / ``scaling.scale_from_amax`` (``triton_fp8.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import triton_fp8 as f8
from .triton_switches import fp8_max, software_cast

# Tile sizes from a sweep on an H200 (8192^2 bf16;
# docs/benchmarks.md, "`quantize` after the kernel sweep"):
# a 16384-element amax block with 4 warps (35 us; 8192 with 8 warps, 38 us); cast tiles of
# 16 x 512 with 4 warps for the rowwise bytes alone (51 us; 64x64, 56 us) and 128 x 128 with 4
# warps when the transpose is written too (89 us; 64x64, 91 us).
_AMAX_BLOCK, _AMAX_WARPS = 16384, 4
_ROW_TILE, _TRANSPOSE_TILE, _CAST_WARPS = (16, 512), (128, 128), 4


@dataclass(frozen=True)
class ScaleRule:
    """``scale = numerator / max(amax, eps)`` (optionally rounded down to a power of two; 1 for a
    zero / Inf / NaN amax; an infinite quotient becomes FLT_MAX): ``scaling.scale_from_amax``
    with ``fp8_max`` replaced by ``numerator`` (delayed scaling's first scale divides
    ``fp8_max * 2^-margin``)."""

    numerator: float
    eps: float = 0.0
    pow2: bool = False


@triton.jit
def _amax_kernel(x_ptr, n, out_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    # |x| >= 0 (NaN dropped): the max of non-negative floats is the max of their int32 bits.
    tl.atomic_max(out_ptr, tl.max(f8.abs_no_nan(x), axis=0).to(tl.int32, bitcast=True))


@triton.jit
def _cast_kernel(x_ptr, M, K, stride_x, scale_ptr, scale_inv_ptr, out_ptr, out_t_ptr,
                 FP8_MAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, SOFTWARE: tl.constexpr,
                 FROM_AMAX: tl.constexpr, NUMERATOR: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr,
                 WRITE_SCALE_INV: tl.constexpr, ROW: tl.constexpr, TRANSPOSE: tl.constexpr,
                 TM: tl.constexpr, TK: tl.constexpr):
    if FROM_AMAX:  # scale_ptr holds the amax
        scale = f8.scale_from_amax(tl.load(scale_ptr), NUMERATOR, EPS, POW2, 3.4028234663852886e38)  # FLT_MAX
    else:
        scale = tl.load(scale_ptr)
    if WRITE_SCALE_INV:
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(scale_inv_ptr, f8.reciprocal(scale))
    offs_m = tl.program_id(0) * TM + tl.arange(0, TM)
    offs_k = tl.program_id(1) * TK + tl.arange(0, TK)
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    q = f8.encode_fp8(x, scale, FP8_MAX, MBITS, BIAS, SOFTWARE)
    if ROW:
        tl.store(out_ptr + offs_m[:, None] * K + offs_k[None, :], q, mask=mask)
    if TRANSPOSE:
        tl.store(out_t_ptr + offs_k[None, :] * M + offs_m[:, None], q, mask=mask)


def amax_into(hp: torch.Tensor, out: torch.Tensor) -> None:
    """``max(|hp|)`` (NaN ignored) into the fp32 element ``out``, a one-element view holding zero
    (the kernel max-reduces into it; callers allocate it with ``torch.zeros``)."""
    flat = hp.reshape(-1) if hp.is_contiguous() else hp.contiguous().reshape(-1)
    n = flat.numel()
    _amax_kernel[(triton.cdiv(n, _AMAX_BLOCK),)](flat, n, out.view(torch.int32), BLOCK=_AMAX_BLOCK, num_warps=_AMAX_WARPS)


def amax(hp: torch.Tensor) -> torch.Tensor:
    """``max(|hp|)`` over the whole tensor, NaN ignored, fp32 of shape ``(1, 1)``.

    Example:
        >>> amax(torch.tensor([[1.0, -3.0]], device="cuda"))  # tensor([[3.]])
    """
    out = torch.zeros((1, 1), dtype=torch.float32, device=hp.device)
    amax_into(hp, out)
    return out


def amaxes(hps: list[torch.Tensor]) -> torch.Tensor:
    """:func:`amax` of each tensor into one fp32 ``(n,)`` vector."""
    out = torch.zeros(len(hps), dtype=torch.float32, device=hps[0].device)
    for i, hp in enumerate(hps):
        amax_into(hp, out[i : i + 1])
    return out


def cast(hp: torch.Tensor, scale: torch.Tensor | None, fp8_dtype: torch.dtype, *, rowwise: bool = True,
         transposed: bool = False, out: torch.Tensor | None = None, amax: torch.Tensor | None = None,
         rule: ScaleRule | None = None, scale_inv_out: torch.Tensor | None = None,
         ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``saturate(hp * scale)`` as ``fp8_dtype`` (round to nearest even, NaN 0x7F) with one scale.

    Args:
        hp: 2-D high-precision tensor (row-major rows).
        scale: fp32 tensor of one element, on ``hp``'s device; or ``None`` with ``amax`` and
            ``rule``: the scale is then ``rule`` applied to ``amax`` in the kernel.
        fp8_dtype: E4M3 or E5M2.
        rowwise: write the ``(M, K)`` bytes (into ``out`` when given: contiguous, ``fp8_dtype``).
        transposed: also write their transpose ``(K, M)`` contiguous, in the same pass.
        amax, rule: see ``scale``.
        scale_inv_out: an fp32 one-element tensor the kernel writes ``1 / scale`` into.

    Returns:
        ``(data, transposed data)``, ``None`` for what was not asked.

    Example:
        >>> data, data_t = cast(x, torch.ones(1, device="cuda"), torch.float8_e4m3fn, transposed=True)
    """
    if hp.stride(1) != 1:
        hp = hp.contiguous()
    m, k = hp.shape
    if rowwise and out is None:
        out = torch.empty((m, k), dtype=fp8_dtype, device=hp.device)
    out_t = torch.empty((k, m), dtype=fp8_dtype, device=hp.device) if transposed else None
    # A pointer argument the kernel does not read or write (its constexpr switch is off): any
    # tensor of the right device, so no allocation.
    unused = hp
    if scale is None:
        if amax is None or rule is None:
            raise ValueError("triton_per_tensor.cast: give a scale, or an amax and a ScaleRule")
        scale_arg, rule_args = amax.reshape(1), dict(FROM_AMAX=True, NUMERATOR=rule.numerator, EPS=rule.eps, POW2=rule.pow2)
    else:
        scale_arg, rule_args = scale.reshape(1), dict(FROM_AMAX=False, NUMERATOR=1.0, EPS=0.0, POW2=False)
    if scale_arg.dtype != torch.float32:
        scale_arg = scale_arg.float()
    mbits, bias = (3, 7) if fp8_dtype == torch.float8_e4m3fn else (2, 15)
    tm, tk = _TRANSPOSE_TILE if transposed else _ROW_TILE
    _cast_kernel[(triton.cdiv(m, tm), triton.cdiv(k, tk))](
        hp, m, k, hp.stride(0), scale_arg, unused if scale_inv_out is None else scale_inv_out,
        out.view(torch.uint8) if rowwise else unused, out_t.view(torch.uint8) if transposed else unused,
        FP8_MAX=fp8_max(fp8_dtype), MBITS=mbits, BIAS=bias, SOFTWARE=software_cast(), **rule_args,
        WRITE_SCALE_INV=scale_inv_out is not None, ROW=rowwise, TRANSPOSE=transposed, TM=tm, TK=tk,
        num_warps=_CAST_WARPS)
    return (out if rowwise else None), out_t
