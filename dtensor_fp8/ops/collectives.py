"""Collectives on a ``QuantizedTensor``: DTensor's gathers move FP8 bytes, whole blocks only.

[Note: gathering a QuantizedTensor]
DTensor's Shard(0) -> Replicate() calls _c10d_functional.all_gather_into_tensor on the local
tensor. We run it on each inner tensor the local tensor holds -- FP8 data as uint8 (gloo rejects
float8), and the scales of blocks that lie along dim 0 -- so only the planes present move: a
tensor built with ``with_usages("rowwise")`` gathers forward bytes only. Scales of blocks that span
dim 0 (per-tensor) are already identical on every rank and are not sent.

[Note: each plane's collective completes before its output is used]
Each plane's collective is waited on right after it is issued, before a view of its output is made
or the next plane's gather starts; DTensor's later ``wait_tensor`` on the gathered tensor finds
nothing left to wait for. Leaving several in flight until that wait (raw outputs kept in a map
keyed by the gathered tensor) crashed gloo runs every few hundred steps of a 1F1B stress loop:
"malloc(): unaligned tcache chunk detected" or a SIGSEGV in a gloo worker thread. The cause is in
torch: after each collective, ``ProcessGroupGloo::runLoop`` writes the collective's name into a
string that the group's two worker threads share, without a lock. A functional all-gather's name
(``ALLGATHER_COALESCED``) lives on the heap, so two workers finishing together can free it twice
(tests/gloo_one_worker.py's note has the evidence). One gather in flight per group keeps the
workers from finishing together, and the stress loop then ran clean. It does not rule the race
out: DTensor's own gathers, and FSDP2's collectives in flight on the same group, can still meet.
docs/README.md's Limitations say what CPU users can do about it; NCCL has no such thread.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import _compat
from ..formats.base import Plane, RecipeError
from ..layout import shard_dim, splits_blocks
from ..op_table import QUANTIZED_OPS
from ..tensor import one_byte_as_uint8
from .slicing import chunk_of, max_piece_grid_rows, piece_phase, scale_rows_of_pieces

c10d = _compat.functional_collectives()

def _refuse_dim1_gather_of_split_pieces(q, group_name: str) -> None:
    """Raise, on every rank of the group alike (before anything is sent), for a gather along dim 1
    of pieces that split blocks: DTensor gathers ``Shard(1)`` by stacking the pieces along dim 0 and
    cutting the stack back into pieces, which cannot describe pieces at different block phases
    along dim 1 (their scale grids may not even have one size). The decision uses the weight's own
    layout (the same on every rank); a tensor without one was checked where it was sharded
    (``placement.check_placements``)."""
    layout = q.param_state.current_layout()
    if layout is None:
        return
    mesh, placements, shape = layout
    last = len(shape) - 1  # the planes' columns (an expert weight's Shard(1) pieces are whole experts: expert_rows.py)
    for i, pl in enumerate(placements):
        if shard_dim(pl) != last or mesh.size(i) < 2 or mesh.get_group(i).group_name != group_name:
            continue
        # dim 0: this piece's rows (the same on every rank of a group sharding dim 1)
        period = q.recipe.phase_period(0)
        rows = q.shape[0] * q.rows_per_index
        if splits_blocks(layout, last, q.recipe.phase_period(1)) or q.phase[0] % period or rows % period:
            raise RecipeError(
                f"{q.recipe.name}: full_tensor() / redistribute of an FP8 weight of shape {tuple(shape)} laid out "
                f"{tuple(placements)} gathers mesh dim {i} along tensor dim 1, and its shards start inside scaling "
                "blocks: a DTensor gather along dim 1 cannot carry pieces at different block phases. The whole "
                "weight is exact through torch's get_model_state_dict(model, options=StateDictOptions("
                "full_state_dict=True)) (plain uint8 / scale tensors), or gather the tensor-parallel dim of a "
                "layout whose TP shards hold whole blocks.")


@QUANTIZED_OPS.implements([c10d.all_gather_into_tensor.default])
def _all_gather_into_tensor(func, args, kwargs):
    q, group_size, group_name = args[0], args[1], args[2]
    _refuse_dim1_gather_of_split_pieces(q, group_name)
    if q.dim() > 2:  # the flattened matrix (tensor.py's note on tensors of more than two dims)
        gathered = _all_gather_into_tensor(func, (q.as_matrix(), group_size, group_name), kwargs)
        return gathered.with_shape([q.shape[0] * group_size, *q.shape[1:]])
    planes = {}

    def gather(t: torch.Tensor) -> torch.Tensor:
        # torch 2.11's functional all-gather refuses a non-contiguous input (a plane transposed
        # for a dim-1 gather is one); 2.13's copies it itself.
        raw = one_byte_as_uint8(t).contiguous()
        out = func(raw, group_size, group_name)
        # Complete it before anything is made of its output (see the note above). The work is
        # registered on this exact tensor: wait on it, not on a view.
        c10d.wait_tensor.default(out)
        return out.view(t.dtype)

    # The pieces are consecutive rows: this rank's starts ``rank * rows`` after the first's.
    rows, cols = q.shape[0], q.shape[1]
    rank = dist.get_rank(_compat.resolve_process_group(group_name))
    phase = piece_phase(q.phase, -rank, rows)
    for usage, plane in q.planes.items():
        block = q.recipe.block_shape(usage)
        if block.extent(0) is None:  # per-tensor: the same scale on every rank, not sent
            planes[usage] = Plane(gather(plane.data), plane.scale_inv)
            continue
        # Each rank's touched scale rows, padded to the most any rank touches (see fsdp_buffers.py's
        # note on shards that split blocks); one row per block kept, from the rank holding its first row.
        data = gather(plane.data)
        gc = block.grid((rows, cols), phase)[1]
        per_slot = max_piece_grid_rows(block, group_size, rows, cols, phase)
        slot = plane.scale_inv
        if slot.shape[0] != per_slot:
            slot = plane.scale_inv.new_zeros((per_slot, gc))
            slot[: plane.scale_inv.shape[0]] = plane.scale_inv
        scale = gather(slot)
        sources = scale_rows_of_pieces(block, group_size, rows, cols, phase)
        if sources is not None:
            scale = scale.index_select(0, torch.tensor(sources, dtype=torch.long, device=scale.device))
        planes[usage] = Plane(data, scale)
    # The FP8 planes only: a kept values plane (``hp_init``) is each rank's own, for its masters to
    # start from, and a gathered copy is no parameter's (gathering it would add high-precision bytes
    # to every full_tensor(), checkpoints' included).
    return q.rebuild(planes, shape=[q.shape[0] * group_size, *q.shape[1:]], hp_init=None, phase=phase)


@QUANTIZED_OPS.implements([c10d.wait_tensor.default])
def _wait_tensor(func, args, kwargs):
    # DTensor waits on the gathered tensor: its planes' collectives completed when it was built.
    return args[0]


@QUANTIZED_OPS.implements([c10d._wrap_tensor_autograd.default] if hasattr(c10d, "_wrap_tensor_autograd") else [])
def _wrap_tensor_autograd(func, args, kwargs):
    # funcol would wrap the result in an AsyncCollectiveTensor that waits lazily; our planes'
    # collectives are already complete (see the note above): hand back the tensor.
    return args[0]


_SHARD_DIM_ALLTOALL = _compat.dtensor_shard_dim_alltoall()


@QUANTIZED_OPS.implements([_SHARD_DIM_ALLTOALL] if _SHARD_DIM_ALLTOALL is not None else [])
def _shard_dim_alltoall(func, args, kwargs):
    """Shard(a) -> Shard(b) on NCCL: DTensor calls ``_dtensor.shard_dim_alltoall``. We do what
    DTensor itself does on gloo (all-gather along ``gather_dim``, keep this rank's chunk along
    ``shard_dim``): FP8 bytes only, whole blocks only; it moves ``world`` times an all-to-all's
    bytes, which is acceptable for a one-off reshard of weights."""
    q, gather_dim, shard_dim, group_name = args
    group = _compat.resolve_process_group(group_name)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    return chunk_of(_compat.all_gather_single(q, gather_dim, group), shard_dim, world, rank)


# torch's TP styles and ``distribute_tensor`` default to ``src_data_rank=0``: rank 0's copy is
# scattered / broadcast through c10d with the wrapper subclass in the tensor lists. Refuse with the
# fix (every rank raises here, before any collective starts, so none is left waiting).
@QUANTIZED_OPS.implements(_compat.c10d_source_rank_ops())
def _refuse_c10d_source_rank(func, args, kwargs):
    raise RecipeError(
        f"dtensor_fp8: {func} on a QuantizedTensor: FP8 weights are not scattered/broadcast from a source "
        "rank. Every rank holds the same quantized weights after quantize_module_, so slice locally: use "
        "dtensor_fp8.parallelize_module(model, tp_mesh, plan), or pass src_data_rank=None to torch's "
        "parallelize_module / distribute_tensor."
    )
