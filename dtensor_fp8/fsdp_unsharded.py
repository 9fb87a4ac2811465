"""The QuantizedTensor that FSDP2 hands out as an FP8 weight's unsharded parameter.

``fsdp.py``'s post-all-gather hook calls one of two functions here (for the weights of TE modules
it calls the registered view instead, ``te_tensor.py``):

* :func:`view_of_shard`: one rank (nothing was gathered): a QuantizedTensor over the shard's own
  planes, serving every usage the shard serves;
* :func:`gathered_weight`: several ranks: a QuantizedTensor over the gathered planes (views of
  FSDP2's all-gather buffers, ``fsdp_buffers.gathered_planes``), cut to the weight's rows where
  FSDP2 re-uses the parameter object (``out``), with the leading dims of a weight of more than two
  dims restored otherwise, and completed at once where its gather brought one plane of two for a
  module that recomputes in backward (``fsdp_completion.py``).

Both build the transpose cache after a backward-only gather (see the note in ``fsdp.py``). The
weight's per-gather state is its owner record's (``param_state.gather``).
"""

from __future__ import annotations

import math
import weakref

import torch

from ._compat import dtensor_local
from .formats.base import ROWWISE, USAGES, Plane
from .fsdp_buffers import GatherMetadata
from .fsdp_completion import GatheredWeight
from .tensor import QuantizedTensor


def view_of_shard(shard: QuantizedTensor, usages: tuple[str, ...], dtype: torch.dtype, out, backward_only: bool):
    """The unsharded parameter of a one-rank gather: a QuantizedTensor over ``shard``'s own planes.

    Args:
        shard: the local shard (at world size 1: the whole weight).
        usages: the usages it serves.
        dtype: FSDP2's parameter dtype.
        out: ``None`` at the first gather (returns ``(tensor, ())``), else FSDP2's unsharded
            parameter, re-pointed in place (returns ``None``).
        backward_only: the gather serves the backward alone: the transpose cache is built.

    Example:
        >>> view, _ = view_of_shard(shard, ("rowwise", "columnwise"), torch.bfloat16, None, False)
    """
    if out is None:
        view = QuantizedTensor.from_planes(shard.planes, shard.recipe, tuple(shard.shape), dtype, usages,
                                           param_state=shard.param_state)
    else:
        # Under tensor parallelism ``out`` is the DTensor over the tp mesh: its local tensor is updated.
        view = dtensor_local(out)
        # Every gather of a step finds it already over the shard's planes (an optimizer step rewrites
        # them in place): re-pointing it would set the same tensors again.
        if not (view.holds(shard.plane_tensors()) and view.usages == tuple(u for u in USAGES if u in usages)):
            view.repoint_(shard.planes, usages)
    if backward_only:
        view.create_transpose_cache()
    return (view, ()) if out is None else None


def gathered_weight(shard: QuantizedTensor, planes: dict[str, Plane], metadata: GatherMetadata, dtype: torch.dtype,
                    out, backward_only: bool):
    """The unsharded parameter of a gather over several ranks, over the gathered ``planes``.

    Args:
        shard: the local shard the gather sent.
        planes: the full (padded) gathered planes.
        metadata: the gather's metadata.
        dtype: FSDP2's parameter dtype.
        out: ``None`` at the first gather (returns ``(tensor, inner tensors)``), else FSDP2's
            unsharded parameter, re-pointed in place (returns ``None``).
        backward_only: the gather serves the backward alone.

    Example:
        >>> weight, inner = gathered_weight(shard, planes, metadata, torch.bfloat16, None, False)
    """
    record = shard.param_state.gather
    recipe, usages, full_rows = shard.recipe, metadata.usages, metadata.padded_rows * metadata.world
    gathered_planes = planes
    if out is not None:
        # FSDP reuses the unsharded parameter object; point it at this gather's planes (views of
        # FSDP's own all-gather buffers, which FSDP frees and re-allocates itself), cut to its rows.
        # Under tensor parallelism ``out`` is the DTensor over the tp mesh: its local tensor is updated.
        weight = dtensor_local(out)
        rows = weight.shape[0] * weight.rows_per_index
        if rows != full_rows:
            planes = recipe.narrow_planes(planes, 0, 0, rows, metadata.phase[0])
        weight.repoint_(planes, usages)
    else:
        weight = QuantizedTensor.from_planes(planes, recipe, (full_rows, metadata.cols), dtype, usages,
                                             param_state=shard.param_state, phase=metadata.phase)
        logical = metadata.logical_shape  # a weight of more than two dims: its planes' rows are flattened
        if logical is not None:  # the padded weight with its leading dims back (FSDP2 un-pads it with as_strided)
            weight = weight.with_shape((full_rows // math.prod(logical[1:-1]), *logical[1:]))
    if backward_only:
        weight.create_transpose_cache()
    if len(usages) < len(USAGES) and metadata.process_group is not None:
        # One plane of two: a read of the other completes the weight (fsdp_completion.py). (Recipes
        # storing one plane, the only ones with a transpose cache, serve both usages: never completed.)
        completion = record.gathered = GatheredWeight(weakref.ref(shard), metadata, gathered_planes)
        if backward_only and record.completes_for_recompute:
            # The backward gather of a weight that a checkpointed module recomputes: the recompute's
            # rowwise plane is all-gathered now, at the gather, not at the recompute's first read
            # (before FSDP2 makes its aliases of the weight, so that they hold the plane too).
            completion.complete_(weight, ROWWISE)
    # The planes are views of FSDP2's outputs, which FSDP2 frees on reshard. The list FSDP2 frees
    # with them is the owner record's: a completion adds its buffers there.
    return None if out is not None else (weight, record.inner_tensors)
