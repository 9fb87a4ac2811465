"""FSDP2 all-gather extension: FP8 bytes on the wire, one direction per gather where one is enough.

[Note: what each FSDP2 all-gather moves]
``fully_shard`` calls ``fsdp_pre_all_gather`` on each rank's local shard and
``fsdp_post_all_gather`` on the gathered buffers (``fsdp_buffers.py`` makes the inputs and reads
the outputs). We choose the *usages* a gather moves (:func:`gather_usages`) from the gathering
``FSDPParamGroup``'s state at the gather:

* forward gather of a group that reshards after forward: ``rowwise`` (forward GEMM); FSDP2 frees
  the weight when this forward ends;
* backward gather: ``columnwise`` (input-gradient GEMM);
* the first gather of a group that does not reshard after forward (the root by default,
  ``reshard_after_forward=False``): both, because no backward gather follows;
* a module marked with :func:`gather_both_usages` under the group: both;
* with a compiled module under the group (``block.compile()`` or ``torch.compile(block)`` before
  ``fully_shard``, torchtitan's per-block compile): both, because a compiled backward is traced
  together with its forward and reads the planes the forward's graph saved (views of FSDP's
  all-gather buffers, which FSDP refills in place at the backward gather), so both gathers must
  fill those buffers with the same planes.

*The count rule.* FSDP2 sizes a parameter's all-gather outputs at its first gather, and every later
gather must hand over the same number of inputs with the same dtypes and numels, or FSDP2 silently
resizes them ("An output ... was resized") and corrupts the data. Rowwise-only and columnwise-only
gathers satisfy it (equal data shapes; scale inputs padded to a slot that fits either grid), a
gather of both planes does not: so a parameter's first gather fixes whether every gather of it
carries both (``param_state.gather.gathers_both``). A group that gathered both once gathers both
again if a backward gather ever follows (a pipeline schedule resharding the root after one
micro-batch's backward while another's is pending).

The plain schedule (``reshard_after_forward=True``, one forward and one backward per step) thus
moves each weight's bytes once per direction: the figures ``tests/test_fsdp.py`` asserts.

*Activation checkpointing.* A weight owned by a module under ``checkpoint_wrapper`` or composable
``checkpoint`` (found at its first gather, :func:`_recomputed_in_backward`) is read three times a
step: forward (rowwise), the recompute inside backward (rowwise) and the input-gradient GEMM
(columnwise), the last two from the backward gather. Its gathers are the plain schedule's (forward
rowwise, backward columnwise: the count rule holds), and the backward gather of an MXFP8 / 1x128
weight completes the rowwise plane at once, in the post-all-gather hook, before the recompute
reads it (``param_state.gather.completes_for_recompute``; ``fsdp_completion.py``): three planes
cross the wire per step, each once, where gathering both planes in both gathers moved four.
Per-tensor and 128x128 weights move their one plane per gather as in the plain schedule (the
backward gather serves the recompute too). A TE module's weight (a registered
:class:`UnshardedView`, which is not completed) under checkpointing gathers both planes, as does
everything under a compiled module. A ``torch.utils.checkpoint`` call inside a module's
``forward`` is not visible beforehand: its recompute completes the weights it reads when it reads
them (the same bytes, not issued at the gather).

*What a gathered weight serves.* Per-tensor and 128x128 recipes store one plane that serves both
directions (the columnwise plane is its transpose), so every gathered weight of those recipes
declares both usages (:func:`fsdp_buffers.served_usages`), whichever direction was asked for: no
schedule finds it lacking, at no wire cost. MXFP8 and 1x128 store two planes: a one-direction
gather brings one.

*Any schedule.* FSDP2 may run a forward on a weight still unsharded from a backward (gradient
accumulation with ``set_reshard_after_backward(False)``, which ``torch.distributed.pipelining``
sets for every micro-batch but the last, so 1F1B runs micro-batch k+1's forward on what k's
backward gathered), or a forward inside a backward (``torch.utils.checkpoint`` around part of a
block's ``forward``, which no structure shows beforehand). Such a read of a plane the gather did
not bring *completes* the unsharded weight: an all-gather of that plane alone over FSDP2's group
for the weight, kept until FSDP2 reshards it (``fsdp_completion.py``). Gathering both planes in
such schedules instead would, by the count rule, have to be decided at the first gather, before
the schedule is known (pipeline schedules flip ``reshard_after_backward`` per micro-batch), and
cost two planes on every gather; completing costs one plane where a forward meets a backward-only
gather, and nothing in the plain schedule. Per micro-batch of gradient accumulation that keeps
the weights: forward rowwise (first micro-batch) or completed rowwise (later ones), backward
columnwise; with ``reshard_after_forward=False`` the forward gathers both once and nothing is
completed.

*``reshard_after_forward=<int>``.* FSDP2 reshards to a smaller post-forward mesh only a parameter
with one plain all-gather output, and cannot all-gather an extension's parameter from that state
at all (torch 2.11 to 2.15), so the first gather of such a group switches it to
``reshard_after_forward=True`` through FSDP2's own ``set_reshard_after_forward``, with a warning:
the same results, the backward gathers over the whole shard group (in FP8). An int equal to the
shard group size (FSDP2: ``True``) or to 1 (FSDP2: ``False``) needs nothing.

On a one-rank mesh nothing is sent at all: the "gather" would be a copy of the shard, so the
unsharded parameter views the shard's own planes instead, serving every usage the shard serves (a
QuantizedTensor over them, or for the weights of TE modules, where every TE buffer of the
direction can be a view of the shard, a TE tensor, ``te_tensor.py``). An optimizer step rewrites the
shard's bytes and scales in place, so an unsharded weight kept across a step
(``set_reshard_after_backward(False)``) reads the new values, never old bytes with a new scale;
FSDP2's own copy would keep the old ones until it gathers again.

For per-tensor and 128x128 blockwise recipes both directions send the same stored plane; the
transpose TE's backward GEMM wants is built after a backward-only gather, or by the backward GEMM
itself (the "transpose cache", kept in the parameter's owner record with the plane tensors it was
built from: see the note in ``tensor.py``), and dropped after use or at the next gather, so it
never outlives the unsharded parameter.
The unsharded weights of TE modules (``te_tensor.py``'s view) serve the gathered direction only and are
not completed: TE's modules read TE's own tensors.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
import weakref

import torch

from . import _compat
from .formats.base import COLUMNWISE, ROWWISE, USAGES, RecipeError
from .fsdp_buffers import (GatherMetadata, GatherPlan, PlanEntry, gather_inputs, gather_plan, gathered_planes, pack,
                           served_usages, split_side_inputs)
from .fsdp_unsharded import gathered_weight, view_of_shard
from .owner_protocols import UnshardedView  # noqa: F401  (re-exported: fsdp.UnshardedView)
from .tensor import QuantizedTensor


# [Note: per-gather state]
# What a parameter's gathers keep between gathers (plans and their last inputs, the gathering
# FSDPParamGroup, whether it gathers both planes, the unsharded weight's scale copies, the
# unsharded view, the transpose cache) is the parameter's: its owner record holds it (``QuantizedTensor.param_state.
# gather``, a ``param_state.GatherState``, shared by the shard and the unsharded weight). Nothing
# is kept on FSDP's objects or in maps here.


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
    """Whether every gather of ``group`` must carry both planes (see the note at the top): a
    compiled module or one marked :func:`gather_both_usages` under it. The walk over every
    submodule is the costliest part of a gather's bookkeeping: it runs at a parameter's first
    gather, whose answer the owner record keeps (``gather.gathers_both``). Apply checkpointing and
    compile before the first forward, as torch's own FSDP2 recipes and torchtitan do."""
    for root in _compat.fsdp_group_modules(group):
        for m in root.modules():
            if getattr(m, GATHER_BOTH_ATTR, False) or _compat.is_compiled_module(m):
                return True
    return False


