"""``describe(t)``: what an FP8 weight is and what gathering it moves, in words.

A quantized DTensor's ``placements`` show only ``Shard(0)``; the block geometry, the planes it
holds and what each direction's gather moves live in its local tensor and recipe. This prints them.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from .formats.base import COLUMNWISE, ROWWISE, USAGES
from .placement import local_tensor, shard_dim
from .tensor import QuantizedTensor

_DIRECTION = {ROWWISE: "forward", COLUMNWISE: "backward"}


def _mib(n: int) -> str:
    return f"{n:,} B ({n / 2**20:.2f} MiB)"


def _plane_bytes(q: QuantizedTensor, stored: str, shape: tuple[int, int]) -> tuple[int, int]:
    """(FP8 data bytes, scale bytes) of plane ``stored`` of a weight of ``shape``."""
    plane = q.planes[stored]
    grid = q.recipe.block_shape(stored).grid(shape)
    return math.prod(shape) * plane.data.element_size(), math.prod(grid) * plane.scale_inv.element_size()


def describe(t: torch.Tensor, *, print_it: bool = True) -> str:
    """Recipe, blocks, shard alignment, usages held and bytes per direction of an FP8 weight.

    Args:
        t: a :class:`QuantizedTensor` or a DTensor of one (e.g. a parameter after ``fully_shard``).
        print_it: also print the text.

    Returns:
        The description.

    Example:
        >>> dtensor_fp8.describe(model.layers[0].attention.wq.weight)
        FP8 weight (4096, 4096), nominal torch.bfloat16, recipe MXFP8(fp8_dtype=torch.float8_e4m3fn)
        ...
    """
    q = local_tensor(t)
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"describe: expected a QuantizedTensor or a DTensor of one, got a {type(q).__name__} "
                        f"of shape {tuple(t.shape)}")
    recipe = q.recipe
    shape = tuple(t.shape)
    lines = [f"FP8 weight {shape}, nominal {q.dtype}, recipe {recipe!r}"]
    for usage in USAGES:
        stored = recipe.stored_usage(usage)
        how = "its own plane" if stored == usage else f"the {stored} plane's bytes, transposed locally"
        lines.append(f"  {usage} ({_DIRECTION[usage]} GEMM): blocks {recipe.block_shape(stored)}, reads {how}")
    lines.append(f"  usages held: {', '.join(q.usages)}; planes stored: {', '.join(q.planes)}")
    if isinstance(t, DTensor):
        mesh = t.device_mesh
        lines.append(f"  sharding: {list(t.placements)} over mesh {tuple(mesh.shape)}, local {tuple(q.shape)}")
        for mesh_dim, p in enumerate(t.placements):
            dim = shard_dim(p)
            if dim is not None:
                align = recipe.shard_alignment(dim, q.usages)
                lines.append(f"  shard boundaries along dim {dim} (mesh dim {mesh_dim}, {mesh.size(mesh_dim)} ranks): "
                             f"multiples of {align}" + (" (no constraint: one scale spans the dim)" if align == 1 else ""))
    else:
        lines.append("  not sharded; dim-0 shard boundaries would need multiples of "
                     f"{recipe.shard_alignment(0, q.usages)}, dim-1 of {recipe.shard_alignment(1, q.usages)}")
    total = 0
    for usage in USAGES:
        stored = recipe.stored_usage(usage)
        if stored not in q.planes:
            lines.append(f"  {_DIRECTION[usage]} gather: not possible, the {stored} plane is not held")
            continue
        data, scales = _plane_bytes(q, stored, shape)
        lines.append(f"  {_DIRECTION[usage]} gather (FSDP2, or for_usage(t, {usage!r})): {_mib(data + scales)} "
                     f"= data {_mib(data)} + scales {_mib(scales)}")
    for stored in q.planes:
        total += sum(_plane_bytes(q, stored, shape))
    hp = math.prod(shape) * torch.empty((), dtype=torch.bfloat16).element_size()
    lines.append(f"  redistribute(Replicate()) / full_tensor(): every plane held, {_mib(total)}; "
                 f"the same weight in bf16: {_mib(hp)}")
    text = "\n".join(lines)
    if print_it:
        print(text)
    return text
