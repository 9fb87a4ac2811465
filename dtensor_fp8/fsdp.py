"""FSDP2 all-gather extension: FP8 bytes on the wire, one direction per gather.

[Note: what each FSDP2 all-gather moves]
``fully_shard`` calls ``fsdp_pre_all_gather`` on each rank's local shard and
``fsdp_post_all_gather`` on the gathered buffers. We choose the *usages* to gather
(:func:`gather_usages`):

* forward gather of a group that reshards after forward: ``rowwise`` (forward GEMM);
* backward gather: ``columnwise`` (input-gradient GEMM);
* a group that does not reshard after forward (the root by default, ``reshard_after_forward=False``)
  gathers both in forward, because no backward gather will happen;
* with activation checkpointing under the group, both, because the forward is recomputed inside
  backward from the backward gather;
* with a compiled module under the group (``block.compile()`` or ``torch.compile(block)`` before
  ``fully_shard``, torchtitan's per-block compile), both, in forward *and* backward: a compiled
  backward is traced together with its forward and reads the planes the forward's graph saved
  (views of FSDP's all-gather buffers, which FSDP refills in place at the backward gather), so
  both gathers must fill those buffers with the same planes. For per-tensor and 128x128 recipes
  this costs nothing (one stored plane either way); MXFP8 and 1x128 move both planes twice.

A module whose forward checkpoints or compiles in a way not detected here (``torch.utils.checkpoint``
called inside ``forward``, a whole-model ``torch.compile`` over FSDP modules) is marked with
:func:`gather_both_usages`.

Each stored plane is sent as two inputs: its FP8 data as uint8 ``(rows, K)`` and its block scales
(only where blocks lie along dim 0; a per-tensor scale is identical on every rank and travels in
the metadata, as every scale does on a one-rank mesh, where the "gather" is a local copy). FSDP
sizes its all-gather outputs once, at the first gather, and every later gather must hand over
the same number of inputs with the same dtypes and numels, or it silently resizes them ("An
output ... was resized") and corrupts the data. Forward (rowwise) and backward
(columnwise) gathers satisfy this: the data inputs are the same shape, and every scale input is
padded to a per-recipe slot size that fits either direction's local scale grid.

On a one-rank mesh nothing is sent at all: the "gather" would be a copy of the shard, so the
unsharded parameter views the shard's own planes instead (a QuantizedTensor over them, or for the
weights of TE modules, where every TE buffer of the direction can be a view of the shard, a TE
tensor, ``te.py``). An optimizer step rewrites the shard's bytes and scales in place, so an
unsharded weight kept across a step (``set_reshard_after_backward(False)``) reads the new values,
never old bytes with a new scale; FSDP2's own copy would keep the old ones until it gathers again.

For per-tensor and 128x128 blockwise recipes both directions send the same stored plane; the
transpose TE's backward GEMM wants is built after a backward-only gather, or by the backward GEMM
itself (the "transpose cache"), and dropped after use, so it never outlives the unsharded parameter.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import weakref
from typing import Protocol

import torch

from . import _compat
from .formats.base import COLUMNWISE, ROWWISE, Plane, RecipeError
from .ops.slicing import check_shardable, slice_quantized
from .tensor import QuantizedTensor, one_byte_as_uint8

aten = torch.ops.aten


# [Note: per-gather state]
# What a parameter's gathers keep between gathers (plans and their last inputs, the gathering
# FSDPParamGroup, whether it gathers both planes, the unsharded weight's scale copies, the
# unsharded view) is the parameter's: its owner record holds it (``QuantizedTensor.param_state.
# gather``, a ``param_state.GatherState``, shared by the shard and the unsharded weight). Nothing
# is kept on FSDP's objects or in maps here.


class UnshardedView(Protocol):
    """What FSDP2 gathers of a module's FP8 weights hand out as the unsharded parameter, where that
    is not a :class:`QuantizedTensor` (registered with :func:`register_unsharded_view`; ``te.py``'s
    ``TEUnshardedView`` builds TE tensors that TE's GEMMs read). ``fsdp_post_all_gather`` calls it.

    Every method follows FSDP2's post-all-gather contract: at the first gather (``out is None``) it
    returns ``(tensor, inner_tensors_to_free)``; at later ones it updates ``out`` (the same object,
    a DTensor over the tp mesh under tensor parallelism) in place and returns ``None``.
    """

    def __call__(self, planes: dict[str, Plane], recipe, shape: tuple[int, int], dtype: torch.dtype,
                 usages: tuple[str, ...], out, orig_rows: int):
        """A gather over several ranks: the unsharded parameter over the gathered ``planes``
        (views of FSDP's all-gather buffers) of a weight of the padded ``shape`` (``orig_rows``:
        its rows before padding), serving ``usages``, of nominal ``dtype``."""

    def views_shard(self, shard: QuantizedTensor) -> bool:
        """Whether a one-rank gather of ``shard`` can hand out a view of the shard itself (then
        nothing is sent and :meth:`from_shard` is called instead of the view). The same answer
        for both directions: FSDP sizes its all-gather outputs once per weight."""

    def from_shard(self, shard: QuantizedTensor, usages: tuple[str, ...], dtype: torch.dtype, out):
        """A one-rank gather where :meth:`views_shard` said so: the unsharded parameter over
        ``shard``'s own planes, serving ``usages``."""


def register_unsharded_view(module: torch.nn.Module, view: UnshardedView) -> None:
    """Make FSDP2 gathers of ``module``'s FP8 parameters hand out what ``view`` builds as the
    unsharded parameter instead of a :class:`QuantizedTensor` (the TE adapter's hook: ``te.py``
    registers TE tensors over the gathered buffers for TE modules). Kept in each parameter's owner
    record (``param_state.gather.unsharded_view``), so call it before or after ``fully_shard``.

    Args:
        module: the module owning the parameters (its own, not its children's).
        view: an :class:`UnshardedView`.

    Example:
        >>> register_unsharded_view(te_linear, dtensor_fp8.te.FSDP_TE_VIEW)
    """
    for p in module.parameters(recurse=False):
        local = _compat.dtensor_local(p)
        if isinstance(local, QuantizedTensor):
            local.param_state.gather.unsharded_view = view


def _gathers_both(group) -> bool:
    """Whether every gather of ``group`` must carry both planes (see the note at the top). The
    walk over every submodule is the costliest part of a gather's bookkeeping: callers keep the
    answer (the owner record's ``gather.gathers_both``). Apply checkpointing and compile before
    the first forward, as torch's own FSDP2 recipes and torchtitan do."""
    wrapper_cls = _compat.checkpoint_wrapper_class()
    for root in _compat.fsdp_group_modules(group):
        for m in root.modules():
            if isinstance(m, wrapper_cls) or getattr(m, GATHER_BOTH_ATTR, False):
                return True
            if _compat.uses_composable_checkpoint(m) or _compat.is_compiled_module(m):
                return True
    return False


def gather_usages(group, *, gathers_both: bool | None = None) -> tuple[str, ...]:
    """Usages the FSDP2 all-gather of ``group`` must deliver (see the note at the top).

    Args:
        group: the ``FSDPParamGroup`` gathering (``None``: outside FSDP's unshard, deliver both).
        gathers_both: whether ``group`` gathers both planes, if already known (else found here).

    Example:
        >>> gather_usages(_compat.fsdp_param_group_of(linear))   # ("rowwise",) in forward
    """
    if group is None:
        return (ROWWISE, COLUMNWISE)
    if gathers_both if gathers_both is not None else _gathers_both(group):
        return (ROWWISE, COLUMNWISE)
    if _compat.in_backward() or _compat.fsdp_group_in_backward(group):
        return (COLUMNWISE,)
    if not _compat.fsdp_group_reshards_after_forward(group):  # no backward gather follows
        return (ROWWISE, COLUMNWISE)
    return (ROWWISE,)


#: Set this attribute to True on a module whose forward runs activation checkpointing by itself
#: (``torch.utils.checkpoint.checkpoint`` inside ``forward``) or runs compiled without being a
#: compiled module itself, so its FP8 weights are gathered with both planes. ``checkpoint_wrapper``,
#: composable ``checkpoint``, ``module.compile()`` and ``torch.compile(module)`` are detected without it.
GATHER_BOTH_ATTR = "_dtensor_fp8_gather_both"


def gather_both_usages(module: torch.nn.Module) -> torch.nn.Module:
    """Mark ``module`` so FSDP gathers of its FP8 weights carry both planes.

    Needed only when the module's forward calls ``torch.utils.checkpoint.checkpoint`` itself, or
    when it runs compiled without ``module.compile()`` / ``torch.compile(module)`` on it or below
    it (e.g. ``torch.compile`` of a whole model whose blocks are ``fully_shard``-ed). Call it
    before the first forward: each FSDP group looks for these once.

    Example:
        >>> dtensor_fp8.gather_both_usages(block); fully_shard(block)
    """
    setattr(module, GATHER_BOTH_ATTR, True)
    return module


# ---- all-gather inputs and outputs -------------------------------------------------------------------
def _scale_slot_numel(q: QuantizedTensor, rows: int) -> int:
    """Numel of the scale input of a ``rows``-row shard: the largest local scale grid over both
    usages, so forward and backward gathers hand FSDP equal numels."""
    return max(math.prod(q.recipe.block_shape(u).grid((rows, q.shape[1]))) for u in (ROWWISE, COLUMNWISE))


def _gathers_scale(q: QuantizedTensor, usage: str) -> bool:
    return q.recipe.block_shape(usage).extent(0) is not None


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _GatherMetadata:
    """What ``fsdp_post_all_gather`` needs to rebuild the planes from FSDP's output buffers."""

    usages: tuple[str, ...]  # usages the gathered tensor serves
    stored: tuple[str, ...]  # planes sent, in order (data, then scale where blocks lie along dim 0)
    shared_scales: dict  # per-tensor scales: identical on every rank, not sent
    padded_rows: int  # rows of each rank's (padded) shard
    world: int
    view: UnshardedView | None  # the owning module's registered view (te.py), or None: a QuantizedTensor
    orig_rows: int  # rows of the unpadded full weight
    cols: int  # columns of the weight (shards split rows only)
    fp8_dtypes: tuple  # dtype of each plane in ``stored``
    packed_layout: list | None = None  # one-rank packing of all parts into one input (see below)
    shard_view: bool = False  # one rank: nothing sent, the unsharded parameter views the shard


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _GatherPlan:
    """What one kind of gather of one weight sends; the same every step, so computed once."""

    world: int
    stored: tuple[str, ...]  # planes sent, in order
    padded_rows: int  # rows of each rank's (padded) shard
    pad_rows: int  # rows this rank's shard is short of ``padded_rows`` (the last shard of an uneven split)
    sent_scales: tuple[str, ...]  # planes whose scales are all-gathered (the others travel in metadata)
    scale_slot: int  # numel of every scale input (see _scale_slot_numel)
    view: UnshardedView | None  # the owning module's registered view (te.py), or None
    fp8_dtypes: tuple  # dtype of each plane in ``stored``
    shard_view: bool  # one rank (with a registered view: if it can view the shard itself, ``views_shard``)


@dataclasses.dataclass(slots=True, eq=False)
class _PlanEntry:
    """A gather's plan, and the last inputs it handed out while they can be handed out again."""

    plan: _GatherPlan
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
def _gather_plan(q: QuantizedTensor, outer_size: tuple[int, ...], world: int, usages: tuple[str, ...], module) -> _GatherPlan:
    """The plan for one kind of gather, after checking that every gather of ``q`` is possible."""
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
    return _GatherPlan(world=world, stored=stored, padded_rows=padded_rows, pad_rows=padded_rows - q.shape[0],
                       sent_scales=sent_scales, scale_slot=_scale_slot_numel(q, padded_rows), view=view,
                       fp8_dtypes=fp8_dtypes, shard_view=shard_view)


def _shard_view_gather(q: QuantizedTensor, plan: _GatherPlan, usages, outer_size):
    """One rank (``_GatherPlan.shard_view``): FSDP gets an empty all-gather input (it copies
    nothing) and the post-all-gather hook hands out a tensor viewing the shard's own planes
    (:func:`_view_of_shard`, or the registered view's ``from_shard``)."""
    empty = torch.empty(0, dtype=torch.uint8, device=q.device)
    metadata = _GatherMetadata(usages=usages, stored=(), shared_scales={}, padded_rows=plan.padded_rows, world=1,
                               view=plan.view, orig_rows=outer_size[0], cols=outer_size[1], fp8_dtypes=(),
                               shard_view=True)
    return (empty,), metadata


def _param_group_of(q: QuantizedTensor, module):
    """The FSDPParamGroup gathering ``q``, from FSDP2's own state (see the note in _compat.py),
    read at the first gather and kept in the owner record with whether it gathers both planes (a
    parameter's group is fixed when ``fully_shard`` runs). FSDP2 calls the hook only for
    parameters it manages, so not finding it means this torch keeps its state where _compat.py
    does not look: that is an error, not a guess."""
    record = q.param_state.gather
    group = record.gathering_group()
    if group is None:
        group = _compat.fsdp_param_group_of(module, q)
        if group is None:
            raise RuntimeError(
                f"dtensor_fp8: FSDP2 is all-gathering an FP8 parameter of a {type(module).__name__}, but no "
                f"FSDP2 state in torch {torch.__version__}'s module-state registry lists it. dtensor_fp8/_compat.py "
                "reads FSDP2's state as torch 2.11, 2.13, 2.14 and 2.15 lay it out: use one of those versions, "
                "or update _compat.fsdp_managed_params for this one.")
        record.group, record.gathers_both = weakref.ref(group), _gathers_both(group)
    return group


def fsdp_pre_all_gather(self: QuantizedTensor, mesh, outer_size, outer_stride, module, mp_policy):
    self.check_bytes_made()  # a meta-built weight is quantized by finish_init_ before its first gather
    group = _param_group_of(self, module)
    usages = gather_usages(group, gathers_both=self.param_state.gather.gathers_both)
    # The same few gathers repeat every step; their plans are kept in the owner record, keyed by
    # the mesh object FSDP holds for the parameter's lifetime.
    plans = self.param_state.gather.plans
    key = (id(mesh), tuple(outer_size), usages, id(module))
    entry = plans.get(key)
    if entry is None:
        entry = plans[key] = _PlanEntry(_gather_plan(self, key[1], mesh.size(), usages, module))
        if entry.plan.shard_view:  # the same (empty) input every time, whatever the planes hold
            entry.last = _shard_view_gather(self, entry.plan, usages, key[1])
    plan = entry.plan
    if entry.last is not None and (plan.shard_view or self.holds(entry.last_planes)):
        # The same plane tensors as last time (an optimizer step rewrites them in place): the
        # inputs are views of the same bytes and the metadata is unchanged.
        return entry.last
    local = self
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
    metadata = _GatherMetadata(usages=usages, stored=plan.stored, shared_scales=shared_scales,
                               padded_rows=plan.padded_rows, world=plan.world, view=plan.view,
                               orig_rows=outer_size[0], cols=outer_size[1], fp8_dtypes=plan.fp8_dtypes)
    if plan.world == 1 and len(inputs) > 1:
        # With one rank FSDP2 skips the collective and copies only the *first* all-gather input
        # (torch 2.13, FSDPParamGroup.wait_for_unshard): hand it every part packed in one buffer.
        layout = [(t.dtype, t.shape, _padded_nbytes(t)) for t in inputs]
        packed = torch.cat([_pad_bytes(t) for t in inputs])
        return (packed,), dataclasses.replace(metadata, packed_layout=layout)
    result = tuple(inputs), metadata
    if not plan.pad_rows and not plan.sent_scales and all(
            t.data_ptr() == local_planes[u].data.data_ptr() for u, t in zip(plan.stored, inputs, strict=True)):
        # Nothing was copied (no padding, no packing, no scale input): reusable while the planes are.
        entry.last, entry.last_planes = result, self.plane_tensors()
    return result


def _shared_scale(record, out, usage: str, live: torch.Tensor) -> torch.Tensor:
    """A copy of the shard's per-tensor scale ``live`` for the unsharded parameter ``out`` (``None``
    at the first gather; its copies are the owner record's ``gather.unsharded_scales``): like the gathered bytes, a copy, so an unsharded weight that outlives an
    optimizer step never pairs its old bytes with the shard's new scale. Later gathers overwrite
    the copy in place (no allocation), keeping its autograd version as FSDP2 keeps its all-gather
    outputs': a compiled block's forward saves the gathered scale for its backward, and the
    backward's gather writes the same value into it (no optimizer step runs in between)."""
    copy = record.unsharded_scales.get(usage) if out is not None else None
    if copy is None or copy.shape != live.shape or copy.dtype != live.dtype:
        return live.clone()
    with _compat.preserve_version_counter(copy):
        return copy.copy_(live)


def _keep_shared_scales(record, planes: dict, shared_scales: dict) -> None:
    """Remember in the owner record which scale tensors are the unsharded parameter's own copies."""
    if shared_scales:
        record.unsharded_scales = {u: planes[u].scale_inv for u in shared_scales}


def _padded_nbytes(t: torch.Tensor) -> int:
    return -(-t.numel() * t.element_size() // 4) * 4  # keep every part 4-byte aligned (fp32 scales)


def _pad_bytes(t: torch.Tensor) -> torch.Tensor:
    raw = t.reshape(-1).view(torch.uint8)
    out = raw.new_zeros(_padded_nbytes(t))
    out[: raw.numel()] = raw
    return out


def _unpack(packed: torch.Tensor, layout) -> list[torch.Tensor]:
    parts, offset = [], 0
    for dtype, shape, nbytes in layout:
        part = packed[offset : offset + math.prod(shape) * torch.empty((), dtype=dtype).element_size()]
        parts.append(part.view(dtype).view(shape))
        offset += nbytes
    return parts


#: The gathers after which the transpose cache is built here: backward-only ones, whose one consumer
#: (the input-gradient GEMM) drops it after use. A gather of both planes (no reshard after forward,
#: activation checkpointing, a compiled block) leaves it to the backward GEMM, which builds it on
#: demand: a compiled backward computes its own transpose inside the graph and never drops an
#: eager cache, which would then hold one byte per weight element until the next gather.
_BACKWARD_ONLY = (COLUMNWISE,)


def _view_of_shard(shard: QuantizedTensor, usages: tuple[str, ...], dtype: torch.dtype, out):
    """The unsharded parameter of a one-rank gather: a QuantizedTensor over ``shard``'s own planes
    serving ``usages`` (``(tensor, ())`` at the first gather, else ``out`` re-pointed in place)."""
    if out is None:
        view = QuantizedTensor.from_planes(shard.planes, shard.recipe, tuple(shard.shape), dtype, usages,
                                           param_state=shard.param_state)
    else:
        # Under tensor parallelism ``out`` is the DTensor over the tp mesh: its local tensor is updated.
        view = _compat.dtensor_local(out).repoint_(shard.planes, usages)
    if usages == _BACKWARD_ONLY:
        view.create_transpose_cache()
    return (view, ()) if out is None else None


def fsdp_post_all_gather(self: QuantizedTensor, outputs, metadata: _GatherMetadata, param_dtype, *, out=None):
    usages = metadata.usages
    if metadata.shard_view:  # one rank: the unsharded parameter views this shard
        if metadata.view is not None:
            return metadata.view.from_shard(self, usages, param_dtype, out)
        return _view_of_shard(self, usages, param_dtype, out)
    if metadata.packed_layout is not None:
        outputs = _unpack(outputs[0], metadata.packed_layout)
    # Under tensor parallelism ``out`` is the DTensor over the tp mesh: its local tensor is updated.
    out_local = _compat.dtensor_local(out) if out is not None else None
    record = self.param_state.gather
    padded_rows, world, k, shared_scales = metadata.padded_rows, metadata.world, metadata.cols, metadata.shared_scales
    full_rows = padded_rows * world
    planes, i = {}, 0
    for usage, fp8_dtype in zip(metadata.stored, metadata.fp8_dtypes, strict=True):
        data = outputs[i].view(full_rows, k).view(fp8_dtype)
        i += 1
        if usage not in shared_scales:
            gr, gc = self.recipe.block_shape(usage).grid((padded_rows, k))
            scale_dtype = self.recipe.scale_inv_dtype
            raw = outputs[i].view(world, -1)
            i += 1
            # Each rank's slot holds its (gr, gc) grid first; concatenating the ranks' grids along
            # dim 0 is the full grid because every shard is a whole number of blocks.
            scale = raw[:, : gr * gc].reshape(world * gr, gc)
            scale = scale.view(scale_dtype) if scale_dtype.itemsize == 1 else scale
        else:
            scale = _shared_scale(record, out_local, usage, shared_scales[usage])
        planes[usage] = Plane(data, scale)
    if metadata.view is not None:  # the registered view builds the unsharded parameter (te.py: a TE tensor)
        result = metadata.view(planes, self.recipe, (full_rows, k), param_dtype, usages, out, metadata.orig_rows)
        _keep_shared_scales(record, planes, shared_scales)
        return result
    gathered = QuantizedTensor.from_planes(planes, self.recipe, (full_rows, k), param_dtype, usages,
                                           param_state=self.param_state)
    if out is not None:
        # FSDP reuses the unsharded parameter object; point it at this gather's planes (views of
        # FSDP's own all-gather buffers, which FSDP frees and re-allocates itself).
        rows = out_local.shape[0]
        trimmed = slice_quantized(gathered, 0, 0, rows) if rows != full_rows else gathered
        out_local.repoint_(trimmed.planes, trimmed.usages)
        if usages == _BACKWARD_ONLY:
            out_local.create_transpose_cache()
        _keep_shared_scales(record, planes, shared_scales)
        return
    if usages == _BACKWARD_ONLY:
        gathered.create_transpose_cache()
    _keep_shared_scales(record, planes, shared_scales)
    # The planes are views of `outputs`, which FSDP already frees on reshard.
    return gathered, ()


class _BoundPreAllGather:
    """``q.fsdp_pre_all_gather`` as FSDP2 reads it. FSDP2 calls ``inspect.signature`` on the hook
    at every all-gather (to choose its calling convention); for a bound method that builds a new
    ``Signature`` each time, for this object it returns the stored one."""

    __slots__ = ("_tensor",)
    __signature__ = inspect.Signature(
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD)
         for n in ("mesh", "outer_size", "outer_stride", "module", "mp_policy")])

    def __init__(self, tensor: QuantizedTensor):
        self._tensor = tensor

    def __call__(self, mesh, outer_size, outer_stride, module, mp_policy):
        return fsdp_pre_all_gather(self._tensor, mesh, outer_size, outer_stride, module, mp_policy)


class _PreAllGatherHook:
    """Descriptor: ``QuantizedTensor().fsdp_pre_all_gather`` is a :class:`_BoundPreAllGather`
    (the sharding is checked at the first gather: see "where an FSDP2 sharding is refused")."""

    def __get__(self, tensor, owner=None):
        if tensor is None:
            return fsdp_pre_all_gather
        return _BoundPreAllGather(tensor)


QuantizedTensor.fsdp_pre_all_gather = _PreAllGatherHook()
QuantizedTensor.fsdp_post_all_gather = fsdp_post_all_gather
