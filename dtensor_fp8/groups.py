"""The process groups an FP8 weight's scaling decisions reduce over, derived from its own mesh.

[Note: which group a scaling decision reduces over]
A per-tensor scale (and any block that spans a sharded dim) needs the amax over every shard of
the weight; delayed scaling's GEMM operands (activations, gradients) need the amax over every
rank that ran the weight's GEMMs on its own data; an optimizer's "is any gradient non-finite"
must be decided alike by every rank that steps the same parameters. Each is a reduction over the
ranks that hold *this weight*, which are the ranks of its DTensor mesh: never the world. Under
pipeline parallelism each stage's weights live on that stage's (dp[, tp]) sub-mesh and the ranks
of other stages run other code at the same time, so a world collective would either pair one
stage's amax list with another's (wrong bytes, silently) or wait for a stage that never comes
(a hang).

* the weight's amax (:func:`weight_groups`): the mesh dims whose placement shards a tensor dim that
  a scaling block spans (FSDP's dp dim for a per-tensor scale; also the tp dim where TP shards
  it). A replicated mesh dim holds identical values and needs nothing.
* operand amaxes and cross-rank agreement (:func:`mesh_groups`): every mesh dim (replicas see
  other data).
* a weight that is not a DTensor (no FSDP, a pipeline stage without data parallelism) has no
  group: its decisions are local.

A reduction over several mesh dims runs one collective per dim, in the mesh's dim order: MAX and
set union compose, and every member of each group issues the same sequence because they hold the
same parameters. Nothing here creates a process group (DeviceMesh already has one per dim).
The owner record (``FP8ParamState.layout``) keeps the weight's mesh and placements once a caller
that sees the DTensor has bound them (:func:`bind_layout_`), so code that only holds the local
shard (an in-place write) derives the same groups.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .layout import Layout, SplitBlocks, dim_pieces, rows_per_index, shard_dim, split_starts, splits_blocks  # noqa: F401  (re-exported)
from .tensor import QuantizedTensor

Group = dist.ProcessGroup


def _layout(p: torch.Tensor):
    """The :class:`Layout` of a DTensor, or the one its owner record is bound to, or ``None``.

    A local shard binds its record from the parameter the record says it is (``FP8ParamState.links.home``,
    set by ``quantize_module_``) when that parameter is a DTensor over the same record, and binds it
    again when that parameter was laid out anew since (``fully_shard`` after ``parallelize_module``):
    a ``copy_`` into a weight right after ``fully_shard``, before any optimizer or gather saw it,
    then derives the groups of its final layout."""
    if isinstance(p, DTensor):
        return Layout(p.device_mesh, tuple(p.placements), tuple(p.shape))
    if isinstance(p, QuantizedTensor):
        return p.param_state.current_layout()
    return None


def layout_of(p: torch.Tensor):
    """``(mesh, placements)`` of an FP8 parameter: its own for a DTensor, else the one its owner
    record is bound to (or can bind from its home module), else ``None`` (a weight that is not
    distributed: its scaling decisions are local).

    Example:
        >>> layout_of(model.w1.weight.to_local())[1]   # after fully_shard
        (Shard(dim=0),)
    """
    return _layout(p)


def bind_layout_(p: torch.Tensor) -> None:
    """Record a DTensor FP8 parameter's mesh and placements in its owner record (a no-op for
    other tensors), so the local shard alone knows its groups.

    Args:
        p: a parameter; a DTensor whose local tensor is a ``QuantizedTensor`` is bound.

    Example:
        >>> bind_layout_(model.w1.weight)   # after fully_shard
        >>> model.w1.weight.to_local().param_state.layout[1]
        (Shard(dim=0),)
    """
    if isinstance(p, DTensor):
        q = p._local_tensor
        if isinstance(q, QuantizedTensor):
            q.param_state.layout = Layout(p.device_mesh, tuple(p.placements), tuple(p.shape))


def weight_groups(p: torch.Tensor, spans: Callable[[int], bool]) -> tuple[Group, ...]:
    """The groups of the mesh dims that shard a tensor dim ``spans(dim)`` says a block crosses.

    Args:
        p: the parameter (a DTensor, or a local shard whose owner record is bound).
        spans: tensor dim -> whether a scaling block of the plane spans that dim.

    Example:
        >>> weight_groups(w, lambda d: recipe.spans_dim("rowwise", d))   # per-tensor under FSDP
        (<ProcessGroup dp>,)
    """
    layout = _layout(p)
    return () if layout is None else _layout_groups(layout, spans)


def _layout_groups(layout, spans: Callable[[int], bool]) -> tuple[Group, ...]:
    """The groups of ``layout``'s mesh dims (of size > 1) that shard a tensor dim ``spans(dim)``."""
    mesh, placements, _ = layout
    return tuple(mesh.get_group(i) for i, pl in enumerate(placements)
                 if (d := shard_dim(pl)) is not None and spans(d) and mesh.size(i) > 1)


def sharded_dims(p: torch.Tensor) -> set[int]:
    """Tensor dims sharded over any mesh dim (a DTensor's, or those of the layout a local shard's
    owner record is bound to: :func:`layout_of`).

    Example:
        >>> sharded_dims(model.w1.weight)   # after fully_shard
        {0}
    """
    layout = _layout(p)
    if layout is None:
        return set()
    return {d for d in map(shard_dim, layout[1]) if d is not None}


