"""Every private torch API the package touches, in one place, for torch 2.11 to 2.15.

[Note: private torch API]
dtensor_fp8 extends FSDP2, DTensor and DCP where they have no public hook: it reads FSDP2's
per-group training state (to choose which planes a gather moves), handles DTensor's functional
collectives on its tensor subclass, recognizes FSDP's ``_StridedShard`` placement, and walks
DCP's nested state dicts. Each such access is an accessor here, named for what it gives, and
written for every torch version the project runs (2.11 on the GPU machine, 2.13 and 2.15 on CPU /
CI); where versions differ the accessor says how. ``tests/test_compat.py`` calls every accessor on the
installed torch, so a torch upgrade that moves one fails there, by name, and not deep inside a
gather. Nothing else in the package imports a private torch module or reads a private attribute
of a torch object (``tests/test_structure.py`` checks the imports). The FSDP2 accessors name the
versions whose sources they were checked against (2.14 and 2.15 too). Nothing here, or anywhere in
the package, inspects the call stack (frames, their locals): FSDP2's objects are found through its
own registry, and ``tests/test_structure.py`` refuses any read of the call stack.

Not counted as private here: the tensor-subclass protocol (``torch.Tensor._make_wrapper_subclass``,
``torch._C._disabled_torch_function_impl``, ``torch.utils._pytree``,
``torch.utils._python_dispatch.TorchDispatchMode``, ``torch.utils.weak``), which is torch's
documented way to write a tensor subclass, and ``torch._scaled_mm`` / ``torch._foreach_*``,
public in all but name.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref

import torch
from torch import nn
from torch.distributed.tensor import DTensor


#: ``(major, minor)`` of the running torch.
TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])

# ======================================================================================================
# DTensor
# ======================================================================================================


def dtensor_local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor without going through autograd (``DTensor._local_tensor``;
    ``to_local()`` would record a view in autograd). Anything else is returned as it is.

    Example:
        >>> dtensor_local(model.weight)   # the QuantizedTensor shard of an FSDP parameter
    """
    return t._local_tensor if isinstance(t, DTensor) else t


def dtensor_chunk_offset(t) -> tuple[int, ...]:
    """Where a DTensor's local chunk starts in the global tensor, per dim (DTensor's own rule,
    uneven shards included).

    Example:
        >>> dtensor_chunk_offset(w)   # rank 1 of 2, Shard(0) of (256, 256)
        (128, 0)
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return tuple(compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)[1])


@functools.cache
def strided_shard_class() -> type:
    """``_StridedShard``: FSDP's dim-0 placement of a tensor-parallel parameter on a (dp, tp) mesh
    (``torch.distributed.tensor.placement_types``, both versions)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard


@functools.cache
def functional_collectives():
    """``torch.ops._c10d_functional``, with every op DTensor uses on it defined.

    Importing ``torch.distributed._functional_collectives`` defines ``_wrap_tensor_autograd``
    (funcol's Python-side op, present in 2.11 and 2.13).
    """
    import torch.distributed._functional_collectives  # noqa: F401

    return torch.ops._c10d_functional


@functools.cache
def dtensor_shard_dim_alltoall():
    """``torch.ops._dtensor.shard_dim_alltoall.default`` (DTensor's Shard(a) -> Shard(b) on NCCL),
    or ``None`` where torch does not define it. Defined by ``torch.distributed.tensor._collective_utils``
    in 2.11 and 2.13."""
    import torch.distributed.tensor._collective_utils  # noqa: F401

    op = getattr(torch.ops._dtensor, "shard_dim_alltoall", None)
    return None if op is None else op.default


def c10d_source_rank_ops() -> list:
    """c10d's ``scatter_`` / ``broadcast_`` ops: what ``distribute_tensor(src_data_rank=0)`` and
    TP styles run on a parameter (those present on this torch)."""
    return [getattr(torch.ops.c10d, name).default for name in ("scatter_", "broadcast_")
            if getattr(torch.ops.c10d, name, None) is not None]


def legacy_all_gather_op():
    """``torch.ops.c10d._allgather_base_.default``: the all-gather FSDP2 issues (both versions)."""
    return torch.ops.c10d._allgather_base_.default


