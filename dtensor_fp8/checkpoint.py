"""DCP checkpoints: atomic saves, a ``latest`` pointer, and loads that name the entries at fault.

The state dicts are torch's own (``torch.distributed.checkpoint.state_dict.get_state_dict``, or
``model.state_dict()`` / ``optimizer.state_dict()``); how an FP8 weight appears in them is
``state_dict.py``'s note.
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch.distributed.tensor import DTensor

from .formats.base import RecipeError
from .placement import like, local_tensor
from .formats.config import recipe_from_config
from .state_dict import RECIPE_KEY, check_saved_recipe

#: torch's key suffix for ``Module.get_extra_state()``; TE stores its FP8 metadata there as a pickled
#: uint8 tensor whose length changes (empty before the first FP8 forward).
_EXTRA_STATE_SUFFIX = "_extra_state"


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
    # Plain values (a step counter, a scheduler's state, the optimizer's hyper-parameters) are
    # restored too: DCP stores them as bytes entries, read here with ``weights_only``.
    copies = {k: (blobs[k] if k in blobs else _clone(v)) if isinstance(v, torch.Tensor) else v for k, v in flat.items()}
    try:
        dcp.load(copies, checkpoint_id=path, planner=_SafeLoadPlanner())
    except (Exception, CheckpointException) as err:  # name the entries that cannot be read
        bad = _unreadable_entries(flat, path, blobs)
        raise RuntimeError(
            f"checkpoint {path} could not be loaded; unreadable entries: {bad or 'unknown'}. The model was not "
            f"modified. Cause: {type(err).__name__}: {str(err)[:500]}"
        ) from err
    with torch.no_grad():
        for key, value in copies.items():
            if key in blobs or not isinstance(value, torch.Tensor):
                # a module's opaque extra state (replaced, whatever its length was), or a plain value
                set_element(state_dict, mappings[key], value)
            else:
                flat[key].copy_(value)


class _SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's load planner over a flat dict, reading bytes entries (plain values) with
    ``weights_only=True``: DCP's own reads them with ``weights_only=False``, which runs whatever a
    crafted entry pickles."""

    def __init__(self):
        super().__init__(flatten_state_dict=False)
        self._target: dict = {}

    def set_up_planner(self, state_dict, *args, **kwargs):
        # Written into the dict we were given: ``self.state_dict`` may be a copy (torch 2.11 makes
        # one when it flattens sharded tensors).
        self._target = state_dict
        super().set_up_planner(state_dict, *args, **kwargs)

    def load_bytes(self, read_item, value):
        self._target[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


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
    recipes = {k: v for k, v in flat.items() if k.endswith("." + RECIPE_KEY)}
    if recipes:
        loaded = {k: None for k in recipes}
        missing = [k for k in recipes if k not in saved]
        if missing:
            raise RecipeError(f"checkpoint {path} has no FP8 entries for {[k.rsplit('.', 1)[0] for k in missing]} "
                              "(saved in high precision? use load_hp_state_dict)")
        dcp.load(loaded, checkpoint_id=path, planner=_SafeLoadPlanner())
        for key, expected in recipes.items():  # configs of any format; compared as recipes
            check_saved_recipe(key.rsplit(".", 1)[0], loaded[key], recipe_from_config(expected))
    for key, value in flat.items():
        meta = saved.get(key)
        if meta is None:
            raise RecipeError(f"{key}: missing from checkpoint {path}")
        if not isinstance(value, torch.Tensor):
            continue
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
