"""How one plane's block scales travel in an FSDP2 all-gather of an FP8 weight: each rank's *scale
slot*, what it sends in it, and how the gathered slots become TE's scale grid of the whole weight.

[Note: scale slots]
FSDP2 all-gathers equal numels from every rank, and sizes its outputs once per weight, so every
scale input of a weight is padded to one slot, the same on every rank and for both directions
(:func:`scale_slot_numel`). What a rank puts in its slot is the plane's :class:`ScaleRoute`:

- *whole blocks* (every shard starts and ends on block boundaries): the rank's own grid; the slots
  concatenate to the full grid.
- *stripes* (shards split blocks, evenly: FSDP2 over a weight or over a TP shard, which may itself
  start inside a block): the full grid, flattened row-major, is cut where the ranks' rows are
  cut, in proportion: a rank starting ``o`` rows into block ``j`` starts its stripe at
  ``j * grid_cols + o * grid_cols // block_rows`` (``o`` and ``block_rows`` counted over the rows
  of the block the gathered weight holds), so where shards hold ``rows * grid_cols / block_rows``
  scales exactly, rank ``r`` sends elements ``[r * S, (r + 1) * S)``. Every element
  lies in a block the rank touches, whose scale it holds (a shared block's scale is the same on
  every rank holding it: ``requantize.AmaxReduction``). Each scale crosses the wire once, so the slots hold
  one copy of the grid: no scale row is sent twice however many ranks share a block (at 1024-way
  FSDP of a Llama3 K projection, 128 ranks share each 128-row block).
- *first rows* (the rest: uneven dims, where a shard past the weight's end holds padding only and
  cannot know a shared block's scale): each
  rank sends every grid row it touches, and the full grid takes each block's row from the rank
  holding the block's first row. A shared block then crosses the wire once per rank holding it.

The arithmetic is the same on every rank and needs no communication.
"""

from __future__ import annotations

import dataclasses

import torch

from .formats.base import COLUMNWISE, ROWWISE
from .ops.slicing import max_piece_grid_rows, scale_rows_of_pieces


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class ScaleRoute:
    """One plane's scales in a gather of ``world`` equal shards of ``rows`` rows (see the note at
    the top): what this rank sends (``send``) and how the gathered slots become the full grid
    (``assemble``)."""

    kind: str  # "whole blocks", "stripes" or "first rows"
    world: int
    grid: tuple[int, int]  # the full (padded) weight's scale grid
    numel: int  # the most any rank sends: this plane's need of the slot
    span: tuple[int, int] = (0, -1)  # stripes: (offset into this rank's flat grid, count) it sends
    share: int = 0  # stripes of equal length: elements every rank but the last sends
    #: first rows: the full grid's rows in the ranks' slots; stripes of unequal length: the full
    #: grid's elements in the gathered slots
    sources: torch.Tensor | None = None

    def send(self, local_scale: torch.Tensor) -> torch.Tensor:
        """What this rank sends of its scale grid ``local_scale``, flat."""
        flat = local_scale.reshape(-1)
        if self.kind != "stripes":
            return flat
        offset, count = self.span
        return flat[offset : offset + count]

    def assemble(self, gathered: torch.Tensor, slot: int) -> torch.Tensor:
        """The full grid from ``gathered``, every rank's ``slot`` elements in rank order."""
        raw = gathered.reshape(self.world, slot)
        g_rows, g_cols = self.grid
        if self.kind == "whole blocks":
            return raw[:, : self.numel].reshape(g_rows, g_cols)
        if self.kind == "stripes" and self.sources is not None:
            return gathered.reshape(-1).index_select(0, self.sources.to(gathered.device)).view(g_rows, g_cols)
        if self.kind == "stripes":
            head = raw[:-1, : self.share].reshape(-1)
            tail = raw[-1, : g_rows * g_cols - head.numel()]
            return torch.cat([head, tail]).view(g_rows, g_cols)
        per_slot = self.numel // g_cols
        rows = raw[:, : self.numel].reshape(self.world * per_slot, g_cols)
        return rows.index_select(0, self.sources.to(rows.device))