def _recomputed_in_backward(group, module: torch.nn.Module) -> bool:
    """Whether ``module`` (the owner of a weight ``group`` gathers) runs again inside backward: it
    is, or lies under, a ``checkpoint_wrapper`` or a module with composable ``checkpoint`` under the
    group's modules (see "Activation checkpointing" in the note at the top). Read once per weight,
    at its first gather."""
    wrapper_cls = _compat.checkpoint_wrapper_class()
    for root in _compat.fsdp_group_modules(group):
        for m in root.modules():
            if isinstance(m, wrapper_cls) or _compat.uses_composable_checkpoint(m):
                if any(sub is module for sub in m.modules()):
                    return True
    return False


def gather_usages(group, *, gathers_both: bool | None = None) -> tuple[str, ...]:
    """Usages the FSDP2 all-gather of ``group`` must deliver (see the note at the top).

    Args:
        group: the ``FSDPParamGroup`` gathering (``None``: outside FSDP's unshard, deliver both).
        gathers_both: whether every gather of the weight carries both directions, fixed by its
            first gather (FSDP2 sizes its all-gather buffers once: see the note at the top):
            ``True``, ``False`` (one direction, this gather's), or ``None`` at the first gather
            (found here from the group's modules and state).

    Example:
        >>> gather_usages(_compat.fsdp_param_group_of(linear))   # ("rowwise",) in forward
    """
    if group is None:
        return (ROWWISE, COLUMNWISE)
    if gathers_both if gathers_both is not None else _gathers_both(group):
        return (ROWWISE, COLUMNWISE)
    if _compat.in_backward() or _compat.fsdp_group_in_backward(group):
        return (COLUMNWISE,)
    if gathers_both is None and not _compat.fsdp_group_reshards_after_forward(group):
        return (ROWWISE, COLUMNWISE)  # the first gather of a weight no backward gather follows
    return (ROWWISE,)


