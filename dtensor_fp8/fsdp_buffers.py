"""What one FSDP2 all-gather of an FP8 weight sends, and how its outputs become planes again.

``fsdp.py``'s hooks choose the usages a gather moves; this module turns that choice into the
all-gather inputs (a :class:`GatherPlan`, made once per kind of gather) and the gathered buffers back
into planes (:func:`gathered_planes`). ``fsdp_completion.py`` sends the same inputs for the one
plane a completion gathers.

Each stored plane is sent as two inputs: its FP8 data as uint8 ``(rows, K)`` and its block scales
(only where blocks lie along dim 0; a per-tensor scale is identical on every rank and travels in
the metadata). Every scale input is padded to a slot that fits either direction's local scale grid
on every rank, so forward and backward gathers hand FSDP2 equal counts, dtypes and numels (FSDP2
sizes its all-gather outputs once: see the note in ``fsdp.py``).

[Note: shards that split blocks]
FSDP2 cuts dim 0 by torch's chunk rule, whatever the blocks: a shard may start inside a block (its
block phase, see ``formats/base.py``) and then holds the scale of every block it touches, a block
shared with its neighbour included (both hold the same scale: the amax is reduced over the ranks
sharing the block, ``requantize.py``). What each rank sends of its scales in its slot, and how the
slots become TE's grid of the whole weight, is the plane's route (``scale_slots.py``: where shards
split blocks evenly, each rank sends a stripe of the full grid, so every scale crosses the wire
once). The FP8 data stays a view of FSDP2's buffer; the gathered scale grid is a copy where shards
split blocks and a view where they hold whole blocks.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from . import _compat
from .formats.base import COLUMNWISE, ROWWISE, USAGES, Plane
import torch.distributed as dist

from .scale_slots import ScaleRoute, scale_route, scale_slot_numel
from .tensor import QuantizedTensor, one_byte_as_uint8

aten = torch.ops.aten


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
    view: object  # the owning module's registered fsdp.UnshardedView (te_tensor.py), or None: a QuantizedTensor
    orig_rows: int  # rows of the unpadded full weight
    cols: int  # columns of the weight (shards split rows only)
    fp8_dtypes: tuple  # dtype of each plane in ``stored``
    packed_layout: list | None = None  # one-rank packing of all parts into one input (see pack)
    shard_view: bool = False  # one rank: nothing sent, the unsharded parameter views the shard
    process_group: object = None  # the group FSDP2 gathers over (several ranks): a completion gathers there
    phase: tuple = (0, 0)  # block phase of the gathered weight (of rank 0's shard; see the note at the top)
    scale_routes: dict | None = None  # sent plane -> its scales' ScaleRoute (GatherPlan.scale_routes)
    side_inputs: tuple = ()  # uneven shards: the scale inputs, gathered beside FSDP2's all-gather (see the note)
    logical_shape: tuple | None = None  # a weight of more than two dims (tensor.py's note): its shape; rows are flattened


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class GatherPlan:
    """What one kind of gather of one weight sends; the same every step, so computed once."""

    world: int
    stored: tuple[str, ...]  # planes sent, in order
    padded_rows: int  # rows of each rank's (padded) shard
    pad_rows: int  # rows this rank's shard is short of ``padded_rows`` (the last shard of an uneven split)
    sent_scales: tuple[str, ...]  # planes whose scales are all-gathered (the others travel in metadata)
    scale_slot: int  # numel of every scale input (see scale_slot_numel)
    view: object  # the owning module's registered fsdp.UnshardedView (te_tensor.py), or None
    fp8_dtypes: tuple  # dtype of each plane in ``stored``
    shard_view: bool  # one rank (with a registered view: if it can view the shard itself, ``views_shard``)
    process_group: object  # the shard mesh's process group (several ranks), else None
    phase: tuple = (0, 0)  # block phase of the gathered weight (of rank 0's shard)
    #: uneven shards with block scales: FSDP2 takes only inputs of the padded shard's shape from a short
    #: shard, so the scale inputs are all-gathered beside its all-gather (see the note on uneven shards)
    side_scales: bool = False
    #: per sent plane: how its scales travel in the slot (``scale_slots.py``)
    scale_routes: dict[str, ScaleRoute] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(slots=True, eq=False)
class PlanEntry:
    """A gather's plan, and the last inputs it handed out while they can be handed out again."""

    plan: GatherPlan
    last: tuple | None = None  # (inputs, metadata) of the last gather, reusable while the planes are the same
    last_planes: tuple | None = None  # the plane tensors (QuantizedTensor.plane_tensors) those inputs view


