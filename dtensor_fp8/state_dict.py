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
world size loads them. Delayed scaling's weight scaling state (``"rowwise_amax_history"``,
``"rowwise_scale"``) is there too: the weight's owner record saves all of its state in this one
entry (checkpoints written before kept the weight's under the optimizer's state:
``load_checkpoint`` reads it from there). A checkpoint written before either was saved lacks them:
it loads with ``load_checkpoint(..., strict=False)``, which names them as missing, and they start
afresh, as they did then.

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
import math
import contextvars

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from . import _compat
from ._compat import dtensor_local
from .entry import RECIPE_KEY, plane_key
from .expert_entries import as_plane_matrix, expert_plane_copies, expert_plane_entries
from .formats.base import Plane, RecipeError, as_matrix_shape
from .formats.config import recipe_config, recipe_from_config
from .param_state import FP8ParamState, ScalingState
from .placement import like, local_slice, local_tensor, shard_dim
from . import groups
from .groups import split_blocks
from .tensor import QuantizedTensor, one_byte_as_uint8


#: While set (to ``(dtype, master_of)``), the state-dict hook puts each FP8 weight's high-precision
#: values in the state dict instead of its planes: its master's where ``master_of(param)`` (by the
#: parameter itself: wrappers such as ``checkpoint_wrapper`` put components in the hook's keys)
#: has one, else its dequantized FP8 values (``export_hp_state_dict``). Set to :data:`_TARGETS`,
#: it leaves each FP8 parameter itself there (``hp_targets``: what a high-precision load writes).
_EXPORT: contextvars.ContextVar[tuple | object | None] = contextvars.ContextVar("_EXPORT", default=None)
_TARGETS = object()


def _scale_placements(param: DTensor, recipe, usage, placements=None):
    """Scales follow the data's sharding (``placements``: the planes', default ``param``'s), except
    along a dim one block spans (then replicated)."""
    return [
        Replicate() if shard_dim(p) is not None and recipe.spans_dim(usage, shard_dim(p)) else p
        for p in (param.placements if placements is None else placements)
    ]


def _dim0_placements(param: DTensor) -> list:
    """Placements of a tensor with one row per index of ``param``'s dim 0, sharded as that dim is."""
    return [(pl if isinstance(pl, _compat.strided_shard_class()) else Shard(0)) if shard_dim(pl) == 0 else Replicate()
            for pl in param.placements]


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
    if q.dim() > 2:  # expert weights: the planes in the weight's own dims (expert_entries.py's note)
        copies = expert_plane_entries(param, q) if isinstance(param, DTensor) else expert_plane_copies(q)
    else:
        copies = _matrix_plane_copies(param, q)
    states = _scaling_entries(param, q)
    return {RECIPE_KEY: recipe_config(q.recipe.of_whole(param.shape)), **states, **copies}  # a TP piece's: its weight's recipe


def _matrix_plane_copies(param: torch.Tensor, q: QuantizedTensor) -> dict:
    """The planes of a 2-D FP8 weight ``param`` (local tensor ``q``) as state-dict copies: DTensors
    of the whole weight's matrix where ``param`` is one."""
    planes, sharded = q.planes, isinstance(param, DTensor)
    if sharded:
        # The layout of every saved tensor first (a 2-D weight's planes are its matrix), then the
        # grids whole where shards split blocks (see the note), then the copies.
        matrix_placements, matrix = list(param.placements), tuple(param.shape)
        scale_placements = {u: _scale_placements(param, q.recipe, u, matrix_placements) for u in planes}
        scales = {}
        for usage, plane in planes.items():
            split = split_blocks(param, usage)
            scales[usage] = plane.scale_inv
            if split is not None:  # shards split blocks: the grid whole along the split dims (see the note)
                scale_placements[usage] = [
                    Replicate() if (d := shard_dim(pl)) is not None and split.total[d] is not None else pl
                    for pl in scale_placements[usage]]
                scales[usage] = groups.whole_grid(one_byte_as_uint8(plane.scale_inv), split)
    copies = {}
    for usage, plane in planes.items():
        data = one_byte_as_uint8(plane.data).clone()
        scale = one_byte_as_uint8(scales[usage] if sharded else plane.scale_inv).clone()
        if sharded:
            grid = q.recipe.block_shape(usage).grid(matrix)
            data = DTensor.from_local(data, param.device_mesh, matrix_placements, run_check=False,
                                      shape=torch.Size(matrix), stride=(matrix[1], 1))
            scale = DTensor.from_local(scale, param.device_mesh, scale_placements[usage],
                                       run_check=False, shape=torch.Size(grid), stride=(grid[1], 1))
        copies[plane_key(usage, "data")] = data
        copies[plane_key(usage, "scale_inv")] = scale
    return copies


