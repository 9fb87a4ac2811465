"""Every accessor of dtensor_fp8/_compat.py (the package's private torch API) called on the installed
torch, with real process groups, FSDP2 and DCP objects: a torch version that moves one fails here,
by name. The last test checks that no accessor is left out."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import dtensor_fp8 as d
from dtensor_fp8 import _compat
from dist_utils import DEVICE, WORLD_SIZES

TOUCHED: set[str] = set()


def touches(*names):
    def mark(fn):
        TOUCHED.update(names)
        return fn

    return mark


@touches("TORCH_VERSION")
def test_torch_version():
    assert _compat.TORCH_VERSION >= (2, 11), _compat.TORCH_VERSION
    assert torch.__version__.startswith(".".join(map(str, _compat.TORCH_VERSION)))


@touches("in_backward")
def test_in_backward():
    seen = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append(_compat.in_backward()))
    assert not _compat.in_backward()
    y.sum().backward()
    assert seen == [True]


@touches("preserve_version_counter")
def test_preserve_version_counter():
    t = torch.zeros(3)
    before = t._version
    with _compat.preserve_version_counter(t):
        t.add_(1)
    assert t._version == before and t.tolist() == [1.0, 1.0, 1.0]
    t.add_(1)
    assert t._version == before + 1  # outside the context writes count again


@touches("is_fake", "is_traced")
def test_is_fake_and_is_traced():
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = torch.ones(2)
    with FakeTensorMode() as mode:
        fake = torch.ones(2)
    assert not _compat.is_fake(real) and _compat.is_fake(fake) and _compat.is_fake(mode.from_tensor(real))
    assert not _compat.is_traced(real) and _compat.is_traced(fake)
    seen = []

    def traced_inside(t):
        seen.append(_compat.is_traced(t))
        return t + 1

    torch.compile(traced_inside, backend="eager", fullgraph=True)(real)
    assert seen == [True]  # dynamo traces it with the real tensor's stand-in


@touches("checkpoint_wrapper_class", "uses_composable_checkpoint")
def test_checkpoint_detection():
    from torch.distributed._composable import checkpoint
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    assert isinstance(checkpoint_wrapper(nn.Linear(2, 2)), _compat.checkpoint_wrapper_class())
    plain, marked = nn.Linear(2, 2), nn.Linear(2, 2)
    checkpoint(marked)
    assert not _compat.uses_composable_checkpoint(plain) and _compat.uses_composable_checkpoint(marked)


@touches("is_compiled_module")
def test_is_compiled_module():
    a, b, c = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
    b.compile()
    assert [_compat.is_compiled_module(m) for m in (a, b, torch.compile(c))] == [False, True, True]


@touches("flatten_state_dict", "set_state_dict_element")
def test_dcp_helpers():
    nested = {"a": {"b": torch.ones(1), "c": [torch.zeros(1)]}}
    flat, mapping = _compat.flatten_state_dict(nested)
    assert set(flat) == {"a.b", "a.c.0"}
    _compat.set_state_dict_element(nested, mapping["a.b"], torch.full((1,), 7.0))
    assert nested["a"]["b"].item() == 7.0


@touches("DCP_METADATA_GLOBALS", "dcp_item_stream")
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_metadata_globals_and_item_stream(tmp_path):
    """A real .metadata names only DCP_METADATA_GLOBALS and dtypes (the CPU and GPU runs check both
    torch versions); dcp_item_stream gives a stored item's own bytes."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import MetadataIndex

    path = str(tmp_path / "ckpt")
    dcp.save({"w": torch.arange(6.0), "u8": torch.zeros(2, dtype=torch.uint8), "e4m3": torch.zeros(2, dtype=torch.float8_e4m3fn),
              "cl": torch.zeros(1, 2, 3, 4).to(memory_format=torch.channels_last), "step": 3, "lr": [1e-3, {"b": (0.9,)}]},
             checkpoint_id=path)
    seen = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    with open(f"{path}/.metadata", "rb") as f:
        metadata = Recording(f).load()
    dtypes = {("torch", n) for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)}
    assert seen - dtypes <= _compat.DCP_METADATA_GLOBALS, seen - dtypes - _compat.DCP_METADATA_GLOBALS
    reader = dcp.FileSystemReader(path)
    reader.set_up_storage_reader(metadata, True)
    index = MetadataIndex("w", [0])
    info = metadata.storage_data[index]
    with open(f"{path}/{info.relative_path}", "rb") as stream:
        data = _compat.dcp_item_stream(reader, stream, info, None).read()
    assert len(data) == info.length
    import io
    assert torch.equal(torch.load(io.BytesIO(data), weights_only=True), torch.arange(6.0))


@touches("functional_collectives", "dtensor_shard_dim_alltoall", "c10d_source_rank_ops", "legacy_all_gather_op")
def test_op_handles():
    c10d = _compat.functional_collectives()
    for name in ("all_gather_into_tensor", "wait_tensor", "_wrap_tensor_autograd"):
        assert hasattr(c10d, name), name
    assert _compat.dtensor_shard_dim_alltoall() is not None
    assert {str(op) for op in _compat.c10d_source_rank_ops()} == {"c10d.scatter_.default", "c10d.broadcast_.default"}
    assert str(_compat.legacy_all_gather_op()) == "c10d._allgather_base_.default"
    # All are in the op table: QuantizedTensor answers them.
    for op in (c10d.all_gather_into_tensor.default, _compat.dtensor_shard_dim_alltoall(), *_compat.c10d_source_rank_ops()):
        assert op in d.op_table.QUANTIZED_OPS, op