#: Set this attribute to True on a module that runs compiled without being a compiled module itself
#: (or whose forward runs ``torch.utils.checkpoint.checkpoint`` by itself, where both planes in every
#: gather are preferred to a completion at the recompute), so its FP8 weights are gathered with both
#: planes. ``module.compile()`` and ``torch.compile(module)`` are detected without it;
#: ``checkpoint_wrapper`` and composable ``checkpoint`` need no mark (their backward gather
#: completes the recompute's plane: see the note at the top).
GATHER_BOTH_ATTR = "_dtensor_fp8_gather_both"


def gather_both_usages(module: torch.nn.Module) -> torch.nn.Module:
    """Mark ``module`` so FSDP gathers of its FP8 weights carry both planes.

    Needed when the module runs compiled without ``module.compile()`` / ``torch.compile(module)``
    on it or below it (e.g. ``torch.compile`` of a whole model whose blocks are ``fully_shard``-ed:
    a compiled region cannot complete a weight). Optional when its forward calls
    ``torch.utils.checkpoint.checkpoint`` itself: without it, MXFP8 and 1x128 weights read by the
    recompute are completed by an all-gather of their rowwise plane at the recompute (not
    prefetched); with it, every gather moves both planes (prefetched, twice the bytes). Also the
    way out where ranks of the FSDP group may read different weights (data-dependent branches),
    since completions must match across ranks. Call it before the first forward: each FSDP group
    looks for these once.

    Example:
        >>> dtensor_fp8.gather_both_usages(block); fully_shard(block)
    """
    setattr(module, GATHER_BOTH_ATTR, True)
    return module


