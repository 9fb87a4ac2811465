"""The op of ``spmd_types`` (torchtitan's default tensor-parallel backend, local tensors with SPMD
type annotations) that cuts a replicated parameter into its tensor-parallel shard.

torchtitan's ``Module.parallelize`` shards each TP weight with ``spmd.shard(w, group, src=I,
dst=S(dim))``, which runs the custom op ``spmd_types::replicate_to_varying`` (``torch.chunk`` along
``dim``, this rank's piece, never an alias). On an FP8 weight it cuts every plane at block
boundaries, as FSDP2's and DTensor's ``Shard(dim)`` do (``slicing.py``), and refuses a cut through
a block. The op is keyed by name: ``spmd_types`` is not imported by dtensor_fp8.
"""

from __future__ import annotations

import torch

from ..formats.base import RecipeError
from ..op_table import QUANTIZED_OPS
from .slicing import check_shardable, chunk_of

aten = torch.ops.aten


@QUANTIZED_OPS.implements(["spmd_types::replicate_to_varying"])
def _replicate_to_varying(func, args, kwargs):
    params = dict(zip(("x", "world_size", "split_dim", "rank", "stack"), args), **kwargs)
    q, world, rank = params["x"], params["world_size"], params["rank"]
    dim = params["split_dim"] % q.dim()
    if params["stack"]:
        raise RecipeError(f"{q.recipe.name}: spmd_types stacking (select along dim {dim}) of an FP8 weight of shape "
                          f"{tuple(q.shape)} is not supported; shard it with S({dim})")
    check_shardable(tuple(q.shape), q.recipe, dim, world, q.usages)
    return aten.clone.default(chunk_of(q, dim, world, rank))
