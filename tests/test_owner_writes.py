"""Every value write of an FP8 weight goes through its owner (``dtensor_fp8/param_writes.py``), on
real gloo ranks, for every recipe, compared byte for byte with quantizing the full
high-precision tensor in one process:

* ``weight.copy_(values)`` into a weight sharded by FSDP2 or by TP: per-tensor scales from the
  amax over the weight's group, not each shard's own;
* after the optimizer exists, ``copy_`` / ``load_hp_state_dict`` / ``load_hp_checkpoint`` without
  ``optimizer=``: the masters follow, so a step (learning rate 0) keeps the written weights; so
  do they a ``model.load_state_dict`` of FP8 planes without the optimizer's state;
* ``to_empty`` after the optimizer: refused, naming the fix, with the FP8 bytes kept;
* a meta-built weight never written after ``to_empty``: named when the optimizer is built.
"""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import dtensor_fp8 as d
from conftest import assert_bytes_equal
from dist_utils import DEVICE, WORLD_SIZES

RECIPES = d.RECIPES
DIM = 256  # 128-row / 128-col shards at 2 ranks: whole blocks of every recipe

needs_two = pytest.mark.skipif(2 not in WORLD_SIZES, reason="needs 2 ranks")


def _values(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # rows spread over 4 decades: the two halves' amaxes differ by far (a shard's own amax is wrong)
    return (torch.randn(DIM, DIM, generator=g) * torch.logspace(-2, 2, DIM)[:, None]).to(DEVICE)


def _model(recipe_name: str, layout: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False)).to(DEVICE)
    d.quantize_module_(model, RECIPES[recipe_name])
    mesh = init_device_mesh(DEVICE, (torch.distributed.get_world_size(),))
    if layout == "tp":
        d.parallelize_module(model, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    else:
        fully_shard(model, mesh=mesh)
    return model


def _assert_is_quantized(weight, full: torch.Tensor, recipe_name: str, what: str) -> None:
    want = d.quantize(full, RECIPES[recipe_name])
    got = d.for_usage(weight.detach(), *want.usages).full_tensor()
    for usage, plane in want.planes.items():
        assert_bytes_equal(got.planes[usage].data, plane.data, f"{what}/{recipe_name}/{usage}/data")
        assert_bytes_equal(got.planes[usage].scale_inv, plane.scale_inv, f"{what}/{recipe_name}/{usage}/scale_inv")


def _copy_in(weight, full: torch.Tensor) -> None:
    with torch.no_grad():
        weight.copy_(distribute_tensor(full, weight.device_mesh, weight.placements, src_data_rank=None))


def _copy_gives_quantized_full_tensor(recipe_name: str, layout: str) -> None:
    model = _model(recipe_name, layout)
    for i, layer in enumerate(model):
        full = _values(10 + i)
        _copy_in(layer.weight, full)
        _assert_is_quantized(layer.weight, full, recipe_name, f"copy_ into {layout} {i}.weight")


@needs_two
@pytest.mark.parametrize("layout", ["fsdp", "tp"])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_copy_into_a_sharded_weight_is_the_quantized_full_tensor(pools, recipe_name, layout):
    pools[2].run(_copy_gives_quantized_full_tensor, recipe_name, layout)


def _step_with_lr_zero(model, opt) -> None:
    x = torch.randn(4, DIM, device=DEVICE)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _writes_after_the_optimizer(recipe_name: str, layout: str, how: str, path: str) -> None:
    model = _model(recipe_name, layout)
    opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=0.0, weight_decay=0.0)
    _step_with_lr_zero(model, opt)  # a trained model: the masters hold their own values
    new = {f"{i}.weight": _values(20 + i) for i in range(2)}
    if how == "copy_":
        for i, layer in enumerate(model):
            _copy_in(layer.weight, new[f"{i}.weight"])
    elif how == "load_state_dict":  # FP8 planes of another model (a checkpoint's entries), without its optimizer's
        other = _model(recipe_name, layout)
        for i, layer in enumerate(other):
            _copy_in(layer.weight, new[f"{i}.weight"])
        model.load_state_dict(other.state_dict())
        # the masters follow the loaded weights (their FP8 values: all the entries hold)
        new = {f"{i}.weight": layer.weight.detach().full_tensor().dequantize(torch.float32) for i, layer in enumerate(other)}
    elif how == "load_hp_state_dict":
        d.load_hp_state_dict(model, new)
    else:
        if torch.distributed.get_rank() == 0:
            dcp.save({k: v.cpu() for k, v in new.items()}, checkpoint_id=path, no_dist=True)
        torch.distributed.barrier(group=torch.distributed.group.WORLD)
        d.load_hp_checkpoint(model, path)
    if how != "load_state_dict":  # (a load of FP8 bytes: the masters follow them at the next step)
        for name, full in new.items():
            assert torch.equal(opt.masters[name].detach().full_tensor(), full), f"{how}: master of {name} did not follow"
    _step_with_lr_zero(model, opt)  # requantizes every weight from its master
    for name, full in new.items():
        assert torch.equal(opt.masters[name].detach().full_tensor(), full), f"{how}: master of {name} moved"
    if how == "load_state_dict":  # requantizing FP8 values need not give their bytes back (current scaling)
        return
    for i, layer in enumerate(model):
        _assert_is_quantized(layer.weight, new[f"{i}.weight"], recipe_name, f"{how} then a step, {i}.weight")


