"""Slicing, splitting, padding and concatenation of a ``QuantizedTensor``, at any row.

Every op works plane by plane and is driven by the recipe's block geometry, never by the recipe:
slicing along a dim moves data rows and the scale rows of every block they touch. A piece may
start inside a block along either dim (FSDP2 at any degree, uneven dims, a ColwiseParallel /
RowwiseParallel shard, TP x FSDP2): it then carries its *block phase* (``QuantizedTensor.phase``,
see the note in ``formats/base.py``) and the scale of each block it shares with its neighbours,
and concatenation keeps one copy of a shared block's scale. These are the ops FSDP2 (``split``/``chunk`` to shard, ``as_strided`` to
un-pad) and DTensor (``split``, ``constant_pad_nd`` and ``cat`` for uneven shards) apply to a
parameter.
"""

from __future__ import annotations

import torch

from ..fix_hints import EXPERT_SHARDING, fix_hints
from ..formats.base import USAGES, Plane, Recipe, RecipeError
from ..op_table import QUANTIZED_OPS
from ..tensor import QuantizedTensor, one_byte_as_uint8
from .expert_rows import cat_expert_rows, slice_expert_rows

aten = torch.ops.aten


# ---- the shard rule ---------------------------------------------------------------------------------
def shard_boundaries(size: int, num_chunks: int) -> list[int]:
    """Interior boundaries torch's ``Shard`` puts along a dim (``torch.chunk`` rule)."""
    chunk = -(-size // num_chunks) if size else 0
    return [i * chunk for i in range(1, num_chunks) if 0 < i * chunk < size]


def check_shardable(shape, recipe: Recipe, dim: int, num_chunks: int, usages=USAGES, what: str = "weight", *,
                    computes: bool = False) -> None:
    """Raise a :class:`RecipeError` if sharding ``dim`` over ``num_chunks`` ranks splits a block
    where that is not supported: along dim 1 of a shard that does not compute on its own elements
    (a plain DTensor, which ``full_tensor()`` would have to gather along dim 1: not supported for
    shards starting inside blocks). A dim-0 shard (FSDP2, a DTensor) and a tensor-parallel shard
    (``computes``: ColwiseParallel along dim 0, RowwiseParallel along dim 1; its GEMMs read its
    blocks at their phase) may split blocks, which keep one scale from the amax over all their
    elements (see the note on block phase in ``formats/base.py``).

    Args:
        shape: the global shape.
        recipe: the recipe.
        dim: the sharded dim.
        num_chunks: ranks along that mesh dim.
        usages: usages whose stored planes must stay whole.
        what: what the tensor is, for the message.

    Example:
        >>> check_shardable((64, 96), MXFP8(), 1, 2)   # raises: column 48 is inside a 1x32 block
    """
    if dim % len(shape) == 0 or computes:
        return
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
        f"(blocks: {', '.join(f'{u} {recipe.block_shape(u)}' for u in usages)}); "
        + "a DTensor sharded along dim 1 is gathered along dim 1, which shards starting inside blocks do not "
        "support (tensor parallelism may split them: dtensor_fp8.parallelize_module with RowwiseParallel). "
        + f"Fix: use a world size whose chunks are multiples of {align} (for this shape: {ok_worlds}), "
        f"or pad dim {dim} to {padded}, or keep this layer in high precision."
    )