def _shard_view_gather(q: QuantizedTensor, plan: GatherPlan, usages, outer_size):
    """One rank (``GatherPlan.shard_view``): FSDP gets an empty all-gather input (it copies
    nothing) and the post-all-gather hook hands out a tensor viewing the shard's own planes
    (``fsdp_unsharded.view_of_shard``, or the registered view's ``from_shard``)."""
    empty = torch.empty(0, dtype=torch.uint8, device=q.device)
    # The shard's planes serve whatever the shard serves (the view is over all of them), except
    # through a registered view (TE's buffers are built for the gathered direction).
    served = usages if plan.view is not None else q.usages
    metadata = GatherMetadata(usages=served, gathered=usages, stored=(), shared_scales={}, padded_rows=plan.padded_rows, world=1,
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
        record.group = weakref.ref(group)
        if _compat.fsdp_group_reshards_to_smaller_mesh(group):
            _reshard_fully_after_forward(group)
    return group


def _reshard_fully_after_forward(group) -> None:
    """Switch a group created with ``reshard_after_forward=<int>`` (a post-forward mesh smaller than
    its shard group) to ``True``, which FSDP2 can do for all-gather extensions (see the note at the
    top), through FSDP2's own setter, before the forward that is gathering ends."""
    modules = _compat.fsdp_group_modules(group)
    for m in modules:
        m.set_reshard_after_forward(True, recurse=False)
    names = ", ".join(type(m).__name__ for m in modules)
    warnings.warn(
        f"dtensor_fp8: fully_shard({names}, reshard_after_forward=<int>) keeps a smaller shard after forward, "
        f"which FSDP2 (torch {torch.__version__}) cannot do for FP8 parameters (all-gather extensions); "
        "this group reshards fully after forward instead (reshard_after_forward=True): the same results, "
        "the backward all-gather runs over the whole shard group. Pass True or False to fully_shard to "
        "silence this.", stacklevel=1)


def fsdp_pre_all_gather(self: QuantizedTensor, mesh, outer_size, outer_stride, module, mp_policy):
    self.check_bytes_made()  # a meta-built weight is quantized by finish_init_ before its first gather
    record = self.param_state.gather
    record.start_gather()  # FSDP2 gathers a sharded weight: the last gather's buffers are freed
    group = _param_group_of(self, module)
    if record.gathers_both is None:  # the first gather fixes how many planes every gather carries
        recomputed = _recomputed_in_backward(group, module)
        # A TE module's unsharded weight is not completed: under checkpointing it gathers both.
        usages = gather_usages(group, gathers_both=True if recomputed and record.unsharded_view is not None else None)
        record.gathers_both = len(usages) == len(USAGES)
        record.completes_for_recompute = recomputed and not record.gathers_both
    else:
        usages = gather_usages(group, gathers_both=record.gathers_both)
    # The same few gathers repeat every step; their plans are kept in the owner record, keyed by
    # the mesh object FSDP holds for the parameter's lifetime.
    plans = record.plans
    key = (id(mesh), tuple(outer_size), usages, id(module))
    entry = plans.get(key)
    if entry is not None and entry.last is not None and (entry.plan.shard_view or self.holds(entry.last_planes)):
        # The same plane tensors as last time (an optimizer step rewrites them in place): the
        # inputs are views of the same bytes and the metadata is unchanged (the checks below
        # passed when they were made, for the same key).
        return entry.last
    # A weight of more than two dims (an [experts, out, in] MoE weight) is gathered as the matrix its
    # planes hold, dim 0's indices flattened into rows (tensor.py's note on tensors of more than two dims).
    matrix, flat = self.as_matrix(), _flat_size(self, outer_size, mesh.size())
    if entry is None:
        world = mesh.size()
        entry = plans[key] = PlanEntry(gather_plan(matrix, flat, world, usages, mesh.get_group() if world > 1 else None))
        if entry.plan.shard_view:  # the same (empty) input every time, whatever the planes hold
            entry.last = _shard_view_gather(matrix, entry.plan, usages, flat)
            entry.last = _with_logical_shape(entry.last, self, outer_size)
            return entry.last
    plan = entry.plan
    inputs, shared_scales, local_planes = gather_inputs(matrix, plan)
    inputs, side_inputs = split_side_inputs(inputs, plan)
    metadata = GatherMetadata(usages=served_usages(self.recipe, plan.stored), gathered=usages, stored=plan.stored,
                               shared_scales=shared_scales, padded_rows=plan.padded_rows, world=plan.world,
                               view=plan.view, orig_rows=flat[0], cols=flat[1],
                               fp8_dtypes=plan.fp8_dtypes, process_group=plan.process_group, phase=plan.phase,
                               scale_routes=plan.scale_routes, side_inputs=side_inputs,
                               logical_shape=None if self.dim() == 2 else tuple(outer_size))
    if plan.world == 1 and len(inputs) > 1:  # FSDP2 copies only the first input of a one-rank "gather"
        packed, layout = pack(inputs)
        return (packed,), dataclasses.replace(metadata, packed_layout=layout)
    result = tuple(inputs), metadata
    if not plan.pad_rows and not plan.sent_scales and all(
            t.data_ptr() == local_planes[u].data.data_ptr() for u, t in zip(plan.stored, inputs, strict=True)):
        # Nothing was copied (no padding, no packing, no scale input): reusable while the planes are.
        entry.last, entry.last_planes = result, self.plane_tensors()
    return result


def _flat_size(q: QuantizedTensor, outer_size, world: int) -> tuple[int, int]:
    """``outer_size`` as the matrix the planes hold (rows flattened; tensor.py's note), after checking
    that FSDP2's chunks of dim 0 are whole indices of it on every rank (for an expert weight: whole
    experts)."""
    if len(outer_size) == 2:
        return tuple(outer_size)
    if outer_size[0] % world:
        raise RecipeError(
            f"{q.recipe.name}: fully_shard over {world} ranks of an FP8 weight of shape {tuple(outer_size)}: dim 0 "
            f"({outer_size[0]}) is not a multiple of the world size, and uneven shards of a weight of more than two "
            "dims are not supported yet. Fix: use a world size dividing dim 0 (for experts: the expert count), or "
            "shard the experts with expert parallelism first.")
    return outer_size[0] * q.rows_per_index, outer_size[-1]


def _with_logical_shape(result, q: QuantizedTensor, outer_size):
    if q.dim() == 2:
        return result
    inputs, metadata = result
    return inputs, dataclasses.replace(metadata, logical_shape=tuple(outer_size))


#: The gathers after which the transpose cache is built by the post-all-gather hook: backward-only
#: ones, whose one consumer (the input-gradient GEMM) drops it after use. A gather of both planes
#: (no reshard after forward, activation checkpointing, a compiled block) leaves it to the backward
#: GEMM, which builds it on demand: a compiled backward computes its own transpose inside the graph
#: and never drops an eager cache, which would then hold one byte per weight element until the next
#: gather.
_BACKWARD_ONLY = (COLUMNWISE,)


def fsdp_post_all_gather(self: QuantizedTensor, outputs, metadata: GatherMetadata, param_dtype, *, out=None):
    backward_only = metadata.gathered == _BACKWARD_ONLY
    view = metadata.view  # the registered view builds the unsharded parameter (te_tensor.py: a TE tensor)
    if metadata.shard_view:  # one rank: the unsharded parameter views this shard
        if view is None:
            return view_of_shard(self, metadata.usages, param_dtype, out, backward_only)
        return view.from_shard(self, metadata.gathered, param_dtype, out)
    record = self.param_state.gather
    # The unsharded weight's per-tensor scales are copies (the last gather's, overwritten in place).
    planes = gathered_planes(self.recipe, outputs, metadata, record.unsharded_scales if out is not None else None)
    if metadata.shared_scales:  # which scale tensors are the unsharded parameter's own copies
        record.unsharded_scales = {u: planes[u].scale_inv for u in metadata.shared_scales}
    if view is None:
        return gathered_weight(self, planes, metadata, param_dtype, out, backward_only)
    return view(planes, self.recipe, (metadata.padded_rows * metadata.world, metadata.cols), param_dtype,
                metadata.gathered, out, metadata.orig_rows)


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