# [Note: every FSDP2 sharding of dim 0 is gathered]
# FSDP2 shards dim 0, and any dim-0 boundary is served (see the note at the top), uneven dims
# included: the last shards are padded to the padded shard's rows (``gather_inputs``) and every
# scale input to the slot, so every all-gather input has the same numel on every rank. An uneven
# dim has one more rule: FSDP2 accepts from a shard shorter than the padded shard only inputs of
# the padded shard's exact shape (torch 2.11 to 2.15, ``FSDPParam.all_gather_inputs``), which block
# scales cannot have. Their scale inputs are then all-gathered by the post-all-gather hook itself,
# over the same group (``side_scales``): one more collective per such weight and gather, of the
# scale bytes only. Dim-1 boundaries inside a block (tensor parallelism's rowwise shards) are
# refused where the weight is distributed (``placement.py``, ``tp.py``).
def gather_plan(q: QuantizedTensor, outer_size: tuple[int, ...], world: int, usages: tuple[str, ...],
                 process_group) -> GatherPlan:
    """The plan for one kind of gather over ``world`` ranks of ``process_group`` (the shard mesh's,
    ``None`` for one rank)."""
    stored = q.recipe.stored_usages(ROWWISE in usages, COLUMNWISE in usages)
    padded_rows = -(-outer_size[0] // world)
    rank = dist.get_rank(process_group) if world > 1 else 0
    if not q.placed:
        # A shard FSDP2 cut whose owner cannot find its DTensor (a module torchtitan's pipeline split
        # copied): FSDP2's shard ``rank`` starts ``rank * padded_rows`` into the tensor it sharded,
        # which starts at a block boundary (a TP shard holds whole blocks).
        q.place_((rank * padded_rows, 0))
    # The gathered weight's block phase: rank 0's shard's (every shard starts padded_rows after the last).
    phase = (q.phase[0] - rank * padded_rows, q.phase[1])
    sent_scales = tuple(u for u in stored if world > 1 and _gathers_scale(q, u))
    even = outer_size[0] == world * padded_rows
    scale_routes = {u: scale_route(q.recipe.block_shape(u), world, padded_rows, outer_size[1], phase, rank, even,
                                   q.device) for u in sent_scales}
    # The unsharded view registered for the owning module (register_unsharded_view; TE modules via te.py).
    view = q.param_state.gather.unsharded_view
    planes = q.planes
    fp8_dtypes = tuple(planes[u].data.dtype if u in planes else q.recipe.fp8_dtype for u in stored)
    # Same answer for both directions (FSDP sizes its all-gather outputs once per weight).
    shard_view = world == 1 and (view is None or view.views_shard(q))
    return GatherPlan(world=world, stored=stored, padded_rows=padded_rows, pad_rows=padded_rows - q.shape[0],
                       sent_scales=sent_scales, view=view,
                       scale_slot=scale_slot_numel(q.recipe, padded_rows, outer_size[1], world, phase, even),
                       fp8_dtypes=fp8_dtypes, shard_view=shard_view, process_group=process_group,
                       phase=(phase[0] % q.recipe.phase_period(0), phase[1]), scale_routes=scale_routes,
                       side_scales=bool(sent_scales) and outer_size[0] % world != 0)


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
            scale = plan.scale_routes[usage].send(one_byte_as_uint8(plane.scale_inv))
            padded = scale.new_zeros(plan.scale_slot)
            padded[: scale.numel()] = scale
            inputs.append(padded)
        else:
            # The shard's own scale: the post-all-gather hook copies it (see fsdp_buffers._scale_copy).
            shared_scales[usage] = plane.scale_inv
    return inputs, shared_scales, local_planes


def gathered_planes(recipe, outputs, metadata: GatherMetadata, kept_scales: dict | None) -> dict[str, Plane]:
    """The full (padded) planes of a gather over several ranks from FSDP2's all-gather ``outputs``
    (unpacked, the side inputs joined): :func:`planes_from_outputs` of the gather's metadata.

    Args:
        recipe: the weight's recipe.
        outputs: FSDP2's all-gather outputs for the inputs :func:`gather_inputs` made.
        metadata: the gather's :class:`GatherMetadata`.
        kept_scales: the unsharded parameter's per-tensor scale copies from its last gather, by
            stored plane (``None`` at its first gather): overwritten in place (see
            :func:`planes_from_outputs`).

    Example:
        >>> planes = gathered_planes(q.recipe, outputs, metadata, None)   # {"rowwise": Plane(...)}
    """
    if metadata.packed_layout is not None:
        outputs = unpack(outputs[0], metadata.packed_layout)
    outputs = join_side_outputs(outputs, metadata)
    return planes_from_outputs(recipe, outputs, metadata.stored, metadata.fp8_dtypes, metadata.shared_scales,
                               metadata.padded_rows, metadata.world, metadata.cols, kept_scales,
                               metadata.scale_routes)


def planes_from_outputs(recipe, outputs, stored, fp8_dtypes, shared_scales: dict, padded_rows: int, world: int,
                        cols: int, kept_scales: dict | None, scale_routes: dict) -> dict[str, Plane]:
    """The full (padded) planes over all-gather ``outputs`` of the inputs :func:`gather_inputs`
    made for the planes ``stored``: views of the output buffers (block scales: the full grid out of
    the ranks' slots, by each plane's route in ``scale_routes``, from the plan); per-tensor scales
    are copies of the shard's (:func:`_scale_copy`), written into ``kept_scales``' tensors where
    given."""
    full_rows = padded_rows * world
    planes, i = {}, 0
    for usage, fp8_dtype in zip(stored, fp8_dtypes, strict=True):
        data = outputs[i].view(full_rows, cols).view(fp8_dtype)
        i += 1
        if usage not in shared_scales:
            scale_dtype = recipe.scale_inv_dtype
            scale = scale_routes[usage].assemble(outputs[i], outputs[i].numel() // world)
            i += 1
            scale = scale.view(scale_dtype) if scale_dtype.itemsize == 1 else scale
        else:
            scale = _scale_copy(None if kept_scales is None else kept_scales.get(usage), shared_scales[usage])
        planes[usage] = Plane(data, scale)
    return planes


def _scale_copy(copy: torch.Tensor | None, live: torch.Tensor) -> torch.Tensor:
    """A copy of the shard's per-tensor scale ``live`` for the unsharded parameter: like the
    gathered bytes, a copy, so an unsharded weight that outlives an optimizer step never pairs its
    old bytes with the shard's new scale. A later gather overwrites the parameter's last ``copy``
    in place (no allocation), keeping its autograd version as FSDP2 keeps its all-gather
    outputs': a compiled block's forward saves the gathered scale for its backward, and the
    backward's gather writes the same value into it (no optimizer step runs in between)."""
    if copy is None or copy.shape != live.shape or copy.dtype != live.dtype:
        return live.clone()
    with _compat.preserve_version_counter(copy):
        return copy.copy_(live)


def split_side_inputs(inputs: list, plan: GatherPlan) -> tuple[list, tuple]:
    """``(FSDP2's inputs, side inputs)`` of a gather: the scale inputs go beside FSDP2's all-gather
    where ``plan.side_scales`` (see the note on uneven shards)."""
    if not plan.side_scales:
        return inputs, ()
    fsdp, side, i = [], [], 0
    for usage in plan.stored:
        fsdp.append(inputs[i])
        i += 1
        if usage in plan.sent_scales:
            side.append(inputs[i])
            i += 1
    return fsdp, tuple(side)


def join_side_outputs(outputs, metadata: GatherMetadata) -> list:
    """FSDP2's outputs with the side inputs all-gathered over the gather's group, in
    :func:`gather_inputs`' order (see the note on uneven shards)."""
    if not metadata.side_inputs:
        return list(outputs)
    side = []
    for inp in metadata.side_inputs:
        flat = inp.reshape(-1)
        out = flat.new_empty(flat.numel() * metadata.world)
        dist.all_gather_into_tensor(out, flat, group=metadata.process_group)
        side.append(out)
    joined, i, j = [], 0, 0
    for usage in metadata.stored:
        joined.append(outputs[i])
        i += 1
        if usage not in metadata.shared_scales:
            joined.append(side[j])
            j += 1
    return joined


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
