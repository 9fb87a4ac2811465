"""Completing an FSDP2-gathered FP8 weight with the plane its gather did not bring.

[Note: completing an unsharded weight]
A gather of an MXFP8 or 1x128 weight over several ranks brings one of its two stored planes when
one direction is all that FSDP2's state asks for (``fsdp.gather_usages``). Some schedules then
read the other one before FSDP2 reshards the weight: a forward on a weight kept from a backward
(gradient accumulation with ``set_reshard_after_backward(False)``, 1F1B), a recompute inside a
backward (``torch.utils.checkpoint`` around part of a block). ``QuantizedTensor.plane`` asks the
weight's owner record (``param_state.gather.complete_``), which holds the current gather's
:class:`GatheredWeight` (left by ``fsdp_post_all_gather``). It recognizes the unsharded weight and
every alias of it (FSDP2's ``as_strided`` and ``nn.Parameter``, a GEMM's transpose view, a cast)
by their data: views of FSDP2's all-gather buffers of this gather. The first read all-gathers the
missing plane from every rank's shard over the process group FSDP2 gathers the weight on (the
shard mesh FSDP2 hands the hook, never the default group; every rank of it runs the same schedule,
so the collectives match), with the inputs the plain gather would send for that plane
(``fsdp_buffers.gather_inputs``); later reads of other aliases reuse it. Its buffers go into the
list FSDP2 holds as the parameter's inner tensors to free (``param_state.gather.inner_tensors``,
returned by the first post-all-gather hook): FSDP2 frees them when it reshards the weight, as it
frees its own buffers, and the next gather empties the list before FSDP2 would allocate them again.

*A stale alias.* FSDP2 re-points the unsharded weight it keeps at each gather's planes
(``fsdp_post_all_gather(out=...)``) and refills the same all-gather buffers; an alias made from it
at an earlier gather is not re-pointed. Expert parallelism makes one every step: torchtitan's
``GroupedExperts`` reads ``w.to_local()`` (a ``view_as`` of the local tensor, a new alias) in the
forward, and the grouped GEMM reads that alias again in the backward. Its planes are views of the
buffers the backward gather refilled, so it is recognized here, but they still name the forward's
direction (rowwise; its bytes are now the columnwise plane). Asked for a plane this gather brought,
it gets that plane without sending anything, and its stale labels are dropped (a later read of the
other direction completes it as above): the step moves each plane once, as without expert
parallelism (``tests/test_moe_benchmark.py`` counts it).

One schedule is known beforehand: a weight owned by a module under ``checkpoint_wrapper`` or
composable ``checkpoint`` is read rowwise by the recompute right after its backward gather (columnwise)
arrives. Its backward gather completes it at once: ``fsdp_post_all_gather`` calls
:meth:`GatheredWeight.complete_` on the unsharded weight it hands FSDP2 (before FSDP2 makes its
aliases), at the same point of FSDP2's schedule on every rank (its wait for that gather), so the
recompute reads a plane that is already there and the step moves three planes, each once. The
plane's buffers live and die with the gather's, as above.
"""

from __future__ import annotations

import weakref

import torch

from . import _compat
from .formats.base import USAGES, Plane, RecipeError
from .fsdp_buffers import GatherMetadata, gather_inputs, gather_plan, planes_from_outputs
from .owner_protocols import PlaneCompletion
from .tensor import QuantizedTensor


