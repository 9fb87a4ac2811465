"""Aliases, views, copies and allocation of a ``QuantizedTensor`` (what ``nn.Parameter``, FSDP2's
sharding, DTensor and DCP apply to a parameter). The FP8 bytes are never converted: a dtype in
``to()`` changes only the nominal dtype, and a high-precision ``copy_`` source is quantized."""

from __future__ import annotations

import torch

from ..formats.base import RecipeError
from ..op_table import QUANTIZED_OPS
from ..tensor import QuantizedTensor
from .slicing import zeros_like_quantized

aten = torch.ops.aten


class PlaneBytes(torch.Tensor):
    """Raw bytes of a quantized tensor's primary plane (what ``view(-1)`` returns)."""


@QUANTIZED_OPS.implements([aten.detach.default, aten.alias.default])
def _alias(func, args, kwargs):
    return same_elements(args[0])


def same_elements(q: QuantizedTensor) -> QuantizedTensor:
    """A new tensor over ``q``'s planes and init values (an alias)."""
    return q.rebuild()


@QUANTIZED_OPS.implements([aten.view.default, aten._unsafe_view.default, aten.reshape.default])
def _view(func, args, kwargs):
    q, size = args[0], list(args[1])
    if -1 in size:
        known = 1
        for s in size:
            known *= s if s != -1 else 1
        size[size.index(-1)] = q.numel() // max(known, 1)
    if len(size) == 1 and size[0] == q.numel() and q.dim() > 1:
        # FSDP2 keeps `padded_shard.view(-1)` as `_sharded_param_data` but reads it only for
        # parameters without the all-gather extension; hand it the primary plane's raw bytes,
        # typed so FSDP does not take it for a plain parameter shard (it would then compare its
        # storage with the wrapper's, which has none).
        primary = next(iter(q.planes.values())).data
        return primary.view(torch.uint8).reshape(-1).as_subclass(PlaneBytes)
    if torch.Size(size) != q.shape and q.bytes_pending and not q.is_meta:
        # An init reshaping a weight whose bytes are pending reads or writes its values (torchtitan's
        # fused-QKV init views a scratch ``new_empty`` as (heads, ..., dim)): see ops/init.py's note.
        # What is done through the view is not seen here: count the weight as written.
        q.param_state.lifecycle.mark_init_written()
        return func(q.hp_init, size)
    if torch.Size(size) != q.shape:
        raise RecipeError(
            f"{q.recipe.name}: cannot view a quantized weight of shape {tuple(q.shape)} as {tuple(size)}: "
            "its planes are block-structured matrices. Views keep the logical shape."
        )
    return same_elements(q)


@QUANTIZED_OPS.implements([aten.clone.default])
def _clone(func, args, kwargs):
    q = args[0]
    hp = None if q.hp_init is None else q.hp_init.clone()
    return q.rebuild({u: p.map(torch.clone) for u, p in q.planes.items()}, hp_init=hp)


@QUANTIZED_OPS.implements([aten._to_copy.default])
def _to_copy(func, args, kwargs):
    q = args[0]
    device = kwargs.get("device") or q.device
    # A dtype here changes only the nominal dtype: the FP8 bytes are never converted.
    dtype = kwargs.get("dtype") or q.dtype
    planes = {u: p.map(lambda t: t.to(device=device)) for u, p in q.planes.items()}
    # Init values awaiting their bytes move with the planes (the user's init runs where they
    # are); kept ones stay where quantize_module_ put them (off the accelerator).
    hp = q.hp_init.to(device=device) if q.bytes_pending else q.hp_init
    out = q.rebuild(planes, dtype=dtype, hp_init=hp)
    tensors = out.plane_tensors()
    if q.holds(tensors) and not never_repointed(q):  # the same bytes: q under another nominal dtype
        q.param_state.read_through_(tensors, reads_from(q))
    return out


def never_repointed(q: QuantizedTensor) -> bool:
    """Whether ``q`` is a module's own parameter that no FSDP2 gather re-points (an unsharded
    model's weight): a cast or transpose view of it then reads its own planes, which are ``q``'s,
    and the owner record keeps no weak reference to ``q`` for it (see :func:`reads_from`).
    ``model.to(dtype)`` replaces such a parameter through ``torch.utils.swap_tensors``, which
    refuses a tensor with weak references.

    Example:
        >>> never_repointed(model.w1.weight)   # no fully_shard
        True
    """
    return isinstance(q, torch.nn.Parameter) and q.param_state.gather.gathering_group() is None


def reads_from(q: QuantizedTensor) -> QuantizedTensor:
    """The tensor whose planes a GEMM on ``q`` reads: ``q``'s source when ``q`` is a same-device
    ``to()`` of it (a new nominal dtype over the same bytes) that still holds the planes it was made
    with, else ``q``.

    [Note: autocast's cast of a weight]
    Under tensor parallelism ``F.linear`` decomposes into DTensor ops, and autocast casts the
    weight with ``to(dtype)`` before they run; the GEMM and the backward's ``mm`` then see the
    cast, made during forward. Under FSDP2 the backward all-gather re-points the unsharded weight
    at the columnwise planes afterwards (``QuantizedTensor.repoint_``), which the cast made in
    forward would not see: reading through to the source gives the backward GEMM the planes the
    backward gather delivered, as without autocast. A cast that was itself re-pointed since (a
    checkpoint load into a model converted with ``model.to(dtype)``) reads its own planes. The
    owner record keeps which tensor a cast reads through to, keyed on the plane tensors the cast
    was made over (``FP8ParamState.read_through_``): every alias of the cast (a detach, a view,
    a GEMM's transpose view) holds them too and reads through the same way, with nothing carried
    by the ops that made it.

    Args:
        q: a quantized GEMM operand.

    Example:
        >>> reads_from(q.to(torch.bfloat16)) is q
        True
    """
    # A cast of a cast was recorded with the first source (read_through_ is given reads_from(q)).
    source = q.param_state.read_through_source(q.plane_tensors())
    return q if source is None else source


