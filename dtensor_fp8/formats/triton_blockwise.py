"""FP8 blockwise quantization in one pass (Triton): 1x128 and 128x1 planes, or 128x128 blocks.

Each program loads one ``128 x 128`` tile once. For 1-D recipes it writes the rowwise plane (one
scale per 128 elements of a row) and the columnwise plane (one per 128 elements of a column) as
asked; for 2-D recipes the one shared plane (one scale per tile). Scales follow TE's
``compute_scale_from_amax`` with the *input* dtype's max for an overflowing scale
(``blockwise.py``); ragged edge blocks are zero-padded for their amax, as the reference pads.
The columnwise data can be written transposed, ``(K, M)`` contiguous, for the backward GEMMs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_fp8 as f8
from .base import Plane
from .triton_kernels import fp8_max, software_cast

BLOCK = 128


@triton.jit
def _blockwise_kernel(x_ptr, M, K, stride_x,
                      row_ptr, row_scale_ptr, col_ptr, col_scale_ptr, stride_col_m, stride_col_k,
                      FP8_MAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, SOFTWARE: tl.constexpr,
                      EPS: tl.constexpr, POW2: tl.constexpr, VALUE_FOR_INF: tl.constexpr,
                      TWO_D: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr, B: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = pid_m * B + tl.arange(0, B)
    offs_k = pid_k * B + tl.arange(0, B)
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    ax = f8.abs_no_nan(x)
    gk = tl.cdiv(K, B)
    if TWO_D:
        amax = tl.max(tl.max(ax, axis=1), axis=0)
        scale = f8.scale_from_amax(amax, FP8_MAX, EPS, POW2, VALUE_FOR_INF)
        q = f8.encode_fp8(x, scale, FP8_MAX, MBITS, BIAS, SOFTWARE)
        tl.store(row_ptr + offs_m[:, None] * K + offs_k[None, :], q, mask=mask)
        tl.store(row_scale_ptr + pid_m * gk + pid_k, f8.reciprocal(scale))
    else:
        if ROW:
            amax = tl.max(ax, axis=1)  # (B,): one block per row
            scale = f8.scale_from_amax(amax, FP8_MAX, EPS, POW2, VALUE_FOR_INF)
            q = f8.encode_fp8(x, scale[:, None], FP8_MAX, MBITS, BIAS, SOFTWARE)
            tl.store(row_ptr + offs_m[:, None] * K + offs_k[None, :], q, mask=mask)
            tl.store(row_scale_ptr + offs_m * gk + pid_k, f8.reciprocal(scale), mask=offs_m < M)
        if COL:
            amax = tl.max(ax, axis=0)  # (B,): one block per column
            scale = f8.scale_from_amax(amax, FP8_MAX, EPS, POW2, VALUE_FOR_INF)
            q = f8.encode_fp8(x, scale[None, :], FP8_MAX, MBITS, BIAS, SOFTWARE)
            tl.store(col_ptr + offs_m[:, None] * stride_col_m + offs_k[None, :] * stride_col_k, q, mask=mask)
            tl.store(col_scale_ptr + pid_m * K + offs_k, f8.reciprocal(scale), mask=offs_k < K)


def quantize(hp: torch.Tensor, fp8_dtype: torch.dtype, *, block_dims: int, force_pow_2_scales: bool,
             amax_epsilon: float, rowwise: bool, columnwise: bool, columnwise_transposed: bool = False,
             out: dict[str, Plane] | None = None) -> dict[str, Plane]:
    """Blockwise planes of a 2-D tensor, one pass over the input (two when both 1-D planes are
    asked with the columnwise one transposed, which is faster; see the sweep note below).

    Args:
        hp: 2-D bf16 / fp16 / fp32 tensor (row-major rows).
        fp8_dtype: E4M3 or E5M2.
        block_dims: 1 (1x128 rowwise / 128x1 columnwise planes) or 2 (one 128x128 plane, stored as
            ``"rowwise"``; ``rowwise`` / ``columnwise`` then just ask for it).
        force_pow_2_scales, amax_epsilon: the recipe's scale rule.
        rowwise, columnwise: the planes to write (1-D).
        columnwise_transposed: store 1-D columnwise data ``(K, M)`` contiguous (``data`` is its
            ``.t()`` view).
        out: existing planes to write into (in-place requantization).

    Returns:
        The planes by stored usage, logical orientation (fp32 scale grids).

    Example:
        >>> planes = quantize(w.cuda(), torch.float8_e4m3fn, block_dims=1, force_pow_2_scales=True,
        ...                   amax_epsilon=0.0, rowwise=True, columnwise=True)
    """
    if hp.stride(1) != 1:
        hp = hp.contiguous()
    m, k = hp.shape
    gm, gk = triton.cdiv(m, BLOCK), triton.cdiv(k, BLOCK)
    out = dict(out or {})
    dev = hp.device
    two_d = block_dims == 2
    want_row = rowwise or (two_d and columnwise)
    want_col = columnwise and not two_d
    if want_row and "rowwise" not in out:
        out["rowwise"] = Plane(torch.empty((m, k), dtype=fp8_dtype, device=dev),
                               torch.empty((gm, gk) if two_d else (m, gk), dtype=torch.float32, device=dev))
    if want_col and "columnwise" not in out:
        data = (torch.empty((k, m), dtype=fp8_dtype, device=dev).t() if columnwise_transposed
                else torch.empty((m, k), dtype=fp8_dtype, device=dev))
        out["columnwise"] = Plane(data, torch.empty((gm, k), dtype=torch.float32, device=dev))
    row, col = (out["rowwise"] if want_row else None), (out["columnwise"] if want_col else None)
    for p in (row, col):
        if p is not None and (not p.scale_inv.is_contiguous() or p.scale_inv.dtype != torch.float32):
            raise ValueError("triton_blockwise.quantize: scale_inv outputs must be contiguous fp32")
    if row is not None and not row.data.is_contiguous():
        raise ValueError("triton_blockwise.quantize: rowwise data must be contiguous")
    col_data = col.data.view(torch.uint8) if col is not None else None
    mbits, bias = (3, 7) if fp8_dtype == torch.float8_e4m3fn else (2, 15)

    def launch(row, col, num_warps):
        unused = hp  # pointer arguments of planes not written (their constexpr switch is off)
        _blockwise_kernel[(gm, gk)](
            hp, m, k, hp.stride(0),
            row.data.view(torch.uint8) if row is not None else unused, row.scale_inv if row is not None else unused,
            col_data if col is not None else unused, col.scale_inv if col is not None else unused,
            col_data.stride(0) if col is not None else 0, col_data.stride(1) if col is not None else 0,
            FP8_MAX=fp8_max(fp8_dtype), MBITS=mbits, BIAS=bias, SOFTWARE=software_cast(),
            EPS=float(amax_epsilon), POW2=bool(force_pow_2_scales), VALUE_FOR_INF=float(torch.finfo(hp.dtype).max),
            TWO_D=two_d, ROW=row is not None, COL=col is not None, B=BLOCK, num_warps=num_warps)

    # Warps and launches from a sweep on an H200 (8192^2 bf16; docs/benchmarks.md, "`quantize`
    # after the kernel sweep"): 128x128 blocks 63 us with 16 warps (85 with 8); 1x128 rowwise alone 76 us with 16;
    # 128x1 columnwise alone 79 us written transposed with 4, 135 us in the logical layout with 8;
    # both planes from one read 188 us with 4 (logical layout), but 219 transposed, where two
    # launches (76 + 79 us, the input read twice) are faster.
    transposed = col is not None and col_data.stride(0) == 1 and m > 1
    if two_d:
        launch(row, None, 16)
    elif row is not None and col is not None and transposed:
        launch(row, None, 16)
        launch(None, col, 4)
    elif row is not None and col is not None:
        launch(row, col, 4)
    elif row is not None:
        launch(row, None, 16)
    else:
        launch(None, col, 4 if transposed else 8)
    return {u: p for u, p in (("rowwise", row), ("columnwise", col)) if p is not None}