def _scaling_entries(param: torch.Tensor, q: QuantizedTensor) -> dict:
    """The scaling states ``q``'s owner saves (made now if no optimizer made them: a complete
    template); a state with a row per index of dim 0 (per expert) sharded as the weight's dim 0 is."""
    record = q.param_state.scaling
    record.ensure_operand_states(q.recipe, q.device)
    for usage, plane in q.planes.items():
        record.weight_state(q.recipe, usage, plane)
    per_index = set(record.weight_entries()) if q.recipe.scaling_state_per_index and isinstance(param, DTensor) else ()
    states = {}
    for name, value in record.entries().items():  # the owner saves its scaling states, once
        value = value.detach().clone()
        if name in per_index:
            shape = (param.shape[0], *value.shape[1:])
            value = DTensor.from_local(value, param.device_mesh, _dim0_placements(param), run_check=False,
                                       shape=torch.Size(shape),
                                       stride=tuple(math.prod(shape[i + 1:]) for i in range(len(shape))))
        states[name] = value
    return states

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
        if export is _TARGETS:
            continue
        dtype, master_of = export
        master, q = master_of(p), local_tensor(p)
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
    check_saved_recipe(name, entry.get(RECIPE_KEY), q.recipe.of_whole(param.shape))
    full = isinstance(param, DTensor) and _holds_full_planes(entry, param)
    shape = tuple(param.shape) if full else tuple(q.shape)
    matrix = as_matrix_shape(shape)  # the planes' shape (leading dims flattened)
    whole = q.recipe.of_whole(shape)  # a full entry of a TP piece's weight holds the whole weight's blocks
    planes = {}
    for usage, plane in q.planes.items():
        missing = [k for k in (plane_key(usage, "data"), plane_key(usage, "scale_inv")) if k not in entry]
        if missing:
            raise RecipeError(f"{name}: checkpoint entry lacks {missing} (has {sorted(entry)}); the model needs the {usage} plane")
        data, scale = local_tensor(entry[plane_key(usage, "data")]), local_tensor(entry[plane_key(usage, "scale_inv")])
        data, scale = as_plane_matrix(data), as_plane_matrix(scale)  # an expert weight's (expert_entries.py)
        split = None if full or not isinstance(param, DTensor) else split_blocks(param, usage)
        if split is not None and isinstance(entry[plane_key(usage, "scale_inv")], DTensor):
            scale = _touched_rows(entry[plane_key(usage, "scale_inv")], split, tuple(plane.scale_inv.shape))
        elif split is not None and tuple(scale.shape) != tuple(plane.scale_inv.shape):
            scale = split.touched(scale, tuple(plane.scale_inv.shape))  # a plain tensor of the whole grid
        want = (matrix, whole.block_shape(usage).grid(matrix)) if full else (tuple(plane.data.shape), tuple(plane.scale_inv.shape))
        if tuple(data.shape) != want[0] or tuple(scale.shape) != tuple(want[1]):
            raise RecipeError(
                f"{name}: {usage} plane of shape {tuple(data.shape)} / scales {tuple(scale.shape)} in the checkpoint, "
                f"model expects {want[0]} / {tuple(want[1])} (block geometry mismatch)"
            )
        planes[usage] = Plane(data.to(plane.data.device).view(plane.data.dtype),
                              scale.to(plane.data.device).view(plane.scale_inv.dtype))
    # The scaling states the entry holds ride on the rebuilt tensor's own record; the parameter's
    # copy_ copies them into its record (an older checkpoint without them: none).
    own = q.param_state.scaling.ensure_operand_states(q.recipe, q.device)
    weight = {usage: q.param_state.scaling.weight_state(q.recipe, usage, plane) for usage, plane in q.planes.items()}

    def saved(states, per_index=False):
        def value(key, like_):
            v = local_tensor(entry[key]).to(like_.device)
            if per_index and full and isinstance(param, DTensor):  # a whole per-expert state: this rank's rows
                v = distribute_tensor(v, param.device_mesh, _dim0_placements(param), src_data_rank=None).to_local()
            return v
        return {name: {k: value(f"{name}_{k}", v) for k, v in state.items()}
                for name, state in states.items() if state is not None and all(f"{name}_{k}" in entry for k in state)}

    loaded_state = FP8ParamState(ScalingState(weight=saved(weight, per_index=q.recipe.scaling_state_per_index),
                                              operand=saved(own)))
    loaded = QuantizedTensor.from_planes(planes, whole, shape, q.dtype, q.usages, param_state=loaded_state)
    if full:  # this rank's block-aligned shard of the full weight (views)
        loaded = local_slice(loaded, param)
    return like(param, loaded)