# ---- slicing ------------------------------------------------------------------------------------------
def slice_quantized(q: QuantizedTensor, dim: int, start: int, end: int) -> QuantizedTensor:
    """Rows/cols ``[start, end)`` of every plane, as views, with the scales of every block they touch.

    ``start`` may fall inside a block: the piece then starts at a block phase along ``dim`` (see
    ``formats/base.py``) and shares that block's scale with the piece before it. ``end`` may fall
    inside a block anywhere: the piece's last block is then ragged, as the last block of any tensor
    whose size is not a block multiple is (this is how padding is cut off after a gather).

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
    if q.dim() > 2 and 0 < dim < q.dim() - 1:  # rows of each expert: a piece of its own (expert_rows.py)
        return slice_expert_rows(q, start, end) if (start, end) != (0, size) else q.rebuild()
    if q.dim() > 2:  # on the flattened matrix (tensor.py's note on tensors of more than two dims)
        f = _leading_dims_only(q, dim, "slice")
        shape = list(q.shape)
        shape[dim] = end - start
        if dim == 0:
            return slice_quantized(q.as_matrix(), 0, start * f, end * f).with_shape(shape)
        return slice_quantized(q.as_matrix(), 1, start, end).with_shape(shape)
    planes = q.planes  # places an unplaced tensor where its owner knows where it lies
    if not q.placed:  # FSDP2 still building the parameter: its leading rows keep every scale row
        if dim != 0 or start != 0:
            raise RecipeError(
                f"{q.recipe.name}: slicing [{start}:{end}] of dim {dim} of an FP8 shard of shape {tuple(q.shape)} whose "
                "place in its weight is not known yet (see tensor.py, a shard placed after it is cut); only its "
                "leading rows can be taken before it is placed.")
        shape = list(q.shape)
        shape[dim] = end - start
        hp = None if q.hp_init is None else q.hp_init.narrow(dim, start, end - start)
        return q.rebuild({u: Plane(p.data.narrow(dim, start, end - start), p.scale_inv) for u, p in planes.items()},
                         shape=shape, hp_init=hp, phase=None)
    planes = q.recipe.narrow_planes(planes, dim, start, end, q.phase[dim])
    shape = list(q.shape)
    shape[dim] = end - start
    new_phase = list(q.phase)
    new_phase[dim] += start
    hp = None if q.hp_init is None else q.hp_init.narrow(dim, start, end - start)
    return q.rebuild(planes, shape=shape, hp_init=hp, phase=tuple(new_phase))


def _leading_dims_only(q: QuantizedTensor, dim: int, what: str) -> int:
    """Plane rows per index along dim 0 of a tensor of more than two dims, after checking that
    ``dim`` is its first or last dim (the others are inside the planes' rows)."""
    if dim % q.dim() not in (0, q.dim() - 1):
        raise RecipeError(
            f"{q.recipe.name}: {what} along dim {dim} of an FP8 weight of shape {tuple(q.shape)} is not supported: "
            "its planes are matrices with the leading dims flattened into rows, so only dim 0 (e.g. the experts of "
            "an [experts, out, in] weight: Shard(0)) and the last dim can be cut. Shard the experts (dim 0) instead, "
            "or keep this weight in high precision." + fix_hints(EXPERT_SHARDING))
    return q.rows_per_index


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
    # Any chunking is exact (a piece starting inside a block carries its phase). A plain DTensor
    # sharded along dim 1 is checked where it is made (placement.check_placements); a TP style's
    # pieces by parallelize_module; a dim-1 gather of pieces that split blocks is refused in
    # ops/collectives.py before it communicates.
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
    if q.dim() > 2 and len(size) == q.dim() and list(size[1:]) == list(q.shape[1:]):  # leading indices of dim 0
        contiguous = [1]
        for n in reversed(size[1:]):
            contiguous.insert(0, contiguous[0] * n)  # row-major strides of (size[0], *size[1:])
        if offset == 0 and stride == contiguous and size[0] <= q.shape[0]:
            return q.rebuild() if size[0] == q.shape[0] else slice_quantized(q, 0, 0, size[0])
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
_SAME_PLACE = object()


def zeros_like_quantized(q: QuantizedTensor, shape, device=None, phase=_SAME_PLACE) -> QuantizedTensor:
    """An all-zero QuantizedTensor of ``shape`` with ``q``'s recipe, planes and usages (and zero
    init values where ``q`` keeps them: FSDP2 pads a shard with ``new_zeros`` + ``copy_``).

    Args:
        q: the tensor it is made like.
        shape: its shape.
        device: its device (default: ``q``'s).
        phase: its block phase (default: ``q``'s, a tensor starting where ``q`` starts); ``None``:
            unplaced, with room for the scale rows of any phase (FSDP2's shard of a weight: see the
            note on a shard placed after it is cut in ``tensor.py``).

    Example:
        >>> padded = zeros_like_quantized(q, (q.shape[0] + 32, q.shape[1]))
    """
    device = device or q.device
    if len(shape) > 2:  # the flattened matrix (tensor.py's note on tensors of more than two dims)
        if list(shape[1:-1]) != list(q.shape[1:-1]) or q.dim() != len(shape):
            raise RecipeError(
                f"{q.recipe.name}: a tensor of shape {tuple(shape)} like an FP8 weight of shape {tuple(q.shape)}: only dim 0 "
                "and the last dim may differ (FSDP2's shard of a dim in between, e.g. its Shard(1) of an [experts, out, in] "
                "weight, would have to be reassembled by viewing each gathered plane and scale grid as the weight's "
                "shape). Shard the experts (dim 0) instead, or keep this weight in high precision."
                + fix_hints(EXPERT_SHARDING))
        f = q.rows_per_index
        return zeros_like_quantized(q.as_matrix(), (shape[0] * f, shape[-1]), device, phase).with_shape(shape)
    if q.bytes_pending and q.is_meta and torch.device(device).type != "meta":
        q.param_state.lifecycle.mark_to_empty()  # the user's init is to write it (finish_init_ checks)
    if phase is _SAME_PLACE:  # an unplaced q (see tensor.py's note) makes an unplaced tensor
        phase = q.phase if q.placed else None
    planes = {}
    for usage, plane in q.planes.items():
        block = q.recipe.block_shape(usage)
        if phase is None:  # the most scale rows / columns a piece of this shape touches, at any phase
            grid = tuple(max(block.grid(tuple(shape), (p, p))[d] for p in range(q.recipe.phase_period(d)))
                         for d in (0, 1))
        else:
            grid = block.grid(tuple(shape), phase)
        planes[usage] = Plane(
            torch.zeros(shape, dtype=plane.data.dtype, device=device),
            torch.zeros(grid, dtype=plane.scale_inv.dtype, device=device),
        )
    hp = None
    if q.hp_init is not None:
        hp = torch.zeros(shape, dtype=q.hp_init.dtype, device=device if q.bytes_pending else q.hp_init.device)
    return q.rebuild(planes, shape=shape, hp_init=hp, phase=phase)


@QUANTIZED_OPS.implements([aten.constant_pad_nd.default])
def _constant_pad_nd(func, args, kwargs):
    q, pad = args[0], list(args[1])
    pad += [0] * (2 * q.dim() - len(pad))
    # F.pad order: last dim first, (before, after) pairs.
    after = {q.dim() - 1 - i // 2: pad[i] for i in range(1, len(pad), 2)}
    if any(pad[i] for i in range(0, len(pad), 2)) or any(v < 0 for v in after.values()):
        raise RecipeError(f"{q.recipe.name}: only padding at the end of a dim is supported on quantized weights, got pad={pad}")
    shape = [s + after.get(d, 0) for d, s in enumerate(q.shape)]
    if q.dim() > 2:  # the flattened matrix (tensor.py's note on tensors of more than two dims)
        for d in after:
            if after[d]:
                _leading_dims_only(q, d, "padding")
        m = q.as_matrix()
        out = _constant_pad_nd(func, (m, [0, after.get(q.dim() - 1, 0), 0, after.get(0, 0) * q.rows_per_index]), {})
        return out.with_shape(shape)
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
    """Concatenate pieces along ``dim``. Each piece must continue the block phase of the one
    before it; a block that two pieces share (a boundary inside it: only along dim 0) must have
    the same scale in both, and is kept once. Scales of blocks spanning ``dim`` (per-tensor) must
    agree between pieces.

    Example:
        >>> full = cat_quantized([top, bottom], 0)
    """
    first = tensors[0]
    dim = dim % first.dim()
    if first.dim() > 2 and 0 < dim < first.dim() - 1:  # rows of each expert (expert_rows.py)
        return cat_expert_rows(tensors) if len(tensors) > 1 else tensors[0].rebuild()
    if first.dim() > 2:  # the flattened matrix (tensor.py's note on tensors of more than two dims)
        _leading_dims_only(first, dim, "concatenation")
        shape = list(first.shape)
        shape[dim] = sum(t.shape[dim] for t in tensors)
        return cat_quantized([t.as_matrix() for t in tensors], 0 if dim == 0 else 1).with_shape(shape)
    stored = tuple(first.planes)
    for t in tensors:
        if not isinstance(t, QuantizedTensor) or t.recipe != first.recipe or tuple(t.planes) != stored:
            raise RecipeError(f"cat: every piece must be a QuantizedTensor with recipe {first.recipe!r} and planes {stored}")
    period = first.recipe.phase_period(dim)
    offset = 0
    for t in tensors:
        if t.shape[dim] and ((t.phase[dim] - first.phase[dim] - offset) % period
                             or [p for d, p in enumerate(t.phase) if d != dim]
                             != [p for d, p in enumerate(first.phase) if d != dim]):
            raise RecipeError(
                f"{first.recipe.name}: cannot concatenate along dim {dim} a piece of shape {tuple(t.shape)} at block "
                f"phase {t.phase} after {offset} elements that started at phase {first.phase}: the pieces are not "
                "consecutive parts of one weight.")
        offset += t.shape[dim]
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
            scale = torch.cat(_distinct_block_scales(first, tensors, scales, usage, dim, block), dim)
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


def _distinct_block_scales(first: QuantizedTensor, tensors, scales, usage: str, dim: int, block: int) -> list:
    """Each piece's scale rows along ``dim`` without the block it shares with the piece before it
    (a boundary inside a block), after checking the two copies agree."""
    out, end = [], first.phase[dim] % block  # position of the running end inside its block
    previous = None
    for t, scale in zip(tensors, scales, strict=True):
        n = t.shape[dim]
        if not n:
            continue
        if end % block and previous is not None:  # this piece starts inside the previous piece's last block
            shared, mine = previous.narrow(dim, previous.shape[dim] - 1, 1), scale.narrow(dim, 0, 1)
            if not torch.equal(one_byte_as_uint8(shared), one_byte_as_uint8(mine)):
                raise RecipeError(
                    f"{first.recipe.name}: two pieces of a weight of shape {tuple(first.shape)} hold different "
                    f"scales for the {usage} block they share along dim {dim}; a block split between shards takes "
                    "one scale from the amax over all of its elements (requantize them together).")
            scale = scale.narrow(dim, 1, scale.shape[dim] - 1)
        out.append(scale)
        previous = scale if scale.shape[dim] else previous
        end = (end + n) % block
    return out or [scales[0]]


# ---- gathered pieces (FSDP2's and DTensor's all-gathers) ----------------------------------------------
def piece_phase(phase: tuple[int, int], index: int, rows: int) -> tuple[int, int]:
    """The block phase of equal piece ``index`` of ``rows`` rows each, the first at ``phase``."""
    return (phase[0] + index * rows, phase[1])


def scale_rows_of_pieces(block, world: int, rows: int, cols: int, phase: tuple[int, int]) -> list[int] | None:
    """Where each row of the block-scale grid of ``world`` consecutive equal pieces (``rows`` rows
    each, the first at block ``phase``) is found in the pieces' own grids: for grid row ``j``, the
    flat row ``piece * rows_per_slot + local_row`` of the piece holding the block's first row (a
    block shared by two pieces is taken from the first; any later piece holds the same scale).
    ``rows_per_slot`` is :func:`max_piece_grid_rows`. ``None`` when every piece is whole blocks
    (the pieces' grids concatenate as they are).

    Example:
        >>> scale_rows_of_pieces(BlockShape(128, 128), 4, 64, 256, (0, 0))   # two 128-row blocks
        [0, 2]
    """
    b = block.extent(0)
    p0 = 0 if b is None else phase[0] % b
    if b is None or (p0 == 0 and rows % b == 0):
        return None
    per_slot = max_piece_grid_rows(block, world, rows, cols, phase)
    total = block.grid((world * rows, cols), phase)[0]
    out = []
    for j in range(total):
        first_row = max(0, j * b - p0)
        piece = min(first_row // rows, world - 1)
        local = block.first_block(0, first_row - piece * rows, p0 + piece * rows)
        out.append(piece * per_slot + local)
    return out


def max_piece_grid_rows(block, world: int, rows: int, cols: int, phase: tuple[int, int]) -> int:
    """The most scale-grid rows any of ``world`` consecutive ``rows``-row pieces touches (the first
    at block ``phase``): the rows of every piece's slot in a gather."""
    b = block.extent(0)
    if b is None:
        return 1
    phases = {(phase[0] + i * rows) % b for i in range(min(world, b))}
    return max(block.grid((rows, cols), (p, phase[1]))[0] for p in phases)