class GatheredWeight(PlaneCompletion):
    """One gather over several ranks that brought one plane of a recipe storing two, kept in the
    owner record (``param_state.gather.gathered``) until the next gather: a read of the other plane
    from the unsharded weight completes it here (see the note above).

    Args:
        shard: a weak reference to the local shard the gather sent.
        metadata: the gather's :class:`GatherMetadata`.
        planes: the gathered (padded) planes, views of FSDP2's all-gather buffers.
    """

    __slots__ = ("_shard", "_metadata", "_data_ptrs", "_brought", "_completed")

    def __init__(self, shard: weakref.ref, metadata: GatherMetadata, planes: dict[str, Plane]):
        self._shard = shard
        self._metadata = metadata
        # The unsharded weight and every alias of it (FSDP2's as_strided and Parameter, a GEMM's
        # transpose view, a dtype cast) hold views of these buffers: that is how they are known.
        self._data_ptrs = frozenset(p.data.data_ptr() for p in planes.values())
        self._brought = planes  # stored plane -> the full (padded) plane this gather brought
        self._completed: dict[str, Plane] = {}  # stored plane -> the full (padded) plane all-gathered

    def _is_gathered_weight(self, t: QuantizedTensor) -> bool:
        return any(p.data.data_ptr() in self._data_ptrs for p in t.planes.values())

    def complete_(self, t: QuantizedTensor, usage: str) -> bool:
        """Give ``t`` the plane serving ``usage`` if ``t`` is (an alias of) this gather's weight:
        all-gathered at the first such read, handed out again to later ones. ``False`` otherwise,
        and while torch.compile traces (a compiled region gathers both planes: see ``fsdp.py``)."""
        if _compat.is_traced(t) or not self._is_gathered_weight(t):
            return False
        stored = t.recipe.stored_usage(usage)
        # An alias made over an earlier gather into the same buffers (see "a stale alias" in the
        # note) asks for a plane this gather brought: handed out, nothing is sent.
        plane = self._full_plane(stored)
        if plane is None:
            plane = self._completed[stored] = self._all_gather(t, stored)
        m = self._metadata
        full_rows = m.padded_rows * m.world
        rows = t.shape[0] * t.rows_per_index  # an [experts, out, in] weight's planes: experts * out rows
        if rows != full_rows:  # the unpadded weight: its rows of the full plane
            plane = t.recipe.narrow_planes({stored: plane}, 0, 0, rows, m.phase[0])[stored]
        # A stale alias's planes name the earlier gather's direction over bytes this gather
        # rewrote: only those over this gather's buffers of the same plane are kept.
        planes = {u: p for u, p in t.planes.items() if self._holds_now(u, p)}
        planes[stored] = plane
        t.repoint_(planes, tuple(u for u in USAGES if t.recipe.stored_usage(u) in planes))
        return True

    def _full_plane(self, stored: str) -> Plane | None:
        """The full (padded) plane ``stored`` this gather holds: brought, or completed since."""
        plane = self._brought.get(stored)
        return self._completed.get(stored) if plane is None else plane

    def _holds_now(self, stored: str, plane: Plane) -> bool:
        """Whether ``plane``, held as ``stored`` by an alias of this gather's weight, is that plane
        of this gather (brought or completed), not an earlier gather's label over its buffers."""
        current = self._full_plane(stored)
        return current is not None and plane.data.data_ptr() == current.data.data_ptr()

    def _all_gather(self, t: QuantizedTensor, stored: str) -> Plane:
        """The full plane ``stored``, all-gathered from every rank's shard over FSDP2's group for
        this weight, into buffers FSDP2 frees when it reshards the weight."""
        shard = self._shard()
        m = self._metadata
        if shard is None:  # the parameter was replaced since (e.g. a checkpoint load): nothing to gather from
            raise RecipeError(
                f"{t.recipe.name}: the unsharded FP8 weight of shape {tuple(t.shape)} is read for its {stored} plane, "
                "which its FSDP2 gather did not bring, and the shard it was gathered from is gone (was the "
                "parameter replaced while FSDP2 held it unsharded?). Call reshard() on the fully_shard-ed module "
                "before replacing its parameters, or mark it with dtensor_fp8.gather_both_usages(module) so that "
                "every gather brings both planes.")
        if shard.device != t.device:  # FSDP2's CPU offload: the shard lives on the host
            shard = shard.to(t.device)
        shard = shard.as_matrix()  # an expert weight is gathered as the matrix its planes hold (fsdp.py)
        plan = gather_plan(shard, (m.orig_rows, m.cols), m.world, (stored,), m.process_group)
        inputs, shared_scales, _ = gather_inputs(shard, plan)
        record = shard.param_state.gather
        outputs = []
        for inp in inputs:
            flat = inp.reshape(-1)
            gathered = flat.new_empty(flat.numel() * m.world)
            torch.distributed.all_gather_into_tensor(gathered, flat, group=m.process_group)
            outputs.append(gathered)
            record.inner_tensors.append(gathered)  # freed by FSDP2 with its own buffers, at reshard
        planes = planes_from_outputs(shard.recipe, outputs, plan.stored, plan.fp8_dtypes, shared_scales,
                                     m.padded_rows, m.world, m.cols, None, plan.scale_routes)
        return planes[stored]
