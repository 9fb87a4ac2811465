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
for a row-parallel one; each rank's local tensor is a :class:`QuantizedTensor` holding whole
scaling blocks. FSDP gathers FP8 bytes over dp (one direction per gather, ``fsdp.py``); the TP
GEMMs run on the local planes (``ops.py``, "Tensor-parallel compute"), and the only TP
collectives move activations and activation gradients, as with high-precision weights.

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

Block recipes need no reduction: their blocks never straddle a shard boundary (checked here for
TP, in ``fsdp.py`` for dp), so every shard's scales are the full tensor's scales for its blocks.

[Note: why our own parallelize_module]
torch's TP styles call ``distribute_tensor(param, mesh, [Shard(d)], src_data_rank=0)``, which
scatters rank 0's copy through c10d (``scatter_`` / ``broadcast_``) with the wrapper subclass in
the tensor lists: c10d cannot send it (a SIGSEGV / "Bad address" on gloo in early versions; now
``ops.py`` refuses those two ops on every rank with this fix in the message). With
``src_data_rank=None`` every rank slices its own copy (identical on every rank after
``quantize_module_``) at block boundaries, and nothing is communicated. This
function also checks block alignment of every FP8 weight against the tp degree first, so a
misaligned plan fails with the shape, block, tp size and the fix, before any weight is touched.
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
    """Raise :class:`~dtensor_fp8.RecipeError` if a TP style would split a scaling block of an FP8
    weight (e.g. ``RowwiseParallel`` shards K, so 1x32 / 1x128 rowwise blocks need ``K / tp`` to be
    a multiple of 32 / 128).

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
    ``PrepareModuleInput``, ...); FP8 weights are sliced locally at block boundaries
    (``src_data_rank=None``), after checking that no scaling block straddles a TP boundary.

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
