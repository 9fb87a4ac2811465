"""What one FSDP2 all-gather of an FP8 weight sends, and how its outputs become planes again.

``fsdp.py``'s hooks choose the usages a gather moves; this module turns that choice into the
all-gather inputs (a :class:`GatherPlan`, made once per kind of gather) and the gathered buffers back
into planes (:func:`planes_from_outputs`). ``fsdp_completion.py`` sends the same inputs for the one
plane a completion gathers.

Each stored plane is sent as two inputs: its FP8 data as uint8 ``(rows, K)`` and its block scales
(only where blocks lie along dim 0; a per-tensor scale is identical on every rank and travels in
the metadata). Every scale input is padded to a per-recipe slot that fits either direction's local
scale grid, so forward and backward gathers hand FSDP2 equal counts, dtypes and numels (FSDP2 sizes
its all-gather outputs once: see the note in ``fsdp.py``).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .formats.base import COLUMNWISE, ROWWISE, USAGES, Plane, RecipeError
from .ops.slicing import check_shardable
from .tensor import QuantizedTensor, one_byte_as_uint8

aten = torch.ops.aten


def _scale_slot_numel(q: QuantizedTensor, rows: int) -> int:
    """Numel of the scale input of a ``rows``-row shard: the largest local scale grid over both
    usages, so forward and backward gathers hand FSDP equal numels."""
    return max(math.prod(q.recipe.block_shape(u).grid((rows, q.shape[1]))) for u in (ROWWISE, COLUMNWISE))


def _gathers_scale(q: QuantizedTensor, usage: str) -> bool:
    return q.recipe.block_shape(usage).extent(0) is not None


def served_usages(recipe, stored: tuple[str, ...]) -> tuple[str, ...]:
    """Every usage that the stored planes ``stored`` serve: both for per-tensor and 128x128 recipes
    (one stored plane), else the planes themselves. A gathered weight declares these (see the note
    at the top).

    Args:
        recipe: the weight's recipe.
        stored: the stored planes a gather brought.

    Example:
        >>> served_usages(dtensor_fp8.CurrentScaling(), ("rowwise",))
        ('rowwise', 'columnwise')
    """
    return tuple(u for u in USAGES if recipe.stored_usage(u) in stored)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class GatherMetadata:
    """What ``fsdp_post_all_gather`` needs to rebuild the planes from FSDP's output buffers."""

    usages: tuple[str, ...]  # usages the gathered tensor serves (served_usages of ``stored``)
    gathered: tuple[str, ...]  # usages this gather was asked for (gather_usages)
    stored: tuple[str, ...]  # planes sent, in order (data, then scale where blocks lie along dim 0)
    shared_scales: dict  # per-tensor scales: identical on every rank, not sent
    padded_rows: int  # rows of each rank's (padded) shard
    world: int
    view: object  # the owning module's registered fsdp.UnshardedView (te.py), or None: a QuantizedTensor
    orig_rows: int  # rows of the unpadded full weight
    cols: int  # columns of the weight (shards split rows only)
    fp8_dtypes: tuple  # dtype of each plane in ``stored``
    packed_layout: list | None = None  # one-rank packing of all parts into one input (see pack)
    shard_view: bool = False  # one rank: nothing sent, the unsharded parameter views the shard
    process_group: object = None  # the group FSDP2 gathers over (several ranks): a completion gathers there


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class GatherPlan:
    """What one kind of gather of one weight sends; the same every step, so computed once."""

    world: int
    stored: tuple[str, ...]  # planes sent, in order
    padded_rows: int  # rows of each rank's (padded) shard
    pad_rows: int  # rows this rank's shard is short of ``padded_rows`` (the last shard of an uneven split)
    sent_scales: tuple[str, ...]  # planes whose scales are all-gathered (the others travel in metadata)
    scale_slot: int  # numel of every scale input (see _scale_slot_numel)
    view: object  # the owning module's registered fsdp.UnshardedView (te.py), or None
    fp8_dtypes: tuple  # dtype of each plane in ``stored``
    shard_view: bool  # one rank (with a registered view: if it can view the shard itself, ``views_shard``)
    process_group: object  # the shard mesh's process group (several ranks), else None


