"""Shards that split quantization blocks: FSDP2 at any degree, uneven dims, HSDP, TP x FSDP2.

torch's ``Shard`` follows the chunk rule whatever the blocks, so a shard may hold part of a block:
64, 32 or 16 rows of a 128-row block, or 3.5 blocks. Each rank then keeps the scale of every block
it touches, one scale per block from the amax over all of its rows (reduced over the ranks sharing
it), and every gather gives TE's layout of the whole weight: the bytes of ``quantize(full)``.
"""

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import dtensor_fp8 as d
from conftest import assert_bytes_equal
from dist_utils import BACKEND, DEVICE, WORLD_SIZES
from test_placement import RECIPES

BLOCK_RECIPES = ["mxfp8", "blockwise1d", "blockwise2d"]
# Rows per shard of a dim-0 sharded weight: inside a 128-row block (64, 32, 16: also inside MXFP8's
# 32-row column blocks at 16) and 3.5 blocks of 128 (448).
SHARD_ROWS = [64, 32, 16, 448]
# The suite's world sizes and 8 (and 3 and 4 below), except where one rank needs its own device (NCCL:
# the world sizes the suite is run with).
WORLDS = sorted(({*WORLD_SIZES, 8} if BACKEND != "nccl" else set(WORLD_SIZES)) - {1})


def _ranks(world: int) -> int:
    """``world``, or a skip where the suite's backend cannot start that many ranks here."""
    if BACKEND == "nccl" and world not in WORLD_SIZES:
        pytest.skip(f"{world} ranks: NCCL needs a device per rank (DTENSOR_FP8_TEST_WORLD_SIZES={WORLD_SIZES})")
    return world


def _planes_equal(got: d.QuantizedTensor, want: d.QuantizedTensor, what: str) -> None:
    for usage, plane in got.planes.items():
        ref = want.planes[usage]
        assert_bytes_equal(plane.data, ref.data, f"{what}: {usage} data")
        assert_bytes_equal(plane.scale_inv, ref.scale_inv, f"{what}: {usage} scale_inv")


def _weight(rows, cols, seed=0):
    g = torch.Generator().manual_seed(seed)
    # magnitudes spread over rows and elements, so every block (and each part of a split block) differs
    w = torch.randn(rows, cols, generator=g) * torch.logspace(-2, 2, rows)[:, None]
    return (w * 2.0 ** -torch.randint(0, 8, (rows, cols), generator=g).float()).to(DEVICE)


def _fsdp_layer_is_exact(recipe_name, shard_rows, rows=None):
    """One Linear, fully_shard-ed so each rank holds ``shard_rows`` rows (or ``rows`` rows over the
    ranks, unevenly): the unsharded weight FSDP2 gathers, forward and input gradient equal
    quantize(full)'s, and so do the planes after an optimizer step requantized every shard from its
    master."""
    world = torch.distributed.get_world_size()
    recipe = RECIPES[recipe_name]
    rows = rows or shard_rows * world
    cols = 128
    layer = nn.Linear(cols, rows, bias=False).to(DEVICE)
    with torch.no_grad():
        layer.weight.copy_(_weight(rows, cols))
    full = d.quantize(layer.weight.detach(), recipe)
    d.quantize_module_(layer, recipe)
    fully_shard(layer, mesh=init_device_mesh(DEVICE, (world,)), reshard_after_forward=True)
    local = layer.weight.to_local()
    chunk = -(-rows // world)  # torch's chunk rule
    assert local.shape[0] == min(chunk, max(0, rows - torch.distributed.get_rank() * chunk))
    x = torch.randn(4, cols, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1), requires_grad=True)
    upstream = torch.randn(4, rows, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(2))
    out = layer(x)
    assert torch.equal(out, torch.nn.functional.linear(x.detach(), full.dequantize(torch.float32, "rowwise")))
    (out * upstream).sum().backward()
    assert torch.equal(x.grad, upstream @ full.dequantize(torch.float32, "columnwise"))
    layer.unshard()
    _planes_equal(layer.weight.to_local() if isinstance(layer.weight, DTensor) else layer.weight, full, "gathered")
    layer.reshard()
    # An optimizer step rewrites every shard from its master: a split block takes one scale from
    # the amax over all of its rows, so the gathered weight is quantize(full master).
    opt = d.MasterWeightOptimizer(layer, torch.optim.SGD, lr=0.5)
    opt.step()
    master = opt.master_of(layer.weight).full_tensor().detach()
    stepped = d.quantize(master, recipe)
    gathered = layer.weight.full_tensor()
    _planes_equal(gathered, stepped, "after a step (full_tensor)")
    layer.unshard()
    _planes_equal(layer.weight.to_local() if isinstance(layer.weight, DTensor) else layer.weight, stepped,
                  "after a step (FSDP2's gather)")
    layer.reshard()
    return True


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("recipe_name", BLOCK_RECIPES)
def test_fsdp2_shards_inside_blocks_are_exact(pools, world, recipe_name):
    for shard_rows in SHARD_ROWS:
        if world == 8 and shard_rows == 448:
            continue  # 3584 rows: the same geometry as at 2 and 4 ranks, 4x the bytes
        pools[world].run(_fsdp_layer_is_exact, recipe_name, shard_rows)


