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
from .base import COLUMNWISE, ROWWISE, BlockShape, Recipe, RecipeError
from .triton_kernels import fast_path, kernels
from .per_tensor import _check_fp8_dtype
from .scaling import reciprocal, scale_from_amax
from .te_binding import TEBinding, TEBuffer
from .scaled_mm import GemmRecipe

BLOCK = 128
_SCALE_PAD = (1, 4)  # TE pads the inner dimension of blockwise scale tensors to a multiple of 4


def _te_binding(block_dims: int) -> TEBinding:
    """TE's ``Float8BlockwiseQTensor``: rowwise data shared, columnwise data ``(K, M)``; 1-D
    rowwise scales stored transposed; with 128x128 blocks the columnwise buffers are the rowwise
    plane's bytes and scales, transposed."""
    column_plane = COLUMNWISE if block_dims == 1 else ROWWISE
    buffers = (
        TEBuffer("_rowwise_data", "rowwise_data", (ROWWISE,), ROWWISE, "data"),
        TEBuffer("_rowwise_scale_inv", "rowwise_scale_inv", (ROWWISE,), ROWWISE, "scale_inv",
                 transposed=block_dims == 1, pad=_SCALE_PAD),
        TEBuffer("_columnwise_data", "columnwise_data", (COLUMNWISE,), column_plane, "data", transposed=True),
        TEBuffer("_columnwise_scale_inv", "columnwise_scale_inv", (COLUMNWISE,), column_plane, "scale_inv",
                 transposed=block_dims == 2, pad=_SCALE_PAD),
    )
    return TEBinding(
        "Float8BlockwiseQTensor", "Float8BlockwiseQTensorStorage", buffers, "Float8BlockQuantizer",
        quantizer_fields=(("force_pow_2_scales", "force_pow_2_scales"), ("amax_epsilon", "amax_epsilon"),
                          ("block_scaling_dim", "block_dims")),
        tensor_flags=(("is_2D_scaled", block_dims == 2),),
        te_recipe="Float8BlockScaling", te_recipe_fields=(("w_block_scaling_dim", "block_dims"),),
    )


_TE_BINDINGS = {1: _te_binding(1), 2: _te_binding(2)}


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

    @property
    def te_binding(self) -> TEBinding:
        return _TE_BINDINGS[self.block_dims]

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

    def gemm_recipe(self):
        # TE's Float8BlockScaling: 1x128 activations and gradients (x_/grad_block_scaling_dim=1) in
        # the recipe's format (E4M3 by default) and QParams; split accumulation in all GEMMs.
        operand = Blockwise(block_dims=1, fp8_dtype=self.fp8_dtype, force_pow_2_scales=self.force_pow_2_scales,
                            amax_epsilon=self.amax_epsilon)
        return GemmRecipe(input=operand, grad=operand, fast_accum=(False, False, False),
                          name=f"Float8BlockScaling(w_block_scaling_dim={self.block_dims})")

    def _triton(self, usages, **kw) -> dict:
        """The Triton kernel's planes (triton_blockwise.py) for ``usages`` (stored usages, or with
        ``out=`` existing planes to write)."""
        hp = kw.pop("hp")
        return kernels("blockwise").quantize(
            hp, self.fp8_dtype, block_dims=self.block_dims, force_pow_2_scales=self.force_pow_2_scales,
            amax_epsilon=self.amax_epsilon, rowwise=ROWWISE in usages, columnwise=COLUMNWISE in usages, **kw)

    def quantize_planes(self, hp, usages, *, scale=None):
        if scale is None and hp.dim() == 2 and fast_path(self, hp) == "triton":  # every plane, one read
            return self._triton(usages, hp=hp)
        return super().quantize_planes(hp, usages, scale=scale)

    def quantize_operand(self, hp, *, rowwise, columnwise, state=None):
        if fast_path(self, hp) == "triton":  # 1-D columnwise plane written transposed, as wgrad reads it
            usages = tuple(u for u, on in ((ROWWISE, rowwise), (COLUMNWISE, columnwise)) if on)
            planes = self._triton(usages, hp=hp, columnwise_transposed=True)
            return {u: planes[self.stored_usage(u)] for u in usages}, state
        return super().quantize_operand(hp, rowwise=rowwise, columnwise=columnwise, state=state)

    def requantize_planes_(self, usage, hps, planes, amaxes, states):
        if all(a is None for a in amaxes) and all(fast_path(self, hp) == "triton" for hp in hps) and all(
                p.data.is_contiguous() and p.scale_inv.is_contiguous() for p in planes):
            for hp, plane in zip(hps, planes, strict=True):  # written into the existing storage
                self._triton((usage,), hp=hp, out={self.stored_usage(usage): plane})
            return list(states)
        return super().requantize_planes_(usage, hps, planes, amaxes, states)

    def quantize_plane(self, hp, usage, *, amax=None, scale=None):
        path = fast_path(self, hp) if amax is None and scale is None else None
        if path == "triton":
            return self._triton((usage,), hp=hp)[self.stored_usage(usage)]
        if path == "te":  # same bytes, one pass (te_kernels.py)
            stored = self.stored_usage(usage)
            buffers = te_kernels.blockwise_quantize(
                hp, block_dims=self.block_dims, fp8_dtype=self.fp8_dtype, force_pow_2_scales=self.force_pow_2_scales,
                amax_epsilon=self.amax_epsilon, rowwise=stored == ROWWISE, columnwise=stored == COLUMNWISE)
            return self.from_te_layout(buffers, tuple(hp.shape))[stored]
        return super().quantize_plane(hp, usage, amax=amax, scale=scale)
