"""FP8 parameters in state dicts: exact bytes as ordinary tensors, reshardable.

[Note: how an FP8 weight appears in a state dict]
``model.state_dict()`` (and so torch's ``get_state_dict`` / ``get_model_state_dict`` and
``dcp.save``) holds, for each FP8 weight, a dict instead of the parameter::

    "layers.0.w1.weight": {
        "rowwise_data": uint8 DTensor (M, K),          # the FP8 bytes
        "rowwise_scale_inv": fp32/uint8 DTensor (grid), # E8M0 scales as their bytes
        "columnwise_data": ..., "columnwise_scale_inv": ...,   # where the recipe stores it
        "recipe": '{"recipe": "MXFP8", "format": 1, "fp8_dtype": "float8_e4m3fn"}',
        "input_amax_history": fp32 (L,), "input_scale": ..., "grad_amax_history": ..., "grad_scale": ...,
    }

The last four are the FP8 GEMMs' operand scaling state (delayed scaling only, see
``param_state.py``): plain tensors, the same on every rank (their amaxes are all-reduced), so any
world size loads them. A checkpoint written before they were saved lacks them: it loads with
``load_checkpoint(..., strict=False)``, which names them as missing, and they start afresh, as
they did then.

Each tensor is a DTensor with the parameter's mesh: data keeps the parameter's placements, a scale
grid is sharded on the same dims where its blocks lie inside shards and replicated where one block
spans the dim (per-tensor scales). Since shards are block-aligned, every saved chunk holds whole
blocks, and DCP can load any other block-aligned sharding (N -> M ranks, 1-D <-> HSDP) exactly.
The recipe is a versioned JSON config of plain values (``formats/config.py``), stored as a string
value entry (DCP pickles it with ``torch.save``; ``load_checkpoint`` reads it with
``weights_only=True``); no dtensor_fp8 class is pickled and plain ``torch`` reads the checkpoint. A full state dict
(``StateDictOptions(full_state_dict=True)``) holds the same entries as full plain tensors; loading
one into a sharded model keeps each rank's block-aligned shard.

The tensors are copies, not views of the live planes: ``dcp.load`` then fills the copies, and only
``model.load_state_dict`` (our pre-hook checks recipe and planes first) writes into the model, so a
failing load leaves the model untouched.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from ._compat import dtensor_local
from .formats.base import Plane, RecipeError
from .formats.config import recipe_config, recipe_from_config
from .param_state import FP8ParamState
from .placement import like, local_tensor, shard_dim
from .requantize import local_slice, requantize_from_hp_
from .tensor import QuantizedTensor, one_byte_as_uint8

RECIPE_KEY = "recipe"

#: While set (to ``(dtype, masters)``), the state-dict hook puts each FP8 weight's high-precision
#: values in the state dict instead of its planes: its master's where ``masters`` (FQN -> master)
#: has one, else its dequantized FP8 values (``export_hp_state_dict``).
_EXPORT: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("_EXPORT", default=None)


def _scale_placements(param: DTensor, recipe, usage):
    """Scales follow the data's sharding, except along a dim one block spans (then replicated)."""
    return [
        Replicate() if shard_dim(p) is not None and recipe.spans_dim(usage, shard_dim(p)) else p
        for p in param.placements
    ]


def plane_entries(param: torch.Tensor) -> dict:
    """The state-dict entry of one FP8 parameter: its planes as plain/DTensor copies + recipe config.

    Args:
        param: a QuantizedTensor or a DTensor of one.

    Example:
        >>> sorted(plane_entries(dtensor_fp8.quantize(w, dtensor_fp8.MXFP8())))
        ['columnwise_data', 'columnwise_scale_inv', 'recipe', 'rowwise_data', 'rowwise_scale_inv']
    """
    q = local_tensor(param)
    q.check_bytes_made()
    entry = {RECIPE_KEY: recipe_config(q.recipe)}
    q.param_state.ensure_operand_states(q.recipe, q.device)
    for name, value in q.param_state.operand_entries().items():
        entry[name] = value.detach().clone()
    for usage, plane in q.planes.items():
        data = one_byte_as_uint8(plane.data).clone()
        scale = one_byte_as_uint8(plane.scale_inv).clone()
        if isinstance(param, DTensor):
            grid = q.recipe.block_shape(usage).grid(tuple(param.shape))
            data = like(param, data)
            scale = DTensor.from_local(scale, param.device_mesh, _scale_placements(param, q.recipe, usage),
                                       run_check=False, shape=torch.Size(grid), stride=(grid[1], 1))
        entry[f"{usage}_data"] = data
        entry[f"{usage}_scale_inv"] = scale
    return entry