# Rows that the ranks cannot share evenly (MXFP8's rows are multiples of 32, which 2, 4 and 8 ranks
# share evenly): the short last shard is padded, and FSDP2 takes only inputs of the padded shard's
# shape from it, so its scales are gathered beside FSDP2's all-gather (fsdp_buffers.py).
UNEVEN = {"mxfp8": [(3, 160), (3, 224)], "blockwise1d": [(2, 255), (4, 250)], "blockwise2d": [(2, 255), (4, 250), (3, 400)],
          "current": [(2, 250)]}


@pytest.mark.parametrize("recipe_name", list(UNEVEN))
def test_fsdp2_uneven_shards_are_exact(pools, recipe_name):
    for world, rows in UNEVEN[recipe_name]:
        pools[_ranks(world)].run(_fsdp_layer_is_exact, recipe_name, None, rows)


# ---- training parity ------------------------------------------------------------------------------------
DIM, HIDDEN, BATCH, STEPS = 192, 320, 16, 12


def _model(seed=3):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(DIM, HIDDEN, bias=False), nn.ReLU(), nn.Linear(HIDDEN, DIM, bias=False))
    with torch.no_grad():
        for layer in (model[0], model[2]):
            layer.weight.mul_(torch.logspace(-1, 1, layer.weight.shape[0])[:, None])
    return model.to(DEVICE)


def _mesh(kind):
    world = torch.distributed.get_world_size()
    if kind == "hsdp":
        return init_device_mesh(DEVICE, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(DEVICE, (world,))


def _sgd_losses(model, opt, dim, shares, share, group):
    """STEPS optimizer steps on the same global batches, this rank taking share ``share`` of
    ``shares``; the mean loss over ``group`` (``None``: this process alone) after each."""
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(BATCH * 2, dim, generator=g).to(DEVICE).chunk(shares)[share]
        target = torch.randn(BATCH * 2, dim, generator=g).to(DEVICE).chunk(shares)[share]
        loss = (model(x) - target).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if group is not None:
            torch.distributed.all_reduce(total, group=group)
            total /= shares
        losses.append(total.item())
    return losses


def _train(recipe_name, kind):
    """STEPS of SGD on a two-layer model whose shards split blocks (HIDDEN / world and DIM / world
    rows), against the one-process run; returns losses, masters and each weight's gathered planes
    next to quantize(its master)."""
    sharded = kind != "single"
    recipe = RECIPES[recipe_name]
    model = d.quantize_module_(_model(), recipe)
    world = torch.distributed.get_world_size() if sharded else 1
    if sharded:
        mesh = _mesh(kind)
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = d.MasterWeightOptimizer(model, torch.optim.SGD, lr=0.05, momentum=0.9)
    rank = torch.distributed.get_rank() if sharded else 0
    losses = _sgd_losses(model, opt, DIM, world, rank % world, None if not sharded else torch.distributed.group.WORLD)
    masters = {n: (m.full_tensor() if sharded else m).detach().cpu() for n, m in opt.masters.items()}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor) or isinstance(p, d.QuantizedTensor):
            full = p.full_tensor() if isinstance(p, DTensor) else p
            _planes_equal(full, d.quantize(masters[name].to(DEVICE), recipe), f"{name} after {STEPS} steps")
    return losses, masters


