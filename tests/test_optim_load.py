"""Trust, round 3 (issue 39): ``MasterWeightOptimizer.load_state_dict`` checks every master and
moment before writing any, and takes the same decision on every rank; a refused
``add_param_group`` leaves the optimizer as it was; a gradient of the wrong layout is named.

Single-process cases use the optimizer as a plain torch optimizer; the sharded ones run on real
gloo ranks (FSDP2 over a 1-D mesh). Every refusal compares every FP8 byte, scale, master,
high-precision parameter, inner-optimizer state and scaling state as bytes before and after."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dtensor_fp8 as d
from dtensor_fp8.placement import local_tensor
from dist_utils import DEVICE, WORLD_SIZES
from test_optim import _batch, _net, _train

WORLD = WORLD_SIZES[0]
needs_two = pytest.mark.skipif(WORLD < 2, reason="needs a second rank")


def _bytes(t):
    return local_tensor(t).detach().reshape(-1).contiguous().view(torch.uint8).cpu().clone()


def _everything(net, opt) -> dict:
    out = {}
    for name, p in net.named_parameters():
        q = local_tensor(p)
        if isinstance(q, d.QuantizedTensor):
            for usage, plane in q.planes.items():
                out[f"{name}/{usage}"] = _bytes(plane.data)
                out[f"{name}/{usage}/scale"] = _bytes(plane.scale_inv)
        else:
            out[name] = _bytes(p)
    for name, m in opt.masters.items():
        out[f"{name}/master"] = _bytes(m)
    for i, state in enumerate(opt.inner.state.values()):
        for key, value in state.items():
            out[f"inner/{i}/{key}"] = _bytes(value) if isinstance(value, torch.Tensor) else torch.tensor(value)
    for (name, usage), fields in opt.scaling_states.items():
        for key, value in fields.items():
            out[f"scaling/{name}/{usage}/{key}"] = _bytes(value)
    out["groups"] = torch.tensor([len(opt.param_groups), len(opt.inner.param_groups)])
    return out


def _changed(before, after):
    assert before.keys() == after.keys(), (before.keys() ^ after.keys())
    return sorted(k for k in before if not torch.equal(before[k], after[k]))


def _trained(recipe="delayed"):
    net = _net(recipe=d.RECIPES[recipe])
    opt = d.MasterWeightOptimizer(net, torch.optim.AdamW, lr=1e-2)
    _train(net, opt, 2)
    return net, opt


def _pid(state, fqn_index):
    return list(state["state"])[fqn_index]


# ---- load_state_dict: all or nothing ----------------------------------------------------------------------------
def _saved(edit):
    """A state dict of a trained optimizer over the same model (other values), edited."""
    net, opt = _trained()
    _train(net, opt, 1, start=5)
    state = copy.deepcopy(opt.state_dict())
    ids = {name: i for i, name in enumerate(n for n, _ in net.named_parameters())}
    edit(state["state"], ids)
    return state


CASES = {  # name -> (edit of the saved state, error class, what the message names)
    "wrong-shape-last": (lambda s, i: s[i["fc2.weight"]].__setitem__("master", torch.zeros(3, 3)),
                         ValueError, ["fc2.weight", "master", "(3, 3)", "(64, 128)"]),
    "broadcast": (lambda s, i: s[i["fc1.weight"]].__setitem__("master", torch.zeros(64)),
                  ValueError, ["fc1.weight", "master", "(64,)", "(128, 64)"]),
    "moment-shape": (lambda s, i: s[i["fc2.bias"]].__setitem__("exp_avg", torch.zeros(1)),
                     ValueError, ["fc2.bias", "exp_avg", "(1,)", "(64,)"]),
    "nan-moment": (lambda s, i: s[i["fc2.weight"]]["exp_avg_sq"].__setitem__((0, 0), float("nan")),
                   FloatingPointError, ["exp_avg_sq of fc2.weight", "NaN or Inf"]),
    "int-master": (lambda s, i: s[i["fc1.weight"]].__setitem__("master", torch.zeros(128, 64, dtype=torch.int32)),
                   ValueError, ["fc1.weight", "master", "torch.int32"]),
    "overflow-moment": (lambda s, i: s[i["fc1.bias"]].__setitem__("exp_avg", torch.full((128,), 1e300, dtype=torch.float64)),
                        FloatingPointError, ["exp_avg of fc1.bias", "beyond torch.float32's range"]),
    # an optimizer state dict of the older layout (the weight scaling state under the optimizer) still loads it
    "nan-scaling": (lambda s, i: s[i["fc2.weight"]].__setitem__(
                        "rowwise_amax_history", torch.full((d.RECIPES["delayed"].amax_history_len,), float("inf"))),
                    FloatingPointError, ["rowwise_amax_history of fc2.weight", "NaN or Inf"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_refused_load_changes_nothing(case):
    """A wrong shape in the last master (the first masters used to be overwritten already), a
    (64,) master that broadcast into a (128, 64) one, a moment of the wrong shape, a NaN Adam
    moment (it loaded, and the next step wrote NaN FP8 bytes and blamed the gradients), a float64
    moment that would be Inf as float32, an integer master, an Inf amax history: refused naming the entry, with everything as it was; a step
    after it works."""
    edit, error, parts = CASES[case]
    state = _saved(edit)
    net, opt = _trained()
    before = _everything(net, opt)
    with pytest.raises(error) as caught:
        opt.load_state_dict(state)
    assert all(part in str(caught.value) for part in parts), str(caught.value)
    assert "Nothing was loaded" in str(caught.value), str(caught.value)
    assert _changed(before, _everything(net, opt)) == []
    _train(net, opt, 1, start=9)  # still a working optimizer


def test_a_good_state_dict_loads_whole():
    net, opt = _trained()
    state = _saved(lambda s, i: None)
    opt.load_state_dict(state)
    after = copy.deepcopy(opt.state_dict())
    for pid, saved in state["state"].items():
        for key, value in saved.items():
            assert torch.equal(torch.as_tensor(after["state"][pid][key]), torch.as_tensor(value)), (pid, key)


# ---- the same decision on every rank -------------------------------------------------------------------------------
def _sharded(recipe="mxfp8", hsdp=False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    net = _net(recipe=d.RECIPES[recipe]).to(DEVICE)
    world = dist.get_world_size()
    mesh = init_device_mesh(DEVICE, (2, world // 2), mesh_dim_names=("replicate", "shard")) if hsdp else \
        init_device_mesh(DEVICE, (world,))
    fully_shard(net, mesh=mesh)
    opt = d.MasterWeightOptimizer(net, torch.optim.AdamW, lr=1e-2)
    net(_batch(0).to(DEVICE)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    return net, opt


def _load_sharded(case, hsdp=False):
    net, opt = _sharded(hsdp=hsdp)
    state = copy.deepcopy(opt.state_dict())
    ids = {name: i for i, name in enumerate(n for n, _ in net.named_parameters())}
    fc1 = state["state"][ids["fc1.weight"]]
    if case == "half-size-full-master":  # a plain tensor of the local shard's shape: not the (128, 64) master
        fc1["master"] = fc1["master"].to_local().clone()
    elif case == "nan-moment-on-last-rank":
        if dist.get_rank() == dist.get_world_size() - 1:
            fc1["exp_avg"].to_local()[0, 0] = float("nan")
    elif case == "full-tensors":  # full tensors of the global shapes: each rank keeps its shard
        for saved in state["state"].values():
            for key, value in saved.items():
                if isinstance(value, torch.Tensor) and hasattr(value, "full_tensor"):
                    saved[key] = value.full_tensor()
    before = _everything(net, opt)
    try:
        opt.load_state_dict(state)
    except Exception as err:  # noqa: BLE001  (returned to the test)
        return type(err).__name__, str(err), _changed(before, _everything(net, opt))
    return None, None, _changed(before, _everything(net, opt))


@needs_two
@pytest.mark.parametrize("case,kind,parts", [
    ("half-size-full-master", "ValueError", ["fc1.weight", "(64, 64)", "(128, 64)"]),
    ("nan-moment-on-last-rank", "FloatingPointError", ["exp_avg of fc1.weight", "NaN or Inf", f"rank {WORLD - 1}"]),
])
def test_every_rank_refuses_alike_and_changes_nothing(pools, case, kind, parts):
    """A full master of half the size (the local shard's shape) was taken as each rank's shard;
    a NaN moment in one rank's shard only: every rank raises the same error, nothing changed."""
    results = pools[WORLD].run(_load_sharded, case)
    assert len({msg for _, msg, _ in results}) == 1, results
    for error, msg, changed in results:
        assert error == kind and all(part in msg for part in parts), (error, msg)
        assert changed == [], changed


@pytest.mark.skipif(4 not in WORLD_SIZES, reason="needs 4 ranks")
def test_every_rank_of_an_hsdp_mesh_refuses_alike(pools):
    """4 ranks, HSDP (2 replicas x 2 shards): a NaN moment on the last rank only is refused by all
    four; full tensors load."""
    results = pools[4].run(_load_sharded, "nan-moment-on-last-rank", True)
    assert len({msg for _, msg, _ in results}) == 1, results
    for error, msg, changed in results:
        assert error == "FloatingPointError" and "exp_avg of fc1.weight holds NaN or Inf (on rank 3)" in msg, msg
        assert changed == [], changed
    for error, msg, _ in pools[4].run(_load_sharded, "full-tensors", True):
        assert error is None, msg


@needs_two
def test_full_tensors_of_the_global_shapes_load_as_each_ranks_shard(pools):
    for error, msg, _ in pools[WORLD].run(_load_sharded, "full-tensors"):
        assert error is None, msg


# ---- add_param_group -------------------------------------------------------------------------------------------
def test_a_refused_add_param_group_leaves_the_optimizer_as_it_was():
    """An FP8 parameter, a tensor that is not the model's, a repeated parameter: refused, and the
    optimizer keeps its groups (torch's add_param_group had appended the group already, and every
    later step raised "param_groups went from 1 to 2 groups")."""
    net = _net()
    opt = d.MasterWeightOptimizer(net, torch.optim.AdamW, [net.fc1.bias, net.norm.weight, net.norm.bias], lr=1e-2)
    _train(net, opt, 1)
    before = _everything(net, opt)
    for group, problem in [({"params": [net.fc1.weight]}, "fc1.weight is an FP8 parameter"),
                           ({"params": [nn.Parameter(torch.zeros(3))]}, "not a parameter of the model"),
                           ({"params": [net.fc1.bias]}, "more than one parameter group")]:
        with pytest.raises(ValueError, match=problem):
            opt.add_param_group(group)
        assert _changed(before, _everything(net, opt)) == []
        assert len(opt.param_groups) == len(opt.inner.param_groups) == 1
    _train(net, opt, 1, start=1)  # the optimizer still steps
    opt.add_param_group({"params": [net.fc2.bias], "lr": 0.5})
    _train(net, opt, 1, start=2)
    assert len(opt.param_groups) == len(opt.inner.param_groups) == 2


# ---- gradients of the wrong layout ------------------------------------------------------------------------------
def _replicate_gradient():
    from torch.distributed.tensor import DTensor, Replicate

    net, opt = _sharded()
    bias = net.fc1.bias
    bias.grad = DTensor.from_local(torch.ones(bias.shape, device=DEVICE), bias.device_mesh, [Replicate()])
    before = _everything(net, opt)
    try:
        opt.step()
    except Exception as err:  # noqa: BLE001
        return type(err).__name__, str(err), _changed(before, _everything(net, opt))
    return None, None, None


@needs_two
def test_a_gradient_laid_out_unlike_its_parameter_is_named(pools):
    """A gradient set as a Replicate DTensor on a Shard(0) parameter: torch said only "attempting
    to assign a gradient of size [128] to a tensor of size [64]"; the error names the parameter,
    both layouts and the fix, and the step changes nothing."""
    for error, msg, changed in pools[WORLD].run(_replicate_gradient):
        assert error == "ValueError", msg
        assert "fc1.bias" in msg and "Replicate()" in msg and "Shard(dim=0)" in msg and "redistribute" in msg, msg
        assert changed == [], changed
