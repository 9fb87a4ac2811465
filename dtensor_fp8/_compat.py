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
of a torch object (``tests/test_structure.py`` checks the imports).

Not counted as private here: the tensor-subclass protocol (``torch.Tensor._make_wrapper_subclass``,
``torch._C._disabled_torch_function_impl``, ``torch.utils._pytree``,
``torch.utils._python_dispatch.TorchDispatchMode``, ``torch.utils.weak``), which is torch's
documented way to write a tensor subclass, and ``torch._scaled_mm`` / ``torch._foreach_*``,
public in all but name.
"""

from __future__ import annotations

import functools
import inspect
import sys
import weakref

import torch
from torch import nn

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
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


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


def disable_aot_autograd_cache() -> None:
    """Turn AOT autograd's on-disk cache of compiled graphs off for this process
    (``torch._functorch.config.enable_autograd_cache``, both versions): every compile traces."""
    import torch._functorch.config as functorch_config

    functorch_config.enable_autograd_cache = False


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
    """``FSDPParamGroup`` (``_fully_shard/_fsdp_param_group.py``, both versions)."""
    return _fsdp_classes()[0]


def fsdp_group_in_backward(group) -> bool:
    """Whether an ``FSDPParamGroup`` is in its backward (``_training_state`` PRE_BACKWARD or
    POST_BACKWARD; prefetched backward gathers are issued in PRE_BACKWARD). Both versions."""
    training_state = _fsdp_classes()[1]
    return group._training_state in (training_state.PRE_BACKWARD, training_state.POST_BACKWARD)


def fsdp_group_reshards_after_forward(group) -> bool:
    """Whether an ``FSDPParamGroup`` frees its unsharded parameters after forward, so that a
    backward all-gather follows (``post_forward_mesh_info`` set; FSDP clears it for a root
    that keeps its parameters, both versions)."""
    return group.post_forward_mesh_info is not None


def fsdp_group_modules(group) -> tuple[nn.Module, ...]:
    """The modules ``fully_shard`` was applied to for this group (``FSDPParamGroup.modules``)."""
    return tuple(getattr(group, "modules", ()))


# [Note: finding the FSDPParamGroup of a gather]
# ``fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)`` is not told which
# FSDPParamGroup gathers; ``module`` is the parameter's owning module (a Linear inside the
# fully_shard'ed block, say). FSDP2 registers each fully_shard'ed module's ``FSDPState`` in the
# composable-API registry ``torch.distributed._composable_state._module_state_mapping`` (a weak
# map module -> state, in 2.11 and 2.13 alike), and the state's ``_fsdp_param_group`` lists its
# ``FSDPParam``s, each with the owning module (``_module_info.module``, and ``shared_modules`` for
# a tied parameter). ``fsdp_param_group_of`` indexes those once and looks ``module`` up; the
# index is rebuilt when a module is missing (a later ``fully_shard``). The call-stack walk
# (``FSDPParamGroup.unshard`` -> ``foreach_all_gather`` -> ``FSDPParam.all_gather_inputs`` ->
# the hook, in both versions) is kept as the fallback should a torch version move the registry.
_GROUP_INDEX: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def _index_fsdp_groups() -> None:
    from torch.distributed._composable_state import _module_state_mapping

    fsdp_state_cls = _fsdp_classes()[2]
    for state_ref in list(_module_state_mapping.values()):
        state = state_ref()
        group = getattr(state, "_fsdp_param_group", None) if isinstance(state, fsdp_state_cls) else None
        if group is None:
            continue
        for fsdp_param in group.fsdp_params:
            info = fsdp_param._module_info
            for owner in (info.module, *info.shared_modules):
                _GROUP_INDEX[owner] = weakref.ref(group)


def fsdp_param_group_of(module: nn.Module | None):
    """The ``FSDPParamGroup`` that gathers the parameters of ``module`` (their owning module), from
    FSDP2's module-state registry; ``None`` if no fully_shard manages them.

    Args:
        module: the module a parameter belongs to (FSDP's ``module`` argument to the hooks).

    Example:
        >>> fsdp_param_group_of(block.attn.q_proj)   # the group of fully_shard(block)
    """
    if module is None:
        return None
    for rebuild in (False, True):
        if rebuild:
            _index_fsdp_groups()
        ref = _GROUP_INDEX.get(module)
        group = ref() if ref is not None else None
        if group is not None:
            return group
    return None


@functools.cache
def _group_method_codes() -> frozenset:
    methods = [f for f in vars(fsdp_param_group_class()).values() if inspect.isfunction(f)]
    # Some methods are decorated (e.g. to disable dynamo): their frames run the wrapped function.
    return frozenset(g.__code__ for f in methods for g in (f, inspect.unwrap(f)))


@functools.cache
def _fsdp_param_init_extensions_code():
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    return inspect.unwrap(FSDPParam._init_extensions).__code__


def fsdp_param_initializing(frame) -> tuple[tuple[int, ...], int] | None:
    """``(full shape, shard world size)`` of the parameter FSDP2 is setting up when ``frame`` is
    ``FSDPParam._init_extensions`` (which looks up ``fsdp_pre_all_gather`` on the new local shard,
    in torch 2.11 and 2.13: the one moment during ``fully_shard`` a shard is told its sharding),
    else ``None``. Cheap when it is not: one code-object comparison.

    Example:
        >>> fsdp_param_initializing(sys._getframe(1))   # inside a descriptor's __get__
    """
    if frame is None or frame.f_code is not _fsdp_param_init_extensions_code():
        return None
    owner = frame.f_locals.get("self")
    return tuple(owner._orig_size), owner.mesh_info.shard_mesh_size


def fsdp_param_group_on_stack(max_depth: int = 16):
    """Fallback of :func:`fsdp_param_group_of`: the ``FSDPParamGroup`` whose method is on the call
    stack (``unshard`` or, on one rank, ``wait_for_unshard``), or ``None``."""
    group_cls, codes = fsdp_param_group_class(), _group_method_codes()
    # Frames of FSDPParamGroup's methods first (reading ``f_locals`` copies a frame's locals on
    # Python < 3.13), then, should another torch version wrap them differently, every frame.
    for only_group_methods in (True, False):
        frame = sys._getframe(1)
        for _ in range(max_depth):
            if frame is None:
                break
            if not only_group_methods or frame.f_code in codes:
                owner = frame.f_locals.get("self")
                if isinstance(owner, group_cls):
                    return owner
            frame = frame.f_back
    return None


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