# ---- with process groups ----------------------------------------------------------------------------
def _distributed_accessors():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    import dtensor_fp8.fsdp as dfsdp

    world = dist.get_world_size()
    mesh = init_device_mesh(DEVICE, (world,))
    out = {}
    # DTensor: local tensor, _StridedShard, the process group behind a collective's group name.
    dt = DTensor.from_local(torch.arange(4.0, device=DEVICE), mesh, [Shard(0)])
    out["dtensor_local"] = _compat.dtensor_local(dt) is dt._local_tensor and _compat.dtensor_local(dt.to_local()) is not None
    out["strided_shard"] = issubclass(_compat.strided_shard_class(), torch.distributed.tensor.placement_types.Placement)
    group = mesh.get_group()
    out["resolve"] = _compat.resolve_process_group(group.group_name) is group
    gathered = _compat.all_gather_single(torch.full((2,), float(dist.get_rank()), device=DEVICE), 0, group)
    gathered = gathered.wait() if hasattr(gathered, "wait") else gathered
    out["all_gather_single"] = torch.equal(gathered.cpu(), torch.arange(world).float().repeat_interleave(2))
    # where a local chunk starts: (7, 3) on `world` ranks, Shard(0) uneven (torch's chunking: ceil(7 / world) rows each)
    uneven = DTensor.from_local(torch.zeros(0, 3, device=DEVICE), mesh, [Shard(0)], run_check=False,
                                shape=(7, 3), stride=(3, 1))
    per_rank = -(-7 // world)
    out["dtensor_chunk_offset"] = _compat.dtensor_chunk_offset(uneven) == (min(7, per_rank * dist.get_rank()), 0)

    # FSDP2: the parameters fully_shard manages and the group of a gather, from the module-state registry.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False)).to(DEVICE)
    d.quantize_module_(model, d.MXFP8())
    tied = nn.Linear(64, 64, bias=False).to(DEVICE)
    model.append(tied)
    tied.weight = model[1].weight  # a parameter shared by two modules: FSDP records the second one
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    expected = fully_shard.state(model[0])._fsdp_param_group
    root = fully_shard.state(model)._fsdp_param_group
    out["group_class"] = isinstance(expected, _compat.fsdp_param_group_class())
    managed = {id(p.local_shard): p for p in _compat.fsdp_managed_params()}
    shard0, shard1 = model[0].weight._local_tensor, model[1].weight._local_tensor
    out["managed"] = (
        isinstance(managed[id(shard0)], _compat.FSDPManagedParam)
        and (managed[id(shard0)].group, managed[id(shard0)].module, managed[id(shard0)].shared_modules)
        == (expected, model[0], ())
        and (managed[id(shard1)].group, managed[id(shard1)].module, managed[id(shard1)].shared_modules)
        == (root, model[1], (tied,)))
    out["group_of"] = (_compat.fsdp_param_group_of(model[0]) is expected and _compat.fsdp_param_group_of(model[1]) is root
                       and _compat.fsdp_param_group_of(tied) is root
                       and _compat.fsdp_param_group_of(None, shard0) is expected
                       and _compat.fsdp_param_group_of(model[1], shard0) is expected  # the shard decides
                       and _compat.fsdp_param_group_of(nn.Linear(2, 2)) is None)
    out["group_modules"] = _compat.fsdp_group_modules(expected) == (model[0],)
    # Reshards after forward to its whole shard group (True) or not at all (the root): no smaller mesh.
    out["smaller_mesh"] = not (_compat.fsdp_group_reshards_to_smaller_mesh(expected)
                               or _compat.fsdp_group_reshards_to_smaller_mesh(root))
    if world % 2 == 0 and world > 2:  # reshard_after_forward=2 of 4 ranks: FSDP2's post-forward mesh
        small = nn.Linear(64, 64, bias=False).to(DEVICE)
        fully_shard(small, mesh=mesh, reshard_after_forward=2)
        out["smaller_mesh"] &= _compat.fsdp_group_reshards_to_smaller_mesh(fully_shard.state(small)._fsdp_param_group)
    seen = []
    real = dfsdp.gather_usages

    def spy(group, **kwargs):
        seen.append((group is expected, _compat.fsdp_group_in_backward(group), _compat.fsdp_group_reshards_after_forward(group)))
        return real(group, **kwargs)

    dfsdp.gather_usages = spy
    try:
        model(torch.randn(4, 64, device=DEVICE)).sum().backward()
    finally:
        dfsdp.gather_usages = real
    out["gathers"] = seen  # per gather: (model[0]'s group, in backward, reshards)
    return out


@touches("dtensor_local", "strided_shard_class", "resolve_process_group", "all_gather_single", "dtensor_chunk_offset",
         "fsdp_param_group_class", "fsdp_managed_params", "fsdp_param_group_of", "fsdp_group_modules",
         "fsdp_group_in_backward", "fsdp_group_reshards_after_forward", "fsdp_group_reshards_to_smaller_mesh")
def test_distributed_accessors(pools):
    world = WORLD_SIZES[0]
    if world < 2:
        pytest.skip("needs 2 ranks")
    out = pools[world].run(_distributed_accessors)[0]
    gathers = out.pop("gathers")
    assert all(out.values()), out
    # The root (model[1], does not reshard after forward) gathers once, model[0] in forward and backward.
    assert gathers == [(False, False, False), (True, False, True), (True, True, True)], gathers


def test_every_accessor_is_touched():
    public = {name for name, value in vars(_compat).items()
              if not name.startswith("_") and (callable(value) and not inspect.isclass(value) or name.isupper())
              and getattr(value, "__module__", _compat.__name__) == _compat.__name__}
    assert public - TOUCHED == set(), f"accessors without a test: {sorted(public - TOUCHED)}"
