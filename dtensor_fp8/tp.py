"""Tensor parallelism with FP8 parameters: ``parallelize_module`` on a (dp, tp) mesh, then FSDP2.

Usage::

    mesh = init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))
    dtensor_fp8.quantize_module_(model, dtensor_fp8.MXFP8())     # full weights, same on every rank
    dtensor_fp8.parallelize_module(model, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    for block in blocks: fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = dtensor_fp8.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-3)

Parameters end up as DTensors on the 2-D mesh with torch's own placements, e.g.
``(_StridedShard(0, sf=tp), Shard(0))`` for a column-parallel weight and ``(Shard(0), Shard(1))``
for a row-parallel one; each rank's local tensor is a :class:`QuantizedTensor` holding its
elements and the scale of every block they touch. FSDP gathers FP8 bytes over dp (one direction
per gather, ``fsdp.py``); the TP GEMMs run on the local planes (``ops/gemm.py``), and the only TP
collectives move activations and activation gradients, as with high-precision weights.

[Note: tensor-parallel shards that split blocks]
torch's ``Shard`` cuts where the chunk rule says, whatever the blocks: Qwen3-4B's 9728-row MLP at
TP 8 gives 1216 rows a rank (9.5 blocks of 128), Llama3's 1024-row K/V projections at TP 16 give 64.
Such a shard starts inside a block (its *block phase*, ``formats/base.py``), along dim 0 for
``ColwiseParallel`` and dim 1 for ``RowwiseParallel``; FSDP2 may cut it further along dim 0. It
keeps the scale of every block it touches, and a block shared by several TP (and dp) ranks has one
scale, from the amax over exactly its elements: at each requantization (optimizer step,
``finish_init_``, ``copy_`` of high-precision values, high-precision loads) each rank puts its
partial block amaxes in the weight's whole block grid along the split dims and the grids are
MAX-reduced over the weight's own mesh groups sharding those dims (``requantize.AmaxReduction``),
once per requantization and never per GEMM. The shards are then exactly ``quantize(full)`` cut at
the TP boundaries, so numerics and checkpoints do not depend on the TP degree. The local GEMMs
read the planes at their phase: the emulated GEMMs under DTensor (``ops/gemm.py``) dequantize with
the block grid offset (``Recipe.dequantize_plane_at``); an FP8 GEMM on such a piece
(``F.linear(x, w.to_local())``) pads its operands to whole blocks (``gemm.py``'s note). Checkpoints
hold the grid whole along split dims (``state_dict.py``), so they load at any other layout.

[Note: one per-tensor scale for the logical tensor under TP]
With per-tensor recipes (delayed and current scaling) a TP shard could carry its own scale (amax of
its shard) or share the scale of the logical tensor (amax reduced over tp and dp). We use ONE scale
for the logical tensor:

* the shards are then exactly ``quantize(full)`` split at block boundaries, so ``full_tensor()``
  reassembles a valid single-scale FP8 tensor (``cat`` refuses pieces with different per-tensor
  scales), and the checkpoint holds the same bytes whatever the mesh, so DCP can reshard it to
  another tp / dp layout or to one process without requantizing;
* the numerics do not depend on the TP degree: a model trained with tp=2 computes what the same
  model computes with tp=1 (the parity tests rely on this), and an FP8 GEMM consumer (TE) sees the
  same one-scale Float8Tensor semantics as without TP;
* the cost is one all-reduce of a few floats per optimizer step (``MasterWeightOptimizer`` packs
  the amaxes of all such weights into one MAX all-reduce over the world group; replicas hold the
  same values, so reducing over replicas too is harmless), against nothing gained per shard: a
  per-shard scale would only help when shards' magnitudes differ by more than FP8's dynamic range
  can absorb, which is what block recipes (MXFP8, blockwise) are for.

Block recipes need a reduction only for the blocks a shard boundary splits (the note above).

[Note: why our own parallelize_module]
torch's TP styles call ``distribute_tensor(param, mesh, [Shard(d)], src_data_rank=0)``, which
scatters rank 0's copy through c10d (``scatter_`` / ``broadcast_``) with the wrapper subclass in
the tensor lists: c10d cannot send it (a SIGSEGV / "Bad address" on gloo in early versions; now
``ops/collectives.py`` refuses those two ops on every rank with this fix in the message). With
``src_data_rank=None`` every rank slices its own copy (identical on every rank after
``quantize_module_``), and nothing is communicated. This function also checks the plan against
every FP8 weight first (:func:`check_tp_plan`), so a plan that cannot be represented fails with
the shape, recipe, tp size and the fix before any weight is touched.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.parallel import parallelize_module as _torch_parallelize_module

from .formats.base import USAGES
from .placement import check_shardable
from .tensor import QuantizedTensor

#: dim of an ``nn.Linear`` weight ``(out, in)`` that each style shards.
_LINEAR_WEIGHT_SHARD_DIM = {ColwiseParallel: 0, RowwiseParallel: 1}


def _style_shard_dim(style: ParallelStyle) -> int | None:
    for cls, dim in _LINEAR_WEIGHT_SHARD_DIM.items():
        if isinstance(style, cls):
            return dim
    return None


def _matching_modules(module: nn.Module, path: str):
    """Submodules ``parallelize_module`` applies a plan entry to (``fnmatch`` per path atom, as torch)."""
    from fnmatch import fnmatch

    if path == "":
        yield "", module
        return
    atoms = path.split(".")
    for fqn, sub in module.named_modules():
        parts = fqn.split(".") if fqn else []
        if len(parts) == len(atoms) and all(fnmatch(p, a) for p, a in zip(parts, atoms)):
            yield fqn, sub


def check_tp_plan(module: nn.Module, mesh: DeviceMesh, plan) -> None:
    """Raise :class:`~dtensor_fp8.RecipeError` if a TP style shards an FP8 weight in a way that
    cannot be represented exactly (:func:`~dtensor_fp8.check_shardable` with ``computes=True``).
    ``ColwiseParallel`` and ``RowwiseParallel`` chunks may start inside scaling blocks at any
    degree, uneven dims included (see the note on tensor-parallel shards that split blocks), so
    for them this accepts every degree today; it stays the one place a TP rule would be checked.

    Args:
        module: the model (FP8 weights already quantized, not yet parallelized).
        mesh: the 1-D tensor-parallel mesh.
        plan: a ``ParallelStyle`` or ``{module path: ParallelStyle}``.
    """
    tp = mesh.size()
    entries = plan.items() if isinstance(plan, dict) else [("", plan)]
    for path, style in entries:
        dim = _style_shard_dim(style)
        if dim is None:
            continue
        for fqn, sub in _matching_modules(module, path):
            if not isinstance(sub, nn.Linear):
                continue
            w = sub.weight
            if isinstance(w, QuantizedTensor):
                check_shardable(
                    tuple(w.shape), w.recipe, dim, tp, w.usages or USAGES,
                    what=f"{type(style).__name__} weight {fqn or '<root>'}.weight (tensor-parallel size {tp})",
                    computes=True,
                )


def parallelize_module(module: nn.Module, device_mesh: DeviceMesh, parallelize_plan) -> nn.Module:
    """torch's ``parallelize_module`` for models with FP8 weights (see the notes above).

    Call it after :func:`dtensor_fp8.quantize_module_` (every rank holding the same full weights)
    and before ``fully_shard``. Styles are torch's (``ColwiseParallel``, ``RowwiseParallel``,
    ``PrepareModuleInput``, ...); FP8 weights are sliced locally (``src_data_rank=None``), after
    :func:`check_tp_plan`; a shard may start inside a scaling block (see the notes above).

    Args:
        module: the model.
        device_mesh: the tensor-parallel mesh (``mesh["tp"]`` of a 2-D mesh).
        parallelize_plan: a ``ParallelStyle`` or ``{module path: ParallelStyle}``, as for torch.

    Returns:
        ``module``.

    Example:
        >>> dtensor_fp8.parallelize_module(mlp, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    """
    check_tp_plan(module, device_mesh, parallelize_plan)
    return _torch_parallelize_module(module, device_mesh, parallelize_plan, src_data_rank=None)
