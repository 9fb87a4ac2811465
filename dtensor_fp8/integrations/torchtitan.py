"""dtensor_fp8 inside torchtitan 0.3: FP8 parameters switched on from a torchtitan job config.

[Note: what a torchtitan user writes]
A job config (a ``Trainer.Config`` function, as torchtitan's ``config_registry`` modules hold)::

    from dtensor_fp8.integrations.torchtitan import (FP8CheckpointManager, FP8ParameterConverter,
                                                     master_weight_adamw)

    def llama3_debugmodel_fp8() -> Trainer.Config:
        config = llama3_debugmodel()
        config.model_spec = model_registry("debugmodel", converters=[
            FP8ParameterConverter.Config(recipe="mxfp8", filter_fqns=["lm_head"])])
        config.optimizer = master_weight_adamw(lr=8e-4)
        config.checkpoint = FP8CheckpointManager.Config(enable=True)   # any CheckpointManager field
        return config

Everything torchtitan does after that is its own code, unchanged: the meta-device build, its
``parallelize_*`` (FSDP2 with any ``spmd_backend``, tensor parallelism), ``pipeline_llm`` and its
schedules (each rank's stages are model parts: one ``MasterWeightOptimizer`` each), ``to_empty``
and ``init_weights``, its ``OptimizersContainer`` machinery, LR schedulers and its DCP
``CheckpointManager``.

[Note: the pieces]
* :class:`FP8ParameterConverter` is a ``QuantizationConverter`` like torchtitan's float8 and mx
  converters: it swaps each selected ``Linear.Config`` for :class:`FP8ParameterLinear.Config` (the
  same fields plus the recipe name), at config time, and refuses at once (listing every layer) a
  shape the recipe cannot hold, a Linear subclass it would replace, or a tied output head.
* :class:`FP8ParameterLinear` is torchtitan's ``Linear`` whose weight is an FP8 parameter, made by
  :func:`dtensor_fp8.quantize_module_` when torchtitan builds the model on the meta device. FSDP2
  then gathers its FP8 planes (forward: rowwise; backward: columnwise) where torchtitan gathers
  bf16; ``init_weights`` writes the weight's high-precision values, which the optimizer quantizes.
* :class:`MasterWeightOptimizersContainer` is torchtitan's ``OptimizersContainer`` whose optimizers
  are :class:`dtensor_fp8.MasterWeightOptimizer` over the optimizer class each param group names
  (FP32 masters of the FP8 weights; building it makes the FP8 bytes from ``init_weights``' values).
  torchtitan's own container over FP8 parameters is refused when the trainer builds
  :class:`FP8CheckpointManager` (right after the optimizers), else at the first forward or
  ``state_dict()``: the FP8 bytes are not made, and the error names this container.
* :class:`FP8CheckpointManager` (``torchtitan_checkpoint.py``) is torchtitan's checkpointer that
  starts an FP8 run from a bf16 / fp32 checkpoint (``initial_load_path``, ``initial_load_in_hf``)
  and writes the final model-only save in high precision (``export_dtype``, ``last_save_in_hf``).
* One FP8 converter a model: another FP8 converter applied before this one is refused at config
  time, one applied after it at ``init_weights`` (``_FP8WeightInit``); a ``filter_fqns`` entry
  that matches no Linear layer warns.
* The state dict: torchtitan's checkpointer keeps ``model.state_dict()``'s entries as tensors and
  refreshes them in place (``ModelWrapper``), so an FP8 weight's entry (a dict of planes, see
  ``dtensor_fp8/state_dict.py``) appears flattened: ``<fqn>.weight.rowwise_data``,
  ``...rowwise_scale_inv``, ... (the keys DCP gives the dict on disk), and the recipe config as a
  uint8 tensor of its JSON, ``<fqn>.weight.recipe`` (:data:`RECIPE_FIELD_BYTES` long). Loading
  gathers them back, and the library checks recipe and planes before any byte is written.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from torchtitan.components.optimizer import OptimizersContainer, default_adamw
from torchtitan.components.quantization import QuantizationConverter
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.config.override import derive
from torchtitan.models.common.linear import Linear

from ..fix_hints import MASTER_WEIGHTS, register_fix_hint
from ..formats.registry import recipe_named
from ..formats.base import RecipeError
from ..module import quantize_module_
from ..optim import MasterWeightOptimizer
from ..placement import local_tensor
from ..entry import RECIPE_FIELD_BYTES, recipe_from_tensor, recipe_tensor
from ..tensor import QuantizedTensor
from .torchtitan_state_dict import flatten_fp8_entries, gather_fp8_entries


class FP8ParameterLinear(Linear):
    """torchtitan's ``Linear`` with an FP8 weight parameter (see the notes).

    Built by :class:`FP8ParameterConverter` from a ``Linear.Config``; build it on the meta device
    (torchtitan's trainer does), then ``parallelize``, ``to_empty``, ``init_weights`` and build the
    :class:`MasterWeightOptimizersContainer`.

    Example:
        >>> with torch.device("meta"):
        ...     lin = FP8ParameterLinear.Config(in_features=256, out_features=512, recipe="mxfp8").build()
        >>> type(lin.weight).__name__
        'QuantizedTensor'
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        recipe: str = "mxfp8"
        """dtensor_fp8 recipe name: delayed, current, mxfp8, blockwise1d or blockwise2d."""

    def __init__(self, config: Config):
        super().__init__(config)
        # Registered before quantize_module_'s own hooks on loading, after them on saving.
        self.register_load_state_dict_pre_hook(gather_fp8_entries)
        quantize_module_(self, recipe_named(config.recipe, "FP8ParameterConverter"))
        self.register_state_dict_post_hook(flatten_fp8_entries)


class FP8ParameterConverter(QuantizationConverter):
    """Swap ``Linear.Config`` for :class:`FP8ParameterLinear.Config` in a torchtitan model config.

    Example:
        >>> spec = model_registry("debugmodel", converters=[
        ...     FP8ParameterConverter.Config(recipe="mxfp8", filter_fqns=["lm_head"])])
    """

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        recipe: str = "mxfp8"
        """dtensor_fp8 recipe name: delayed, current, mxfp8, blockwise1d or blockwise2d."""

        filter_fqns: list[str] = field(default_factory=list)
        """Linear layers to keep in high precision: any whose FQN contains one of these strings
        (torchtitan's float8 rule), e.g. ``["lm_head"]``."""

        targets: Literal["dense", "experts", "both"] = "dense"
        """What becomes FP8: ``"dense"`` the Linear layers, ``"experts"`` the routed experts'
        3-D weights (``GroupedExperts``, quantized per expert: ``torchtitan_experts.py``),
        ``"both"`` both."""

    def __init__(self, config: Config):
        self.config = config
        self.recipe = recipe_named(config.recipe, "FP8ParameterConverter")

    def convert(self, model_config):
        """The model config with every selected ``Linear.Config`` swapped, or a :class:`RecipeError`
        listing every selected layer that cannot be converted (nothing is swapped then). Refuses a
        config another FP8 converter already converted; warns of a ``filter_fqns`` entry that
        matches no Linear layer (its layers would silently become FP8)."""
        skip = self.config.filter_fqns
        if self.config.targets not in ("dense", "experts", "both"):
            raise RecipeError(f"FP8ParameterConverter: targets must be 'dense', 'experts' or 'both', got "
                              f"{self.config.targets!r}")
        if self.config.targets != "dense":
            from .torchtitan_experts import convert_grouped_experts

            model_config = convert_grouped_experts(model_config, self.config.recipe, self.recipe, skip)
            if self.config.targets == "experts":
                return model_config
        linears = list(model_config.traverse(Linear.Config))
        _refuse_a_second_fp8_converter(linears)
        for f in skip:
            if not any(f in fqn for fqn, *_ in linears):
                warnings.warn(
                    f"FP8ParameterConverter: filter_fqns entry {f!r} matches no Linear layer, so it keeps none in high "
                    f"precision (the model's Linear layers are e.g. {_examples([fqn for fqn, *_ in linears])}). Fix: "
                    "name them as the model does (torchtitan 0.3's output head is 'lm_head', not 'output')",
                    UserWarning, stacklevel=2)
        tied = bool(getattr(model_config, "enable_weight_tying", False))
        targets, problems = [], []
        for fqn, linear, parent, attr in linears:
            if any(f in fqn for f in skip):
                continue
            if type(linear) is not Linear.Config:
                problems.append(f"{fqn}: a {type(linear).__qualname__}, not a plain Linear.Config (converting it would "
                                "drop what the subclass does)")
                continue
            if tied and fqn.split(".")[-1] == "lm_head":
                problems.append(f"{fqn}: tied to the token embedding (enable_weight_tying); one FP8 parameter cannot "
                                "serve an embedding lookup")
                continue
            try:
                self.recipe.check_shape((linear.out_features, linear.in_features))
            except RecipeError as err:
                problems.append(f"{fqn}: {err}")
                continue
            targets.append((linear, parent, attr))
        if problems:
            raise RecipeError(
                f"FP8ParameterConverter({self.config.recipe!r}): nothing was converted; {len(problems)} Linear layers "
                "cannot hold FP8 parameters:\n  " + "\n  ".join(problems) +
                f"\nKeep them in high precision with filter_fqns=[...] (now {skip!r}), e.g. "
                f"filter_fqns={skip + [problems[0].split(':')[0]]!r}.")
        for linear, parent, attr in targets:
            new = derive(linear, FP8ParameterLinear.Config, recipe=self.config.recipe)
            if isinstance(new.param_init, dict) and "weight" in new.param_init:
                new.param_init = {**new.param_init, "weight": _FP8WeightInit(new.param_init["weight"], self.config.recipe)}
            if isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
        return model_config


#: where torchtitan's own quantized Linear configs live (Float8Linear, MXFP8Linear, NVFP4Linear)
_TORCHTITAN_QUANTIZATION = "torchtitan.components.quantization"
_ONE_CONVERTER = ("use one FP8 converter: FP8ParameterConverter alone (FP8 parameters, FP32 masters), or torchtitan's "
                  "float8 / mx converter alone (high-precision parameters, FP8 GEMMs)")


def _examples(fqns: list[str]) -> str:
    return ", ".join(repr(f) for f in fqns[:2]) + (f", ..., {fqns[-1]!r}" if len(fqns) > 2 else "")


def _refuse_a_second_fp8_converter(linears) -> None:
    """An FP8 converter applied before this one: refused, naming it and the layers it converted."""
    converted = [(fqn, type(linear)) for fqn, linear, _, _ in linears
                 if isinstance(linear, FP8ParameterLinear.Config)
                 or type(linear).__module__.startswith(_TORCHTITAN_QUANTIZATION)]
    if converted:
        kinds = sorted({kind.__qualname__ for _, kind in converted})
        raise RecipeError(
            f"FP8ParameterConverter: {len(converted)} Linear layers were already converted by another FP8 converter "
            f"({', '.join(kinds)}: {_examples([fqn for fqn, _ in converted])}); {_ONE_CONVERTER}")


class _FP8WeightInit:
    """``param_init["weight"]`` of a Linear the converter made FP8: the model's initializer, after
    a check that the weight it initializes is FP8. A converter applied after this one that swaps
    the Linear's config (torchtitan's ``Float8LinearConverter`` keeps ``param_init`` and drops
    the FP8 parameter) is caught here, at ``init_weights``, before any step."""

    def __init__(self, init, recipe: str) -> None:
        self.init, self.recipe = init, recipe

    def __call__(self, param: torch.Tensor):
        if not isinstance(local_tensor(param), QuantizedTensor):
            raise RecipeError(
                f"FP8ParameterConverter(recipe={self.recipe!r}) converted this Linear, but a converter applied after "
                f"it replaced the layer (its weight is a {param.dtype} parameter of shape {tuple(param.shape)}, not "
                f"FP8: torchtitan's Float8LinearConverter / MXFP8LinearConverter do this); {_ONE_CONVERTER}")
        return self.init(param)

    def __repr__(self) -> str:
        return f"FP8ParameterConverter({self.recipe!r}).weight_init({self.init!r})"


class MasterWeightOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` whose optimizers are
    :class:`dtensor_fp8.MasterWeightOptimizer` (see the notes): the same param groups, optimizer
    names, kwargs, state-dict layout and hooks; FP8 weights step through high-precision masters.

    Example:
        >>> config.optimizer = MasterWeightOptimizersContainer.Config(param_groups=[
        ...     ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 8e-4})])
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        master_dtype: Literal["float32", "bfloat16"] = "float32"
        """dtype of the FP8 weights' masters and of their optimizer state."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        self._master_dtype = TORCH_DTYPE_MAP[config.master_dtype]
        self._part_of = {id(p): part for part in model_parts for p in part.parameters()}
        super().__init__(config, model_parts=model_parts)

    def _resolve_optimizer_factory(self, name: str):
        """torchtitan's optimizer class for ``name``, built as the inner optimizer of a
        ``MasterWeightOptimizer`` over the model part that holds the group's parameters."""
        inner = OptimizersContainer._resolve_optimizer_factory(name)
        if not (isinstance(inner, type) and issubclass(inner, torch.optim.Optimizer)):
            raise ValueError(f"MasterWeightOptimizersContainer: optimizer_name={name!r} builds through a factory "
                             f"({getattr(inner, '__qualname__', inner)}), not a torch.optim.Optimizer class; FP8 "
                             "parameters train through MasterWeightOptimizer over an Optimizer class (Adam, AdamW)")

        def build(param_groups: list[dict[str, Any]], **kwargs: Any) -> MasterWeightOptimizer:
            part = self._part_of[id(param_groups[0]["params"][0])]
            return MasterWeightOptimizer(part, inner, param_groups, master_dtype=self._master_dtype, **kwargs)

        return build


def master_weight_adamw(lr: float = 8e-4, *, master_dtype: str = "float32",
                        **kwargs: Any) -> MasterWeightOptimizersContainer.Config:
    """torchtitan's ``default_adamw`` (one catch-all AdamW group), through
    :class:`MasterWeightOptimizersContainer`.

    Args:
        lr: learning rate.
        master_dtype: ``"float32"`` (default) or ``"bfloat16"``.
        **kwargs: more AdamW kwargs (``weight_decay=...``).

    Example:
        >>> config.optimizer = master_weight_adamw(lr=8e-4)
    """
    return MasterWeightOptimizersContainer.Config(param_groups=default_adamw(lr, **kwargs).param_groups,
                                                  master_dtype=master_dtype)


# the core's errors about training FP8 weights (a meta build's pending bytes, an optimizer writing in
# place) name the fix a torchtitan user needs, which the core does not know (``fix_hints.py``)
register_fix_hint(MASTER_WEIGHTS, "torchtitan", (
    "In torchtitan, set the job config's optimizer to dtensor_fp8.integrations.torchtitan.master_weight_adamw(...) "
    "(or MasterWeightOptimizersContainer.Config): torchtitan's own OptimizersContainer cannot train FP8 weights."))


from .torchtitan_checkpoint import FP8CheckpointManager  # noqa: E402,F401  (the checkpointer, beside the converter)

__all__ = ["FP8CheckpointManager", "FP8ParameterConverter", "FP8ParameterLinear", "MasterWeightOptimizersContainer",
           "RECIPE_FIELD_BYTES", "master_weight_adamw", "recipe_from_tensor", "recipe_tensor"]