def _stripe_starts(b: int, world: int, rows: int, grid: tuple[int, int], phase: int = 0) -> list[int]:
    """Where each rank's stripe starts in the flat full grid, and the grid's end: rank ``r``'s first
    row, mapped into its block's grid row in proportion to its offset among the block's rows that
    the gathered weight holds (its first block holds ``b - phase`` of them when the weight, a TP
    shard, starts ``phase`` rows into a block; a last block the shards fill in part is cut in
    proportion to the rows it has). A stripe then ends inside the block holding the rank's last
    row, or at the end of the block before: it lies in blocks the rank touches."""
    g_rows, g_cols = grid
    total = world * rows
    starts = []
    for r in range(world):
        at = phase + r * rows  # rank r's first row, counted from the first block's start
        block = at // b
        first, stop = max(block * b, phase), min((block + 1) * b, phase + total)  # the block's rows held
        starts.append(block * g_cols + (at - first) * g_cols // (stop - first))
    return starts + [g_rows * g_cols]


def scale_route(block, world: int, rows: int, cols: int, phase: tuple[int, int], rank: int,
                even: bool = True, device=None) -> ScaleRoute:
    """The :class:`ScaleRoute` of a plane with blocks ``block`` in a gather of ``world`` shards of
    ``rows`` rows of a ``cols``-column weight (rank 0's shard at block ``phase``), as seen by
    ``rank``; ``even``: the weight fills every shard (no padding rows).

    Args:
        block: the plane's :class:`~dtensor_fp8.formats.planes.BlockShape`.
        world: ranks in the gather.
        rows: rows of every (padded) shard.
        cols: columns of the weight.
        phase: block phase of rank 0's shard.
        rank: this rank.
        even: whether the weight's rows are exactly ``world * rows``.
        device: where an assembly index lives (the shard's device).

    Example:
        >>> r = scale_route(BlockShape(128, 1), 64, 16, 4096, (0, 0), rank=3)   # 1x128's column plane
        >>> r.kind, r.numel, r.span   # 16 rows: 1/8 of a 4096-scale grid row, from the rank's one row
        ('stripes', 512, (1536, 512))
    """
    full = block.grid((world * rows, cols), phase)
    local = block.grid((rows, cols), phase)
    b = block.extent(0)
    sources = scale_rows_of_pieces(block, world, rows, cols, phase) if b is not None else None
    if sources is None:
        return ScaleRoute("whole blocks", world, full, local[0] * local[1])
    if even:
        p0 = phase[0] % b
        starts = _stripe_starts(b, world, rows, full, p0)
        counts = [stop - start for start, stop in zip(starts, starts[1:])]
        slot = max(counts)
        span = (starts[rank] - (p0 + rank * rows) // b * full[1], counts[rank])
        if len(set(counts[:-1])) == 1:  # equal stripes (the last may differ): two slices assemble the grid
            return ScaleRoute("stripes", world, full, slot, span=span, share=counts[0])
        # Stripes of unequal length (a share of a block that is not a whole number of scales, a last
        # block the shards fill in part): the grid is taken out of the slots by an index.
        index = torch.cat([torch.arange(r * slot, r * slot + n) for r, n in enumerate(counts)])
        return ScaleRoute("stripes", world, full, slot, span=span, sources=index.to(device))
    per_slot = max_piece_grid_rows(block, world, rows, cols, phase)
    return ScaleRoute("first rows", world, full, per_slot * full[1],
                      sources=torch.tensor(sources, dtype=torch.long, device=device))


def scale_slot_numel(recipe, rows: int, cols: int, world: int, phase: tuple[int, int] = (0, 0),
                     even: bool = True) -> int:
    """Numel of every scale input of an FSDP2 gather of ``rows``-row shards of a ``cols``-column
    weight over ``world`` ranks (the first shard at block ``phase``; ``even``: no padding rows):
    the most any rank sends of either usage's scales (:func:`scale_route`), so forward and backward
    gathers hand FSDP equal numels on every rank (see the note in ``fsdp.py``).

    Args:
        recipe: the weight's recipe.
        rows: rows of every (padded) shard.
        cols: columns of the weight.
        world: ranks in the gather.
        phase: block phase of rank 0's shard.
        even: whether the weight's rows are exactly ``world * rows``.

    Example:
        >>> scale_slot_numel(MXFP8(), 64, 4096, 8)   # the rowwise grid (64, 128); the column plane's stripe as large
        8192
    """
    return max(scale_route(recipe.block_shape(u), world, rows, cols, phase, 0, even).numel
               for u in (ROWWISE, COLUMNWISE))