def _fp8_params(module):
    return [(name, p) for name, p in module.named_parameters(recurse=False) if isinstance(local_tensor(p), QuantizedTensor)]


def _state_dict_hook(module, state_dict, prefix, local_metadata):
    export = _EXPORT.get()
    for name, p in _fp8_params(module):
        key = prefix + name
        if key not in state_dict:
            continue
        if export is None:
            state_dict[key] = plane_entries(p)
            continue
        dtype, masters = export
        master, q = masters.get(key), local_tensor(p)
        if master is not None:
            state_dict[key] = like(p, local_tensor(master).detach().to(dtype, copy=True))
        elif q.bytes_pending:  # a meta-built weight before finish_init_: its values are all it has
            state_dict[key] = like(p, q.hp_init.to(dtype, copy=True))
        else:
            state_dict[key] = like(p, q.dequantize(dtype))


def check_saved_recipe(name: str, saved, recipe) -> None:
    """Raise a :class:`RecipeError` naming both recipes and the fix unless the checkpoint's recipe
    config ``saved`` (any format) is ``recipe``."""
    theirs = recipe_from_config(saved)
    if theirs != recipe:
        raise RecipeError(
            f"{name}: the checkpoint holds this weight in {theirs!r}, the model in {recipe!r}. Build the model with "
            f"the checkpoint's recipe ({theirs!r}) to load it exactly; or switch recipes through high precision: "
            "load it into a model and optimizer of the checkpoint's recipe, then hp = "
            "dtensor_fp8.export_hp_state_dict(model, torch.float32, optimizer=opt); "
            "dtensor_fp8.load_hp_state_dict(new_model, hp, optimizer=new_opt) keeps the FP32 masters exactly "
            "and requantizes every weight in the new recipe; new_opt.load_state_dict(opt.state_dict()) carries the "
            "optimizer's moments too. What resets: the FP8 bytes (requantized), and the old recipe's scaling state."
        )


def entry_to_param(entry: dict, param: torch.Tensor, name: str) -> torch.Tensor:
    """Validate a saved FP8 entry against the model's parameter and rebuild it (same class and
    sharding as ``param``) so ``load_state_dict``'s ``copy_`` moves exact bytes. Entries of the
    parameter's shard shape (DCP) and of its full shape (a full state dict) are both accepted.

    Args:
        entry: the saved entry (see the note).
        param: the model's parameter.
        name: its FQN, for messages.
    """
    q = local_tensor(param)
    check_saved_recipe(name, entry.get(RECIPE_KEY), q.recipe)
    full = isinstance(param, DTensor) and _holds_full_planes(entry, param)
    shape = tuple(param.shape) if full else tuple(q.shape)
    planes = {}
    for usage, plane in q.planes.items():
        missing = [k for k in (f"{usage}_data", f"{usage}_scale_inv") if k not in entry]
        if missing:
            raise RecipeError(f"{name}: checkpoint entry lacks {missing} (has {sorted(entry)}); the model needs the {usage} plane")
        data, scale = local_tensor(entry[f"{usage}_data"]), local_tensor(entry[f"{usage}_scale_inv"])
        want = (shape, q.recipe.block_shape(usage).grid(shape)) if full else (tuple(plane.data.shape), tuple(plane.scale_inv.shape))
        if tuple(data.shape) != want[0] or tuple(scale.shape) != tuple(want[1]):
            raise RecipeError(
                f"{name}: {usage} plane of shape {tuple(data.shape)} / scales {tuple(scale.shape)} in the checkpoint, "
                f"model expects {want[0]} / {tuple(want[1])} (block geometry mismatch)"
            )
        planes[usage] = Plane(data.to(plane.data.device).view(plane.data.dtype),
                              scale.to(plane.data.device).view(plane.scale_inv.dtype))
    # The operand scaling states the entry holds ride on the rebuilt tensor's own record; the
    # parameter's copy_ copies them into its record (an older checkpoint without them: none).
    own = q.param_state.ensure_operand_states(q.recipe, q.device)
    loaded_state = FP8ParamState(operand_scaling={
        op: {k: local_tensor(entry[f"{op}_{k}"]).to(v.device) for k, v in state.items()}
        for op, state in own.items() if all(f"{op}_{k}" in entry for k in state)})
    loaded = QuantizedTensor.from_planes(planes, q.recipe, shape, q.dtype, q.usages, param_state=loaded_state)
    if full:  # this rank's block-aligned shard of the full weight (views)
        loaded = local_slice(loaded, param)
    return like(param, loaded)


