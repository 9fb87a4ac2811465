"""Public entry points: high precision -> :class:`QuantizedTensor`, and TE's storage layout."""

from __future__ import annotations

import torch

from .formats.base import COLUMNWISE, ROWWISE, Recipe, RecipeError, as_matrix_shape
from .tensor import QuantizedTensor

_HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def quantize(
    x: torch.Tensor,
    recipe: Recipe,
    *,
    rowwise: bool = True,
    columnwise: bool = True,
    scale: torch.Tensor | float | None = None,
) -> QuantizedTensor:
    """Quantize a high-precision tensor into the planes of ``recipe``, bit-exact with TE.

    Args:
        x: bf16 / fp16 / fp32 tensor, 2-D (a weight ``(M, K)``; more dims are accepted and
            flattened into rows as TE does).
        recipe: ``DelayedScaling()``, ``CurrentScaling()``, ``MXFP8()`` or ``Blockwise()``.
        rowwise: produce the plane read by the forward GEMM.
        columnwise: produce the plane read by the backward GEMM (for per-tensor and 128x128
            blockwise this is the same stored plane; TE's transpose is built on demand).
        scale: the per-tensor scale for delayed scaling (default: seeded from ``x``'s amax, see
            ``DelayedScaling.scale_from_amax``; TE's own initial scale is 1.0).

    Returns:
        A :class:`QuantizedTensor` of ``x``'s shape and dtype.

    Example:
        >>> q = dtensor_fp8.quantize(torch.randn(256, 512, dtype=torch.bfloat16), dtensor_fp8.MXFP8())
        >>> q.dequantize().shape
        torch.Size([256, 512])
    """
    if isinstance(x, QuantizedTensor):
        raise RecipeError(f"quantize: input of shape {tuple(x.shape)} is already quantized ({x.recipe!r})")
    if x.dtype not in _HP_DTYPES:
        raise RecipeError(f"quantize: input dtype must be one of {_HP_DTYPES}, got {x.dtype} (shape {tuple(x.shape)})")
    if not (rowwise or columnwise):
        raise RecipeError("quantize: at least one of rowwise / columnwise must be True")
    recipe.check_shape(tuple(x.shape))
    matrix = as_matrix_shape(x.shape)
    x2d = x.detach().reshape(matrix)
    # One call for all stored planes: recipes with a fused kernel write them from one read of x.
    planes = recipe.quantize_planes(x2d, recipe.stored_usages(rowwise, columnwise), scale=scale)
    usages = tuple(u for u, on in ((ROWWISE, rowwise), (COLUMNWISE, columnwise)) if on)
    q = QuantizedTensor.from_planes(planes, recipe, matrix, x.dtype, usages)
    return q if len(x.shape) == 2 else q.rebuild(shape=x.shape)


def te_layout(q: QuantizedTensor) -> dict[str, torch.Tensor]:
    """TE's own attribute names, shapes and dtypes for ``q`` (no TE import).

    ``_data`` / ``_transpose`` / ``_scale_inv`` for per-tensor recipes (``Float8Tensor``);
    ``_rowwise_data`` / ``_columnwise_data`` / ``_rowwise_scale_inv`` / ``_columnwise_scale_inv``
    for MXFP8 and blockwise, with TE's padded scale shapes (padding zero) and transposed
    columnwise storage. FP8 data is returned as uint8.

    Args:
        q: a quantized tensor.

    Example:
        >>> bufs = dtensor_fp8.te_layout(dtensor_fp8.quantize(w, dtensor_fp8.Blockwise(block_dims=1)))
        >>> bufs["_rowwise_scale_inv"].shape  # (ceil(K/128), roundup(M, 4))
    """
    return q.recipe.te_layout(q.planes, tuple(q.shape), q.usages)
