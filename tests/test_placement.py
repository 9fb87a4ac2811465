"""Quantized DTensors on real process groups: block-aligned shards, per-direction gathers."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import dtensor_fp8 as d
from conftest import assert_bytes_equal
from dist_utils import DEVICE, WORLD_SIZES, CollectiveBytes

RECIPES = d.RECIPES


def _input(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    # per-row magnitudes spread over 4 decades so rowwise and columnwise blocks differ
    x = torch.randn(shape, generator=g) * torch.logspace(-2, 2, shape[0])[:, None]
    return x.to(torch.bfloat16).to(DEVICE)


def expected_gather_bytes(shape, recipe, usage, world_size, dim=0):
    """Bytes one rank hands to the all-gather: its padded chunk of the stored plane only."""
    if world_size == 1:  # DTensor runs no collective over a one-rank mesh dim
        return 0
    stored = recipe.stored_usage(usage)
    block = recipe.block_shape(stored)
    m, k = shape
    chunk = -(-shape[dim] // world_size)
    local = (chunk, k) if dim == 0 else (m, chunk)
    data = local[0] * local[1]  # 1 byte per FP8 element
    if block.extent(dim) is None:  # per-tensor: the scale is the same everywhere, never sent
        return data
    # Every rank sends the scale rows of the blocks it touches, padded to the most any rank touches.
    rows = max(block.grid(local, (r * chunk if dim == 0 else 0, 0))[0] for r in range(world_size))
    gc = block.grid(local)[1]
    return data + rows * gc * torch.empty((), dtype=recipe.scale_inv_dtype).element_size()


def _gather_each_usage(recipe_name, shape, dim):
    world = torch.distributed.get_world_size()
    mesh = init_device_mesh(DEVICE, (world,))
    recipe = RECIPES[recipe_name]
    x = _input(shape)
    full = d.quantize(x, recipe)
    dt = d.distribute(x, mesh, [Shard(dim)], recipe)
    assert isinstance(dt, DTensor) and isinstance(dt.to_local(), d.QuantizedTensor)
    for usage in ("rowwise", "columnwise"):
        view = d.for_usage(dt, usage)
        with CollectiveBytes() as counted:
            gathered = view.redistribute(mesh, [Replicate()]).to_local()
        assert isinstance(gathered, d.QuantizedTensor), type(gathered)
        assert gathered.usages == (usage,)
        assert gathered.shape == full.shape
        ref, got = full.plane(usage), gathered.plane(usage)
        assert_bytes_equal(got.data, ref.data, f"{recipe_name} {usage} data")
        assert_bytes_equal(got.scale_inv, ref.scale_inv, f"{recipe_name} {usage} scale_inv")
        assert counted.sent == expected_gather_bytes(shape, recipe, usage, world, dim), counted.calls
        # full_tensor() is the same gather
        again = view.full_tensor()
        assert isinstance(again, d.QuantizedTensor)
        assert_bytes_equal(again.plane(usage).data, ref.data, "full_tensor")
        # what the GEMM reads: identical values from the gathered plane
        assert_bytes_equal(gathered.dequantize(torch.float32, usage), full.dequantize(torch.float32, usage), "dequant")
    return True


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_gather_each_direction_is_exact_and_moves_only_its_plane(pools, world_size, recipe_name):
    pools[world_size].run(_gather_each_usage, recipe_name, (512, 256), 0)


@pytest.mark.parametrize("recipe_name", ["current", "mxfp8", "blockwise1d", "delayed"])
def test_gather_along_dim1(pools, recipe_name):
    world = WORLD_SIZES[0]
    pools[world].run(_gather_each_usage, recipe_name, (256, 512), 1)


def _works_left_by_a_gather(recipe_name):
    """How many c10d works a QuantizedTensor's functional all-gather leaves registered (in flight)
    when the op returns, before DTensor's wait_tensor on its result."""
    registry_size = torch._C._distributed_c10d._get_work_registry_size
    world = torch.distributed.get_world_size()
    mesh = init_device_mesh(DEVICE, (world,))
    recipe = RECIPES[recipe_name]
    x = _input((512, 256))
    local = d.distribute(x, mesh, [Shard(0)], recipe).to_local()
    before = registry_size()
    gathered = torch.ops._c10d_functional.all_gather_into_tensor(local, world, mesh.get_group().group_name)
    left = registry_size() - before
    torch.ops._c10d_functional.wait_tensor(gathered)  # what DTensor does next
    assert_bytes_equal(gathered.plane("rowwise").data, d.quantize(x, recipe).plane("rowwise").data, "gathered")
    return left


