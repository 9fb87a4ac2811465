"""The op table of ``QuantizedTensor``: the aten ops FSDP2, DTensor and DCP apply to parameters.

Every op works plane by plane and is driven by the recipe's block geometry, never by the recipe:
slicing along a dim moves data rows and the scale rows of the blocks they belong to, and refuses
a boundary that would split a block (``RecipeError``) instead of falling back to high precision.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives  # noqa: F401  (defines _c10d_functional._wrap_tensor_autograd)
import torch.distributed.tensor._collective_utils  # noqa: F401  (defines _dtensor.shard_dim_alltoall)

from .formats.base import ROWWISE, Plane, RecipeError
from .tensor import QuantizedTensor, one_byte_as_uint8

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

QUANTIZED_OPS: dict = {}


def implements(ops):
    def register(fn):
        for op in ops:
            QUANTIZED_OPS[op] = fn
        return fn

    return register


# ---- block-aligned slicing ---------------------------------------------------------------------------
def misaligned_message(q: QuantizedTensor, dim: int, boundary: int, usage: str, block: int) -> str:
    return (
        f"{q.recipe.name}: a boundary at index {boundary} of dim {dim} of a weight of shape "
        f"{tuple(q.shape)} splits the {q.recipe.block_shape(usage)} blocks of its {usage} plane. "
        f"Shard/slice boundaries along dim {dim} must be multiples of {block} (or the end of the dim)."
    )


def slice_quantized(q: QuantizedTensor, dim: int, start: int, end: int) -> QuantizedTensor:
    """Rows/cols ``[start, end)`` of every plane, as views.

    ``start`` must be a block boundary: a piece starting inside a block would share that block's
    scale with the previous piece, and pieces could no longer be concatenated (gathered) exactly.
    ``end`` may fall inside a block: the piece's last block is then ragged, as the last block of
    any tensor whose size is not a block multiple is (this is how padding is cut off after a gather).
    """
    dim = dim % q.dim()
    size = q.shape[dim]
    start, end = max(0, min(start, size)), max(0, min(end, size))
    end = max(start, end)
    planes = {}
    for usage, plane in q._planes.items():
        block = q.recipe.block_shape(usage).extent(dim)
        if block is None:  # one scale for the whole dim: shared by every slice
            scale = plane.scale_inv
        else:
            if start % block and start != size:
                raise RecipeError(misaligned_message(q, dim, start, usage, block))
            first, last = start // block, -(-end // block)
            scale = plane.scale_inv.narrow(dim, first, last - first)
        planes[usage] = Plane(plane.data.narrow(dim, start, end - start), scale)
    shape = list(q.shape)
    shape[dim] = end - start
    return q._rebuild(planes, shape=shape)


def chunk_of(q: QuantizedTensor, dim: int, num_chunks: int, index: int) -> QuantizedTensor:
    """Piece ``index`` of ``q`` cut along ``dim`` by torch's chunk rule (what ``Shard(dim)`` holds)."""
    size = q.shape[dim]
    chunk = -(-size // num_chunks)
    start = min(index * chunk, size)
    return slice_quantized(q, dim, start, min(start + chunk, size))


@implements([aten.slice.Tensor])
def _slice(func, args, kwargs):
    q, dim, start, end, step = (list(args) + [0, None, None, 1][len(args) - 1 :])[:5]
    if step != 1:
        raise RecipeError(f"{q.recipe.name}: strided slicing (step={step}) of a quantized weight is not supported")
    size = q.shape[dim]
    start = 0 if start is None else (start + size if start < 0 else start)
    end = size if end is None else (end + size if end < 0 else end)
    return slice_quantized(q, dim, start, end)


def _split_by_sizes(q, sizes, dim):
    out, offset = [], 0
    for s in sizes:
        out.append(slice_quantized(q, dim, offset, offset + s))
        offset += s
    return out


@implements([aten.split.Tensor])
def _split(func, args, kwargs):
    q, split_size = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    size = q.shape[dim]
    sizes = [min(split_size, size - i) for i in range(0, size, split_size)] or [0]
    if len(sizes) > 1:  # torch.chunk over ranks (FSDP2 / DTensor sharding): name the world size
        from .placement import check_shardable

        check_shardable(tuple(q.shape), q.recipe, dim, -(-size // split_size), q.usages)
    return _split_by_sizes(q, sizes, dim)


@implements([aten.chunk.default])
def _chunk(func, args, kwargs):
    q, chunks = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    size = q.shape[dim]
    return _split(aten.split.Tensor, (q, max(-(-size // chunks), 1), dim), {})


@implements([aten.split_with_sizes.default])
def _split_with_sizes(func, args, kwargs):
    q, sizes = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    return _split_by_sizes(q, sizes, dim)


class PlaneBytes(torch.Tensor):
    """Raw bytes of a quantized tensor's primary plane (what ``view(-1)`` returns)."""


# ---- aliasing, copies, allocation ------------------------------------------------------------------
@implements([aten.detach.default, aten.alias.default])
def _alias(func, args, kwargs):
    q = args[0]
    return q._rebuild(q._planes, transpose=q._transpose)


@implements([aten.view.default, aten._unsafe_view.default, aten.reshape.default])
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
        return next(iter(q._planes.values())).data.view(torch.uint8).reshape(-1).as_subclass(PlaneBytes)
    if torch.Size(size) != q.shape:
        raise RecipeError(
            f"{q.recipe.name}: cannot view a quantized weight of shape {tuple(q.shape)} as {tuple(size)}: "
            "its planes are block-structured matrices. Views keep the logical shape."
        )
    return q._rebuild(q._planes, transpose=q._transpose)


@implements([aten.clone.default])
def _clone(func, args, kwargs):
    q = args[0]
    return q._rebuild({u: p.map(torch.clone) for u, p in q._planes.items()})


@implements([aten._to_copy.default])
def _to_copy(func, args, kwargs):
    q = args[0]
    device = kwargs.get("device") or q.device
    # A dtype here changes only the nominal dtype: the FP8 bytes are never converted.
    dtype = kwargs.get("dtype") or q.dtype
    planes = {u: p.map(lambda t: t.to(device=device)) for u, p in q._planes.items()}
    return q._rebuild(planes, dtype=dtype)


def zeros_like_quantized(q: QuantizedTensor, shape, device=None) -> QuantizedTensor:
    """An all-zero QuantizedTensor of ``shape`` with ``q``'s recipe, planes and usages."""
    device = device or q.device
    planes = {}
    for usage, plane in q._planes.items():
        grid = q.recipe.block_shape(usage).grid(tuple(shape))
        planes[usage] = Plane(
            torch.zeros(shape, dtype=plane.data.dtype, device=device),
            torch.zeros(grid, dtype=plane.scale_inv.dtype, device=device),
        )
    return q._rebuild(planes, shape=shape)


@implements([aten.new_zeros.default, aten.new_empty.default])
def _new_zeros(func, args, kwargs):
    q, size = args[0], args[1]
    _check_nominal_dtype(q, kwargs.get("dtype"), func)
    return zeros_like_quantized(q, list(size), kwargs.get("device"))


@implements([aten.zeros_like.default, aten.empty_like.default])
def _zeros_like(func, args, kwargs):
    q = args[0]
    _check_nominal_dtype(q, kwargs.get("dtype"), func)
    return zeros_like_quantized(q, list(q.shape), kwargs.get("device"))


def _check_nominal_dtype(q, dtype, func):
    if dtype is not None and dtype != q.dtype:
        raise RecipeError(
            f"{q.recipe.name}: {func} asked for dtype {dtype} from a quantized weight of nominal dtype "
            f"{q.dtype}; FP8 storage is not converted implicitly. Call .dequantize({dtype}) explicitly."
        )


@implements([aten.copy_.default])
def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    if isinstance(src, QuantizedTensor):
        if src.recipe != dst.recipe:
            raise RecipeError(f"copy_: recipe mismatch, destination {dst.recipe!r} vs source {src.recipe!r}")
        for usage, plane in dst._planes.items():
            if usage not in src._planes:
                raise RecipeError(
                    f"copy_: source holds planes {tuple(src._planes)}, destination needs {usage!r} ({dst.recipe.name})"
                )
            plane.data.copy_(src._planes[usage].data)
            plane.scale_inv.copy_(src._planes[usage].scale_inv)
    else:
        # High precision into FP8: quantize every plane the destination stores (local amax; a
        # delayed-scaling destination keeps its scale).
        for usage, plane in dst._planes.items():
            fresh, _ = dst.recipe.requantize_plane(src.reshape(dst.shape).to(plane.data.device), usage, plane)
            plane.data.copy_(fresh.data)
            plane.scale_inv.copy_(fresh.scale_inv)
    dst.discard_transpose_cache()
    return dst


@implements([aten.is_same_size.default])
def _is_same_size(func, args, kwargs):
    return args[0].shape == args[1].shape


# ---- padding and concatenation (DTensor's uneven-shard gathers) ------------------------------------------
@implements([aten.constant_pad_nd.default])
def _constant_pad_nd(func, args, kwargs):
    q, pad = args[0], list(args[1])
    pad += [0] * (2 * q.dim() - len(pad))
    # F.pad order: last dim first, (before, after) pairs.
    after = {q.dim() - 1 - i // 2: pad[i] for i in range(1, len(pad), 2)}
    if any(pad[i] for i in range(0, len(pad), 2)) or any(v < 0 for v in after.values()):
        raise RecipeError(f"{q.recipe.name}: only padding at the end of a dim is supported on quantized weights, got pad={pad}")
    shape = [s + after.get(d, 0) for d, s in enumerate(q.shape)]
    padded = zeros_like_quantized(q, shape)
    for usage, plane in q._planes.items():
        target = padded._planes[usage]
        _narrow_to(target.data, plane.data.shape).view(torch.uint8).copy_(plane.data.view(torch.uint8))
        _narrow_to(target.scale_inv, plane.scale_inv.shape).copy_(plane.scale_inv)
    return padded


def _narrow_to(t: torch.Tensor, shape) -> torch.Tensor:
    for d, s in enumerate(shape):
        t = t.narrow(d, 0, s)
    return t


@implements([aten.cat.default])
def _cat(func, args, kwargs):
    tensors = [t for t in args[0]]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    return cat_quantized(tensors, dim)


def cat_quantized(tensors: list[QuantizedTensor], dim: int) -> QuantizedTensor:
    """Concatenate pieces along ``dim``; every inner boundary must fall on a block boundary, and
    scales of blocks spanning ``dim`` (per-tensor) must agree between pieces."""
    first = tensors[0]
    dim = dim % first.dim()
    for t in tensors:
        if not isinstance(t, QuantizedTensor) or t.recipe != first.recipe or set(t._planes) != set(first._planes):
            raise RecipeError(f"cat: every piece must be a QuantizedTensor with recipe {first.recipe!r} and planes {tuple(first._planes)}")
    planes = {}
    for usage in first._planes:
        block = first.recipe.block_shape(usage).extent(dim)
        scales = [t._planes[usage].scale_inv for t in tensors]
        if block is None:
            if not all(torch.equal(s, scales[0]) for s in scales[1:]):
                raise RecipeError(
                    f"{first.recipe.name}: cannot concatenate along dim {dim} pieces quantized with different "
                    f"per-tensor scales ({[s.flatten()[0].item() for s in scales]}); requantize with one shared amax."
                )
            scale = scales[0]
        else:
            offset = 0
            for t in tensors[:-1]:
                offset += t.shape[dim]
                if t.shape[dim] % block:
                    raise RecipeError(misaligned_message(first, dim, offset, usage, block))
            scale = torch.cat(scales, dim)
        data = torch.cat([t._planes[usage].data.view(torch.uint8) for t in tensors], dim).view(first._planes[usage].data.dtype)
        planes[usage] = Plane(data, scale)
    shape = list(first.shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    return first._rebuild(planes, shape=shape)


# ---- functional collectives (DTensor redistribute / full_tensor) ------------------------------------------
# [Note: gathering a QuantizedTensor]
# DTensor's Shard(0) -> Replicate() calls _c10d_functional.all_gather_into_tensor on the local
# tensor. We run it on each inner tensor the local tensor holds -- FP8 data as uint8 (gloo rejects
# float8), and the scales of blocks that lie along dim 0 -- so only the planes present move: a
# tensor built with ``with_usages("rowwise")`` gathers forward bytes only. Scales of blocks that span
# dim 0 (per-tensor) are already identical on every rank and are not sent.
@implements([c10d.all_gather_into_tensor.default])
def _all_gather_into_tensor(func, args, kwargs):
    q, group_size, group_name = args[0], args[1], args[2]
    planes, pending = {}, []

    def gather(t: torch.Tensor) -> torch.Tensor:
        raw = one_byte_as_uint8(t)
        out = func(raw, group_size, group_name)
        pending.append(out)  # the work is registered on this exact tensor: wait on it, not a view
        return out.view(t.dtype)

    for usage, plane in q._planes.items():
        block = q.recipe.block_shape(usage).extent(0)
        if block is not None and q.shape[0] % block:
            raise RecipeError(
                f"{q.recipe.name}: all-gather input of shape {tuple(q.shape)} is not a whole number of "
                f"{block}-row blocks of its {usage} plane; shards must be padded to whole blocks first."
            )
        shared_scale = block is None
        planes[usage] = Plane(gather(plane.data), plane.scale_inv if shared_scale else gather(plane.scale_inv))
    out = q._rebuild(planes, shape=[q.shape[0] * group_size, *q.shape[1:]])
    out._pending_collectives = pending
    return out


@implements([c10d.wait_tensor.default])
def _wait_tensor(func, args, kwargs):
    q = args[0]
    for t in getattr(q, "_pending_collectives", ()):
        func(t)
    q._pending_collectives = []
    return q


def _shard_dim_alltoall(func, args, kwargs):
    """Shard(a) -> Shard(b) on NCCL: DTensor calls ``_dtensor.shard_dim_alltoall``. We do what
    DTensor itself does on gloo (all-gather along ``gather_dim``, keep this rank's chunk along
    ``shard_dim``): FP8 bytes only, whole blocks only; it moves ``world`` times an all-to-all's
    bytes, which is acceptable for a one-off reshard of weights."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    q, gather_dim, shard_dim, group_name = args
    group = dist.distributed_c10d._resolve_process_group(group_name)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    gather = getattr(funcol, "all_gather_single", funcol.all_gather_tensor)  # 2.13 / 2.11 name
    return chunk_of(gather(q, gather_dim, group), shard_dim, world, rank)


if hasattr(torch.ops._dtensor, "shard_dim_alltoall"):
    QUANTIZED_OPS[torch.ops._dtensor.shard_dim_alltoall.default] = _shard_dim_alltoall


@implements([c10d._wrap_tensor_autograd.default] if hasattr(c10d, "_wrap_tensor_autograd") else [])
def _wrap_tensor_autograd(func, args, kwargs):
    # funcol would wrap the result in an AsyncCollectiveTensor that waits lazily; our planes are
    # views of several raw outputs, so complete the collectives here and hand back the tensor.
    return c10d.wait_tensor.default(args[0])


# ======================================================================================================
# Tensor-parallel compute: the local GEMMs of a DTensor weight whose local tensor is quantized
# ======================================================================================================
# [Note: which plane a local GEMM reads]
# Under ColwiseParallel / RowwiseParallel the weight is a DTensor, so ``F.linear(x, w)`` never reaches
# ``QuantizedTensor.__torch_function__``: autograd decomposes it into ``aten.t`` + ``aten.mm`` /
# ``aten.addmm`` (``matmul`` folds leading dims into ``mm``) and DTensor runs those on the local
# tensors. ``aten.t`` of a QuantizedTensor ``W`` (logical ``(M, K)``) returns a
# :class:`QuantizedTransposeView`, a ``(K, M)`` tensor that only remembers ``W`` (no copy, and it
# sees the planes FSDP's backward gather later writes into ``W``). A GEMM with a quantized operand
# then picks the plane from the logical dim of ``W`` it contracts over:
#
# * over K (forward ``y = x W^T``: ``mm(x, W^T)``; or ``mm(W, x^T)``) -> the rowwise plane;
# * over M (input gradient ``dx = dy W``: ``mm(dy, W)``; or ``mm(W^T, dy^T)``) -> the columnwise
#   plane (for per-tensor / 128x128 recipes, the transpose cache, dropped after use).
#
# The plane is dequantized to the other operand's dtype and the GEMM runs in high precision, as in
# ``linear.py``. A plane the tensor does not hold raises (``QuantizedTensor.plane``); nothing is
# recomputed from high precision. The weight gradient ``x^T dy`` involves no quantized operand, so it
# is a plain high-precision tensor, and FSDP reduce-scatters it as usual.
class QuantizedTransposeView(torch.Tensor):
    """``W.t()`` of a :class:`QuantizedTensor` ``W``: shape ``(K, M)``, holds only ``W``.

    Supports ``t`` / ``transpose(0, 1)`` (back to ``W``), ``detach`` / ``alias`` / same-shape views,
    and the GEMMs ``mm`` / ``addmm``; anything else raises.
    """

    _base_q: QuantizedTensor

    @staticmethod
    def __new__(cls, base: QuantizedTensor):
        m, k = base.shape
        return torch.Tensor._make_wrapper_subclass(
            cls, torch.Size((k, m)), strides=(1, k), dtype=base.dtype, device=base.device,
            requires_grad=False,
        )

    def __init__(self, base: QuantizedTensor):
        self._base_q = base

    @property
    def base(self) -> QuantizedTensor:
        return self._base_q

    def __repr__(self) -> str:
        return f"QuantizedTransposeView(shape={tuple(self.shape)}, of={self._base_q!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        impl = _TRANSPOSE_VIEW_OPS.get(func)
        if impl is None:
            raise NotImplementedError(
                f"dtensor_fp8: {func} is not supported on the transpose of a quantized weight (shape "
                f"{tuple(args[0].shape) if args else '?'}); FP8 weights are never silently dequantized. "
                "Only t/transpose and the GEMMs mm/addmm run on it."
            )
        return impl(func, args, kwargs)


def _is_01_transpose(func, args) -> bool:
    if func is aten.t.default:
        return True
    d0, d1 = sorted(int(x) % 2 for x in args[1:3])
    return (d0, d1) == (0, 1)


def _transpose_quantized(func, args, kwargs):
    q = args[0]
    if q.dim() != 2 or not _is_01_transpose(func, args):
        raise RecipeError(f"{q.recipe.name}: only the 2-D transpose of a quantized weight is supported, got {func}{tuple(args[1:])}")
    return QuantizedTransposeView(q)


def _transpose_back(func, args, kwargs):
    if not _is_01_transpose(func, args):
        raise RecipeError(f"only the 2-D transpose of a quantized weight is supported, got {func}{tuple(args[1:])}")
    base = args[0]._base_q
    # A new object (autograd's view tracking forbids returning the base itself) that reads through
    # to ``base``: when this runs in backward, ``base`` holds what FSDP's backward gather put in it.
    out = base._rebuild(base._planes, transpose=base._transpose)
    out._read_through = base
    return out


def _view_alias(func, args, kwargs):
    v = args[0]
    if func in (aten.view.default, aten._unsafe_view.default, aten.reshape.default) and torch.Size(args[1]) != v.shape:
        raise RecipeError(f"cannot view the transpose of a quantized weight {tuple(v.shape)} as {tuple(args[1])}")
    return QuantizedTransposeView(v._base_q)


def _gemm_operand(t, position: str, dtype: torch.dtype):
    """High-precision matrix for a GEMM operand: plain tensors as they are, quantized ones from the
    plane their contraction dim selects (see the note above). ``position``: ``"left"`` contracts
    dim 1, ``"right"`` dim 0."""
    if isinstance(t, QuantizedTransposeView):
        q, transposed = t._base_q, True
    elif isinstance(t, QuantizedTensor):
        q, transposed = t, False
    else:
        return t, None
    q = getattr(q, "_read_through", q)
    if q.dim() != 2:
        raise RecipeError(f"{q.recipe.name}: GEMM on a quantized tensor of shape {tuple(q.shape)}; expected 2-D")
    contracted = 1 if position == "left" else 0  # in the operand's own (possibly transposed) dims
    base_dim = 1 - contracted if transposed else contracted
    if base_dim == 1:  # contracts K: forward
        w = q.dequantize(dtype, ROWWISE)
    else:  # contracts M: input gradient
        w = q.columnwise_matrix(dtype)
        q.discard_transpose_cache()  # built for this one use (see fsdp.py)
    return (w.t() if transposed else w), q


def _other_dtype(a, b):
    for t in (a, b):
        if not isinstance(t, (QuantizedTensor, QuantizedTransposeView)):
            return t.dtype
    raise RecipeError("GEMM of two quantized operands is not supported: dequantize one explicitly")


def _quantized_gemm(func, args, kwargs):
    if func is aten.mm.default:
        a, b = args[0], args[1]
    else:  # addmm(bias, a, b, *, beta, alpha)
        a, b = args[1], args[2]
    dtype = _other_dtype(a, b)
    a_hp, _ = _gemm_operand(a, "left", dtype)
    b_hp, _ = _gemm_operand(b, "right", dtype)
    if func is aten.mm.default:
        return torch.mm(a_hp, b_hp)
    bias = args[0]
    if isinstance(bias, (QuantizedTensor, QuantizedTransposeView)):
        raise RecipeError("addmm: a quantized bias is not supported")
    return torch.addmm(bias, a_hp, b_hp, beta=kwargs.get("beta", 1), alpha=kwargs.get("alpha", 1))


QUANTIZED_OPS[aten.t.default] = _transpose_quantized
QUANTIZED_OPS[aten.transpose.int] = _transpose_quantized
QUANTIZED_OPS[aten.mm.default] = _quantized_gemm
QUANTIZED_OPS[aten.addmm.default] = _quantized_gemm

_TRANSPOSE_VIEW_OPS = {
    aten.t.default: _transpose_back,
    aten.transpose.int: _transpose_back,
    aten.detach.default: _view_alias,
    aten.alias.default: _view_alias,
    aten.view.default: _view_alias,
    aten._unsafe_view.default: _view_alias,
    aten.mm.default: _quantized_gemm,
    aten.addmm.default: _quantized_gemm,
}


# torch's TP styles and ``distribute_tensor`` default to ``src_data_rank=0``: rank 0's copy is
# scattered / broadcast through c10d with the wrapper subclass in the tensor lists. Refuse with the
# fix (every rank raises here, before any collective starts, so none is left waiting).
def _refuse_c10d_source_rank(func, args, kwargs):
    raise RecipeError(
        f"dtensor_fp8: {func} on a QuantizedTensor: FP8 weights are not scattered/broadcast from a source "
        "rank. Every rank holds the same quantized weights after quantize_module_, so slice locally: use "
        "dtensor_fp8.parallelize_module(model, tp_mesh, plan), or pass src_data_rank=None to torch's "
        "parallelize_module / distribute_tensor."
    )


for _name in ("scatter_", "broadcast_"):
    _op = getattr(torch.ops.c10d, _name, None)
    if _op is not None:
        QUANTIZED_OPS[_op.default] = _refuse_c10d_source_rank
