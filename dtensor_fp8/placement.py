"""Quantized DTensors: every plane sharded at block boundaries, gathers that move one direction.

[Note: why plain Shard/Replicate placements]
A quantized DTensor uses torch's own ``Shard(dim)`` / ``Replicate()`` placements; the block
geometry travels with the local tensor (its recipe), and the direction with the planes it holds.
We do not subclass ``Shard``: in torch 2.13 it is a C++ class whose ``==``/hash a Python subclass
inherits, so DTensor's redistribute plan cache (``_gen_transform_infos``) would hand a plain-Shard
plan to the subclass or the reverse, and overriding ``__eq__`` breaks DTensor construction. With
plain placements the cached plans are the ordinary ones, and correctness rests on the local
tensor's ops (``ops/``): a shard whose boundary falls inside a block carries its block phase and
the scale of every block it touches (``formats/base.py``'s note), and a layout those ops cannot
gather (a ``Shard(1)`` cut inside blocks: DTensor gathers dim 1 by stacking pieces along dim 0) is
refused when the DTensor is built (:func:`check_placements`, naming shape, block and world size),
or before a gather sends anything.

Direction: ``dtensor_fp8.for_usage(dt, "rowwise")`` is a zero-copy DTensor view whose local
tensor holds only the rowwise plane; ``redistribute(mesh, [Replicate()])`` / ``full_tensor()`` of
it gather forward bytes only (and ``"columnwise"`` backward bytes only; for per-tensor and
128x128 blockwise that is the shared plane, and the transpose is rebuilt locally).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from ._compat import dtensor_local
from .formats.base import USAGES, Recipe, RecipeError
from .layout import shard_dim  # noqa: F401  (re-exported: placement.shard_dim)
from .ops.slicing import check_shardable, chunk_of  # noqa: F401  (check_shardable: public here)
from .quantize import quantize
from .tensor import QuantizedTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor; any other tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def like(ref: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a DTensor laid out like ``ref`` (mesh, placements, global shape and stride);
    ``local`` itself when ``ref`` is not a DTensor."""
    if not isinstance(ref, DTensor):
        return local
    return DTensor.from_local(local, ref.device_mesh, ref.placements, run_check=False, shape=ref.shape, stride=ref.stride())


def inner_tensor(p: torch.Tensor) -> torch.Tensor:
    """``p`` itself unless it is a DTensor, else a parameter sharing the storage of its local shard
    (what a ``MasterWeightOptimizer``'s inner optimizer steps for ``p``).

    Example:
        >>> inner_tensor(master).data_ptr() == master.to_local().data_ptr()
        True
    """
    if not isinstance(p, DTensor):
        return p
    return torch.nn.Parameter(dtensor_local(p).detach(), requires_grad=p.requires_grad)


def local_slice(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a full tensor laid out like the (possibly DTensor) parameter ``p``.

    torch's own ``distribute_tensor`` with ``p``'s placements, each rank slicing its own copy
    (``src_data_rank=None``: no communication). One (offset, length) window per dim cannot
    describe FSDP's ``_StridedShard`` on a (dp, tp) mesh: a dp shard of a tp shard is a set of
    interleaved row ranges of the full tensor, not one contiguous slice.

    Example:
        >>> local_slice(full_master, model.w1.weight).shape   # fully_shard over 4 ranks
        torch.Size([64, 128])
    """
    if not isinstance(p, DTensor):
        return full
    full = full.to(p.device_mesh.device_type)
    return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()


def check_placements(q_shape, recipe: Recipe, mesh: DeviceMesh, placements, usages=USAGES) -> None:
    """:func:`check_shardable` for every ``Shard`` in ``placements`` (nested shards compound)."""
    shape = list(q_shape)
    for mesh_dim, p in enumerate(placements):
        if p.is_shard():
            n = mesh.size(mesh_dim)
            check_shardable(shape, recipe, p.dim, n, usages)
            shape[p.dim] = -(-shape[p.dim] // n)


def local_shard(q: QuantizedTensor, mesh: DeviceMesh, placements) -> QuantizedTensor:
    """This rank's block-aligned piece of a full quantized tensor (views, no copy)."""
    check_placements(q.shape, q.recipe, mesh, placements, q.usages)
    local = q
    coord = mesh.get_coordinate()
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard) and type(p) is Shard:
            local = chunk_of(local, p.dim, mesh.size(mesh_dim), coord[mesh_dim])
        elif not isinstance(p, Replicate):
            raise RecipeError(f"dtensor_fp8.distribute supports Shard(dim) and Replicate() placements, got {p}")
    return local


def distribute_quantized(q: QuantizedTensor, mesh: DeviceMesh, placements: list[Placement]) -> DTensor:
    """A DTensor over ``mesh`` whose local tensor is this rank's block-aligned shard of ``q``.

    Every rank must hold the same full ``q``. Nothing is communicated.

    Args:
        q: full quantized tensor (identical on every rank).
        mesh: the device mesh.
        placements: ``Shard(dim)`` / ``Replicate()`` per mesh dim.

    Example:
        >>> dt = distribute_quantized(quantize(w, MXFP8()), mesh, [Shard(0)])
    """
    placements = list(placements)
    local = local_shard(q, mesh, placements)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=q.shape, stride=q.stride())


def distribute(
    x: torch.Tensor, mesh: DeviceMesh, placements: list[Placement], recipe: Recipe, *,
    rowwise: bool = True, columnwise: bool = True,
) -> DTensor:
    """Quantize a full high-precision tensor (the same on every rank) and shard it at block boundaries.

    The bytes equal ``quantize(x, recipe)``'s: scales of blocks spanning a sharded dim
    (per-tensor) come from the full tensor's amax.

    Args:
        x: full high-precision tensor, identical on every rank.
        mesh: the device mesh.
        placements: ``Shard(dim)`` / ``Replicate()`` per mesh dim.
        recipe: the FP8 recipe.
        rowwise / columnwise: which usages to produce.

    Example:
        >>> mesh = init_device_mesh("cpu", (2,))
        >>> dt = dtensor_fp8.distribute(w, mesh, [Shard(0)], dtensor_fp8.MXFP8())
        >>> full = dtensor_fp8.for_usage(dt, "rowwise").full_tensor()   # QuantizedTensor
    """
    q = quantize(x.to(mesh.device_type), recipe, rowwise=rowwise, columnwise=columnwise)
    return distribute_quantized(q, mesh, placements)


def for_usage(dt: DTensor, *usages: str) -> DTensor:
    """Zero-copy DTensor view holding only the planes for ``usages``.

    Gathering it (``redistribute(mesh, [Replicate()])``, ``full_tensor()``) moves only those
    planes: ``"rowwise"`` for the forward GEMM, ``"columnwise"`` for the backward GEMM.

    Args:
        dt: a DTensor whose local tensor is a :class:`QuantizedTensor`.
        usages: ``"rowwise"`` and/or ``"columnwise"``.

    Example:
        >>> fwd = dtensor_fp8.for_usage(dt, "rowwise").full_tensor()
    """
    local = dt.to_local()
    if not isinstance(local, QuantizedTensor):
        raise RecipeError(f"for_usage: DTensor of shape {tuple(dt.shape)} does not hold a QuantizedTensor")
    return like(dt, local.with_usages(*usages))