@needs_two
@pytest.mark.parametrize("how", ["copy_", "load_hp_state_dict", "load_hp_checkpoint", "load_state_dict"])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_masters_follow_writes_after_the_optimizer(pools, recipe_name, how, tmp_path):
    pools[2].run(_writes_after_the_optimizer, recipe_name, "fsdp", how, str(tmp_path / "hp"))


@needs_two
@pytest.mark.parametrize("recipe_name", ["current", "mxfp8"])
def test_masters_follow_copy_under_tp(pools, recipe_name, tmp_path):
    pools[2].run(_writes_after_the_optimizer, recipe_name, "tp", "copy_", str(tmp_path / "hp"))


def _to_empty_after_the_optimizer(recipe_name: str) -> None:
    model = _model(recipe_name, "fsdp")
    opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-3)
    before = [m.detach().full_tensor() for m in opt.masters.values()]
    with pytest.raises(d.RecipeError, match=r"to_empty.*MasterWeightOptimizer exists.*before building"):
        model.to_empty(device=DEVICE)
    for layer, master in zip(model, before):
        _assert_is_quantized(layer.weight, master, recipe_name, "after a refused to_empty")


@needs_two
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_to_empty_after_the_optimizer_is_refused(pools, recipe_name):
    pools[2].run(_to_empty_after_the_optimizer, recipe_name)


def _never_written(recipe_name: str, build: str) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False))
    d.quantize_module_(model, RECIPES[recipe_name])
    fully_shard(model, mesh=init_device_mesh(DEVICE, (torch.distributed.get_world_size(),)))
    model.to_empty(device=DEVICE)
    model[0].reset_parameters()  # the user's init skips model[1]
    pattern = rf"never written after model.to_empty.*1\.weight \({DIM}, {DIM}\) \({RECIPES[recipe_name].name}\)"
    with pytest.raises(d.RecipeError, match=pattern) as err:
        if build == "optimizer":
            d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-3)
        else:
            d.finish_init_(model)
    assert "0.weight" not in str(err.value)
    with torch.no_grad():  # written now: the optimizer builds, with the values written
        model[1].weight.copy_(distribute_tensor(_values(3), model[1].weight.device_mesh, model[1].weight.placements,
                                                src_data_rank=None))
    opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-3)
    _assert_is_quantized(model[1].weight, _values(3), recipe_name, "a meta-built weight written by copy_")
    assert torch.equal(opt.masters["1.weight"].detach().full_tensor(), _values(3))


@needs_two
@pytest.mark.parametrize("build", ["optimizer", "finish_init_"])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_a_weight_never_written_after_to_empty_is_named(pools, recipe_name, build):
    pools[2].run(_never_written, recipe_name, build)
