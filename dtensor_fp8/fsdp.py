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

import inspect
import math
import sys
import weakref
from typing import Callable, NamedTuple

import torch

from . import _compat
from .formats.base import COLUMNWISE, ROWWISE, Plane, RecipeError
from .ops.slicing import check_shardable, slice_quantized
from .tensor import QuantizedTensor, one_byte_as_uint8
from .weak_id_map import WeakIdMap

aten = torch.ops.aten


# ---- the state this module owns ------------------------------------------------------------------------
# [Note: per-gather state]
# A gather's bookkeeping is kept here, in weak maps keyed by the object it describes, never on the
# tensors (a QuantizedTensor has exactly the fields tensor.py declares) or on FSDP's objects:
#: local shard -> {(mesh, outer size, usages, module): [plan, last (inputs, metadata), planes they view]}
_GATHER_PLANS = WeakIdMap()
#: local shard -> {(mesh, module): weakref to the FSDPParamGroup gathering it}
_PARAM_GROUPS = WeakIdMap()
#: unsharded parameter -> its own copies of per-tensor scales, by usage (see _shared_scale)
_SHARED_SCALES = WeakIdMap()
#: FSDPParamGroup -> whether its gathers carry both planes (checkpointing or compile under it; found once)
_GATHERS_BOTH: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
#: owning module -> the function that turns its gathered planes into the unsharded parameter
#: (see register_unsharded_view; te.py registers TE's tensor classes this way)
_UNSHARDED_VIEWS: "weakref.WeakKeyDictionary[torch.nn.Module, Callable]" = weakref.WeakKeyDictionary()


def register_unsharded_view(module: torch.nn.Module, view: Callable) -> None:
    """Make FSDP2 gathers of ``module``'s FP8 parameters return ``view(...)`` as the unsharded
    parameter instead of a :class:`QuantizedTensor` (the TE adapter's hook: ``te.py`` registers
    TE tensors over the gathered buffers for TE modules).

    ``view(planes, recipe, shape, param_dtype, usages, out, orig_rows)`` is called by
    ``fsdp_post_all_gather``: on the first gather (``out=None``) it returns
    ``(tensor, inner_tensors_to_free)``; on later ones it updates ``out`` in place.

    Args:
        module: the module owning the parameters.
        view: the function described above.

    Example:
        >>> register_unsharded_view(te_linear, fsdp_te_view)
    """
    _UNSHARDED_VIEWS[module] = view


def _gathers_both(group) -> bool:
    """Whether every gather of ``group`` must carry both planes (see the note at the top); found
    once per group (the walk over every submodule is the costliest part of a gather's
    bookkeeping). Apply checkpointing and compile before the first forward, as torch's own
    FSDP2 recipes and torchtitan do."""
    cached = _GATHERS_BOTH.get(group)
    if cached is None:
        cached = _GATHERS_BOTH[group] = _find_gather_both(group)
    return cached


def _find_gather_both(group) -> bool:
    wrapper_cls = _compat.checkpoint_wrapper_class()
    for root in _compat.fsdp_group_modules(group):
        for m in root.modules():
            if isinstance(m, wrapper_cls) or getattr(m, GATHER_BOTH_ATTR, False):
                return True
            if _compat.uses_composable_checkpoint(m) or _compat.is_compiled_module(m):
                return True
    return False


def gather_usages(group) -> tuple[str, ...]:
    """Usages the FSDP2 all-gather of ``group`` must deliver (see the note at the top).

    Args:
        group: the ``FSDPParamGroup`` gathering (``None``: outside FSDP's unshard, deliver both).

    Example:
        >>> gather_usages(_compat.fsdp_param_group_of(linear))   # ("rowwise",) in forward
    """
    if group is None:
        return (ROWWISE, COLUMNWISE)
    if _gathers_both(group):
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


class _GatherMetadata(NamedTuple):
    """What ``fsdp_post_all_gather`` needs to rebuild the planes from FSDP's output buffers."""

    usages: tuple[str, ...]  # usages the gathered tensor serves
    stored: tuple[str, ...]  # planes sent, in order (data, then scale where blocks lie along dim 0)
    shared_scales: dict  # per-tensor scales: identical on every rank, not sent
    padded_rows: int  # rows of each rank's (padded) shard
    world: int
    packed_layout: list | None  # one-rank packing of all parts into one input (see below)
    te_view: Callable | None  # TE adapter hook of the owning module (te.py)
    orig_rows: int  # rows of the unpadded full weight
    cols: int  # columns of the weight (shards split rows only)
    fp8_dtypes: tuple  # dtype of each plane in ``stored``
    shard_view: bool = False  # one rank: nothing sent, the unsharded parameter views the shard


