"""DCP of FP8 parameters saved under (dp=2, tp=2), loaded under dp=4 and on one rank: bit-exact."""

import pytest
import torch

import dtensor_fp8 as d
from dist_utils import WORLD_SIZES
from test_checkpoint import _assert_same, _full_planes
from test_placement import RECIPES
from test_tp import _batch, _build


def _save_2d(root, recipe_name):
    model, _ = _build("mlp", RECIPES[recipe_name], "2d")
    opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-2)
    for step in range(2):
        x, target = _batch("mlp", step)
        (model(x) - target).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    d.save_checkpoint({"model": model.state_dict(), "optim": opt.state_dict()}, root, 2)
    return _full_planes(model, opt)


def _load_1d(root, recipe_name):
    model, _ = _build("mlp", RECIPES[recipe_name], "1d")
    opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-2)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    d.load_checkpoint(state, d.latest_checkpoint(root))
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    return _full_planes(model, opt)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_save_2d_load_dp4_and_one_rank(pools, tmp_path, recipe_name):
    if 4 not in WORLD_SIZES:
        pytest.skip("needs 4 ranks")
    root = str(tmp_path / "ckpt")
    expected = pools[4].run(_save_2d, root, recipe_name)[0]
    for planes in pools[4].run(_load_1d, root, recipe_name):
        _assert_same(planes, expected)
    _assert_same(pools[1].run(_load_1d, root, recipe_name)[0], expected)