@pytest.mark.parametrize("kind", ["fsdp", "hsdp"])
@pytest.mark.parametrize("recipe_name", BLOCK_RECIPES)
def test_training_with_split_blocks_matches_one_process(pools, recipe_name, kind):
    world = _ranks(4) if kind == "hsdp" else WORLD_SIZES[-1]
    if world < 2:
        pytest.skip("one rank holds whole blocks")
    ref_losses, ref_masters = _train(recipe_name, "single")
    losses, masters = pools[world].run(_train, recipe_name, kind)[0]
    assert losses[-1] < losses[0] * 0.9, losses
    # Tolerances as tests/test_fsdp.py's [Tolerance] note: reduce-scatter sums in another order.
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-3, atol=1e-5)
    for name, ref in ref_masters.items():
        torch.testing.assert_close(masters[name], ref, rtol=0, atol=5e-3, msg=name)


# ---- checkpoints across layouts -------------------------------------------------------------------------
CKPT_ROWS, CKPT_COLS = 384, 128  # 2 ranks: 192-row shards (1.5 blocks); 4: 96; 8: 48; 3: 128 (aligned)


def _ckpt_model(recipe_name, seed, kind):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(CKPT_COLS, CKPT_ROWS, bias=False), nn.Linear(CKPT_ROWS, CKPT_COLS, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(_weight(CKPT_ROWS, CKPT_COLS, seed))
    model = d.quantize_module_(model.to(DEVICE), RECIPES[recipe_name])
    if kind != "single":
        mesh = _mesh(kind)
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _full_planes(model):
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        for usage, plane in full.planes.items():
            out[f"{name}.{usage}"] = (plane.data.view(torch.uint8).cpu().clone(),
                                      plane.scale_inv.view(torch.uint8).cpu().clone())
    return out


def _dcp_save(recipe_name, path, kind):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model = _ckpt_model(recipe_name, 0, kind)
    d.finish_init_(model)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)
    return _full_planes(model)


def _dcp_load(recipe_name, path, kind):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model = _ckpt_model(recipe_name, 1, kind)  # other values, overwritten by the load
    d.finish_init_(model)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    return _full_planes(model)


@pytest.mark.parametrize("recipe_name", BLOCK_RECIPES)
def test_checkpoint_across_split_and_aligned_layouts_is_exact(pools, tmp_path, recipe_name):
    """Saved where shards split blocks (4 ranks: 96-row shards of 128-row blocks), loaded where they
    split them differently (2 ranks: 192 rows), where they do not (3 ranks: 128 rows) and under HSDP;
    and saved aligned, loaded split: every plane's bytes and scales equal the saved ones."""
    split4 = str(tmp_path / "split4")
    saved = pools[_ranks(4)].run(_dcp_save, recipe_name, split4, "fsdp")[0]
    for world, kind in ((2, "fsdp"), (3, "fsdp"), (4, "hsdp")):
        for got in pools[_ranks(world)].run(_dcp_load, recipe_name, split4, kind):
            assert got.keys() == saved.keys()
            for key, (data, scale) in saved.items():
                assert torch.equal(got[key][0], data), f"{key} data at {world} ranks ({kind})"
                assert torch.equal(got[key][1], scale), f"{key} scale_inv at {world} ranks ({kind})"
    aligned3 = str(tmp_path / "aligned3")
    saved = pools[_ranks(3)].run(_dcp_save, recipe_name, aligned3, "fsdp")[0]
    for got in pools[4].run(_dcp_load, recipe_name, aligned3, "fsdp"):
        for key, (data, scale) in saved.items():
            assert torch.equal(got[key][0], data) and torch.equal(got[key][1], scale), key


# ---- tensor parallel x FSDP2 ------------------------------------------------------------------------------
# Whole blocks per TP shard (TP computes on them), split by FSDP2 inside each: w1 (256, 192) column-
# parallel: 128 rows per TP rank, 64 per FSDP rank; w2 (192, 256) row-parallel: 96 rows per FSDP rank.
TP_DIM, TP_HIDDEN = 192, 256