@QUANTIZED_OPS.implements([aten.new_zeros.default, aten.new_empty.default])
def _new_zeros(func, args, kwargs):
    q, size = args[0], args[1]
    _check_nominal_dtype(q, kwargs.get("dtype"), func)
    if len(size) == q.dim() and 0 < size[0] < q.shape[0] and q.recipe.phase_period(0) > 1:
        # A piece of q's rows at a place new_zeros is not told (FSDP2's padded shard, filled by
        # copy_ from its chunk): unplaced until its owner's layout places it (tensor.py's note).
        return zeros_like_quantized(q, list(size), kwargs.get("device"), phase=None)
    if len(size) == q.dim() and size[0] == 0:  # no rows, no blocks
        return zeros_like_quantized(q, list(size), kwargs.get("device"), phase=(0, 0))
    return zeros_like_quantized(q, list(size), kwargs.get("device"))


@QUANTIZED_OPS.implements([aten.zeros_like.default, aten.empty_like.default])
def _zeros_like(func, args, kwargs):
    q = args[0]
    _check_nominal_dtype(q, kwargs.get("dtype"), func)
    if func is aten.empty_like.default and q.param_state.links.master_tensor() is not None:
        # ``module.to_empty`` (its only caller on a parameter) of a module quantize_module_ did not
        # see (the model checks first: param_writes.CheckedToEmpty).
        from ..param_writes import to_empty_refusal  # the writes layer sits above the op table

        raise to_empty_refusal(q.recipe.name, q.shape)
    return zeros_like_quantized(q, list(q.shape), kwargs.get("device"))


def _check_nominal_dtype(q, dtype, func):
    if dtype is not None and dtype != q.dtype:
        raise RecipeError(
            f"{q.recipe.name}: {func} asked for dtype {dtype} from a quantized weight of nominal dtype "
            f"{q.dtype}; FP8 storage is not converted implicitly. Call .dequantize({dtype}) explicitly."
        )


@QUANTIZED_OPS.implements([aten.copy_.default])
def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    if not isinstance(src, QuantizedTensor):
        # High precision into FP8: a write of the weight's values, through its owner (the scale
        # from the amax over the weight's groups, its master following; a meta-built weight's
        # init values awaiting their bytes). See param_writes.py.
        from ..param_writes import check_copy_source, write_hp_values_  # the writes layer sits above the op table

        write_hp_values_([(None, dst, check_copy_source(dst, src))])
        return dst
    dst_planes = dst.planes
    if src.bytes_pending:
        # FSDP2 copies a pending shard into its padded shard: the values, not undefined bytes.
        if dst.hp_init is None:
            raise RecipeError(f"copy_: {src.recipe.name} source of shape {tuple(src.shape)} holds init values without "
                              "FP8 bytes; the destination has no room for them (make it with new_zeros/empty_like)")
        dst.hp_init.copy_(src.hp_init)
        if dst.param_state is not src.param_state:  # another owner's values (the same owner's: FSDP2's padded shard)
            dst.param_state.lifecycle.mark_copied_pending_values()
        return dst
    if src.recipe != dst.recipe:
        raise RecipeError(f"copy_: recipe mismatch, destination {dst.recipe!r} vs source {src.recipe!r}")
    src_planes = src.planes
    for usage, plane in dst_planes.items():
        if usage not in src_planes:
            raise RecipeError(
                f"copy_: source holds planes {tuple(src_planes)}, destination needs {usage!r} ({dst.recipe.name})"
            )
        plane.data.copy_(src_planes[usage].data)
        scale = src_planes[usage].scale_inv
        if not dst.placed and tuple(plane.scale_inv.shape) != tuple(scale.shape):
            # An unplaced destination (FSDP2's padded shard) has room for any phase's scale rows and
            # columns: the source's go first, which is where placing it keeps them (tensor.py's note).
            plane.scale_inv.zero_()
            plane.scale_inv[: scale.shape[0], : scale.shape[1]].copy_(scale)
            continue
        plane.scale_inv.copy_(scale)
    if dst.hp_init is not None and src.hp_init is not None:
        dst.hp_init.copy_(src.hp_init)
    if dst.param_state is not src.param_state:
        # Another weight's bytes (a loaded checkpoint entry): its scaling states too, and the
        # master follows them (see param_writes.py); init values kept for a master that does not
        # exist yet are stale now: it will start from these bytes.
        dst.param_state.scaling.copy_from_(src.param_state.scaling)
        if dst.param_state.links.master_tensor() is not None:
            dst.param_state.lifecycle.mark_bytes_loaded()
        if src.hp_init is None and not dst.bytes_pending:
            dst.take_hp_init()
    dst.discard_transpose_cache()
    return dst


@QUANTIZED_OPS.implements([aten.is_same_size.default])
def _is_same_size(func, args, kwargs):
    return args[0].shape == args[1].shape