def resolve_process_group(group_name: str):
    """The ProcessGroup a functional collective's ``group_name`` names
    (``distributed_c10d._resolve_process_group``, both versions)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def all_gather_single(t: torch.Tensor, gather_dim: int, group) -> torch.Tensor:
    """``funcol.all_gather_single`` (torch 2.13; ``all_gather_tensor`` in 2.11, deprecated in 2.13)."""
    import torch.distributed._functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    return gather(t, gather_dim, group)


# ======================================================================================================
# autograd
# ======================================================================================================


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread
    (``torch._C._current_graph_task_id() != -1``, both versions)."""
    return torch._C._current_graph_task_id() != -1


def preserve_version_counter(t: torch.Tensor):
    """A context in which in-place writes to ``t`` leave its autograd version counter as it was
    (``torch.autograd._unsafe_preserve_version_counter``, both versions): for buffers refilled
    with the same values between a forward that saved them and its backward, as FSDP2 does with
    its own all-gather outputs."""
    return torch.autograd._unsafe_preserve_version_counter(t)


def is_fake(t: torch.Tensor) -> bool:
    """True for a tensor that has no data: a FakeTensor, or a functional / subclass wrapper of one,
    as torch.compile traces with (``torch._subclasses.fake_tensor.is_fake``, both versions). Hand-
    written kernels (Triton, TE) cannot run on it; torch ops can, and are traced."""
    if type(t) is torch.Tensor or type(t) is nn.Parameter:  # the common case, in ~0.3 us
        return torch._is_functional_tensor(t) and _fake_check()(t)
    return _fake_check()(t)


def is_traced(t: torch.Tensor) -> bool:
    """True while torch.compile traces ``t``: inside dynamo (``torch.compiler.is_compiling()``), or
    ``t`` is fake (torch 2.11's AOT autograd runs traced code outside dynamo, where
    ``is_compiling()`` is False; 2.13 sets it for the whole compile)."""
    return torch.compiler.is_compiling() or is_fake(t)


@functools.cache
def _fake_check():
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return _is_fake


# ======================================================================================================
# FSDP2 (torch.distributed.fsdp._fully_shard)
# ======================================================================================================


@functools.cache
def _fsdp_classes():
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    return FSDPParamGroup, TrainingState, FSDPState


def fsdp_param_group_class() -> type:
    """``FSDPParamGroup`` (``_fully_shard/_fsdp_param_group.py``; torch 2.11, 2.13, 2.14, 2.15)."""
    return _fsdp_classes()[0]


def fsdp_group_in_backward(group) -> bool:
    """Whether an ``FSDPParamGroup`` is in its backward (``_training_state`` PRE_BACKWARD or
    POST_BACKWARD; prefetched backward gathers are issued in PRE_BACKWARD). torch 2.11, 2.13,
    2.14, 2.15."""
    training_state = _fsdp_classes()[1]
    return group._training_state in (training_state.PRE_BACKWARD, training_state.POST_BACKWARD)


def fsdp_group_reshards_after_forward(group) -> bool:
    """Whether an ``FSDPParamGroup`` frees its unsharded parameters after forward, so that a
    backward all-gather follows (``post_forward_mesh_info`` set; FSDP clears it for a root
    that keeps its parameters; torch 2.11, 2.13, 2.14, 2.15)."""
    return group.post_forward_mesh_info is not None


def fsdp_group_reshards_to_smaller_mesh(group) -> bool:
    """Whether an ``FSDPParamGroup`` keeps a shard over a smaller mesh after forward
    (``fully_shard(..., reshard_after_forward=<int>)`` with 1 < int < shard group size: its
    ``post_forward_mesh_info`` is neither ``None`` nor its ``mesh_info``; FSDP2's own test,
    ``_use_post_forward_mesh``). torch 2.11, 2.13, 2.14, 2.15."""
    info = group.post_forward_mesh_info
    return info is not None and info is not group.mesh_info and info != group.mesh_info


def fsdp_group_modules(group) -> tuple[nn.Module, ...]:
    """The modules ``fully_shard`` was applied to for this group (``FSDPParamGroup.modules``;
    torch 2.11, 2.13, 2.14, 2.15)."""
    return tuple(getattr(group, "modules", ()))