def _train_tp(recipe_name, kind):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    recipe = RECIPES[recipe_name]
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(TP_DIM, TP_HIDDEN, bias=False), nn.ReLU(), nn.Linear(TP_HIDDEN, TP_DIM, bias=False))
    with torch.no_grad():
        for layer in (model[0], model[2]):
            layer.weight.mul_(torch.logspace(-1, 1, layer.weight.shape[0])[:, None])
    model = d.quantize_module_(model.to(DEVICE), recipe)
    sharded = kind != "single"
    if sharded:
        mesh = init_device_mesh(DEVICE, (2, 2), mesh_dim_names=("dp", "tp"))
        d.parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    opt = d.MasterWeightOptimizer(model, torch.optim.SGD, lr=0.05, momentum=0.9)
    # the dp ranks split the batch; the tp ranks of a dp rank see the same rows
    losses = (_sgd_losses(model, opt, TP_DIM, 2, torch.distributed.get_rank() // 2, mesh["dp"].get_group()) if sharded
              else _sgd_losses(model, opt, TP_DIM, 1, 0, None))
    masters = {n: (m.full_tensor() if sharded else m).detach().cpu() for n, m in opt.masters.items()}
    # The whole weights through torch's full state dict (DTensor's full_tensor() of a weight whose dp
    # shards split blocks while tp shards dim 1 is refused: docs/README.md, Limitations).
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)) if sharded else None
    for name, p in model.named_parameters():
        want = d.quantize(masters[name].to(DEVICE), recipe)
        if not sharded:
            _planes_equal(p, want, f"{name} after {STEPS} steps")
            continue
        for usage, plane in want.planes.items():
            assert_bytes_equal(state[name][f"{usage}_data"], plane.data, f"{name} {usage} data")
            assert_bytes_equal(state[name][f"{usage}_scale_inv"], plane.scale_inv, f"{name} {usage} scale_inv")
    return losses, masters


@pytest.mark.parametrize("recipe_name", BLOCK_RECIPES)
def test_tp_x_fsdp2_with_split_blocks_matches_one_process(pools, recipe_name):
    ref_losses, ref_masters = _train_tp(recipe_name, "single")
    losses, masters = pools[_ranks(4)].run(_train_tp, recipe_name, "2d")[0]
    assert losses[-1] < losses[0] * 0.9, losses
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-3, atol=1e-5)
    for name, ref in ref_masters.items():
        torch.testing.assert_close(masters[name], ref, rtol=0, atol=5e-3, msg=name)


# ---- resume ---------------------------------------------------------------------------------------------
def _resume_run(recipe_name, root, save_at, total, resume):
    """``total`` AdamW steps of the split-block model (96-row shards of 128-row blocks at 4 ranks),
    checkpointed at ``save_at`` (model, optimizer, masters through torch's get_state_dict); with
    ``resume`` a fresh model loads that checkpoint and runs the rest. Losses after ``save_at`` and
    every plane and master at the end."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _ckpt_model(recipe_name, 7 if resume else 0, "fsdp")
    opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-2)

    def steps(first, last):
        losses = []
        for step in range(first, last):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(8 * torch.distributed.get_world_size(), CKPT_COLS, generator=g).to(DEVICE)
            loss = model(x.chunk(torch.distributed.get_world_size())[torch.distributed.get_rank()]).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    if resume:
        state = dict(zip(("model", "optim"), get_state_dict(model, opt)))
        d.load_checkpoint(state, d.latest_checkpoint(root))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        steps(0, save_at)
        d.save_checkpoint(dict(zip(("model", "optim"), get_state_dict(model, opt))), root, save_at)
    losses = steps(save_at, total)
    out = _full_planes(model)
    out.update({f"{n}/master": (m.full_tensor().detach().cpu().clone(),) for n, m in opt.masters.items()})
    return losses, out


@pytest.mark.parametrize("recipe_name", BLOCK_RECIPES)
def test_resume_where_shards_split_blocks_is_bit_exact(pools, tmp_path, recipe_name):
    root = str(tmp_path / "ckpt")
    world = _ranks(4)
    losses, final = pools[world].run(_resume_run, recipe_name, root, 3, 6, False)[0]
    resumed_losses, resumed = pools[world].run(_resume_run, recipe_name, root, 3, 6, True)[0]
    assert resumed_losses == losses
    assert resumed.keys() == final.keys()
    for key, tensors in final.items():
        for a, b in zip(tensors, resumed[key], strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), key