def split_blocks(p: torch.Tensor, usage: str) -> SplitBlocks | None:
    """:class:`~dtensor_fp8.layout.SplitBlocks` of the plane ``usage`` of the FP8 parameter ``p``
    (a DTensor, or a local shard whose owner record is bound), or ``None`` when its shards hold
    whole blocks.

    Args:
        p: the parameter.
        usage: the stored plane (``"rowwise"`` / ``"columnwise"``).

    Example:
        >>> split_blocks(w, "rowwise")   # 128x128 blocks, a 256-row weight over 4 ranks, rank 1
        SplitBlocks(first=(0, 0), total=(2, None), groups=(<ProcessGroup dp>,))
    """
    layout = _layout(p)
    if layout is None:
        return None
    block = (p._local_tensor if isinstance(p, DTensor) else p).recipe.block_shape(usage)
    starts = split_starts(layout, (block.extent(0), block.extent(1)))
    if starts is None:
        return None
    dims = (0, len(layout.shape) - 1)  # the weight's dims holding the plane's rows and columns
    extents = (layout.shape[0] * rows_per_index(layout), layout.shape[-1])
    split = {dims[i] for i, s in enumerate(starts) if s is not None}
    return SplitBlocks(tuple(0 if s is None else s // block.extent(i) for i, s in enumerate(starts)),
                       tuple(None if s is None else -(-extents[i] // block.extent(i)) for i, s in enumerate(starts)),
                       _layout_groups(layout, lambda d: d in split))


def mesh_groups(params: Iterable[torch.Tensor]) -> tuple[Group, ...]:
    """The groups of every mesh dim (of size > 1) of ``params``' meshes, without repeats, in the
    order the parameters and their mesh dims come (the same on every rank that holds them).

    Args:
        params: parameters (DTensors, or local shards whose owner records are bound).

    Example:
        >>> mesh_groups(model.parameters())   # FSDP2 over a (dp, tp) mesh
        (<ProcessGroup dp>, <ProcessGroup tp>)
    """
    out: dict[int, Group] = {}
    for p in params:
        layout = _layout(p)
        if layout is None:
            continue
        mesh = layout[0]
        for i in range(mesh.ndim):
            if mesh.size(i) > 1:
                g = mesh.get_group(i)
                out.setdefault(id(g), g)
    return tuple(out.values())


def max_over_(tensor: torch.Tensor, groups: Sequence[Group]) -> torch.Tensor:
    """``tensor`` reduced (MAX) over every group in turn, in place; returns it.

    Args:
        tensor: a floating tensor (an amax, a flag) on the device of the groups' mesh.
        groups: the groups (from :func:`weight_groups` / :func:`mesh_groups`); none: unchanged.

    Example:
        >>> amax = max_over_(local_amax, weight_groups(w, spans))
    """
    for group in groups:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def whole_grid(scale: torch.Tensor, split: SplitBlocks) -> torch.Tensor:
    """A weight's block grid, whole along the dims its shards split, from each rank's grid of the
    blocks it touches: :meth:`SplitBlocks.whole` MAX-reduced over ``split.groups``.

    Args:
        scale: this rank's scales of the blocks it touches (E8M0 as uint8 bytes, which reduce
            exactly as floats).
        split: ``split_blocks`` of the plane.

    Example:
        >>> whole_grid(local_scales, split_blocks(w, "rowwise"))   # the same grid on every rank
    """
    rows = scale.float() if scale.dtype.itemsize == 1 else scale
    whole = max_over_(split.whole(rows), split.groups)
    return whole.to(scale.dtype) if scale.dtype.itemsize == 1 else whole


def max_by_groups_(amaxes: list[torch.Tensor], groups: Sequence[tuple[Group, ...]]) -> list[torch.Tensor]:
    """Reduce each amax over its own groups with one collective per distinct group tuple: the amaxes
    sharing a tuple are packed into one tensor (the order of first appearance, the same on every
    member rank). Amaxes with no group are returned as they are.

    Args:
        amaxes: local amaxes (any shapes, one device).
        groups: for each amax, the groups it reduces over.

    Example:
        >>> amaxes = max_by_groups_(amaxes, [weight_groups(p, spans) for p in params])
    """
    batches: dict[tuple[int, ...], list[int]] = {}
    for i, gs in enumerate(groups):
        if gs:
            batches.setdefault(tuple(id(g) for g in gs), []).append(i)
    out = list(amaxes)
    for idx in batches.values():
        flat = max_over_(torch.cat([amaxes[i].reshape(-1).float() for i in idx]), groups[idx[0]])
        for i, part in zip(idx, flat.split([amaxes[i].numel() for i in idx]), strict=True):
            out[i] = part.reshape(amaxes[i].shape).to(amaxes[i].dtype)
    return out


def reduces(groups: Iterable[tuple[Group, ...]]) -> bool:
    """Whether any of the group tuples would communicate (a CUDA graph cannot hold that collective)."""
    return any(gs for gs in groups)


__all__ = ["Layout", "dim_pieces", "splits_blocks", "bind_layout_", "layout_of", "weight_groups", "sharded_dims", "split_blocks", "mesh_groups", "max_over_", "max_by_groups_", "reduces"]
