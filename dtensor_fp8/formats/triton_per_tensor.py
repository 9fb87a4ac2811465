"""Per-tensor FP8 scaling kernels (Triton): the amax of a tensor, and the cast with one scale
that writes the FP8 bytes and, in the same pass, their transpose (TE's ``_transpose``, what the
backward GEMMs read).

The scale is read from device memory (an amax reduced across shards, a delayed-scaling history),
so nothing waits for the host. Rules as ``Recipe.encode`` / ``Recipe.block_amax``
(``triton_fp8.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_fp8 as f8
from .triton_kernels import fp8_max, software_cast

_AMAX_BLOCK = 8192
_TILE = 64


@triton.jit
def _amax_kernel(x_ptr, n, out_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    # |x| >= 0 (NaN dropped): the max of non-negative floats is the max of their int32 bits.
    tl.atomic_max(out_ptr, tl.max(f8.abs_no_nan(x), axis=0).to(tl.int32, bitcast=True))


@triton.jit
def _cast_kernel(x_ptr, M, K, stride_x, scale_ptr, out_ptr, out_t_ptr,
                 FP8_MAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, SOFTWARE: tl.constexpr,
                 ROW: tl.constexpr, TRANSPOSE: tl.constexpr, T: tl.constexpr):
    offs_m = tl.program_id(0) * T + tl.arange(0, T)
    offs_k = tl.program_id(1) * T + tl.arange(0, T)
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    q = f8.encode_fp8(x, tl.load(scale_ptr), FP8_MAX, MBITS, BIAS, SOFTWARE)
    if ROW:
        tl.store(out_ptr + offs_m[:, None] * K + offs_k[None, :], q, mask=mask)
    if TRANSPOSE:
        tl.store(out_t_ptr + offs_k[None, :] * M + offs_m[:, None], q, mask=mask)


def amax_into(hp: torch.Tensor, out: torch.Tensor) -> None:
    """``max(|hp|)`` (NaN ignored) into the fp32 element ``out`` (one-element view, zeroed here)."""
    flat = hp.reshape(-1) if hp.is_contiguous() else hp.contiguous().reshape(-1)
    out.zero_()
    n = flat.numel()
    _amax_kernel[(triton.cdiv(n, _AMAX_BLOCK),)](flat, n, out.view(torch.int32), BLOCK=_AMAX_BLOCK, num_warps=8)


def amax(hp: torch.Tensor) -> torch.Tensor:
    """``max(|hp|)`` over the whole tensor, NaN ignored, fp32 of shape ``(1, 1)``.

    Example:
        >>> amax(torch.tensor([[1.0, -3.0]], device="cuda"))  # tensor([[3.]])
    """
    out = torch.empty(1, dtype=torch.float32, device=hp.device)
    amax_into(hp, out)
    return out.reshape(1, 1)


def amaxes(hps: list[torch.Tensor]) -> torch.Tensor:
    """:func:`amax` of each tensor into one fp32 ``(n,)`` vector."""
    out = torch.empty(len(hps), dtype=torch.float32, device=hps[0].device)
    for i, hp in enumerate(hps):
        amax_into(hp, out[i : i + 1])
    return out


def cast(hp: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, *, rowwise: bool = True,
         transposed: bool = False, out: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``saturate(hp * scale)`` as ``fp8_dtype`` (round to nearest even, NaN 0x7F) with one scale.

    Args:
        hp: 2-D high-precision tensor (row-major rows).
        scale: fp32 tensor of one element, on ``hp``'s device.
        fp8_dtype: E4M3 or E5M2.
        rowwise: write the ``(M, K)`` bytes (into ``out`` when given: contiguous, ``fp8_dtype``).
        transposed: also write their transpose ``(K, M)`` contiguous, in the same pass.

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
    dummy = hp.new_empty(1, dtype=torch.uint8)
    mbits, bias = (3, 7) if fp8_dtype == torch.float8_e4m3fn else (2, 15)
    _cast_kernel[(triton.cdiv(m, _TILE), triton.cdiv(k, _TILE))](
        hp, m, k, hp.stride(0), scale.float().reshape(1),
        out.view(torch.uint8) if rowwise else dummy, out_t.view(torch.uint8) if transposed else dummy,
        FP8_MAX=fp8_max(fp8_dtype), MBITS=mbits, BIAS=bias, SOFTWARE=software_cast(),
        ROW=rowwise, TRANSPOSE=transposed, T=_TILE, num_warps=4)
    return (out if rowwise else None), out_t
