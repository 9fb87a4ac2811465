"""MXFP8 quantization in one pass (Triton): both planes of a tile from one load.

Each program loads a ``BM x BK`` tile of the high-precision input once and writes, as asked, the
rowwise plane (1x32 blocks: one E8M0 scale per 32 elements of a row) and the columnwise plane
(32x1 blocks), each with the reference's rules (``mxfp8.py``, ``triton_fp8.py``). The columnwise
data can be written transposed, ``(K, M)`` contiguous, which is what the backward GEMMs read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_fp8 as f8
from .planes import Plane
from .triton_switches import fp8_max, software_cast

# Tiles and warps from a sweep on an H200 (8192^2 bf16;
# docs/benchmarks.md, "`quantize` after the kernel sweep"):
# both planes 118 us with 32 x 128 tiles and 2 warps (178 with 64 x 128 and 4); the rowwise plane
# alone 61 us with 32 x 256 and 2 warps; the columnwise alone 83 us with 32 x 128 and 2 warps.
_BOTH, _ROW_ONLY, _COL_ONLY = (32, 128, 2), (32, 256, 2), (32, 128, 2)


@triton.jit
def _mxfp8_kernel(x_ptr, M, K, stride_x,
                  row_ptr, row_scale_ptr, col_ptr, col_scale_ptr, stride_col_m, stride_col_k,
                  FP8_MAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, SOFTWARE: tl.constexpr,
                  ROW: tl.constexpr, COL: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = pid_k * BK + tl.arange(0, BK)
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    ax = f8.abs_no_nan(x)
    rcp: tl.constexpr = 1.0 / FP8_MAX  # TE multiplies by the fp32 reciprocal of fp8_max
    if ROW:
        amax = tl.max(tl.reshape(ax, (BM, BK // 32, 32)), axis=2)
        e = f8.e8m0_up(amax * rcp)
        s = f8.e8m0_reciprocal(e)
        q = f8.encode_fp8(tl.reshape(x, (BM, BK // 32, 32)), s[:, :, None], FP8_MAX, MBITS, BIAS, SOFTWARE)
        tl.store(row_ptr + offs_m[:, None] * K + offs_k[None, :], tl.reshape(q, (BM, BK)), mask=mask)
        offs_g = pid_k * (BK // 32) + tl.arange(0, BK // 32)
        tl.store(row_scale_ptr + offs_m[:, None] * (K // 32) + offs_g[None, :], e.to(tl.uint8),
                 mask=(offs_m[:, None] < M) & (offs_g[None, :] < K // 32))
    if COL:
        amax = tl.max(tl.reshape(ax, (BM // 32, 32, BK)), axis=1)
        e = f8.e8m0_up(amax * rcp)
        s = f8.e8m0_reciprocal(e)
        q = f8.encode_fp8(tl.reshape(x, (BM // 32, 32, BK)), s[:, None, :], FP8_MAX, MBITS, BIAS, SOFTWARE)
        q = tl.reshape(q, (BM, BK))
        tl.store(col_ptr + offs_m[:, None] * stride_col_m + offs_k[None, :] * stride_col_k, q, mask=mask)
        offs_g = pid_m * (BM // 32) + tl.arange(0, BM // 32)
        tl.store(col_scale_ptr + offs_g[:, None] * K + offs_k[None, :], e.to(tl.uint8),
                 mask=(offs_g[:, None] < M // 32) & (offs_k[None, :] < K))


def _format(fp8_dtype: torch.dtype) -> tuple[int, int]:
    return (3, 7) if fp8_dtype == torch.float8_e4m3fn else (2, 15)


def quantize(hp: torch.Tensor, fp8_dtype: torch.dtype, *, rowwise: bool, columnwise: bool,
             columnwise_transposed: bool = False, out: dict[str, Plane] | None = None) -> dict[str, Plane]:
    """MXFP8 planes of a 2-D tensor (``M``, ``K`` multiples of 32), one pass over the input.

    Args:
        hp: 2-D bf16 / fp16 / fp32 tensor (row-major rows: stride ``(s, 1)``).
        fp8_dtype: E4M3 or E5M2.
        rowwise, columnwise: the planes to write.
        columnwise_transposed: store the columnwise data as a ``(K, M)`` contiguous buffer (the
            plane's ``data`` is then its ``.t()`` view, logical ``(M, K)``).
        out: existing planes to write into (an optimizer step's in-place requantization).

    Returns:
        The planes by usage (logical orientation; E8M0 scales ``(M, K/32)`` / ``(M/32, K)``).

    Example:
        >>> planes = quantize(w.cuda(), torch.float8_e4m3fn, rowwise=True, columnwise=True)
    """
    if hp.stride(1) != 1:
        hp = hp.contiguous()
    m, k = hp.shape
    out = dict(out or {})
    e8 = torch.float8_e8m0fnu
    if rowwise and "rowwise" not in out:
        out["rowwise"] = Plane(torch.empty((m, k), dtype=fp8_dtype, device=hp.device),
                               torch.empty((m, k // 32), dtype=e8, device=hp.device))
    if columnwise and "columnwise" not in out:
        data = (torch.empty((k, m), dtype=fp8_dtype, device=hp.device).t() if columnwise_transposed
                else torch.empty((m, k), dtype=fp8_dtype, device=hp.device))
        out["columnwise"] = Plane(data, torch.empty((m // 32, k), dtype=e8, device=hp.device))
    row, col = out.get("rowwise") if rowwise else None, out.get("columnwise") if columnwise else None
    for p in (row, col):
        if p is not None and not p.scale_inv.is_contiguous():
            raise ValueError("triton_mxfp8.quantize: scale_inv outputs must be contiguous")
    if row is not None and not row.data.is_contiguous():
        raise ValueError("triton_mxfp8.quantize: rowwise data must be contiguous")
    unused = hp  # pointer arguments of planes not written (their constexpr switch is off)
    mbits, bias = _format(fp8_dtype)
    u8 = lambda t: t.view(torch.uint8) if t is not None else unused  # noqa: E731
    col_data = col.data.view(torch.uint8) if col is not None else unused
    bm, bk, warps = _BOTH if row is not None and col is not None else _ROW_ONLY if row is not None else _COL_ONLY
    grid = (triton.cdiv(m, bm), triton.cdiv(k, bk))
    _mxfp8_kernel[grid](
        hp, m, k, hp.stride(0),
        u8(row.data if row else None), u8(row.scale_inv if row else None),
        col_data, u8(col.scale_inv if col else None),
        col_data.stride(0) if col is not None else 0, col_data.stride(1) if col is not None else 0,
        FP8_MAX=fp8_max(fp8_dtype), MBITS=mbits, BIAS=bias, SOFTWARE=software_cast(),
        ROW=row is not None, COL=col is not None, BM=bm, BK=bk, num_warps=warps)
    return {u: p for u, p in (("rowwise", row), ("columnwise", col)) if p is not None}