# [Note: finding the FSDPParamGroup of a gather]
# ``fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)`` is not told which
# FSDPParamGroup gathers. FSDP2 registers each fully_shard'ed module's ``FSDPState`` in the
# composable-API registry ``torch.distributed._composable_state._module_state_mapping`` (a weak map
# module -> weakref to its state); a state holds its param groups, and each group's
# ``fsdp_params`` are the ``FSDPParam``s it gathers: the local shard FSDP hands the hook
# (``_sharded_local_tensor``, the sharded DTensor parameter's local tensor), the owning module
# FSDP passes as ``module`` (``_module_info.module``; ``shared_modules`` for a tied parameter).
# ``fsdp_param_group_of`` reads them and looks the shard up (the module where the shard is a copy,
# as with CPU offload); the caller keeps the answer in the parameter's owner record.
# Where the groups sit in the state differs between versions (``_param_groups_of_state`` below).
# Nothing here reads the call stack: a torch that moves the registry fails loudly, naming itself.


@dataclasses.dataclass(frozen=True, slots=True)
class FSDPManagedParam:
    """One parameter under ``fully_shard`` (an ``FSDPParam``), as the FSDP2 extension reads it.

    Attributes:
        group: the ``FSDPParamGroup`` whose all-gathers move it.
        module: its owning module (the ``module`` FSDP2 passes to ``fsdp_pre_all_gather``).
        shared_modules: further modules holding the same parameter (tied weights).
        local_shard: this rank's local tensor of the sharded parameter, whose
            ``fsdp_pre_all_gather`` FSDP2 calls.
    """

    group: object
    module: nn.Module
    shared_modules: tuple[nn.Module, ...]
    local_shard: torch.Tensor


def _param_groups_of_state(state) -> list:
    """The param groups of an ``FSDPState``. torch 2.13, 2.14 and 2.15 keep a list,
    ``_fsdp_param_groups`` (several groups where ``shard_placement_fn`` gives parameters their own
    meshes; the singular ``_fsdp_param_group`` is then a property that raises); torch 2.11 has the
    one attribute ``_fsdp_param_group`` (``None`` for a module without parameters). 2.12 was not
    checked: it takes the 2.11 branch, and a wrong guess fails in fsdp_managed_params, by name."""
    if TORCH_VERSION >= (2, 13):
        return list(state._fsdp_param_groups)
    group = state._fsdp_param_group
    return [group] if group is not None else []


def _registry_error(what: str) -> RuntimeError:
    return RuntimeError(
        f"dtensor_fp8 cannot read FSDP2's state on torch {torch.__version__}: {what}. dtensor_fp8/_compat.py "
        "reads it as torch 2.11, 2.13, 2.14 and 2.15 lay it out (torch.distributed._composable_state."
        "_module_state_mapping -> FSDPState -> FSDPParamGroup.fsdp_params); use one of those versions, or "
        "update _compat.fsdp_managed_params for this one.")


def fsdp_managed_params() -> list[FSDPManagedParam]:
    """Every parameter of every live ``fully_shard`` state, read from FSDP2's module-state registry
    (see the note above). Checked against torch 2.11, 2.13, 2.14 and 2.15.

    Raises:
        RuntimeError: naming the torch version, where the registry or FSDP2's state is not laid
            out as in those versions.

    Example:
        >>> fully_shard(model[0]); fully_shard(model)
        >>> [p.group for p in fsdp_managed_params() if p.module is model[0]]   # fully_shard(model[0])'s group, per parameter
    """
    try:
        from torch.distributed._composable_state import _module_state_mapping
    except ImportError as e:
        raise _registry_error(f"no module-state registry ({e})") from e
    fsdp_state_cls = _fsdp_classes()[2]
    found = []
    for state_ref in list(_module_state_mapping.values()):
        state = state_ref() if isinstance(state_ref, weakref.ref) else state_ref
        if not isinstance(state, fsdp_state_cls):
            continue  # another composable API's state (e.g. checkpoint), or collected
        try:
            for group in _param_groups_of_state(state):
                found += [FSDPManagedParam(group, p._module_info.module, tuple(p._module_info.shared_modules),
                                           p._sharded_local_tensor) for p in group.fsdp_params]
        except AttributeError as e:
            raise _registry_error(f"an FSDPState, FSDPParamGroup or FSDPParam lacks {e.name!r}") from e
    return found