class _GatherPlan(NamedTuple):
    """What one kind of gather of one weight sends; the same every step, so computed once."""

    world: int
    stored: tuple[str, ...]  # planes sent, in order
    padded_rows: int  # rows of each rank's (padded) shard
    pad_rows: int  # rows this rank's shard is short of ``padded_rows`` (the last shard of an uneven split)
    sent_scales: tuple[str, ...]  # planes whose scales are all-gathered (the others travel in metadata)
    scale_slot: int  # numel of every scale input (see _scale_slot_numel)
    te_view: Callable | None  # TE adapter hook of the owning module (te.py), or None
    fp8_dtypes: tuple  # dtype of each plane in ``stored``
    shard_view: bool  # one rank (TE modules: if the TE hook can view the shard itself, te.py ``views_shard``)


def _check_gatherable(q: QuantizedTensor, outer_size: tuple[int, ...], world: int, usages: tuple[str, ...]):
    """Raise a :class:`RecipeError` with the fix unless FSDP2 can gather ``usages`` of a weight of
    ``outer_size`` sharded over ``world`` ranks; returns the planes such a gather sends."""
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
    return stored


def _gather_plan(q: QuantizedTensor, outer_size: tuple[int, ...], world: int, usages: tuple[str, ...], module) -> _GatherPlan:
    """The plan for one kind of gather, after checking it is possible."""
    stored = _check_gatherable(q, outer_size, world, usages)
    padded_rows = -(-outer_size[0] // world)
    sent_scales = tuple(u for u in stored if world > 1 and _gathers_scale(q, u))
    # The unsharded-view hook of the owning module (register_unsharded_view; TE modules via te.py).
    te_view = _UNSHARDED_VIEWS.get(module) if module is not None else None
    planes = q.planes
    fp8_dtypes = tuple(planes[u].data.dtype if u in planes else q.recipe.fp8_dtype for u in stored)
    # Same answer for both directions (FSDP sizes its all-gather outputs once per weight).
    shard_view = world == 1 and (te_view is None or te_view.views_shard(q))
    return _GatherPlan(world, stored, padded_rows, padded_rows - q.shape[0], sent_scales,
                       _scale_slot_numel(q, padded_rows), te_view, fp8_dtypes, shard_view)


def _shard_view_gather(q: QuantizedTensor, plan: _GatherPlan, usages, outer_size):
    """One rank (``_GatherPlan.shard_view``): FSDP gets an empty all-gather input (it copies
    nothing) and the post-all-gather hook hands out a tensor viewing the shard's own planes
    (:func:`_view_of_shard`, or for TE modules te.py's ``TEUnshardedView.from_shard``)."""
    empty = torch.empty(0, dtype=torch.uint8, device=q.device)
    return (empty,), _GatherMetadata(usages, (), {}, plan.padded_rows, 1, None, plan.te_view, outer_size[0],
                                     outer_size[1], (), True)


def _param_group_of(q: QuantizedTensor, mesh, module):
    """The FSDPParamGroup gathering ``q``: from FSDP2's module state (see the note in _compat.py),
    else from the call stack; found once per (mesh, module) and kept (a parameter's group is
    fixed when ``fully_shard`` runs)."""
    groups = _PARAM_GROUPS.get_or_create(q, dict)
    key = (id(mesh), id(module))
    ref = groups.get(key)
    group = ref() if ref is not None else None
    if group is None:
        group = _compat.fsdp_param_group_of(module) or _compat.fsdp_param_group_on_stack()
        if group is not None:
            groups[key] = weakref.ref(group)
    return group


def fsdp_pre_all_gather(self: QuantizedTensor, mesh, outer_size, outer_stride, module, mp_policy):
    self.check_bytes_made()  # a meta-built weight is quantized by finish_init_ before its first gather
    usages = gather_usages(_param_group_of(self, mesh, module))
    # The same few gathers repeat every step; their plans are kept per (persistent) local shard,
    # keyed by the mesh object FSDP holds for the parameter's lifetime.
    plans = _GATHER_PLANS.get_or_create(self, dict)
    key = (id(mesh), tuple(outer_size), usages, id(module))
    entry = plans.get(key)
    if entry is None:
        # [plan, the last (inputs, metadata) if they can be handed out again, the plane tensors they view]
        entry = plans[key] = [_gather_plan(self, key[1], mesh.size(), usages, module), None, None]
        if entry[0].shard_view:  # the same (empty) input every time, whatever the planes hold
            entry[1] = _shard_view_gather(self, entry[0], usages, key[1])
    plan, last, last_planes = entry
    if last is not None and (plan.shard_view or self.holds(last_planes)):
        # The same plane tensors as last time (an optimizer step rewrites them in place): the
        # inputs are views of the same bytes and the metadata is unchanged.
        return last
    world, stored, padded_rows, pad_rows, sent_scales, slot, te_view, fp8_dtypes, _ = plan
    local = self
    if pad_rows:  # short last shard: pad to the padded shard size
        local = aten.constant_pad_nd.default(local, [0, 0, 0, pad_rows])
    inputs, shared_scales = [], {}
    local_planes = local.planes
    for usage in stored:
        plane = local_planes[usage]
        inputs.append(plane.data.contiguous().view(torch.uint8))
        if usage in sent_scales:
            scale = one_byte_as_uint8(plane.scale_inv).reshape(-1)
            padded = scale.new_zeros(slot)
            padded[: scale.numel()] = scale
            inputs.append(padded)
        else:
            # The shard's own scale: the post-all-gather hook copies it (see _shared_scale).
            shared_scales[usage] = plane.scale_inv
    metadata = _GatherMetadata(usages, stored, shared_scales, padded_rows, world, None, te_view, outer_size[0],
                               outer_size[1], fp8_dtypes)
    if world == 1 and len(inputs) > 1:
        # With one rank FSDP2 skips the collective and copies only the *first* all-gather input
        # (torch 2.13, FSDPParamGroup.wait_for_unshard): hand it every part packed in one buffer.
        layout = [(t.dtype, t.shape, _padded_nbytes(t)) for t in inputs]
        packed = torch.cat([_pad_bytes(t) for t in inputs])
        return (packed,), metadata._replace(packed_layout=layout)
    result = tuple(inputs), metadata
    if not pad_rows and not sent_scales and all(
            t.data_ptr() == local_planes[u].data.data_ptr() for u, t in zip(stored, inputs, strict=True)):
        # Nothing was copied (no padding, no packing, no scale input): reusable while the planes are.
        entry[1], entry[2] = result, self.plane_tensors()
    return result


def _shared_scale(out, usage: str, live: torch.Tensor) -> torch.Tensor:
    """A copy of the shard's per-tensor scale ``live`` for the unsharded parameter ``out`` (``None``
    at the first gather): like the gathered bytes, a copy, so an unsharded weight that outlives an
    optimizer step never pairs its old bytes with the shard's new scale. Later gathers overwrite
    the copy in place (no allocation), keeping its autograd version as FSDP2 keeps its all-gather
    outputs': a compiled block's forward saves the gathered scale for its backward, and the
    backward's gather writes the same value into it (no optimizer step runs in between)."""
    kept = _SHARED_SCALES.get(out) if out is not None else None
    copy = kept.get(usage) if kept is not None else None
    if copy is None or copy.shape != live.shape or copy.dtype != live.dtype:
        return live.clone()
    with _compat.preserve_version_counter(copy):
        return copy.copy_(live)


def _keep_shared_scales(tensor, planes: dict, shared_scales: dict) -> None:
    """Remember on the unsharded parameter which scale tensors are its own copies."""
    if shared_scales:
        _SHARED_SCALES[tensor] = {u: planes[u].scale_inv for u in shared_scales}


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


def fsdp_post_all_gather(self: QuantizedTensor, outputs, metadata, param_dtype, *, out=None):
    if metadata.shard_view:  # one rank: the unsharded parameter views this shard
        if metadata.te_view is not None:
            return metadata.te_view.from_shard(self, metadata.usages, param_dtype, out)
        return _view_of_shard(self, metadata.usages, param_dtype, out)
    usages, stored, shared_scales, padded_rows, world, packed_layout, te_view, orig_rows, k, fp8_dtypes, _ = metadata
    if packed_layout is not None:
        outputs = _unpack(outputs[0], packed_layout)
    # Under tensor parallelism ``out`` is the DTensor over the tp mesh: its local tensor is updated.
    out_local = _compat.dtensor_local(out) if out is not None else None
    full_rows = padded_rows * world
    planes, i = {}, 0
    for usage, fp8_dtype in zip(stored, fp8_dtypes):
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
            scale = _shared_scale(out_local, usage, shared_scales[usage])
        planes[usage] = Plane(data, scale)
    if te_view is not None:  # the unsharded parameter is a TE tensor over these buffers (te.py)
        result = te_view(planes, self.recipe, (full_rows, k), param_dtype, usages, out, orig_rows)
        _keep_shared_scales(out_local if out is not None else result[0], planes, shared_scales)
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
        _keep_shared_scales(out_local, planes, shared_scales)
        return
    if usages == _BACKWARD_ONLY:
        gathered.create_transpose_cache()
    _keep_shared_scales(gathered, planes, shared_scales)
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
    """Descriptor: ``QuantizedTensor().fsdp_pre_all_gather`` is a :class:`_BoundPreAllGather`."""

    def __get__(self, tensor, owner=None):
        if tensor is None:
            return fsdp_pre_all_gather
        # ``fully_shard`` looks the hook up once per parameter as it shards it: refuse a sharding no
        # gather could move there, not at the first forward.
        sharding = _compat.fsdp_param_initializing(sys._getframe(1))
        if sharding is not None:
            _check_gatherable(tensor, sharding[0], sharding[1], tensor.usages)
        return _BoundPreAllGather(tensor)


QuantizedTensor.fsdp_pre_all_gather = _PreAllGatherHook()
QuantizedTensor.fsdp_post_all_gather = fsdp_post_all_gather