@dataclasses.dataclass(slots=True, eq=False)
class PlanEntry:
    """A gather's plan, and the last inputs it handed out while they can be handed out again."""

    plan: GatherPlan
    last: tuple | None = None  # (inputs, metadata) of the last gather, reusable while the planes are the same
    last_planes: tuple | None = None  # the plane tensors (QuantizedTensor.plane_tensors) those inputs view


def _check_gatherable(q: QuantizedTensor, outer_size: tuple[int, ...], world: int, usages: tuple[str, ...]):
    """Raise a :class:`RecipeError` with the fix unless FSDP2 can gather ``usages`` of a weight of
    ``outer_size`` sharded over ``world`` ranks."""
    stored = q.recipe.stored_usages(ROWWISE in usages, COLUMNWISE in usages)
    check_shardable(outer_size, q.recipe, 0, world, usages)
    if any(_gathers_scale(q, u) for u in stored) and outer_size[0] % world:
        # FSDP2 requires every all-gather input of an unevenly sharded parameter to have the
        # padded shard's exact shape; block scales cannot. Raised on every rank alike.
        padded_rows = -(-outer_size[0] // world)
        raise RecipeError(
            f"{q.recipe.name}: FSDP2 shards dim 0 of weight shape {tuple(outer_size)} unevenly over "
            f"{world} ranks, and FSDP2 cannot all-gather block scales of uneven shards. Pad dim 0 to "
            f"{padded_rows * world} (a multiple of {world} x its block rows) or use another world size."
        )


# [Note: where an FSDP2 sharding is refused]
# Shard boundaries inside a block are refused at ``fully_shard`` itself: FSDP2 chunks the weight
# with ``torch.chunk``, and the op table's split cuts whole blocks only (ops/slicing.py). Block
# scales of uneven dim-0 shards are a limit of FSDP2's all-gather alone (every input must have the
# padded shard's shape), not of the tensor op, so they are refused by the weight's first
# ``fsdp_pre_all_gather``, which FSDP2 tells the full shape (``outer_size``) and the shard mesh: on
# every rank alike (each checks the same shape and world size), before FSDP2 issues the collective,
# with a RecipeError naming shape, world size and fix. Every direction the weight will be gathered
# in is checked there, so a forward cannot succeed and its backward then fail. ``fully_shard``
# offers no frame-free moment to do it earlier: ``FSDPParam.__init__`` looks the hook up on the new
# shard before FSDP2 attaches the param group to its state (so the registry of
# ``_compat.fsdp_managed_params`` cannot say whose shard it is yet), and it sets the sharded
# parameter on the module without ``Module.__setattr__``, so no parameter-registration hook fires.
def gather_plan(q: QuantizedTensor, outer_size: tuple[int, ...], world: int, usages: tuple[str, ...],
                 process_group) -> GatherPlan:
    """The plan for one kind of gather over ``world`` ranks of ``process_group`` (the shard mesh's,
    ``None`` for one rank), after checking that every gather of ``q`` is possible."""
    every_usage = tuple(u for u in (ROWWISE, COLUMNWISE) if u in usages or u in q.usages)
    _check_gatherable(q, outer_size, world, every_usage)
    stored = q.recipe.stored_usages(ROWWISE in usages, COLUMNWISE in usages)
    padded_rows = -(-outer_size[0] // world)
    sent_scales = tuple(u for u in stored if world > 1 and _gathers_scale(q, u))
    # The unsharded view registered for the owning module (register_unsharded_view; TE modules via te.py).
    view = q.param_state.gather.unsharded_view
    planes = q.planes
    fp8_dtypes = tuple(planes[u].data.dtype if u in planes else q.recipe.fp8_dtype for u in stored)
    # Same answer for both directions (FSDP sizes its all-gather outputs once per weight).
    shard_view = world == 1 and (view is None or view.views_shard(q))
    return GatherPlan(world=world, stored=stored, padded_rows=padded_rows, pad_rows=padded_rows - q.shape[0],
                       sent_scales=sent_scales, scale_slot=_scale_slot_numel(q, padded_rows), view=view,
                       fp8_dtypes=fp8_dtypes, shard_view=shard_view, process_group=process_group)


def gather_inputs(q: QuantizedTensor, plan: GatherPlan) -> tuple[list, dict, dict]:
    """What ``plan`` sends of the shard ``q``: ``(inputs, shared_scales, local_planes)``: each stored
    plane's FP8 data as uint8, then its block scales padded to the slot (where sent); the per-tensor
    scales that are not sent, by plane; the (padded) shard's planes the inputs were made from."""
    local = q
    if plan.pad_rows:  # short last shard: pad to the padded shard size
        local = aten.constant_pad_nd.default(local, [0, 0, 0, plan.pad_rows])
    inputs, shared_scales = [], {}
    local_planes = local.planes
    for usage in plan.stored:
        plane = local_planes[usage]
        inputs.append(plane.data.contiguous().view(torch.uint8))
        if usage in plan.sent_scales:
            scale = one_byte_as_uint8(plane.scale_inv).reshape(-1)
            padded = scale.new_zeros(plan.scale_slot)
            padded[: scale.numel()] = scale
            inputs.append(padded)
        else:
            # The shard's own scale: the post-all-gather hook copies it (see _shared_scale).
            shared_scales[usage] = plane.scale_inv
    return inputs, shared_scales, local_planes


def planes_from_outputs(recipe, outputs, stored, fp8_dtypes, shared_scales: dict, padded_rows: int, world: int,
                         cols: int, scale_copy) -> dict[str, Plane]:
    """The full (padded) planes over all-gather ``outputs`` of the inputs :func:`gather_inputs`
    made for the planes ``stored``: views of the output buffers (block scales: the ranks' grids,
    out of their slots); per-tensor scales from ``scale_copy(usage, shard_scale)``."""
    full_rows = padded_rows * world
    planes, i = {}, 0
    for usage, fp8_dtype in zip(stored, fp8_dtypes, strict=True):
        data = outputs[i].view(full_rows, cols).view(fp8_dtype)
        i += 1
        if usage not in shared_scales:
            gr, gc = recipe.block_shape(usage).grid((padded_rows, cols))
            scale_dtype = recipe.scale_inv_dtype
            raw = outputs[i].view(world, -1)
            i += 1
            # Each rank's slot holds its (gr, gc) grid first; concatenating the ranks' grids along
            # dim 0 is the full grid because every shard is a whole number of blocks.
            scale = raw[:, : gr * gc].reshape(world * gr, gc)
            scale = scale.view(scale_dtype) if scale_dtype.itemsize == 1 else scale
        else:
            scale = scale_copy(usage, shared_scales[usage])
        planes[usage] = Plane(data, scale)
    return planes


def pack(inputs: list[torch.Tensor]) -> tuple[torch.Tensor, list]:
    """Every input in one uint8 buffer, each part 4-byte aligned, and the layout :func:`unpack` reads:
    with one rank FSDP2 skips the collective and copies only the *first* all-gather input (torch
    2.13, ``FSDPParamGroup.wait_for_unshard``)."""
    layout = [(t.dtype, t.shape, _padded_nbytes(t)) for t in inputs]
    return torch.cat([_pad_bytes(t) for t in inputs]), layout


def _padded_nbytes(t: torch.Tensor) -> int:
    return -(-t.numel() * t.element_size() // 4) * 4  # keep every part 4-byte aligned (fp32 scales)


def _pad_bytes(t: torch.Tensor) -> torch.Tensor:
    raw = t.reshape(-1).view(torch.uint8)
    out = raw.new_zeros(_padded_nbytes(t))
    out[: raw.numel()] = raw
    return out


def unpack(packed: torch.Tensor, layout) -> list[torch.Tensor]:
    parts, offset = [], 0
    for dtype, shape, nbytes in layout:
        part = packed[offset : offset + math.prod(shape) * torch.empty((), dtype=dtype).element_size()]
        parts.append(part.view(dtype).view(shape))
        offset += nbytes
    return parts