def _holds_full_planes(entry: dict, param: DTensor) -> bool:
    data = entry.get(f"{next(iter(local_tensor(param).planes))}_data")
    return (data is not None and not isinstance(data, DTensor) and tuple(data.shape) == tuple(param.shape)
            and tuple(param.shape) != tuple(dtensor_local(param).shape))


def _load_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    for name, p in _fp8_params(module):
        key = prefix + name
        entry = state_dict.get(key)
        if isinstance(entry, dict):
            state_dict[key] = entry_to_param(entry, p, key)
        elif entry is not None and not isinstance(local_tensor(entry), QuantizedTensor):
            raise RecipeError(
                f"{key}: the state dict holds a {entry.dtype} tensor for an FP8 weight; use "
                "dtensor_fp8.load_hp_state_dict to quantize high-precision weights on load"
            )


def register_state_dict_hooks(module: nn.Module) -> None:
    """Make the FP8 parameters of ``module`` (its own, not its children's) save and load as plane
    tensors (see the note)."""
    module.register_state_dict_post_hook(_state_dict_hook)
    module.register_load_state_dict_pre_hook(_load_pre_hook)


# ---- high-precision export / import ------------------------------------------------------------------
def export_hp_state_dict(model: nn.Module, dtype: torch.dtype = torch.bfloat16, *, optimizer=None
                         ) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every FP8 weight in high precision: the keys of the same model
    without FP8 (persistent buffers only, modules' extra state included), ready for the
    unquantized model's ``load_state_dict(strict=True)``, ``save_pretrained`` or another recipe.

    Each FP8 weight's values are its master's when ``optimizer`` is given (the values training
    actually holds; with FP32 masters and ``dtype=torch.float32``, exactly), else the dequantized
    rowwise plane (the FP8 rounding of the master).

    Sharded parameters stay DTensors with their placements (``dcp.save`` it, or ``full_tensor()``
    each entry for a single-file export).

    Args:
        model: a model with FP8 parameters.
        dtype: the dtype of the exported FP8 weights (other entries keep theirs).
        optimizer: a :class:`MasterWeightOptimizer` over ``model``, whose masters are exported.

    Example:
        >>> sd = dtensor_fp8.export_hp_state_dict(model)        # bf16, same keys as nn.Linear
        >>> plain.load_state_dict({k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in sd.items()})
    """
    with high_precision_state_dict(dtype, optimizer=optimizer):
        return model.state_dict()


@contextlib.contextmanager
def high_precision_state_dict(dtype: torch.dtype = torch.bfloat16, *, optimizer=None):
    """Within the block, every ``state_dict()`` of a model with FP8 parameters holds each FP8
    weight in high precision, as :func:`export_hp_state_dict` does, so code that calls
    ``state_dict()`` itself exports a standard model: torch's ``get_model_state_dict`` (a full
    state dict too), accelerate's ``Accelerator.get_state_dict``, Lightning's savers.

    Args:
        dtype: the dtype of the exported FP8 weights.
        optimizer: a :class:`MasterWeightOptimizer` (or a framework's wrapper of one, which holds
            it as ``.optimizer``: accelerate's, Lightning's) whose masters are exported; default:
            the dequantized FP8 values.

    Example:
        >>> with dtensor_fp8.high_precision_state_dict(torch.bfloat16):
        ...     sd = accelerator.get_state_dict(model)   # full bf16 tensors, the unquantized model's keys
        >>> accelerator.unwrap_model(model).save_pretrained(out, state_dict=sd)
    """
    while optimizer is not None and not hasattr(optimizer, "masters") and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    token = _EXPORT.set((dtype, optimizer.masters if optimizer is not None else {}))
    try:
        yield
    finally:
        _EXPORT.reset(token)


@torch.no_grad()
def load_hp_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], optimizer=None, *,
                       strict: bool = True) -> None:
    """Load high-precision weights into an FP8 model: quantize on load, masters from the hp values.

    Takes what :func:`export_hp_state_dict` gives, or the state dict of the same model without FP8
    (e.g. read from a safetensors file): parameters, persistent buffers and modules' extra state.
    Entries may be full tensors (every rank the same values) or DTensors laid out like the
    parameters. Blocks that span shards (per-tensor scales) get the global amax. A meta-built
    weight whose bytes are still pending takes the values as its init (the optimizer, or
    ``finish_init_``, makes its bytes). To read a sharded checkpoint shard by shard, see
    :func:`dtensor_fp8.load_hp_checkpoint`.

    Args:
        model: the FP8 model (sharded or not).
        state_dict: name -> bf16/fp32 tensor.
        optimizer: a :class:`MasterWeightOptimizer` whose masters are set from the same values.
        strict: missing or unexpected keys are an error (naming them) unless False.

    Example:
        >>> dtensor_fp8.load_hp_state_dict(model, safetensors.torch.load_file("model.safetensors"), optimizer=opt)
    """
    masters = optimizer.masters if optimizer is not None else {}
    own = export_hp_state_dict(model)
    missing, unexpected = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
    if strict and (missing or unexpected):
        raise KeyError(f"load_hp_state_dict: the state dict does not match the model: missing {missing[:8]}"
                       f"{'...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''} "
                       "(pass strict=False to load the common keys)")
    params = dict(model.named_parameters())
    tensors = {**dict(model.named_buffers()), **params}
    items, others = [], {}
    for name, src in state_dict.items():
        target = tensors.get(name)
        if target is None:  # a module's extra state (or an unexpected key under strict=False)
            if name in own:
                others[name] = src
            continue
        local = local_tensor(src) if isinstance(src, DTensor) else local_slice(src, target)
        local = local.to(device=local_tensor(target).device)
        if isinstance(local_tensor(target), QuantizedTensor) and local_tensor(target).bytes_pending:
            local_tensor(target).hp_init.copy_(local)  # the init values (shared by every alias)
        elif isinstance(local_tensor(target), QuantizedTensor):
            items.append((name, target, local.float()))
            if name in masters:
                local_tensor(masters[name]).copy_(local)
        else:
            local_tensor(target).copy_(local)
    # Quantized as quantize() would quantize them: a stateful recipe (delayed scaling) starts a new
    # weight scaling state from these values (written into the owner records' existing tensors).
    kept = {id(t): {u: dict(s) for u, s in local_tensor(t).param_state.weight_scaling.items()} for _, t, _ in items}
    for _, t, _ in items:
        local_tensor(t).param_state.weight_scaling.clear()
    requantize_from_hp_(items)
    for _, t, _ in items:
        record = local_tensor(t).param_state
        for usage, old in kept[id(t)].items():
            for field, value in old.items():
                value.copy_(record.weight_scaling[usage][field])
            record.weight_scaling[usage] = old
    if others:
        model.load_state_dict(others, strict=False)
