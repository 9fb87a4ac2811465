"""FP8 blockwise quantization (Triton): 1x128 and 128x1 planes, or 128x128 blocks.

Each program loads one tile of the input once and writes, for 1-D recipes, the rowwise plane
(one scale per 128 elements of a row) or the columnwise plane (one per 128 elements of a column);
both 1-D planes take one launch each. For 2-D recipes it writes the one shared plane (one scale
per 128 x 128 tile). Scales follow TE's ``compute_scale_from_amax`` with the *input* dtype's max
for an overflowing scale (``blockwise.py``); ragged edge blocks are zero-padded for their amax,
as the reference pads. The columnwise data can be written transposed, ``(K, M)`` contiguous, for
the backward GEMMs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_fp8 as f8
from .planes import Plane
from .triton_switches import fp8_max, interpreting, software_cast

BLOCK = 128

# (BM, BK, warps, amax in the input dtype) per launch, from sweeps on an H200 (8192^2 bf16, kernel
# time; docs/benchmarks.md, "`quantize` after the kernel sweep" and "Issue 18's last measurements"):
# 128x128 blocks 63 us with 16 warps (85 with 8); the 1x128 rowwise plane 65 us with 64 x 128
# tiles, 4 warps, the amax in bf16 (76 us as 128 x 128, 16 warps, fp32); the 128x1 columnwise plane
# in the logical layout 86 us with 128 x 64 tiles, 4 warps, bf16 amax (135-151 us as 128 x 128),
# written transposed 79 us with 128 x 128 and 4 warps.
_TWO_D = (BLOCK, BLOCK, 16, False)
_ROWWISE = (64, BLOCK, 4, True)
_COLUMNWISE = (BLOCK, 64, 4, True)
_COLUMNWISE_TRANSPOSED = (BLOCK, BLOCK, 4, False)


@triton.jit
def _blockwise_kernel(x_ptr, M, K, stride_x,
                      row_ptr, row_scale_ptr, col_ptr, col_scale_ptr, stride_col_m, stride_col_k,
                      FP8_MAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, SOFTWARE: tl.constexpr,
                      EPS: tl.constexpr, POW2: tl.constexpr, VALUE_FOR_INF: tl.constexpr,
                      TWO_D: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                      AMAX_IN_INPUT_DTYPE: tl.constexpr):
    # A tile of BM x BK: 128 x 128 for 2-D blocks, BM x 128 for the rowwise plane, 128 x BK for
    # the columnwise plane (the program ids then index 128-element blocks along the blocked
    # dimension, as the scale stores below assume).
    tl.static_assert((not ROW and not TWO_D) or BK == 128)
    tl.static_assert((not COL and not TWO_D) or BM == 128)
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = pid_k * BK + tl.arange(0, BK)
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :], mask=mask, other=0.0)
    if AMAX_IN_INPUT_DTYPE:  # a bf16 / fp16 max is exact; keeping the tile narrow saves registers
        ax = f8.abs_no_nan(x)
    else:
        ax = f8.abs_no_nan(x.to(tl.float32))
    x = x.to(tl.float32)
    gk = tl.cdiv(K, 128)
    if TWO_D:
        amax = tl.max(tl.max(ax, axis=1), axis=0).to(tl.float32)
        scale = f8.scale_from_amax(amax, FP8_MAX, EPS, POW2, VALUE_FOR_INF)
        q = f8.encode_fp8(x, scale, FP8_MAX, MBITS, BIAS, SOFTWARE)
        tl.store(row_ptr + offs_m[:, None] * K + offs_k[None, :], q, mask=mask)
        tl.store(row_scale_ptr + pid_m * gk + pid_k, f8.reciprocal(scale))
    else:
        if ROW:
            amax = tl.max(ax, axis=1).to(tl.float32)  # (BM,): one block per row
            scale = f8.scale_from_amax(amax, FP8_MAX, EPS, POW2, VALUE_FOR_INF)
            q = f8.encode_fp8(x, scale[:, None], FP8_MAX, MBITS, BIAS, SOFTWARE)
            tl.store(row_ptr + offs_m[:, None] * K + offs_k[None, :], q, mask=mask)
            tl.store(row_scale_ptr + offs_m * gk + pid_k, f8.reciprocal(scale), mask=offs_m < M)
        if COL:
            amax = tl.max(ax, axis=0).to(tl.float32)  # (BK,): one block per column
            scale = f8.scale_from_amax(amax, FP8_MAX, EPS, POW2, VALUE_FOR_INF)
            q = f8.encode_fp8(x, scale[None, :], FP8_MAX, MBITS, BIAS, SOFTWARE)
            tl.store(col_ptr + offs_m[:, None] * stride_col_m + offs_k[None, :] * stride_col_k, q, mask=mask)
            tl.store(col_scale_ptr + pid_m * K + offs_k, f8.reciprocal(scale), mask=offs_k < K)


def quantize(hp: torch.Tensor, fp8_dtype: torch.dtype, *, block_dims: int, force_pow_2_scales: bool,
             amax_epsilon: float, rowwise: bool, columnwise: bool, columnwise_transposed: bool = False,
             out: dict[str, Plane] | None = None) -> dict[str, Plane]:
    """Blockwise planes of a 2-D tensor: one pass over the input per plane written.

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

    def launch(row, col, tile):
        bm, bk, num_warps, amax_in_input_dtype = tile
        unused = hp  # pointer arguments of planes not written (their constexpr switch is off)
        _blockwise_kernel[(triton.cdiv(m, bm), triton.cdiv(k, bk))](
            hp, m, k, hp.stride(0),
            row.data.view(torch.uint8) if row is not None else unused, row.scale_inv if row is not None else unused,
            col_data if col is not None else unused, col.scale_inv if col is not None else unused,
            col_data.stride(0) if col is not None else 0, col_data.stride(1) if col is not None else 0,
            FP8_MAX=fp8_max(fp8_dtype), MBITS=mbits, BIAS=bias, SOFTWARE=software_cast(),
            EPS=float(amax_epsilon), POW2=bool(force_pow_2_scales), VALUE_FOR_INF=float(torch.finfo(hp.dtype).max),
            TWO_D=two_d, ROW=row is not None, COL=col is not None, BM=bm, BK=bk,
            # Triton's interpreter computes bf16 with numpy on raw bits (NaN != NaN is false there):
            # it takes the fp32 amax; the GPU tests check the bf16 one.
            AMAX_IN_INPUT_DTYPE=amax_in_input_dtype and not interpreting(), num_warps=num_warps)

    transposed = col is not None and col_data.stride(0) == 1 and m > 1
    if two_d:
        launch(row, None, _TWO_D)
    else:
        # Both 1-D planes take two launches (the input read twice): one 128 x 128 tile for both
        # holds too much in registers (255 registers and spills at 4 warps; 192-263 us).
        if row is not None:
            launch(row, None, _ROWWISE)
        if col is not None:
            launch(None, col, _COLUMNWISE_TRANSPOSED if transposed else _COLUMNWISE)
    return {u: p for u, p in (("rowwise", row), ("columnwise", col)) if p is not None}
