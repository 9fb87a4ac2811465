"""Turning a model's ``nn.Linear`` weights into FP8 parameters."""

from __future__ import annotations

from typing import Callable

from torch import nn

from .formats.base import Recipe, RecipeError
from .quantize import quantize
from .state_dict import register_state_dict_hooks
from .tensor import QuantizedTensor

#: ``module._dtensor_fp8_hp_init[fqn]``: the high-precision weight each FP8 parameter was quantized
#: from (kept on CPU), so :class:`MasterWeightOptimizer` can start the FP32 masters from the exact
#: initial values rather than from their FP8 rounding. The optimizer drops it once consumed.
HP_INIT_ATTR = "_dtensor_fp8_hp_init"


def quantize_module_(
    module: nn.Module,
    recipe: Recipe,
    *,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    keep_hp_init: bool = True,
) -> nn.Module:
    """Replace the weights of ``nn.Linear`` layers by FP8 parameters, in place.

    Call it after initialization and before ``fully_shard``. A model built on the meta device is
    materialized and initialized first (``module.to_empty(device=...)``, then your init, e.g.
    ``reset_parameters()``), then quantized: FP8 bytes are a function of real values.

    Args:
        module: the model.
        recipe: ``DelayedScaling()``, ``CurrentScaling()``, ``MXFP8()`` or ``Blockwise()``.
        filter_fn: ``(linear_module, fqn) -> bool``; only layers it accepts are converted.
            Default: every ``nn.Linear`` whose weight the recipe can represent.
        keep_hp_init: keep a CPU copy of each high-precision weight for the master weights.

    Returns:
        ``module``.

    Example:
        >>> model = Transformer(args)                       # or on meta + to_empty + init
        >>> dtensor_fp8.quantize_module_(model, dtensor_fp8.MXFP8())
        >>> for block in model.layers: fully_shard(block)
        >>> fully_shard(model)
    """
    hp_init = getattr(module, HP_INIT_ATTR, {})
    for fqn, sub in module.named_modules():
        if not isinstance(sub, nn.Linear) or isinstance(sub.weight, QuantizedTensor):
            continue
        if filter_fn is not None and not filter_fn(sub, fqn):
            continue
        weight = sub.weight
        if weight.is_meta:
            raise RecipeError(
                f"quantize_module_: {fqn or 'module'}.weight {tuple(weight.shape)} is on the meta device. "
                "Materialize and initialize first: module.to_empty(device=...), then your init "
                "(e.g. reset_parameters()), then quantize_module_."
            )
        q = quantize(weight.detach(), recipe)
        sub.weight = nn.Parameter(q, requires_grad=weight.requires_grad)
        register_state_dict_hooks(sub)
        if keep_hp_init:
            hp_init[f"{fqn}.weight" if fqn else "weight"] = weight.detach().to("cpu", copy=True)
    setattr(module, HP_INIT_ATTR, hp_init)
    return module
