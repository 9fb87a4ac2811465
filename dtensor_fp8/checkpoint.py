"""DCP checkpoints of FP8 parameters: exact bytes as ordinary tensors, reshardable.

[Note: how an FP8 weight appears in a state dict]
``model.state_dict()`` (and so ``get_state_dict`` / ``dcp.save``) holds, for each FP8 weight, a
dict instead of the parameter::

    "layers.0.w1.weight": {
        "rowwise_data": uint8 DTensor (M, K),          # the FP8 bytes
        "rowwise_scale_inv": fp32/uint8 DTensor (grid), # E8M0 scales as their bytes
        "columnwise_data": ..., "columnwise_scale_inv": ...,   # where the recipe stores it
        "recipe": "MXFP8(fp8_dtype=torch.float8_e4m3fn)",
    }

Each tensor is a DTensor with the parameter's mesh: data keeps the parameter's placements, a scale
grid is sharded on the same dims where its blocks lie inside shards and replicated where one block
spans the dim (per-tensor scales). Since shards are block-aligned, every saved chunk holds whole
blocks, and DCP can load any other block-aligned sharding (N -> M ranks, 1-D <-> HSDP) exactly.
Nothing is pickled but the recipe string; plain ``torch`` reads the checkpoint.

The tensors are copies, not views of the live planes: ``dcp.load`` then fills the copies, and only
``model.load_state_dict`` (our pre-hook checks recipe and planes first) writes into the model, so a
failing load leaves the model untouched.
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch.distributed.tensor import DTensor, Replicate

from .formats.base import Plane, RecipeError
from .placement import like, local_tensor
from .tensor import QuantizedTensor, one_byte_as_uint8

_RECIPE_KEY = "recipe"
#: torch's key suffix for ``Module.get_extra_state()``; TE stores its FP8 metadata there as a pickled
#: uint8 tensor whose length changes (empty before the first FP8 forward).
_EXTRA_STATE_SUFFIX = "_extra_state"


def _scale_placements(param: DTensor, recipe, usage):
    """Scales follow the data's sharding, except along a dim one block spans (then replicated)."""
    from .placement import shard_dim

    return [
        Replicate() if shard_dim(p) is not None and recipe.spans_dim(usage, shard_dim(p)) else p
        for p in param.placements
    ]


def plane_entries(param: torch.Tensor) -> dict:
    """The state-dict entry of one FP8 parameter: its planes as plain/DTensor copies + recipe."""
    q = local_tensor(param)
    entry = {_RECIPE_KEY: repr(q.recipe)}
    for usage, plane in q._planes.items():
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
    for name, p in _fp8_params(module):
        if prefix + name in state_dict:
            state_dict[prefix + name] = plane_entries(p)
    return state_dict


def entry_to_param(entry: dict, param: torch.Tensor, name: str) -> torch.Tensor:
    """Validate a saved FP8 entry against the model's parameter and rebuild it (same class and
    sharding as ``param``) so ``load_state_dict``'s ``copy_`` moves exact bytes."""
    q = local_tensor(param)
    saved = entry.get(_RECIPE_KEY)
    if saved != repr(q.recipe):
        raise RecipeError(
            f"{name}: checkpoint recipe {saved!r} does not match the model's {q.recipe!r}. Load with the same "
            "recipe, or export/import through high precision (export_hp_state_dict / load_hp_state_dict)."
        )
    planes = {}
    for usage, plane in q._planes.items():
        missing = [k for k in (f"{usage}_data", f"{usage}_scale_inv") if k not in entry]
        if missing:
            raise RecipeError(f"{name}: checkpoint entry lacks {missing} (has {sorted(entry)}); the model needs the {usage} plane")
        data, scale = local_tensor(entry[f"{usage}_data"]), local_tensor(entry[f"{usage}_scale_inv"])
        if data.shape != plane.data.shape or scale.shape != plane.scale_inv.shape:
            raise RecipeError(
                f"{name}: {usage} plane of shape {tuple(data.shape)} / scales {tuple(scale.shape)} in the checkpoint, "
                f"model expects {tuple(plane.data.shape)} / {tuple(plane.scale_inv.shape)} (block geometry mismatch)"
            )
        planes[usage] = Plane(data.view(plane.data.dtype), scale.view(plane.scale_inv.dtype))
    return like(param, QuantizedTensor(planes, q.recipe, q.shape, q.dtype, q.usages))


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
    module._register_state_dict_hook(_state_dict_hook)
    module._register_load_state_dict_pre_hook(_load_pre_hook, with_module=True)


