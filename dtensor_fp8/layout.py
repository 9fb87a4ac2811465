"""Where a parameter's shards lie: its DTensor's mesh, placements and global shape, and the rows each
rank holds by torch's chunk rule.

A leaf: it imports only torch and ``_compat``, so the quantized tensor, its owner record and the
process-group code (``groups.py``) can all use it without importing each other.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement

from . import _compat


class Layout(NamedTuple):
    """Where an FP8 parameter's shards lie: its DTensor's mesh, placements and global shape."""

    mesh: object
    placements: tuple
    shape: tuple[int, ...]


def shard_dim(placement: Placement) -> int | None:
    """The tensor dim a placement shards: ``Shard(d)`` and FSDP's ``_StridedShard(d)`` on a
    (dp, tp) mesh (whose ``is_shard()`` is False in torch 2.13); ``None`` otherwise."""
    if isinstance(placement, (Shard, _compat.strided_shard_class())) or placement.is_shard():
        return placement.dim
    return None


def dim_pieces(layout: Layout, dim: int) -> tuple[tuple[int, int], list[tuple[int, int]]]:
    """Where the shards of ``layout`` lie along tensor dim ``dim``: ``((start, stop) of this rank's
    shard, [(start, stop) of every rank's shard])``, by torch's chunk rule applied mesh dim by mesh
    dim (FSDP2's ``_StridedShard`` over a tensor-parallel dim after the TP dims it shards within:
    FSDP2 chunks the TP shard). No communication: every rank computes every shard.

    Args:
        layout: a parameter's :class:`Layout` (``groups.layout_of``).
        dim: the tensor dim.

    Example:
        >>> dim_pieces(layout_of(w), 0)   # fully_shard of a 256-row weight over 4 ranks, rank 1
        ((64, 128), [(0, 64), (64, 128), (128, 192), (192, 256)])
    """
    mesh, placements, shape = layout
    strided = _compat.strided_shard_class()
    order = [i for i, pl in enumerate(placements) if shard_dim(pl) == dim and not isinstance(pl, strided)]
    order += [i for i, pl in enumerate(placements) if shard_dim(pl) == dim and isinstance(pl, strided)]
    coord = mesh.get_coordinate()
    mine, every = (0, shape[dim]), [(0, shape[dim])]
    for i in order:
        n = mesh.size(i)
        mine = _chunk(mine, n)[coord[i]]
        every = [piece for whole in every for piece in _chunk(whole, n)]
    return mine, every


def _chunk(span: tuple[int, int], n: int) -> list[tuple[int, int]]:
    start, stop = span
    size = stop - start
    step = -(-size // n) if size else 0
    return [(min(start + k * step, stop), min(start + (k + 1) * step, stop)) for k in range(n)]


def splits_blocks(layout: Layout | None, dim: int, block: int | None) -> bool:
    """Whether a shard of ``layout`` starts inside a ``block``-long scaling block along ``dim``
    (the same answer on every rank: then the block's amax is reduced over the ranks sharing it).

    Example:
        >>> splits_blocks(layout_of(w), 0, 128)   # a 256-row weight over 4 ranks: 64-row shards
        True
    """
    if layout is None or block is None or not any(shard_dim(pl) == dim for pl in layout.placements):
        return False
    # along dim 0 of a weight of more than two dims, an index is rows_per_index(layout) plane rows
    f = rows_per_index(layout) if dim == 0 else 1
    return any((start * f) % block for start, stop in dim_pieces(layout, dim)[1] if stop > start)


def rows_per_index(layout: Layout) -> int:
    """Plane rows per index along dim 0 of the weight ``layout`` lays out: its planes are matrices
    with the leading dims flattened into rows (``tensor.py``'s note on tensors of more than two
    dims), so 1 for a 2-D weight and ``out`` for an ``[experts, out, in]`` one.

    Example:
        >>> rows_per_index(layout_of(experts.w1))   # w1: [8, 256, 128]
        256
    """
    return math.prod(layout.shape[1:-1])


__all__ = ["Layout", "shard_dim", "dim_pieces", "splits_blocks", "rows_per_index"]