def fsdp_param_group_of(module: nn.Module | None, shard: torch.Tensor | None = None):
    """The ``FSDPParamGroup`` that gathers ``shard`` (a local tensor FSDP2 hands
    ``fsdp_pre_all_gather``), else the one gathering the parameters of ``module`` (their owning
    module) where one group gathers them all; ``None`` if no ``fully_shard`` manages them. Read
    from FSDP2's module-state registry (:func:`fsdp_managed_params`), never from the call stack.
    Checked against torch 2.11, 2.13, 2.14 and 2.15.

    Args:
        module: the module a parameter belongs to (FSDP's ``module`` argument to the hooks).
        shard: the local shard itself (FSDP's ``self`` of the hook): exact where a module's
            parameters are split over groups of different meshes (``shard_placement_fn``).

    Example:
        >>> fsdp_param_group_of(block.attn.q_proj)   # the group of fully_shard(block)
    """
    if module is None and shard is None:
        return None
    # Read afresh each call: the caller keeps the answer (the parameter's owner record), so this
    # runs once per parameter, at its first gather.
    managed = fsdp_managed_params()
    for p in managed:
        if shard is not None and p.local_shard is shard:
            return p.group
    # The hook was handed a copy of the shard (CPU offload moves it to the device first): the owning
    # module decides, where all its parameters are gathered by one group.
    groups = {id(p.group): p.group for p in managed if module is not None and module in (p.module, *p.shared_modules)}
    return next(iter(groups.values())) if len(groups) == 1 else None


def checkpoint_wrapper_class() -> type:
    """``CheckpointWrapper`` (``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return CheckpointWrapper


def uses_composable_checkpoint(module: nn.Module) -> bool:
    """Whether composable ``checkpoint(module)`` (``torch.distributed._composable``) was applied."""
    try:
        from torch.distributed._composable.checkpoint_activation import checkpoint
    except ImportError:  # pragma: no cover  (present in 2.11 and 2.13)
        return False
    return checkpoint.state(module) is not None


# ======================================================================================================
# torch.compile
# ======================================================================================================


def is_compiled_module(module: nn.Module) -> bool:
    """Whether ``module``'s calls run compiled: ``module.compile()`` (``Module._compiled_call_impl``
    set) or ``torch.compile(module)`` (a ``torch._dynamo.eval_frame.OptimizedModule``). Both versions."""
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule) or getattr(module, "_compiled_call_impl", None) is not None


# ======================================================================================================
# DCP (torch.distributed.checkpoint) -- for checkpoint/
# ======================================================================================================

#: The globals a DCP ``.metadata`` pickle names, in torch 2.11 and 2.13 (``metadata.py`` and
#: ``filesystem.py`` define the same classes in both): the metadata dataclasses and their
#: memory-format enum, ``filesystem._StorageInfo``, ``torch.Size``, the layout helper
#: ``torch.serialization._get_layout``, ``pathlib`` paths (``StorageMeta.checkpoint_id``); plus
#: ``set`` / ``frozenset`` / ``OrderedDict``. Dtypes (``torch.<dtype>``) are allowed separately.
DCP_METADATA_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
                 "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"),
    ("pathlib", "Path"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
})


def dcp_item_stream(reader, stream, storage_info, read_item):
    """The bytes of one stored item, as ``FileSystemReader.read_data`` reads them: its slice of the
    open file (``reader._slice_file``) through DCP's stream transforms (``reader.transforms``, none
    unless the checkpoint was written with DCP's experimental extensions). Both versions."""
    raw = reader._slice_file(stream, storage_info)
    return reader.transforms.transform_load_stream(read_item, storage_info.transform_descriptors or (), raw)


def flatten_state_dict(state_dict: dict):
    """DCP's ``_nested_dict.flatten_state_dict``: ``(flat, mapping)`` with FQN-path keys."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as flatten

    return flatten(state_dict)


def set_state_dict_element(root: dict, path, value) -> None:
    """DCP's ``_traverse.set_element``: write ``value`` at a ``flatten_state_dict`` path."""
    from torch.distributed.checkpoint._traverse import set_element

    set_element(root, path, value)
