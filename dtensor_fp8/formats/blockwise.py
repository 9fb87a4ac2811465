"""FP8 blockwise scaling (TE ``Float8BlockScaling`` / ``Float8BlockwiseQTensor``).

* 1-D (``block_dims=1``): rowwise plane in 1x128 blocks, columnwise plane quantized separately in
  128x1 blocks (different bytes, so both planes are stored and moved).
* 2-D (``block_dims=2``): 128x128 blocks; the columnwise plane is the rowwise plane transposed.

TE's storage (``Float8BlockQuantizer.get_scale_shape``, GEMM-ready layout): columnwise data is
``(K, M)``; scale tensors are padded to a multiple of 4 along their inner dimension and the 1-D
rowwise scales are stored transposed, ``(ceil(K/128), roundup(M, 4))``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import te_kernels
from .base import COLUMNWISE, ROWWISE, BlockShape, Recipe, Plane, RecipeError, as_matrix_shape, dense, pad_2d, round_up, te_data, transpose_2d
from .per_tensor import _check_fp8_dtype
from .scaling import reciprocal, scale_from_amax

BLOCK = 128
_SCALE_PAD = 4  # TE pads the inner dimension of blockwise scale tensors to a multiple of 4


def _pad_cols(t: torch.Tensor, cols: int, reuse: torch.Tensor | None = None) -> torch.Tensor:
    return pad_2d(t, t.shape[0], cols, reuse)


@dataclass(frozen=True, repr=True)
class Blockwise(Recipe):
    """FP8 blockwise scaling with fp32 scales per 1x128 (``block_dims=1``) or 128x128 block.

    Args:
        block_dims: 1 for 1x128 rowwise / 128x1 columnwise blocks, 2 for 128x128 blocks.
        fp8_dtype: ``torch.float8_e4m3fn`` (TE's blockwise recipe also allows E5M2).
        force_pow_2_scales: round scales down to powers of two (TE's default: True).
        amax_epsilon: lower bound on each block's amax.

    Example:
        >>> q = dtensor_fp8.quantize(torch.randn(256, 512), Blockwise(block_dims=2))
    """

    block_dims: int = 2
    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    force_pow_2_scales: bool = True
    amax_epsilon: float = 0.0

    def __post_init__(self):
        if self.block_dims not in (1, 2):
            raise RecipeError(f"Blockwise: block_dims must be 1 (1x128 blocks) or 2 (128x128 blocks), got {self.block_dims}")
        _check_fp8_dtype("Blockwise", self.fp8_dtype)

    @property
    def name(self) -> str:
        return f"blockwise{self.block_dims}d"

    @property
    def columnwise_is_transpose(self) -> bool:  # type: ignore[override]
        return self.block_dims == 2

    def block_shape(self, usage: str) -> BlockShape:
        if self.block_dims == 2:
            return BlockShape(BLOCK, BLOCK)
        return BlockShape(1, BLOCK) if usage == ROWWISE else BlockShape(BLOCK, 1)

    def scale_from_amax(self, amax, usage, hp_dtype=torch.float32):
        scale = scale_from_amax(
            amax, torch.finfo(self.fp8_dtype).max,
            force_pow_2_scales=self.force_pow_2_scales, amax_epsilon=self.amax_epsilon,
            # TE's blockwise kernels replace an overflowing scale by the *input* dtype's max.
            value_for_inf=torch.finfo(hp_dtype).max,
        )
        return scale, reciprocal(scale)

    def quantize_plane(self, hp, usage, *, amax=None, scale=None):
        if amax is None and scale is None and te_kernels.takes_input(hp):  # same bytes, one pass (te_kernels.py)
            stored = self.stored_usage(usage)
            buffers = te_kernels.blockwise_quantize(
                hp, block_dims=self.block_dims, fp8_dtype=self.fp8_dtype, force_pow_2_scales=self.force_pow_2_scales,
                amax_epsilon=self.amax_epsilon, rowwise=stored == ROWWISE, columnwise=stored == COLUMNWISE)
            return self.from_te_layout(buffers, tuple(hp.shape))[stored]
        return super().quantize_plane(hp, usage, amax=amax, scale=scale)

    def te_layout(self, planes, shape, usages=(ROWWISE, COLUMNWISE), reuse=None):
        m, k = as_matrix_shape(shape)
        reuse = reuse or {}
        out = {}
        if ROWWISE in usages:
            p = planes[ROWWISE]
            out["_rowwise_data"] = te_data(p.data, shape, transposed=False)
            if self.block_dims == 1:  # (M, K/128) stored transposed
                out["_rowwise_scale_inv"] = _pad_cols(p.scale_inv.t(), round_up(m, _SCALE_PAD), reuse.get("_rowwise_scale_inv"))
            else:
                out["_rowwise_scale_inv"] = _pad_cols(p.scale_inv, round_up(p.scale_inv.shape[1], _SCALE_PAD), reuse.get("_rowwise_scale_inv"))
        if COLUMNWISE in usages:
            p = planes[self.stored_usage(COLUMNWISE)]
            out["_columnwise_data"] = te_data(p.data, shape, transposed=True)
            if self.block_dims == 1:  # (M/128, K)
                out["_columnwise_scale_inv"] = _pad_cols(p.scale_inv, round_up(k, _SCALE_PAD), reuse.get("_columnwise_scale_inv"))
            else:  # the transposed grid, (K/128, M/128)
                out["_columnwise_scale_inv"] = _pad_cols(p.scale_inv.t(), round_up(p.scale_inv.shape[0], _SCALE_PAD),
                                                    reuse.get("_columnwise_scale_inv"))
        return out

    def te_scale_extents(self, shape):
        m, k = as_matrix_shape(shape)
        gm, gk = -(-m // BLOCK), -(-k // BLOCK)
        if self.block_dims == 1:
            return {"_rowwise_scale_inv": (gk, m), "_columnwise_scale_inv": (gm, k)}
        return {"_rowwise_scale_inv": (gm, gk), "_columnwise_scale_inv": (gk, gm)}

    def from_te_layout(self, buffers, shape):
        m, k = as_matrix_shape(shape)
        planes = {}
        gm, gk = -(-m // BLOCK), -(-k // BLOCK)
        if buffers.get("_rowwise_data") is not None:
            s = buffers["_rowwise_scale_inv"]
            scale_inv = s[:gk, :m].t() if self.block_dims == 1 else s[:gm, :gk]
            planes[ROWWISE] = Plane(buffers["_rowwise_data"].view(self.fp8_dtype).reshape(m, k), dense(scale_inv))
        if buffers.get("_columnwise_data") is not None and (self.block_dims == 1 or ROWWISE not in planes):
            s = buffers["_columnwise_scale_inv"]
            scale_inv = s[:gm, :k] if self.block_dims == 1 else s[:gk, :gm].t()
            data = transpose_2d(buffers["_columnwise_data"].view(self.fp8_dtype).reshape(k, m))
            planes[self.stored_usage(COLUMNWISE)] = Plane(data, dense(scale_inv))
        return planes
