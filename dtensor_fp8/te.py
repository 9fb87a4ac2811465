"""Transformer Engine adapter: TE tensors that share our FP8 bytes, and TE modules under FSDP2.

[Note: what is shared and what is built at the TE boundary]
:func:`to_te_tensor` wraps a :class:`QuantizedTensor` in TE's own class (``Float8Tensor`` for the
per-tensor recipes, ``Float8BlockwiseQTensor`` for blockwise, ``MXFP8Tensor``) so TE's GEMMs read
it. Which class, which buffers, which quantizer: each recipe declares it once, as its
``te_binding`` (``formats/te_binding.py``); this module reads that declaration and never asks
which recipe it holds. FP8 data whose layout agrees with TE's is shared, not copied (the rowwise
plane, MXFP8's columnwise plane, the per-tensor ``_scale_inv``, and block scales whose grid needs no
padding); what TE lays out differently is built here: padded (and for 1x128 blockwise, transposed)
scale tensors — a few KB — and the transposed ``(K, M)`` columnwise data (per-tensor
``_transpose``, blockwise ``_columnwise_data``): for per-tensor and 128x128 blockwise that copy
*is* the transpose cache of ``tensor.py``.

:func:`from_te_tensor` is the inverse (TE tensor -> QuantizedTensor, FP8 bytes shared where the
layouts agree), and :func:`quantize_te_module_` turns the weights of TE modules (``te.Linear``,
``LayerNormLinear``, ``LayerNormMLP``, and the ones inside ``TransformerLayer``) into dtensor_fp8
parameters — from high precision, or from TE FP8 parameters made by ``te.quantized_model_init``
(masters from ``get_high_precision_init_val()`` when TE kept them).

[Note: TE tensors as FSDP2's unsharded parameters] is ``te_tensor.py``'s: the TE tensor over our
planes and the hook that makes one FSDP2's unsharded parameter live there, below ``fsdp.py``.

Transformer Engine is optional: it is imported on first use only (``formats/te_import.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn

from .formats import RECIPES
from .formats import te_import
from .formats.base import Recipe, RecipeError, as_matrix_shape
from .formats.te_binding import te_quantizer, te_recipe_for
from .fsdp import register_unsharded_view
from .te_tensor import FSDP_TE_VIEW, te_buffers, to_te_tensor, update_te_tensor_
from .tensor import QuantizedTensor

__all__ = [
    "FSDP_TE_VIEW", "from_te_tensor", "quantize_te_module_", "recipe_from_te", "te_buffers",
    "te_quantizer", "te_recipe_for", "to_te_tensor", "update_te_tensor_",
]


# ---- TE -> our recipe ---------------------------------------------------------------------------------
def recipe_from_te(t) -> Recipe:
    """Our recipe for a TE tensor: the one whose declared TE binding has ``t``'s class, quantizer
    class and flags, with the quantizer's arguments (TE's defaults where ``t`` has no quantizer;
    a ``Float8Tensor`` without one reads as delayed scaling).

    Args:
        t: a TE ``Float8Tensor`` / ``Float8BlockwiseQTensor`` / ``MXFP8Tensor`` (or storage).

    Example:
        >>> recipe_from_te(te_linear.weight)  # CurrentScaling(fp8_dtype=torch.float8_e4m3fn, ...)
    """
    fp8 = te_import.torch_fp8_dtype(getattr(t, "_fp8_dtype", None))
    if fp8 is None:
        raise RecipeError(f"from_te_tensor: TE dtype {getattr(t, '_fp8_dtype', None)!r} of a {type(t).__name__} "
                          "is not an FP8 dtype dtensor_fp8 stores")
    quantizer = getattr(t, "_quantizer", None)
    classes = {c.__name__ for c in type(t).__mro__}
    seen = []
    for default in RECIPES.values():
        b = default.te_binding
        if b.tensor_class not in classes and b.storage_class not in classes:
            continue
        if quantizer is not None and type(quantizer).__name__ != b.quantizer_class:
            continue
        flags = {arg: getattr(t, "_" + arg, value) for arg, value in b.tensor_flags}
        if flags != dict(b.tensor_flags):
            seen.append(f"{default.name} needs {dict(b.tensor_flags)}, the tensor has {flags}")
            continue
        fields = ({field: type(getattr(default, field))(getattr(quantizer, te_name))
                   for te_name, field in b.quantizer_fields} if quantizer is not None else {})
        return dataclasses.replace(default, fp8_dtype=fp8, **fields)
    raise RecipeError(
        f"from_te_tensor: no dtensor_fp8 recipe reads a TE {type(t).__name__} with quantizer "
        f"{type(quantizer).__name__}" + (f" ({'; '.join(seen)})" if seen else "")
        + ". Convert the weight before TE changes its layout (e.g. GEMM-swizzled MXFP8 scales), or quantize "
          "its high-precision values with one of dtensor_fp8.RECIPES")


# ---- TE -> QuantizedTensor ---------------------------------------------------------------------------
def from_te_tensor(t, *, dtype: torch.dtype | None = None) -> QuantizedTensor:
    """A :class:`QuantizedTensor` holding a TE tensor's FP8 bytes (shared where layouts agree).

    Args:
        t: ``Float8Tensor`` / ``Float8BlockwiseQTensor`` / ``MXFP8Tensor`` (or their storage classes).
        dtype: nominal dtype (default: ``t.dtype``).

    Example:
        >>> q = from_te_tensor(te_linear.weight)  # a te.quantized_model_init weight
    """
    recipe = recipe_from_te(t)
    b = recipe.te_binding
    shape = tuple(t.shape)
    bufs = {}
    for buf in b.buffers:
        value = getattr(t, buf.name, None)
        if buf.invalid_flag is not None and getattr(t, buf.invalid_flag, False):
            value = None
        bufs[buf.name] = value
    planes, usages = b.planes_from(recipe, bufs, shape)
    # TE's transpose cache is not carried over: it is rebuilt from the shared bytes when needed.
    return QuantizedTensor.from_planes(planes, recipe, as_matrix_shape(shape), dtype or t.dtype, usages)


# ---- TE modules ---------------------------------------------------------------------------------------
def _is_te_module(m: nn.Module) -> bool:
    ns = te_import.load()
    return ns is not None and isinstance(m, ns.TransformerEngineBaseModule)


def _is_te_quantized(p) -> bool:
    ns = te_import.load()
    return ns is not None and isinstance(p, ns.QuantizedTensor)


def quantize_te_module_(
    module: nn.Module,
    recipe: Recipe | None = None,
    *,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    keep_hp_init: bool = True,
) -> nn.Module:
    """Replace the 2-D weights of TE modules by dtensor_fp8 parameters, in place (before ``fully_shard``).

    Each TE module (``te.Linear``, ``LayerNormLinear``, ``LayerNormMLP``, ... also inside
    ``TransformerLayer``) gets its 2-D weight parameters (``weight``, ``fc1_weight``, ...)
    quantized with ``recipe``; a weight that already is a TE FP8 tensor (``te.quantized_model_init``)
    is converted with :func:`from_te_tensor` (its bytes kept) and its master starts from
    ``get_high_precision_init_val()`` when TE kept it. The module is marked so FSDP2's all-gather
    returns TE tensors (see the notes at the top), which TE's GEMMs read directly.

    Use ``fuse_qkv_params=True`` in ``TransformerLayer`` / ``MultiheadAttention``: with split Q/K/V
    parameters TE concatenates the weights in forward, which is not an FP8 operation.

    Args:
        module: the model.
        recipe: our recipe for high-precision weights (must match the ``te.autocast`` recipe's weight
            quantizer; :func:`te_recipe_for` gives that TE recipe).
        filter_fn: ``(te_module, param_name) -> bool``; only accepted weights are converted.
        keep_hp_init: keep a CPU copy of each high-precision init value for the master weights.

    Modules built on the meta device (with or without TE's ``quantized_model_init``) are
    converted to FP8 parameters without bytes; ``fully_shard``, ``to_empty`` and TE's own
    ``reset_parameters()`` then initialize each rank's shard, and the optimizer makes the bytes
    (``dtensor_fp8.finish_init_``), as for ``quantize_module_``.

    Example:
        >>> quantize_te_module_(model, dtensor_fp8.CurrentScaling())
        >>> for layer in model.layers: fully_shard(layer)
    """
    from .module import fp8_parameter_values
    from .state_dict import register_state_dict_hooks

    for fqn, sub in module.named_modules():
        if not _is_te_module(sub):
            continue
        converted = False
        for pname, p in list(sub.named_parameters(recurse=False)):
            if p.dim() != 2 or isinstance(p, QuantizedTensor):
                continue
            if filter_fn is not None and not filter_fn(sub, pname):
                continue
            full = f"{fqn}.{pname}" if fqn else pname
            if _is_te_quantized(p) and not p.is_meta:
                q = from_te_tensor(p)
                init = p.get_high_precision_init_val() if hasattr(p, "get_high_precision_init_val") else None
                if keep_hp_init and init is not None:
                    q = q.rebuild(hp_init=init.detach().to("cpu", copy=True).reshape(q.shape))
            else:
                # High precision, or built on the meta device (with or without TE's
                # quantized_model_init): the bytes come from the values, made now or, on meta, by
                # finish_init_ after to_empty and reset_parameters() (see module.py's note).
                if recipe is None:
                    raise RecipeError(f"quantize_te_module_: {full} has no FP8 bytes to convert (high precision, or "
                                      "built on the meta device); pass the recipe of your te.autocast")
                # A TE FP8 parameter on meta is read by its shape and nominal dtype only.
                values = torch.empty(tuple(p.shape), dtype=p.dtype, device="meta") if p.is_meta else p.detach()
                q = fp8_parameter_values(values, recipe, keep_hp_init)
            setattr(sub, pname, nn.Parameter(q, requires_grad=p.requires_grad))
            q.param_state.links.set_home_(sub, pname)  # where writes find its DTensor (groups.py)
            converted = True
        if converted:
            # TE's reset_parameters() would quantize a primary FP8 weight with its own quantizer;
            # ours are initialized through their pending values instead (ops/init.py).
            if getattr(sub, "primary_weights_in_fp8", False) and any(
                    isinstance(t, QuantizedTensor) and t.bytes_pending for t in sub.parameters(recurse=False)):
                sub.primary_weights_in_fp8 = False
            register_unsharded_view(sub, FSDP_TE_VIEW)  # FSDP2 gathers of sub's weights give TE tensors
            register_state_dict_hooks(sub)
    return module


