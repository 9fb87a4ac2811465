"""QuantizedTensor -> Transformer Engine tensor: TE's class over our planes' bytes, and the TE
tensor FSDP2 uses as the unsharded parameter of a TE module's FP8 weight.

What is shared and what is built at the TE boundary is ``te.py``'s note; this module builds the
TE side from a recipe's ``te_binding`` (``formats/te_binding.py``) and never asks which recipe it
holds. It stands below ``fsdp.py``, whose post-all-gather hook calls :data:`FSDP_TE_VIEW`.

[Note: TE tensors as FSDP2's unsharded parameters]
Under ``fully_shard`` the FSDP2 extension of ``fsdp.py`` gathers our planes (rowwise for forward,
columnwise for backward) and, for parameters of modules marked by ``te.quantize_te_module_``,
asks :data:`FSDP_TE_VIEW` for the unsharded parameter: a TE tensor over the gathered buffers.
TE's modules take an already-quantized weight as is (``quantize_weight`` skips the cast), so their
forward GEMM reads what the forward gather delivered and their dgrad GEMM what the backward gather
delivered; TE drops the columnwise buffers after the dgrad GEMM (``clear_columnwise_cache``).
FSDP2 builds the unsharded parameter at the first gather and hands the same object to every
later one (``out=``), whose buffers are re-pointed in place, as TE's own ``fsdp_post_all_gather``
does. Per gather that is a handful of attribute writes (TE's hook: the same, 16 weights in
0.35 ms of host time per step on the H200), so the work per gather is kept to:

* one rank (``views_shard``): the "gather" would be a copy of the shard. When every rowwise TE
  buffer is a view of the shard's planes (the binding's ``views_planes``: per-tensor recipes
  always; 128x128 blockwise and MXFP8 where the scale grid needs no padding), FSDP is handed an
  empty all-gather input (it copies nothing) and the TE tensor views the shard itself: its
  views are made once and re-set per gather; only the columnwise buffers TE drops after use (the
  transposes, padded columnwise scales) are built per backward gather, as TE's hook builds them.
  The unsharded weight and the shard are then the same bytes and scales, so they always pair;
  unlike a copy, the weight follows an optimizer step that runs while it is unsharded
  (``set_reshard_after_backward(False)``), columnwise buffers are rebuilt at the next gather.
* several ranks: the buffers are made from the gathered planes at every gather (views of FSDP's
  output buffers; padded scales overwritten in place, not reallocated).

Transformer Engine is optional: it is imported on first use only (``formats/te_import.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor

from ._compat import dtensor_local
from .formats import te_import
from .formats.base import COLUMNWISE, ROWWISE, Recipe, RecipeError
from .formats.te_binding import SCALE_INV, TEBinding, te_quantizer
from .ops.slicing import slice_quantized
from .owner_protocols import UnshardedView
from .tensor import QuantizedTensor

__all__ = ["FSDP_TE_VIEW", "TEUnshardedView", "te_buffers", "to_te_tensor", "update_te_tensor_"]


# ---- QuantizedTensor -> TE ---------------------------------------------------------------------------
def te_buffers(q: QuantizedTensor, usages: tuple[str, ...] | None = None) -> dict[str, torch.Tensor | None]:
    """TE's attribute names -> tensors for ``q`` (``None`` for a usage not served).

    Data TE lays out as we do are views of ``q``'s planes; a transpose cache already built on
    ``q`` is reused for TE's transposed data.

    Args:
        q: a local quantized tensor.
        usages: the usages to serve (default ``q.usages``).

    Example:
        >>> te_buffers(dtensor_fp8.quantize(w, dtensor_fp8.CurrentScaling()))["_transpose"].shape  # (K, M)
    """
    usages = tuple(q.usages if usages is None else usages)
    b = q.recipe.te_binding
    layout = b.layout(q.recipe, q.planes, tuple(q.shape), usages, transposed_data=q.transpose_cache)
    return {n: layout.get(n) for n in b.names}


def _new_te_tensor(recipe: Recipe, bufs: dict, shape, dtype, device, usages, quantizer=None, scale_inv=None,
                   requires_grad=False):
    """TE's tensor of ``recipe``'s binding over ``bufs`` (TE names -> tensors)."""
    b = recipe.te_binding
    if quantizer is None:
        quantizer = te_quantizer(recipe, rowwise=ROWWISE in usages, columnwise=COLUMNWISE in usages, device=device,
                                 scale_inv=scale_inv)
    cls = getattr(te_import.require("to_te_tensor"), b.tensor_class)
    return cls(shape=shape, dtype=dtype, requires_grad=requires_grad, device=device,
               fp8_dtype=te_import.te_dtype(recipe.fp8_dtype), quantizer=quantizer,
               **{buf.arg: bufs.get(buf.name) for buf in b.buffers}, **dict(b.tensor_flags))


def _scale_inv_of(planes: dict) -> torch.Tensor | None:
    """The scale_inv a per-tensor quantizer holds the reciprocal of (the rowwise plane's)."""
    plane = planes.get(ROWWISE)
    return plane.scale_inv if plane is not None else None


def to_te_tensor(q: QuantizedTensor, *, usages: tuple[str, ...] | None = None, quantizer=None,
                 requires_grad: bool = False):
    """A TE tensor (``Float8Tensor`` / ``Float8BlockwiseQTensor`` / ``MXFP8Tensor``) over ``q``'s bytes.

    Args:
        q: a (local, unsharded) quantized tensor on a CUDA device.
        usages: usages the TE tensor serves (default: ``q.usages``); a columnwise usage builds the
            transposed data TE's Hopper GEMMs need (the transpose cache).
        quantizer: TE quantizer to attach (default: :func:`te_quantizer` of ``q.recipe`` with these usages).
        requires_grad: of the result.

    Example:
        >>> w_te = to_te_tensor(dtensor_fp8.quantize(w, dtensor_fp8.CurrentScaling()))
        >>> w_te._data.data_ptr() == q.plane("rowwise").data.data_ptr()
        True
    """
    if isinstance(q, DTensor):
        raise RecipeError("to_te_tensor takes a local QuantizedTensor; call .to_local() or full_tensor() first")
    if not isinstance(q, QuantizedTensor):
        raise RecipeError(f"to_te_tensor takes a QuantizedTensor, got {type(q).__name__}")
    usages = tuple(q.usages if usages is None else usages)
    for u in usages:
        q.plane(u)  # raises for a usage q does not hold
    planes = q.planes
    return _new_te_tensor(q.recipe, te_buffers(q, usages), tuple(q.shape), q.dtype, q.device, usages, quantizer,
                          _scale_inv_of(planes), requires_grad)


def update_te_tensor_(t, q: QuantizedTensor, usages: tuple[str, ...] | None = None):
    """Point an existing TE tensor at ``q``'s buffers (FSDP's ``out=`` gathers); returns ``t``.

    Args:
        t: a TE tensor of ``q.recipe``'s TE class and ``q``'s shape.
        q: the quantized tensor whose planes ``t`` views from now on.
        usages: the usages ``t`` serves (default ``q.usages``).
    """
    usages = tuple(q.usages if usages is None else usages)
    _point_te_tensor(t, q.recipe, q.planes, tuple(q.shape), usages, q.transpose_cache)
    return t


class _ShardPlan(NamedTuple):
    """How a one-rank gather for one set of usages re-points the TE tensor (see ``from_shard``).

    Attributes:
        tensors: the shard's :meth:`~QuantizedTensor.plane_tensors` it was made for (an optimizer
            step rewrites them in place; a checkpoint load may replace them, and then the plan is
            made again).
        assign: ``(attribute, value)`` written as they are: the TE buffers that are views of the
            shard, ``None`` for the absent ones, stale flags.
        build: ``(name, fn, keep)`` per TE buffer made again at every gather (``fn`` from
            ``TEBinding.builder``; ``keep``: a padded scale to overwrite next time).
        rowwise, columnwise: the quantizer's usages.
    """

    tensors: tuple
    assign: tuple
    build: tuple
    rowwise: bool
    columnwise: bool


class _ViewState:
    """What the FSDP hook keeps per unsharded TE tensor between gathers (on the TE tensor, as
    :data:`_VIEW_STATE_ATTR`: FSDP hands the same object to every later gather).

    Attributes:
        kept: padded scale tensors by TE name, overwritten by later gathers (a forward gather
            sets only the rowwise ones, a backward gather only the columnwise ones).
        plans: one-rank gathers: a :class:`_ShardPlan` per usages (forward, backward).
    """

    __slots__ = ("kept", "plans")

    def __init__(self):
        self.kept: dict[str, torch.Tensor] = {}
        self.plans: dict[tuple, _ShardPlan] = {}


#: Attribute of an unsharded TE tensor made by the FSDP hook: its :class:`_ViewState`.
_VIEW_STATE_ATTR = "_dtensor_fp8_view_state"


def _view_state(t) -> _ViewState:
    state = t.__dict__.get(_VIEW_STATE_ATTR)
    if state is None:
        state = t.__dict__[_VIEW_STATE_ATTR] = _ViewState()
    return state


def _set_usage(t, binding: TEBinding, usages) -> None:
    """TE's bookkeeping after its buffers changed: stale flags, and the quantizer's usages."""
    for buf in binding.buffers:
        if buf.invalid_flag is not None:
            setattr(t, buf.invalid_flag, getattr(t, buf.name) is None)
    quantizer = getattr(t, "_quantizer", None)
    if quantizer is not None:
        quantizer.set_usage(rowwise=ROWWISE in usages, columnwise=COLUMNWISE in usages)


def _point_te_tensor(t, recipe: Recipe, planes: dict, shape: tuple, usages: tuple[str, ...], transpose=None):
    """Re-point ``t``'s buffers at ``planes``; padded scale tensors from earlier calls on ``t``
    are overwritten, not reallocated."""
    b = recipe.te_binding
    kept = _view_state(t).kept
    bufs = b.layout(recipe, planes, shape, usages, reuse=kept, transposed_data=transpose)
    for buf in b.buffers:
        value = bufs.get(buf.name)
        setattr(t, buf.name, value)
        if value is not None and buf.part == SCALE_INV and not b.is_view(buf, recipe, shape):
            kept[buf.name] = value
    _set_usage(t, b, usages)


# ---- FSDP2's unsharded parameter of a TE module ------------------------------------------------------
class TEUnshardedView(UnshardedView):
    """Builds and re-points the TE tensor FSDP2 uses as the unsharded parameter of a marked TE
    module's FP8 weight (see the note at the top): ``fsdp.py``'s :class:`~dtensor_fp8.fsdp.UnshardedView`
    for TE modules. ``fsdp.py`` calls it; one instance, :data:`FSDP_TE_VIEW`, serves every module."""

    def views_shard(self, shard: QuantizedTensor) -> bool:
        """Whether one-rank gathers of ``shard`` can hand TE views of the shard itself (no
        all-gather input, no copy): every rowwise TE buffer is a view of its planes. The same
        answer for both directions: FSDP sizes its all-gather outputs once per weight."""
        recipe = shard.recipe
        # FSDP2 un-pads the first unsharded parameter with ``as_strided(..., storage_offset=0)``,
        # which TE applies to its data buffers: they must start their storage (FSDP's own copy of
        # a shard always does; a view into a larger tensor would not).
        starts = all(t.storage_offset() == 0 for p in shard.planes.values() for t in (p.data, p.scale_inv))
        return starts and recipe.te_binding.views_planes(recipe, tuple(shard.shape), (ROWWISE, COLUMNWISE))

    def from_shard(self, shard: QuantizedTensor, usages: tuple[str, ...], dtype: torch.dtype, out):
        """The unsharded parameter of a one-rank gather: a TE tensor over ``shard``'s own planes.

        Args:
            shard: the local shard (at world size 1: the whole weight).
            usages: the usages this gather serves.
            dtype: FSDP's parameter dtype (the TE tensor's nominal dtype).
            out: ``None`` at the first gather (the TE tensor is made and returned as
                ``(tensor, ())``), else the unsharded parameter to re-point (returns ``None``).
        """
        if out is None:
            recipe, planes, shape = shard.recipe, shard.planes, tuple(shard.shape)
            bufs = recipe.te_binding.layout(recipe, planes, shape, usages)
            return _new_te_tensor(recipe, bufs, shape, dtype, shard.device, usages, scale_inv=_scale_inv_of(planes)), ()
        # Runs at every gather (TE's own hook: a few attribute writes), so the plan is found from
        # the shard's tensors without building its planes, and DTensor (tensor parallelism) is
        # unwrapped inline.
        t = out._local_tensor if isinstance(out, DTensor) else out
        state = _view_state(t)
        plan = self._plan(state, shard, usages)
        for name, value in plan.assign:
            setattr(t, name, value)
        if plan.build:
            kept = state.kept
            for name, build, keep in plan.build:
                value = build(kept.get(name))
                setattr(t, name, value)
                if keep:
                    kept[name] = value
        quantizer = t._quantizer
        if quantizer is not None:
            quantizer.set_usage(rowwise=plan.rowwise, columnwise=plan.columnwise)
        return None

    @staticmethod
    def _plan(state: _ViewState, shard: QuantizedTensor, usages) -> _ShardPlan:
        """Which buffers of a one-rank gather are views of the shard (made once, here, and kept in
        ``state`` while the shard holds the same plane tensors) and which are built per gather."""
        plan = state.plans.get(usages)
        if plan is not None and shard.holds(plan.tensors):
            return plan
        recipe, shape = shard.recipe, tuple(shard.shape)
        planes = shard.planes
        tensors = QuantizedTensor.plane_tensors_of(planes)
        b = recipe.te_binding
        served = b.buffers_for(tuple(usages))
        assign, build = [], []
        for buf in b.buffers:
            if buf not in served:
                assign.append((buf.name, None))
            elif b.is_view(buf, recipe, shape):
                assign.append((buf.name, TEBinding.make(buf, planes[buf.plane], shape)))
            else:
                build.append((buf.name, TEBinding.builder(buf, planes[buf.plane], shape), buf.part == SCALE_INV))
            if buf.invalid_flag is not None:
                assign.append((buf.invalid_flag, buf not in served))
        plan = state.plans[usages] = _ShardPlan(tensors, tuple(assign), tuple(build), ROWWISE in usages,
                                                COLUMNWISE in usages)
        return plan

    def __call__(self, planes: dict, recipe: Recipe, shape: tuple[int, int], dtype: torch.dtype,
                 usages: tuple[str, ...], out, orig_rows: int):
        """The unsharded parameter of a gather over several ranks, from the gathered planes
        (views of FSDP's buffers) of a ``shape`` weight serving ``usages``.

        First gather (``out is None``): returns ``(te_tensor, ())``. Later gathers: re-points
        ``out``'s buffers in place and returns ``None``; it builds no QuantizedTensor unless rows
        of a padded last shard must be cut off.
        """
        if out is not None and shape[0] == orig_rows:
            _point_te_tensor(dtensor_local(out), recipe, planes, shape, usages)
            return None
        gathered = QuantizedTensor.from_planes(planes, recipe, shape, dtype, usages)
        if shape[0] != orig_rows:
            gathered = slice_quantized(gathered, 0, 0, orig_rows)
        if out is not None:
            update_te_tensor_(dtensor_local(out), gathered)
            return None
        return to_te_tensor(gathered), ()


#: The hook ``fsdp.py`` calls for the FP8 weights of modules marked by ``te.quantize_te_module_``.
FSDP_TE_VIEW = TEUnshardedView()
