"""Block-aligned slicing, splitting, padding and concatenation of a ``QuantizedTensor``.

Every op works plane by plane and is driven by the recipe's block geometry, never by the recipe:
slicing along a dim moves data rows and the scale rows of the blocks they belong to, and refuses
a boundary that would split a block (``RecipeError``) instead of falling back to high precision.
These are the ops FSDP2 (``split``/``chunk`` to shard, ``as_strided`` to un-pad) and DTensor
(``split``, ``constant_pad_nd`` and ``cat`` for uneven shards) apply to a parameter.
"""

from __future__ import annotations

import torch

from ..formats.base import USAGES, Plane, Recipe, RecipeError
from ..op_table import QUANTIZED_OPS
from ..tensor import QuantizedTensor

aten = torch.ops.aten


# ---- the shard rule ---------------------------------------------------------------------------------
def shard_boundaries(size: int, num_chunks: int) -> list[int]:
    """Interior boundaries torch's ``Shard`` puts along a dim (``torch.chunk`` rule)."""
    chunk = -(-size // num_chunks) if size else 0
    return [i * chunk for i in range(1, num_chunks) if 0 < i * chunk < size]


def check_shardable(shape, recipe: Recipe, dim: int, num_chunks: int, usages=USAGES, what: str = "weight") -> None:
    """Raise a :class:`RecipeError` if sharding ``dim`` over ``num_chunks`` ranks splits a block.

    Args:
        shape: the global shape.
        recipe: the recipe.
        dim: the sharded dim.
        num_chunks: ranks along that mesh dim.
        usages: usages whose stored planes must stay whole.
        what: what the tensor is, for the message.

    Example:
        >>> check_shardable((96, 64), MXFP8(), 0, 2)   # raises: row 48 is inside a 32-row block
    """
    align = recipe.shard_alignment(dim, usages)
    size = shape[dim]
    bad = [b for b in shard_boundaries(size, num_chunks) if b % align]
    if not bad:
        return
    ok_worlds = [w for w in range(1, 17) if all(b % align == 0 for b in shard_boundaries(size, w))]
    padded = -(-size // (align * num_chunks)) * align * num_chunks
    raise RecipeError(
        f"{recipe.name}: cannot shard dim {dim} of {what} shape {tuple(shape)} over {num_chunks} ranks: "
        f"torch's Shard({dim}) puts a boundary at index {bad[0]}, inside a block of {align} along dim {dim} "
        f"(blocks: {', '.join(f'{u} {recipe.block_shape(u)}' for u in usages)}). Fix: use a world size whose "
        f"chunks are multiples of {align} (for this shape: {ok_worlds}), or pad dim {dim} to {padded}, "
        f"or keep this layer in high precision."
    )


def misaligned_message(q: QuantizedTensor, dim: int, boundary: int, usage: str, block: int) -> str:
    return (
        f"{q.recipe.name}: a boundary at index {boundary} of dim {dim} of a weight of shape "
        f"{tuple(q.shape)} splits the {q.recipe.block_shape(usage)} blocks of its {usage} plane. "
        f"Shard/slice boundaries along dim {dim} must be multiples of {block} (or the end of the dim)."
    )


# ---- slicing ------------------------------------------------------------------------------------------
def slice_quantized(q: QuantizedTensor, dim: int, start: int, end: int) -> QuantizedTensor:
    """Rows/cols ``[start, end)`` of every plane, as views.

    ``start`` must be a block boundary: a piece starting inside a block would share that block's
    scale with the previous piece, and pieces could no longer be concatenated (gathered) exactly.
    ``end`` may fall inside a block: the piece's last block is then ragged, as the last block of
    any tensor whose size is not a block multiple is (this is how padding is cut off after a gather).

    Args:
        q: the tensor.
        dim: the dim to slice.
        start, end: the range (clamped to the dim).

    Example:
        >>> top = slice_quantized(q, 0, 0, 128)   # rows 0..127 of every plane
    """
    dim = dim % q.dim()
    size = q.shape[dim]
    start, end = max(0, min(start, size)), max(0, min(end, size))
    end = max(start, end)
    planes = {}
    for usage, plane in q.planes.items():
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
    hp = None if q.hp_init is None else q.hp_init.narrow(dim, start, end - start)
    return q.rebuild(planes, shape=shape, hp_init=hp)


def chunk_of(q: QuantizedTensor, dim: int, num_chunks: int, index: int) -> QuantizedTensor:
    """Piece ``index`` of ``q`` cut along ``dim`` by torch's chunk rule (what ``Shard(dim)`` holds)."""
    size = q.shape[dim]
    chunk = -(-size // num_chunks)
    start = min(index * chunk, size)
    return slice_quantized(q, dim, start, min(start + chunk, size))


@QUANTIZED_OPS.implements([aten.slice.Tensor])
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


@QUANTIZED_OPS.implements([aten.split.Tensor])
def _split(func, args, kwargs):
    q, split_size = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    size = q.shape[dim]
    sizes = [min(split_size, size - i) for i in range(0, size, split_size)] or [0]
    if len(sizes) > 1:  # torch.chunk over ranks (FSDP2 / DTensor sharding): name the world size
        check_shardable(tuple(q.shape), q.recipe, dim, -(-size // split_size), q.usages)
    return _split_by_sizes(q, sizes, dim)


@QUANTIZED_OPS.implements([aten.chunk.default])
def _chunk(func, args, kwargs):
    q, chunks = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    size = q.shape[dim]
    return _split(aten.split.Tensor, (q, max(-(-size // chunks), 1), dim), {})


@QUANTIZED_OPS.implements([aten.split_with_sizes.default])
def _split_with_sizes(func, args, kwargs):
    q, sizes = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    return _split_by_sizes(q, sizes, dim)


@QUANTIZED_OPS.implements([aten.as_strided.default])
def _as_strided(func, args, kwargs):
    """FSDP2 un-pads the gathered parameter with ``as_strided(full, orig_size, contiguous, 0)``."""
    q, size, stride = args[0], list(args[1]), list(args[2])
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset", 0) or 0
    contiguous = [size[1], 1] if len(size) == 2 else None
    if len(size) != 2 or offset != 0 or stride != contiguous or size[1] != q.shape[1] or size[0] > q.shape[0]:
        raise RecipeError(
            f"{q.recipe.name}: as_strided{tuple(size), tuple(stride), offset} on a quantized weight of shape "
            f"{tuple(q.shape)}: only a leading-rows view (FSDP's un-padding) is supported"
        )
    if size[0] == q.shape[0]:  # the whole tensor: its own planes (and so the owner's transpose cache)
        return q.rebuild()
    return slice_quantized(q, 0, 0, size[0])


# ---- padding and concatenation (DTensor's uneven-shard gathers) ------------------------------------------
def zeros_like_quantized(q: QuantizedTensor, shape, device=None) -> QuantizedTensor:
    """An all-zero QuantizedTensor of ``shape`` with ``q``'s recipe, planes and usages (and zero
    init values where ``q`` keeps them: FSDP2 pads a shard with ``new_zeros`` + ``copy_``).

    Example:
        >>> padded = zeros_like_quantized(q, (q.shape[0] + 32, q.shape[1]))
    """
    device = device or q.device
    if q.bytes_pending and q.is_meta and torch.device(device).type != "meta":
        q.param_state.init_written = False  # ``to_empty``: the user's init is to write it (finish_init_ checks)
    planes = {}
    for usage, plane in q.planes.items():
        grid = q.recipe.block_shape(usage).grid(tuple(shape))
        planes[usage] = Plane(
            torch.zeros(shape, dtype=plane.data.dtype, device=device),
            torch.zeros(grid, dtype=plane.scale_inv.dtype, device=device),
        )
    hp = None
    if q.hp_init is not None:
        hp = torch.zeros(shape, dtype=q.hp_init.dtype, device=device if q.bytes_pending else q.hp_init.device)
    return q.rebuild(planes, shape=shape, hp_init=hp)


@QUANTIZED_OPS.implements([aten.constant_pad_nd.default])
def _constant_pad_nd(func, args, kwargs):
    q, pad = args[0], list(args[1])
    pad += [0] * (2 * q.dim() - len(pad))
    # F.pad order: last dim first, (before, after) pairs.
    after = {q.dim() - 1 - i // 2: pad[i] for i in range(1, len(pad), 2)}
    if any(pad[i] for i in range(0, len(pad), 2)) or any(v < 0 for v in after.values()):
        raise RecipeError(f"{q.recipe.name}: only padding at the end of a dim is supported on quantized weights, got pad={pad}")
    shape = [s + after.get(d, 0) for d, s in enumerate(q.shape)]
    padded = zeros_like_quantized(q, shape)
    targets = padded.planes
    for usage, plane in q.planes.items():
        target = targets[usage]
        _narrow_to(target.data, plane.data.shape).view(torch.uint8).copy_(plane.data.view(torch.uint8))
        _narrow_to(target.scale_inv, plane.scale_inv.shape).copy_(plane.scale_inv)
    if q.hp_init is not None:
        _narrow_to(padded.hp_init, q.hp_init.shape).copy_(q.hp_init)
    return padded


def _narrow_to(t: torch.Tensor, shape) -> torch.Tensor:
    for d, s in enumerate(shape):
        t = t.narrow(d, 0, s)
    return t


@QUANTIZED_OPS.implements([aten.cat.default])
def _cat(func, args, kwargs):
    tensors = [t for t in args[0]]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    return cat_quantized(tensors, dim)


def cat_quantized(tensors: list[QuantizedTensor], dim: int) -> QuantizedTensor:
    """Concatenate pieces along ``dim``; every inner boundary must fall on a block boundary, and
    scales of blocks spanning ``dim`` (per-tensor) must agree between pieces.

    Example:
        >>> full = cat_quantized([top, bottom], 0)
    """
    first = tensors[0]
    dim = dim % first.dim()
    stored = tuple(first.planes)
    for t in tensors:
        if not isinstance(t, QuantizedTensor) or t.recipe != first.recipe or tuple(t.planes) != stored:
            raise RecipeError(f"cat: every piece must be a QuantizedTensor with recipe {first.recipe!r} and planes {stored}")
    pieces = [t.planes for t in tensors]
    planes = {}
    for usage in stored:
        block = first.recipe.block_shape(usage).extent(dim)
        scales = [p[usage].scale_inv for p in pieces]
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
        fp8_dtype = pieces[0][usage].data.dtype
        data = torch.cat([p[usage].data.view(torch.uint8) for p in pieces], dim).view(fp8_dtype)
        planes[usage] = Plane(data, scale)
    shape = list(first.shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    hp = None
    if all(t.hp_init is not None for t in tensors):
        hp = torch.cat([t.hp_init for t in tensors], dim)
    elif any(t.bytes_pending for t in tensors):
        raise RecipeError(f"{first.recipe.name}: cannot concatenate weights whose FP8 bytes are pending with others")
    return first.rebuild(planes, shape=shape, hp_init=hp)
