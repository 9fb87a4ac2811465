"""Tensor-parallel pieces of each expert: ``Shard(1)`` of an ``[E, out, in]`` expert weight.

[Note: a piece of every expert's rows]
torchtitan's tensor parallelism shards a routed expert's output dim: ``w1`` / ``w3`` ``[E, F, D]``
by ``Shard(1)`` (column-parallel, each rank ``F / tp`` rows of every expert), ``w2`` ``[E, D, F]``
by ``Shard(2)`` (row-parallel: the last dim, which the planes' columns are, so the dim-1 cuts of
``ops/slicing.py`` serve it, inside blocks included). Rows ``[a, b)`` of every expert are not one
range of the planes' flattened rows ``(E * out, in)`` (``tensor.py``'s note on tensors of more
than two dims) but ``E`` ranges, one per expert. Such a piece is therefore held as an expert weight
of its own, ``[E, b - a, in]`` whose planes are each expert's rows ``[a, b)`` stacked (copies), with
the recipe of experts of ``b - a`` rows (``PerExpert.expert_rows_piece``): every FSDP2 shard,
gather, GEMM and requantization of the piece is then that of a whole expert weight, and nothing
outside these two functions and the codec knows the piece was cut from a larger one.

What the codec allows (``formats/experts.py``): a cut at a block boundary of every stored plane
(MXFP8: 32 rows, 1x128's columnwise and 128x128: 128 rows, where an expert has more rows than a
block), so the piece's blocks are the whole weight's; per-tensor bases at any row, the piece keeping
its expert's one scale (its amax is MAX-reduced over the ranks of the pieces at each
requantization: ``spans_dim`` of dim 1 is true, ``requantize.py``). A cut inside a block is refused
with the fix (a degree whose pieces are whole blocks); pieces that split blocks along the output
dim, as 2-D ``ColwiseParallel`` weights may, are not built for expert weights yet.

Joining pieces (``cat`` along dim 1: DTensor's ``full_tensor()`` of a ``Shard(1)`` weight stacks
them along dim 0, chunks and concatenates along dim 1) is the inverse: each expert's rows of every
piece in order, a shared per-expert scale kept once after checking the pieces agree.
"""

from __future__ import annotations

import torch

from ..formats.base import Plane, RecipeError
from ..tensor import QuantizedTensor, one_byte_as_uint8


def _per_expert(t: torch.Tensor, experts: int) -> torch.Tensor:
    """``t`` (a plane's data or scale grid, rows expert after expert) as ``[E, rows per expert, cols]`` bytes."""
    b = one_byte_as_uint8(t)
    return b.reshape(experts, b.shape[0] // experts, b.shape[1])


def _as(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).view(like.dtype)


def _check(q: QuantizedTensor, what: str):
    piece = getattr(q.recipe, "expert_rows_piece", None)
    if piece is None or q.dim() != 3:
        raise RecipeError(
            f"{q.recipe.name}: {what} along dim 1 of an FP8 weight of shape {tuple(q.shape)}: only the rows of each "
            "expert of an [experts, out, in] weight quantized per expert (dtensor_fp8.per_expert) can be cut there.")
    if q.phase[0]:
        raise RecipeError(
            f"{q.recipe.name}: {what} along dim 1 of an FP8 expert piece of shape {tuple(q.shape)} that starts inside "
            "an expert's blocks; cut the experts' rows (tensor parallelism) before FSDP2 shards inside them.")
    return piece


def slice_expert_rows(q: QuantizedTensor, start: int, stop: int) -> QuantizedTensor:
    """Rows ``[start, stop)`` of every expert of the 3-D expert weight ``q`` (see the note).

    Args:
        q: an ``[E, out, in]`` expert weight quantized per expert.
        start, stop: the rows of each expert (a ``Shard(1)`` piece), at block boundaries.

    Example:
        >>> piece = slice_expert_rows(q, 128, 256)   # q: [8, 256, 512] -> [8, 128, 512]
    """
    recipe = _check(q, "slicing")(start, stop, q.shape)
    e, out, cols = q.shape
    planes = {}
    for usage, plane in q.planes.items():
        block = q.recipe.block_shape(usage).rows  # an expert's block rows (all of them: a per-expert scale)
        first, last = start // block, -(-stop // block)
        planes[usage] = Plane(_as(_per_expert(plane.data, e)[:, start:stop], plane.data),
                              _as(_per_expert(plane.scale_inv, e)[:, first:last], plane.scale_inv))
    hp = None if q.hp_init is None else q.hp_init.reshape(e, out, cols)[:, start:stop].contiguous()
    return QuantizedTensor.from_planes(planes, recipe, (e, stop - start, cols), q.dtype, q.usages,
                                       param_state=q.param_state, hp_init=hp, phase=(0, q.phase[1]))


def cat_expert_rows(pieces: list[QuantizedTensor]) -> QuantizedTensor:
    """The pieces' rows of each expert joined (``cat`` along dim 1 of ``[E, rows, in]`` pieces): the
    inverse of :func:`slice_expert_rows`.

    Example:
        >>> full = cat_expert_rows([top, bottom])   # two [8, 128, 512] pieces -> [8, 256, 512]
    """
    first = pieces[0]
    _check(first, "concatenation")
    e, _, cols = first.shape
    rows = sum(p.shape[1] for p in pieces)
    for p in pieces:
        if (not isinstance(p, QuantizedTensor) or p.dim() != 3 or (p.shape[0], p.shape[2]) != (e, cols)
                or tuple(p.planes) != tuple(first.planes) or p.phase != first.phase
                or p.recipe.with_expert_rows(rows) != first.recipe.with_expert_rows(rows)):
            raise RecipeError(f"{first.recipe.name}: cannot join along dim 1 an expert piece of shape {tuple(p.shape)} "
                              f"with {tuple(first.shape)}: pieces of one expert weight hold the same experts, columns, "
                              "recipe and planes.")
    recipe = first.recipe.with_expert_rows(rows)
    planes = {}
    for usage, plane in first.planes.items():
        data = torch.cat([_per_expert(p.planes[usage].data, e) for p in pieces], 1)
        scales = [p.planes[usage].scale_inv for p in pieces]
        if recipe.expert_rows_share_scale(usage):  # one scale per expert, the same in every piece
            if not all(torch.equal(one_byte_as_uint8(s), one_byte_as_uint8(scales[0])) for s in scales[1:]):
                raise RecipeError(f"{recipe.name}: the pieces of an expert weight of shape {(e, rows, cols)} hold "
                                  f"different {usage} scales for the same experts; requantize them together (one "
                                  "amax per expert over every piece).")
            scale = scales[0]
        else:
            scale = _as(torch.cat([_per_expert(s, e) for s in scales], 1), plane.scale_inv)
        planes[usage] = Plane(_as(data, plane.data), scale)
    hp = None
    if all(p.hp_init is not None for p in pieces):
        hp = torch.cat([p.hp_init.reshape(e, p.shape[1], cols) for p in pieces], 1)
    return QuantizedTensor.from_planes(planes, recipe, (e, rows, cols), first.dtype, first.usages,
                                       param_state=first.param_state, hp_init=hp, phase=first.phase)