@pytest.mark.skipif(not hasattr(torch._C._distributed_c10d, "_get_work_registry_size"),
                    reason="this torch does not expose c10d's functional work registry")
@pytest.mark.parametrize("recipe_name", ["mxfp8", "blockwise1d", "current"])
def test_gather_completes_every_plane_collective_before_returning(pools, recipe_name):
    """Planes' collectives left in flight past the op (waited only at DTensor's wait_tensor, views of
    their outputs already in the planes) corrupted the heap now and then under gloo
    (ops/collectives.py, the note on completing each plane's collective): none may be left."""
    world = WORLD_SIZES[0]
    assert pools[world].run(_works_left_by_a_gather, recipe_name) == [0] * world


# ---- uneven and misaligned shards -------------------------------------------------------------------
UNEVEN_ALIGNED = {  # (recipe, world) -> shape whose torch-chunk boundaries are block-aligned but uneven
    ("current", 2): (250, 64), ("current", 4): (250, 64), ("delayed", 2): (131, 48), ("delayed", 4): (131, 48),
    ("blockwise1d", 2): (255, 256), ("blockwise2d", 2): (255, 256),
    ("blockwise1d", 4): (510, 128), ("blockwise2d", 4): (510, 200),
}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("recipe_name", ["current", "delayed", "blockwise1d", "blockwise2d"])
def test_uneven_block_aligned_shards_are_exact(pools, world_size, recipe_name):
    shape = UNEVEN_ALIGNED.get((recipe_name, world_size))
    if shape is None:
        pytest.skip(f"no uneven aligned case listed for {recipe_name} on {world_size} ranks")
    pools[world_size].run(_gather_each_usage, recipe_name, shape, 0)


# Shards whose boundaries fall inside blocks along dim 0 (each rank holds the scale of every block it
# touches; a shared block has one scale, from the amax over all its rows): uneven and even, a few rows
# of a block each and several blocks and a half each.
SPLITTING = {"mxfp8": [(96, 64), (160, 64)], "blockwise1d": [(250, 256), (256, 256)],
             "blockwise2d": [(384, 256), (256, 256), (900, 128)], "current": [(250, 64)], "delayed": [(131, 48)]}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("recipe_name", list(SPLITTING))
def test_shards_that_split_blocks_gather_exactly(pools, world_size, recipe_name):
    for shape in SPLITTING[recipe_name]:
        pools[world_size].run(_gather_each_usage, recipe_name, shape, 0)


def _split_dim1_refused(recipe_name, shape):
    world = torch.distributed.get_world_size()
    mesh = init_device_mesh(DEVICE, (world,))
    with pytest.raises(d.RecipeError) as err:
        d.distribute(_input(shape), mesh, [Shard(1)], RECIPES[recipe_name])
    msg = str(err.value)
    for part in (str(tuple(shape)), f"over {world} ranks", "gathered along dim 1", "RowwiseParallel", "Fix:"):
        assert part in msg, msg
    return msg


@pytest.mark.parametrize("recipe_name", ["mxfp8", "blockwise1d", "blockwise2d"])
def test_dim1_shards_inside_blocks_raise_at_construction(pools, recipe_name):
    world = WORLD_SIZES[0]
    if world == 1:
        pytest.skip("one rank holds every column")
    shape = (256, 96) if recipe_name == "mxfp8" else (256, 384)  # dim-1 chunks of 48 / 24 or 192 / 96 columns
    msgs = pools[world].run(_split_dim1_refused, recipe_name, shape)
    assert RECIPES[recipe_name].name in msgs[0]


