"""State-dict planes of FP8 weights of more than two dims (MoE expert weights ``[E, out, in]``).

[Note: an expert weight's planes in a state dict]
An expert weight's planes are matrices ``(E * out, in)`` (``tensor.py``'s note on tensors of more
than two dims), but its shards need not be ranges of those rows: a tensor-parallel ``Shard(1)``
piece holds rows ``[a, b)`` of every expert (``ops/expert_rows.py``), ``E`` ranges that no
sharding of the flattened matrix describes. So the state dict holds each plane in the weight's own
dims: the data ``[E, out, in]`` with the parameter's placements, and the scale grid ``[E, grid rows
per expert, grid cols]`` sharded the same way (replicated along a dim one block spans: a per-expert
scale along ``out`` and ``in``; whole along a dim whose shards split blocks, as
``state_dict.py``'s note on split blocks says). Every layout of the weight (EP, FSDP2 over experts,
TP ``Shard(1)`` / ``Shard(2)``, none) then saves the same entries, so DCP loads any of them into any
other exactly, and a load reshapes the entries back to the planes' matrices (:func:`as_plane_matrix`).
Checkpoints written before this layout (the planes' matrices themselves) are refused by name, with
the way over (:func:`older_layout_problem`).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Replicate

from . import groups
from .entry import PLANE_FIELDS, plane_key
from .formats.base import USAGES
from .groups import split_blocks
from .layout import shard_dim
from .tensor import QuantizedTensor, one_byte_as_uint8


def as_plane_matrix(t: torch.Tensor) -> torch.Tensor:
    """A saved plane or scale grid of more than two dims as the planes' matrix (leading dims as rows)."""
    return t.reshape(-1, t.shape[-1]) if t.dim() > 2 else t


#: the first commit whose state dicts hold expert planes in the weights' own dims (the note)
OWN_DIMS_COMMIT = "92b7a64"


def older_layout_problem(key: str, saved_shape: tuple, shape: tuple) -> str | None:
    """Why the flat entry ``key``, saved as ``saved_shape`` where the state dict has ``shape``, does
    not load, if it is an expert plane written before the note's layout (the planes' matrix
    ``(E * out, in)``, the scales ``(E * grid rows, grid cols)``); ``None`` for any other mismatch.

    Args:
        key: a flattened ``"<fqn>.<usage>_<field>"`` key.
        saved_shape: the entry's shape in the checkpoint.
        shape: its shape in the state dict being loaded.

    Example:
        >>> older_layout_problem("w1.rowwise_data", (2048, 128), (8, 256, 128))[:44]
        "entry 'w1.rowwise_data' is (2048, 128) in th"
    """
    name = key.rsplit(".", 1)[-1]
    if name not in {plane_key(u, f) for u in USAGES for f in PLANE_FIELDS} or len(shape) < 3:
        return None
    if tuple(saved_shape) != (math.prod(shape[:-1]), shape[-1]):  # as_plane_matrix's shape
        return None
    return (f"entry {key!r} is {tuple(saved_shape)} in the checkpoint, {tuple(shape)} in the state dict: an FP8 expert "
            f"weight's plane in the layout dtensor_fp8 wrote before commit {OWN_DIMS_COMMIT} (the planes' matrix, "
            "experts' rows stacked), which this version does not read. Fix: with dtensor_fp8 before "
            f"{OWN_DIMS_COMMIT}, build the model, load_checkpoint it, and dcp.save(export_hp_state_dict(model)); "
            "here, load_hp_checkpoint(model, that directory) quantizes those values afresh (the FP8 bytes and "
            "optimizer state are not kept: resume from a checkpoint saved by this version for those)")


def expert_plane_entries(param: DTensor, q: QuantizedTensor) -> dict:
    """The planes of the sharded expert weight ``param`` (local tensor ``q``) as state-dict entries in
    the weight's own dims (see the note): ``{"<usage>_data": ..., "<usage>_scale_inv": ...}``.

    Args:
        param: a DTensor of more than two dims whose local tensor is ``q``.
        q: its local :class:`QuantizedTensor`.

    Example:
        >>> expert_plane_entries(experts.w1, experts.w1.to_local())["rowwise_data"].shape   # w1: [8, 256, 128]
        torch.Size([8, 256, 128])
    """
    last, out = param.dim() - 1, {}
    for usage, plane in q.planes.items():
        data = one_byte_as_uint8(plane.data).clone().reshape(q.shape)
        scale = one_byte_as_uint8(plane.scale_inv).clone()
        placements = [Replicate() if (d := shard_dim(pl)) is not None and q.recipe.spans_dim(usage, d) else pl
                      for pl in param.placements]
        split = split_blocks(param, usage)
        if split is not None:  # shards split blocks (along the last dim: Shard(2)): the grid whole there
            matrix_dim = {0: 0, last: 1}
            placements = [Replicate() if (d := shard_dim(pl)) in matrix_dim and split.total[matrix_dim[d]] is not None
                          else pl for pl in placements]
            scale = groups.whole_grid(scale, split)
        scale = scale.reshape(q.shape[0], -1, scale.shape[-1])
        stride = tuple(param.stride())
        out[plane_key(usage, "data")] = DTensor.from_local(data, param.device_mesh, param.placements, run_check=False,
                                                           shape=param.shape, stride=stride)
        out[plane_key(usage, "scale_inv")] = DTensor.from_local(scale, param.device_mesh, placements, run_check=False)
    return out


def expert_plane_copies(q: QuantizedTensor) -> dict:
    """The planes of an unsharded expert weight ``q`` as state-dict copies in its own dims (see the
    note): data ``[E, out, in]``, scale grids ``[E, grid rows per expert, grid cols]``.

    Args:
        q: a :class:`QuantizedTensor` of more than two dims.

    Example:
        >>> expert_plane_copies(w1)["rowwise_scale_inv"].shape   # w1: [8, 256, 128], 1x128 blocks
        torch.Size([8, 256, 1])
    """
    out = {}
    for usage, plane in q.planes.items():
        out[plane_key(usage, "data")] = one_byte_as_uint8(plane.data).clone().reshape(q.shape)
        scale = one_byte_as_uint8(plane.scale_inv).clone()
        out[plane_key(usage, "scale_inv")] = scale.reshape(q.shape[0], -1, scale.shape[-1])
    return out