# ---- high-precision export / import ------------------------------------------------------------------
def export_hp_state_dict(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The model's state dict with every FP8 weight dequantized (rowwise plane) to ``dtype``.

    Sharded parameters stay DTensors with their placements (``dcp.save`` it, or ``full_tensor()``
    each entry for a single-file export).

    Args:
        model: a model with FP8 parameters.
        dtype: the export dtype.

    Example:
        >>> sd = dtensor_fp8.export_hp_state_dict(model)        # bf16, same keys as nn.Linear
        >>> dcp.save(sd, checkpoint_id="export/")
    """
    out = {}
    for name, p in model.named_parameters():
        q = local_tensor(p)
        if isinstance(q, QuantizedTensor):
            hp = q.dequantize(dtype)
            out[name] = like(p, hp)
        else:
            out[name] = p.detach()
    for name, b in model.named_buffers():
        out[name] = b
    return out


@torch.no_grad()
def load_hp_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], optimizer=None) -> None:
    """Load high-precision weights into an FP8 model: quantize on load, masters from the hp values.

    Entries may be full tensors (every rank the same values) or DTensors laid out like the
    parameters. Blocks that span shards (per-tensor scales) get the global amax.

    Args:
        model: the FP8 model (sharded or not).
        state_dict: parameter name -> bf16/fp32 tensor.
        optimizer: a :class:`MasterWeightOptimizer` whose masters are set from the same values.

    Example:
        >>> dtensor_fp8.load_hp_state_dict(model, torch.load("bf16.pt"), optimizer=opt)
    """
    from .requantize import local_slice, requantize_from_hp_

    masters = optimizer.masters if optimizer is not None else {}
    items = []
    for name, p in model.named_parameters():
        if name not in state_dict:
            raise KeyError(f"load_hp_state_dict: {name} missing from the state dict")
        src = state_dict[name]
        local = local_tensor(src) if isinstance(src, DTensor) else local_slice(src, p)
        local = local.to(device=local_tensor(p).device)
        if isinstance(local_tensor(p), QuantizedTensor):
            items.append((name, p, local.float()))
            if name in masters:
                local_tensor(masters[name]).copy_(local)
        else:
            local_tensor(p).copy_(local)
    requantize_from_hp_(items)


# ---- atomic save / load ------------------------------------------------------------------------------------
LATEST = "latest"


def save_checkpoint(state_dict: dict, root: str, step: int) -> str:
    """``dcp.save`` into ``root/step-<step>`` and only then point ``root/latest`` at it.

    A save that fails or is killed on any rank never updates ``latest``, so the previous checkpoint
    stays the one :func:`load_checkpoint` opens. Rank 0 switches the pointer with an atomic
    ``os.replace`` after a barrier.

    Args:
        state_dict: e.g. ``{"model": model.state_dict(), "optim": opt.state_dict()}``.
        root: checkpoint directory (shared by all ranks).
        step: training step, names the sub-directory.

    Returns:
        The directory written.

    Example:
        >>> dtensor_fp8.save_checkpoint({"model": model.state_dict(), "optim": opt.state_dict()}, "ckpt", step)
    """
    path = os.path.join(root, f"step-{step:08d}")
    if not dist.is_initialized() or dist.get_rank() == 0:
        if os.path.exists(path):
            shutil.rmtree(path)
        os.makedirs(root, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    dcp.save(state_dict, checkpoint_id=path)
    if dist.is_initialized():
        dist.barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        tmp = os.path.join(root, f".{LATEST}.tmp")
        with open(tmp, "w") as f:
            f.write(os.path.basename(path))
        os.replace(tmp, os.path.join(root, LATEST))
    if dist.is_initialized():
        dist.barrier()
    return path


def latest_checkpoint(root: str) -> str:
    """The directory ``root/latest`` points to (the last save that completed on every rank)."""
    with open(os.path.join(root, LATEST)) as f:
        return os.path.join(root, f.read().strip())


def load_checkpoint(state_dict: dict, path: str) -> None:
    """``dcp.load`` into ``state_dict`` (in place) with errors that name the entries at fault.

    Load into ``{"model": model.state_dict(), "optim": opt.state_dict()}`` and then call
    ``model.load_state_dict`` / ``opt.load_state_dict``: the FP8 entries are copies, so a failing
    load leaves the model untouched.

    Args:
        state_dict: the state dict to fill (its tensors give the target sharding).
        path: a checkpoint directory (e.g. :func:`latest_checkpoint`).
    """
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint._traverse import set_element

    # Optimizer state dicts hold references to live tensors: read into copies, and write them back
    # only once every entry has been read, so a failing load changes nothing.
    flat, mappings = flatten_state_dict(state_dict)
    blobs = _check_against_metadata(flat, path)
    copies = {k: blobs[k] if k in blobs else _clone(v) for k, v in flat.items() if isinstance(v, torch.Tensor)}
    try:
        dcp.load(copies, checkpoint_id=path, planner=dcp.DefaultLoadPlanner(flatten_state_dict=False))
    except (Exception, CheckpointException) as err:  # name the entries that cannot be read
        bad = _unreadable_entries(flat, path, blobs)
        raise RuntimeError(
            f"checkpoint {path} could not be loaded; unreadable entries: {bad or 'unknown'}. The model was not "
            f"modified. Cause: {type(err).__name__}: {str(err)[:500]}"
        ) from err
    with torch.no_grad():
        for key, value in copies.items():
            if key in blobs:  # a module's opaque extra state: replaced, whatever its length was
                set_element(state_dict, mappings[key], value)
            else:
                flat[key].copy_(value)


class _CaptureBytes(dcp.DefaultLoadPlanner):
    """Keeps the non-tensor entries it reads (dcp.load does not write them back into plain dicts)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False)
        self.captured = {}

    def load_bytes(self, read_item, value):
        self.captured[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def _check_against_metadata(flat: dict, path: str) -> dict[str, torch.Tensor]:
    """Recipe, presence and shape of every entry of a flattened state dict, checked before any
    tensor is read.

    Returns:
        Buffers of the saved size for modules' extra states (``..._extra_state``): opaque blobs
        (TE's pickled FP8 metadata) whose length in a fresh model differs from a trained one's.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    blobs = {}
    recipes = {k: v for k, v in flat.items() if k.endswith("." + _RECIPE_KEY)}
    if recipes:
        loaded = {k: None for k in recipes}
        missing = [k for k in recipes if k not in saved]
        if missing:
            raise RecipeError(f"checkpoint {path} has no FP8 entries for {[k.rsplit('.', 1)[0] for k in missing]} "
                              "(saved in high precision? use load_hp_state_dict)")
        planner = _CaptureBytes()
        dcp.load(loaded, checkpoint_id=path, planner=planner)
        for key, expected in recipes.items():
            if planner.captured.get(key) != expected:
                raise RecipeError(
                    f"{key.rsplit('.', 1)[0]}: checkpoint recipe {planner.captured.get(key)!r} does not match the model's {expected!r}. "
                    "Load with the same recipe, or export/import through high precision "
                    "(export_hp_state_dict / load_hp_state_dict)."
                )
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            continue
        meta = saved.get(key)
        if meta is None:
            raise RecipeError(f"{key}: missing from checkpoint {path}")
        if (_is_extra_state(key) and isinstance(meta, TensorStorageMetadata)
                and not isinstance(value, DTensor)):
            blobs[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype, device=value.device)
        elif isinstance(meta, TensorStorageMetadata) and tuple(meta.size) != tuple(value.shape):
            raise RecipeError(f"{key}: shape {tuple(meta.size)} in the checkpoint, {tuple(value.shape)} in the model")
    return blobs


def _is_extra_state(key: str) -> bool:
    return key == _EXTRA_STATE_SUFFIX or key.endswith("." + _EXTRA_STATE_SUFFIX)


def _unreadable_entries(flat: dict, path: str, blobs: dict) -> list[str]:
    bad = []
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            continue
        probe = {key: torch.empty_like(blobs[key]) if key in blobs else _clone(value)}
        try:
            dcp.load(probe, checkpoint_id=path, planner=dcp.DefaultLoadPlanner(flatten_state_dict=False))
        except (Exception, CheckpointException):  # noqa: BLE001
            bad.append(key)
    return bad


def _clone(t: torch.Tensor) -> torch.Tensor:
    return like(t, local_tensor(t).clone())
