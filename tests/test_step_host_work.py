"""What an optimizer step decides once and repeats, or skips, instead of redoing it every step.

The requantization plan is decided once per set of tensors and repeated: under
``fully_shard`` (where torch >= 2.13's ``DTensor.to_local()`` of a parameter is a new view at every
call) a step with unchanged tensors reuses the plan it made before, writes the same bytes as a plan
made afresh at every step, and a replaced plane makes a new plan that writes into the new plane.
Per-tensor recipes at world > 1 all-reduce their amax, so this is the eager path a multi-GPU run
takes every step (no CUDA graph). The once-per-step operand scaling update walks only weights whose
recipe keeps operand state, which each recipe says of itself (``Recipe.keeps_operand_state``)."""

import copy

import pytest
import torch
from torch import nn

import dtensor_fp8 as d
from dtensor_fp8._compat import dtensor_local
from dtensor_fp8.formats.base import Plane
from dtensor_fp8.requantize import GraphedRequantize

DIM = 64
STEPS = 3


def _planes_and_states(net, opt) -> dict:
    """Every local plane tensor and weight scaling state, as uint8 bytes, by name."""
    out = {}
    for name, p in net.named_parameters():
        q = p.to_local()
        if isinstance(q, d.QuantizedTensor):
            for usage, plane in q.planes.items():
                out[f"{name}/{usage}/data"] = plane.data.view(torch.uint8).clone()
                out[f"{name}/{usage}/scale_inv"] = plane.scale_inv.contiguous().view(torch.uint8).clone()
    for (name, usage), state in opt.scaling_states.items():
        for field, t in state.items():
            out[f"{name}/{usage}/{field}"] = t.contiguous().view(torch.uint8).clone()
    return out


def _run_both(recipe_name: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from dist_utils import DEVICE

    torch.manual_seed(0)
    base = d.quantize_module_(nn.Sequential(nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(2 * DIM, DIM, bias=False)),
                              d.RECIPES[recipe_name])
    mesh = init_device_mesh(DEVICE, (dist.get_world_size(),))
    kept_net, fresh_net = copy.deepcopy(base).to(DEVICE), copy.deepcopy(base).to(DEVICE)
    for net in (kept_net, fresh_net):
        fully_shard(net, mesh=mesh)
    kept = d.MasterWeightOptimizer(kept_net, torch.optim.AdamW, lr=1e-2)
    fresh = d.MasterWeightOptimizer(fresh_net, torch.optim.AdamW, lr=1e-2)
    out = {"plan_kept": [], "differs": [], "new_plane_written": None}

    def step(i):
        x = torch.randn(8, DIM, generator=torch.Generator().manual_seed(100 * dist.get_rank() + i)).to(DEVICE)
        for net, opt in ((kept_net, kept), (fresh_net, fresh)):
            net(x).pow(2).mean().backward()
            if opt is fresh:  # a plan made afresh for this step (what every step did before)
                opt._requantize = GraphedRequantize(False)
            opt.step()
            opt.zero_grad()
        a, b = _planes_and_states(kept_net, kept), _planes_and_states(fresh_net, fresh)
        assert a.keys() == b.keys()
        out["differs"] += [f"step {i}: {k}" for k in a if not torch.equal(a[k], b[k])]

    step(0)
    plan = kept._requantize._plan
    out["plan_made"] = plan is not None
    for i in range(1, STEPS):
        step(i)
        out["plan_kept"].append(kept._requantize._plan is plan)
    # A replaced plane (new tensors, same values) in both runs: the kept plan wrote into the old
    # tensors, so it must give way to a new one writing into the new plane.
    for net in (kept_net, fresh_net):
        q = dtensor_local(net[0].weight)  # the shard itself (to_local() may be a new view of it)
        usage, plane = next(iter(q.planes.items()))
        q.repoint_({**q.planes, usage: Plane(plane.data.clone(), plane.scale_inv.clone())}, q.usages)
    new_data = dtensor_local(kept_net[0].weight).planes[usage].data
    before = new_data.view(torch.uint8).clone()
    step(STEPS)
    out["plan_renewed"] = kept._requantize._plan is not plan
    out["new_plane_written"] = not torch.equal(new_data.view(torch.uint8), before)
    return out


@pytest.mark.parametrize("recipe_name", ["current", "delayed", "blockwise2d"])
def test_a_kept_plan_writes_what_a_fresh_one_writes(pools, recipe_name):
    from dist_utils import WORLD_SIZES

    for out in pools[WORLD_SIZES[0]].run(_run_both, recipe_name):
        assert out["differs"] == [], out["differs"][:8]
        assert out["plan_made"] and out["plan_kept"] == [True] * (STEPS - 1), out
        assert out["plan_renewed"] and out["new_plane_written"], out


@pytest.mark.parametrize("name", list(d.RECIPES))
def test_each_recipe_says_whether_its_operands_keep_state(name):
    """``keeps_operand_state`` is what ``operand_state`` does, for the weight's recipe and its GEMM
    operands' recipes; ``operands_keep_state`` (the update's filter) is true exactly where a weight
    of the recipe gets operand states."""
    from dtensor_fp8.operand_scaling import operands_keep_state

    recipe = d.RECIPES[name]
    gemm = recipe.gemm_recipe()
    operands = [recipe] + ([gemm.input, gemm.grad] if gemm is not None else [])
    for r in operands:
        assert r.keeps_operand_state == (r.operand_state(torch.device("cpu")) is not None), r
    q = d.quantize(torch.randn(64, 64), recipe)
    states = q.param_state.scaling.ensure_operand_states(recipe, q.device)
    assert operands_keep_state(recipe) == bool(states), (name, sorted(states))