def test_dim1_split_error_names_block_and_fix():
    with pytest.raises(d.RecipeError, match=r"boundary at index 48.*block of 32.*\[1, 3\]"):
        d.check_shardable((64, 96), d.MXFP8(), 1, 2)
    d.check_shardable((96, 64), d.MXFP8(), 0, 2)  # dim 0: any boundary


# ---- DTensor's redistribute plan cache ----------------------------------------------------------------
def _plan_cache(recipe_name):
    world = torch.distributed.get_world_size()
    mesh = init_device_mesh(DEVICE, (world,))
    x = _input((256, 128))
    plain = distribute_tensor(x, mesh, [Shard(0)])
    before = plain.redistribute(mesh, [Replicate()]).to_local()
    assert type(before) is torch.Tensor and torch.equal(before, x)
    dt = d.distribute(x, mesh, [Shard(0)], RECIPES[recipe_name])
    q = dt.redistribute(mesh, [Replicate()]).to_local()
    assert isinstance(q, d.QuantizedTensor)
    assert_bytes_equal(q.dequantize(torch.float32), d.quantize(x, RECIPES[recipe_name]).dequantize(torch.float32))
    after = distribute_tensor(x, mesh, [Shard(0)]).redistribute(mesh, [Replicate()]).to_local()
    assert type(after) is torch.Tensor and torch.equal(after, x)
    # and back: Replicate -> Shard(0) of the quantized tensor keeps the block-aligned pieces
    resharded = DTensor.from_local(q, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(0)])
    local = resharded.to_local()
    assert isinstance(local, d.QuantizedTensor)
    expected = d.distribute(x, mesh, [Shard(0)], RECIPES[recipe_name]).to_local()
    for usage in local.planes:
        assert_bytes_equal(local.planes[usage].data, expected.planes[usage].data, "reshard data")
        assert_bytes_equal(local.planes[usage].scale_inv, expected.planes[usage].scale_inv, "reshard scale")
    return True


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_plain_shard_plans_are_not_confused_with_quantized_ones(pools, recipe_name):
    pools[WORLD_SIZES[0]].run(_plan_cache, recipe_name)


# ---- Shard(a) -> Shard(b) -----------------------------------------------------------------------------
def _shard_to_shard(recipe_name, src_dim, dst_dim):
    world = torch.distributed.get_world_size()
    mesh = init_device_mesh(DEVICE, (world,))
    recipe = RECIPES[recipe_name]
    x = _input((512, 512))
    expected = d.distribute(x, mesh, [Shard(dst_dim)], recipe).to_local()
    src = d.distribute(x, mesh, [Shard(src_dim)], recipe)
    # DTensor's own path (gloo: all-gather + chunk; NCCL: the _dtensor.shard_dim_alltoall op) ...
    via_dtensor = src.redistribute(mesh, [Shard(dst_dim)]).to_local()
    # ... and the op NCCL meshes dispatch to the local QuantizedTensor, called directly.
    group_name = mesh.get_group().group_name
    via_op = torch.ops._dtensor.shard_dim_alltoall(src.to_local(), src_dim, dst_dim, group_name)
    for got in (via_dtensor, via_op):
        assert isinstance(got, d.QuantizedTensor)
        for usage, plane in expected.planes.items():
            assert_bytes_equal(got.planes[usage].data, plane.data, f"{usage} data")
            assert_bytes_equal(got.planes[usage].scale_inv.contiguous(), plane.scale_inv.contiguous(), f"{usage} scale")
    return True


@pytest.mark.parametrize("src_dim,dst_dim", [(0, 1), (1, 0)])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_shard_to_shard_between_dims(pools, recipe_name, src_dim, dst_dim):
    pools[WORLD_SIZES[0]].run(_shard_to_shard, recipe_name, src_dim, dst_dim)
