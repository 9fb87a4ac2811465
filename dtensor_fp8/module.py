"""Turning a model's ``nn.Linear`` weights into FP8 parameters."""

from __future__ import annotations

from typing import Callable

import torch
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
    """Replace the weights of ``nn.Linear`` layers by FP8 parameters, in place, all or nothing.

    Call it after initialization and before ``fully_shard``. A model built on the meta device is
    materialized and initialized first (``module.to_empty(device=...)``, then your init, e.g.
    ``reset_parameters()``), then quantized: FP8 bytes are a function of real values.

    Every selected layer is checked first — materialized, a weight shape the recipe can represent,
    a floating dtype, no NaN or Inf — and if any fails, a :class:`RecipeError` lists every failing
    layer and nothing is converted; otherwise all are converted.

    Args:
        module: the model.
        recipe: ``DelayedScaling()``, ``CurrentScaling()``, ``MXFP8()`` or ``Blockwise()``.
        filter_fn: ``(linear_module, fqn) -> bool``; only layers it accepts are converted.
            Default: every ``nn.Linear`` (use a filter to keep layers the recipe cannot represent,
            or that should stay precise, e.g. an output head, in high precision).
        keep_hp_init: keep a CPU copy of each high-precision weight for the master weights.

    Returns:
        ``module``.

    Example:
        >>> model = Transformer(args)                       # or on meta + to_empty + init
        >>> dtensor_fp8.quantize_module_(model, dtensor_fp8.MXFP8(), filter_fn=lambda m, fqn: fqn != "head")
        >>> for block in model.layers: fully_shard(block)
        >>> fully_shard(model)
    """
    targets = [(fqn, sub) for fqn, sub in module.named_modules()
               if isinstance(sub, nn.Linear) and not isinstance(sub.weight, QuantizedTensor)
               and (filter_fn is None or filter_fn(sub, fqn))]
    problems = [p for fqn, sub in targets if (p := _why_not_quantizable(f"{fqn}.weight" if fqn else "weight", sub.weight, recipe))]
    if problems:
        raise RecipeError(
            f"quantize_module_: nothing was converted; {len(problems)} of {len(targets)} selected Linear weights "
            f"cannot be quantized with {recipe!r}:\n  " + "\n  ".join(problems) +
            "\nFix those weights, or leave their layers out with filter_fn=lambda module, fqn: ... (they then stay "
            "in high precision)."
        )
    converted = [(fqn, sub, quantize(sub.weight.detach(), recipe)) for fqn, sub in targets]
    hp_init = getattr(module, HP_INIT_ATTR, {})
    for fqn, sub, q in converted:  # nothing can fail from here on
        weight = sub.weight
        sub.weight = nn.Parameter(q, requires_grad=weight.requires_grad)
        register_state_dict_hooks(sub)
        if keep_hp_init:
            hp_init[f"{fqn}.weight" if fqn else "weight"] = weight.detach().to("cpu", copy=True)
    setattr(module, HP_INIT_ATTR, hp_init)
    return module


def _why_not_quantizable(name: str, weight: torch.Tensor, recipe: Recipe) -> str | None:
    """Why ``weight`` cannot become an FP8 parameter of ``recipe`` (``None``: it can)."""
    shape = tuple(weight.shape)
    if weight.is_meta:
        return (f"{name} {shape} is on the meta device: materialize and initialize first (module.to_empty(device=...), "
                "then your init, e.g. reset_parameters())")
    if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"{name} {shape} has dtype {weight.dtype}; FP8 parameters are made from fp32 / bf16 / fp16 weights"
    try:
        recipe.check_shape(shape)
    except RecipeError as err:
        return f"{name}: {err}"
    finite = torch.isfinite(weight.detach())
    if not bool(finite.all()):
        nan = int(torch.isnan(weight.detach()).sum())
        return (f"{name} {shape} holds {nan} NaN and {int((~finite).sum()) - nan} infinite values: FP8 cannot store "
                "them faithfully (a NaN poisons its block or tensor; an Inf saturates to the FP8 maximum); fix the init")
    return None