# [Note: saved scales of shards that split blocks]
# Where shards split blocks (see "block phase" in formats/base.py) each rank holds the scales of
# the blocks it touches, a shared block on both ranks, which no DTensor sharding describes. The
# entry's scale tensor is then the weight's grid whole along every split dim (dim 0 where FSDP2 or
# ColwiseParallel cut inside blocks, dim 1 where RowwiseParallel does; replicated over the mesh
# dims sharding those dims, still sharded along an aligned dim where the data is): each rank builds
# it from its own with one MAX all-reduce (every rank's scales in place, zeros elsewhere), DCP
# writes it once, and a load takes this rank's touched blocks out of it. The checkpoint holds the same grid as at any
# other layout, so it loads aligned or split, at any world size, and old checkpoints load here.
# Cost: the dim-0 scale grids of such weights are whole on every rank while the state dict lives
# (128x128: 4 bytes per 128x128 block; 1x128 and MXFP8 column planes: 1/32 byte per element).
def _touched_rows(saved, split, grid: tuple[int, int]) -> torch.Tensor:
    """The scales of the blocks this rank's shard touches (a ``grid``), from a loaded grid DTensor
    ``saved`` (whole along the split dims: see the note)."""
    return split.touched(as_plane_matrix(saved.to_local()), grid)


def _holds_full_planes(entry: dict, param: DTensor) -> bool:
    data = entry.get(plane_key(next(iter(local_tensor(param).planes)), "data"))
    matrix = as_matrix_shape(param.shape)
    return (data is not None and not isinstance(data, DTensor) and tuple(data.shape) in (matrix, tuple(param.shape))
            and tuple(param.shape) != tuple(dtensor_local(param).shape))


def _load_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    for name, p in _fp8_params(module):
        key = prefix + name
        entry = state_dict.get(key)
        if isinstance(entry, dict):
            state_dict[key] = entry_to_param(entry, p, key)
        elif entry is not None and not isinstance(local_tensor(entry), QuantizedTensor):
            raise RecipeError(
                f"{key}: the state dict holds a {entry.dtype} tensor for an FP8 weight (high-precision weights; "
                "load_state_dict / set_model_state_dict load FP8 planes, and would leave the optimizer's masters "
                "stale). Fix: dtensor_fp8.load_hp_state_dict(model, state_dict, optimizer=opt) quantizes them on load "
                "and sets the masters; dtensor_fp8.load_hp_checkpoint(model, path, optimizer=opt) reads a checkpoint "
                "directory shard by shard"
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
    while optimizer is not None and not hasattr(optimizer, "master_of") and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    token = _EXPORT.set((dtype, optimizer.master_of if optimizer is not None else (lambda p: None)))
    try:
        yield
    finally:
        _EXPORT.reset(token)


def hp_targets(model: nn.Module) -> dict:
    """Key -> what a high-precision load of ``model`` writes there: its parameters and persistent
    buffers themselves (FP8 ones as they are, no copies) and its modules' extra states: the keys
    and layout of :func:`export_hp_state_dict`."""
    token = _EXPORT.set(_TARGETS)
    try:
        return model.state_dict(keep_vars=True)
    finally:
        _EXPORT.reset(token)


def is_fp8(t) -> bool:
    """Whether ``t`` is an FP8 parameter: a :class:`QuantizedTensor`, or a DTensor of one.

    Example:
        >>> is_fp8(model.w1.weight), is_fp8(model.norm.weight)
        (True, False)
    """
    return isinstance(t, torch.Tensor) and isinstance(local_tensor(t), QuantizedTensor)
