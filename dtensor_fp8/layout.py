"""Where a parameter's shards lie: its DTensor's mesh, placements and global shape, and the rows each
rank holds by torch's chunk rule.

A leaf: it imports only torch and ``_compat``, so the quantized tensor, its owner record and the
process-group code (``groups.py``) can all use it without importing each other.
"""

from __future__ import annotations

import functools
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
    dims), so 1 for a 2-D weight and ``out`` for an ``[experts, out, in]`` one: this rank's ``out``,
    a tensor-parallel ``Shard(1)`` piece being an expert weight of its own (``ops/expert_rows.py``).

    Example:
        >>> rows_per_index(layout_of(experts.w1))   # w1: [8, 256, 128]; (Shard(0), Shard(1)) over (2, 2): 128
        256
    """
    return math.prod(dim_pieces(layout, d)[0][1] - dim_pieces(layout, d)[0][0] for d in range(1, len(layout.shape) - 1))


class SplitBlocks(NamedTuple):
    """A plane whose blocks are split between shards along dim 0 and/or dim 1 (FSDP2 at a degree
    whose shards are not whole blocks; a tensor-parallel shard starting inside a block): where this
    shard's blocks lie in the weight's block grid along each split dim, and the groups its block
    amaxes reduce over (``groups.split_blocks`` makes it). Along a dim that no shard boundary splits
    the grid is this shard's own (the ranks of :attr:`groups` hold the same blocks of that dim: a
    mesh dim's group varies one coordinate only)."""

    first: tuple[int, int]  # per dim: index, in the whole grid, of the first block this shard touches (0: not split)
    total: tuple[int | None, int | None]  # per dim: blocks of the whole dim where split, None where not
    groups: tuple

    def whole(self, local):
        """The grid whole along the split dims with this shard's ``local`` grid (of the blocks it
        touches) in place, zeros elsewhere: what a MAX reduction over :attr:`groups` completes."""
        shape = tuple(n if t is None else t for n, t in zip(local.shape, self.total))
        out = local.new_zeros(shape)
        out[self.first[0] : self.first[0] + local.shape[0], self.first[1] : self.first[1] + local.shape[1]] = local
        return out

    def touched(self, whole, grid: tuple[int, int]):
        """The ``grid``-shaped part of ``whole`` holding the blocks this shard touches."""
        return whole[self.first[0] : self.first[0] + grid[0], self.first[1] : self.first[1] + grid[1]]


@functools.lru_cache(maxsize=4096)
def split_starts(layout: Layout, blocks: tuple) -> tuple | None:
    """Per plane dim (rows, columns), this rank's first plane row / column if ``layout``'s shards
    split that dim's ``blocks[dim]``-long blocks (else ``None``); ``None`` when no dim is split (a
    pure function of the layout, kept: each requantization asks it of every weight). A weight of
    more than two dims has its leading dims flattened into plane rows (:func:`rows_per_index`).

    Example:
        >>> split_starts(layout_of(w), (128, 128))   # a 256-row weight over 4 ranks, rank 1
        (64, None)
    """
    dims = (0, len(layout.shape) - 1)
    starts = tuple(dim_pieces(layout, d)[0][0] * (rows_per_index(layout) if d == 0 else 1)
                   if splits_blocks(layout, d, b) else None for d, b in zip(dims, blocks))
    return None if all(s is None for s in starts) else starts


__all__ = ["Layout", "shard_dim", "dim_pieces", "splits_blocks", "rows_per_index", "SplitBlocks", "split_starts"]
