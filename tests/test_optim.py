"""``MasterWeightOptimizer`` is what torch's optimizer utilities expect: a ``torch.optim.Optimizer``
with the user's param groups, LR schedulers, hooks, closures and torch's state-dict format."""

import copy
import math

import pytest
import torch
from torch import nn

import dtensor_fp8 as d

DIM = 64


class _Net(nn.Module):
    """FP8-able Linear weights, high-precision biases, a norm and an embedding: every kind of group."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, DIM)
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.norm = nn.LayerNorm(2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)

    def forward(self, tokens):
        return self.fc2(torch.relu(self.norm(self.fc1(self.embed(tokens)))))


def _net(seed=0, fp8=True, recipe=d.RECIPES["mxfp8"]):
    torch.manual_seed(seed)
    net = _Net()
    return d.quantize_module_(net, recipe) if fp8 else net


def _groups(net):
    """No weight decay for norms, biases and the embedding; its own lr for the embedding."""
    decay = [p for n, p in net.named_parameters() if n.endswith("weight") and n.startswith("fc")]
    no_decay = [p for n, p in net.named_parameters() if n.endswith("bias") or n.startswith("norm")]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0},
            {"params": [net.embed.weight], "lr": 3e-2, "weight_decay": 0.0}]


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(16, (8, 4), generator=g)


def _train(net, opt, steps, sched=None, start=0):
    losses = []
    for step in range(start, start + steps):
        loss = net(_batch(step)).pow(2).mean()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _warmup_cosine(total=10, warmup=3):
    return lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup)))


def _snapshot(net, opt):
    """Every FP8 byte, scale, master and high-precision parameter, as bytes."""
    out = {}
    for name, p in net.named_parameters():
        if isinstance(p, d.QuantizedTensor):
            for usage, plane in p.planes.items():
                out[f"{name}/{usage}"] = plane.data.view(torch.uint8).clone()
                out[f"{name}/{usage}/scale"] = plane.scale_inv.contiguous().view(torch.uint8).clone()
        else:
            out[name] = p.detach().clone().view(torch.uint8)
    for name, m in opt.masters.items():
        out[f"{name}/master"] = m.detach().clone().view(torch.uint8)
    return out


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_is_a_torch_optimizer_with_the_users_groups():
    net = _net()
    opt = d.MasterWeightOptimizer(net, torch.optim.AdamW, _groups(net), lr=1e-2, weight_decay=0.1)
    assert isinstance(opt, torch.optim.Optimizer)
    assert [len(g["params"]) for g in opt.param_groups] == [2, 4, 1]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0, 0.0]
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 1e-2, 3e-2]
    # Every hyper-parameter of the inner class is in the groups (what a checkpoint restores).
    assert {"betas", "eps", "amsgrad"} <= set(opt.param_groups[0])
    # The groups hold the model's own parameters, FP8 ones included.
    assert opt.param_groups[0]["params"][0] is net.fc1.weight
    assert isinstance(opt.param_groups[0]["params"][0], d.QuantizedTensor)


def test_high_precision_parameters_step_exactly_as_torch_adamw():
    """Without FP8 parameters the optimizer is torch's AdamW, bit for bit, groups and schedule included."""
    ours_net, ref_net = _net(fp8=False), _net(fp8=False)
    ours = d.MasterWeightOptimizer(ours_net, torch.optim.AdamW, _groups(ours_net), lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(_groups(ref_net), lr=1e-2, weight_decay=0.1)
    s1 = torch.optim.lr_scheduler.LambdaLR(ours, _warmup_cosine())
    s2 = torch.optim.lr_scheduler.LambdaLR(ref, _warmup_cosine())
    assert _train(ours_net, ours, 6, s1) == _train(ref_net, ref, 6, s2)
    for (n, a), (_, b) in zip(ours_net.named_parameters(), ref_net.named_parameters()):
        assert torch.equal(a, b), n


def test_masters_step_exactly_as_torch_adamw_on_fp32_copies():
    """Given the same gradients, each master moves as torch's AdamW moves an fp32 copy of the init,
    and the FP8 weight is then the recipe's quantization of that master."""
    recipe = d.RECIPES["blockwise1d"]
    torch.manual_seed(0)
    layer = nn.Linear(DIM, 2 * DIM, bias=False)
    ref = nn.Parameter(layer.weight.detach().clone())
    d.quantize_module_(layer, recipe)
    opt = d.MasterWeightOptimizer(layer, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine())
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, _warmup_cosine())
    for step in range(5):
        grad = torch.randn(2 * DIM, DIM, generator=torch.Generator().manual_seed(step))
        layer.weight.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        ref_opt.step()
        sched.step()
        ref_sched.step()
        assert torch.equal(opt.masters["weight"], ref), step
        expected = d.quantize(ref.detach(), recipe)
        for usage, plane in layer.weight.planes.items():
            assert torch.equal(plane.data.view(torch.uint8), expected.plane(usage).data.view(torch.uint8)), (step, usage)


def test_a_manual_lr_change_takes_effect_at_the_next_step():
    def run(change):
        torch.manual_seed(0)
        layer = d.quantize_module_(nn.Linear(DIM, DIM, bias=False), d.RECIPES["current"])
        opt = d.MasterWeightOptimizer(layer, torch.optim.SGD, lr=0.1)
        for step in range(3):
            layer.weight.grad = torch.ones(DIM, DIM)
            if step == 1 and change:
                opt.param_groups[0]["lr"] = 0.0
            opt.step()
            if step == 1:
                moved = opt.masters["weight"].detach().clone()
            if step == 0:
                before = opt.masters["weight"].detach().clone()
        return before, moved

    before, frozen = run(change=True)
    assert torch.equal(before, frozen)  # lr 0 at step 1: the master did not move
    before, moved = run(change=False)
    assert not torch.equal(before, moved)


def test_schedulers_drive_every_group():
    net = _net()
    opt = d.MasterWeightOptimizer(net, torch.optim.AdamW, _groups(net), lr=1e-2)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=2)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[2])
    seen = []
    opt.inner.register_step_pre_hook(lambda inner, *_: seen.append([g["lr"] for g in inner.param_groups]))
    _train(net, opt, 5, sched)
    outer = []
    ref_net = _net(fp8=False)
    ref = torch.optim.AdamW(_groups(ref_net), lr=1e-2)
    w2 = torch.optim.lr_scheduler.LinearLR(ref, start_factor=0.1, total_iters=2)
    c2 = torch.optim.lr_scheduler.CosineAnnealingLR(ref, T_max=4)
    s2 = torch.optim.lr_scheduler.SequentialLR(ref, [w2, c2], milestones=[2])
    for _ in range(5):
        outer.append([g["lr"] for g in ref.param_groups])
        ref.step()
        s2.step()
    assert seen == outer  # the inner optimizer stepped with the scheduler's learning rates


def test_step_hooks_closure_and_zero_grad():
    net = _net()
    opt = d.MasterWeightOptimizer(net, torch.optim.AdamW, lr=1e-2)
    calls = []
    opt.register_step_pre_hook(lambda o, *_: calls.append("pre"))
    opt.register_step_post_hook(lambda o, *_: calls.append("post"))

    def closure():
        opt.zero_grad()
        loss = net(_batch(0)).pow(2).mean()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert calls == ["pre", "post"] and loss.item() > 0
    assert net.fc1.weight.grad is not None
    opt.zero_grad(set_to_none=False)
    assert torch.count_nonzero(net.fc1.weight.grad) == 0 and torch.count_nonzero(net.fc1.bias.grad) == 0
    opt.zero_grad()
    assert net.fc1.weight.grad is None and net.fc1.bias.grad is None


def test_state_shows_masters_and_inner_state_per_parameter():
    net = _net(recipe=d.RECIPES["delayed"])
    opt = d.MasterWeightOptimizer(net, torch.optim.AdamW, lr=1e-2)
    state = opt.state[net.fc1.weight]  # before any step: the state a checkpoint will hold
    # the weight scaling state (delayed scaling) is the weight's owner's, saved in its model entry
    assert set(state) == {"master", "step", "exp_avg", "exp_avg_sq"}
    assert {"rowwise_amax_history", "rowwise_scale"} <= set(net.state_dict()["fc1.weight"])
    assert state["master"].dtype == torch.float32 and state["exp_avg"].shape == net.fc1.weight.shape
    assert float(state["step"]) == 0.0
    assert set(opt.state[net.fc1.bias]) == {"step", "exp_avg", "exp_avg_sq"}
    _train(net, opt, 2)
    assert float(opt.state[net.fc1.weight]["step"]) == 2.0


@pytest.mark.parametrize("optimizer_cls,kwargs", [
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1}),
    (torch.optim.SGD, {"lr": 1e-1, "momentum": 0.9}),
    (torch.optim.RMSprop, {"lr": 1e-3}),
    (torch.optim.Adagrad, {"lr": 1e-2}),
], ids=lambda v: v.__name__ if isinstance(v, type) else "")
def test_reading_state_before_the_first_step_changes_nothing(optimizer_cls, kwargs):
    """A fresh optimizer's state exists for checkpointing from the start; creating it leaves the
    training that follows bit-identical to one that never read it."""
    a_net, b_net = _net(), _net()
    a = d.MasterWeightOptimizer(a_net, optimizer_cls, **kwargs)
    b = d.MasterWeightOptimizer(b_net, optimizer_cls, **kwargs)
    a.state_dict()  # creates the state (as torch's get_state_dict would)
    assert _train(a_net, a, 4) == _train(b_net, b, 4)
    _assert_same(_snapshot(a_net, a), _snapshot(b_net, b))


@pytest.mark.parametrize("recipe_name", list(d.RECIPES))
def test_state_dict_round_trip_continues_exactly(recipe_name):
    """torch's format: a fresh optimizer (and model) loading a state dict continue bit-identically."""
    recipe = d.RECIPES[recipe_name]
    net = _net(recipe=recipe)
    opt = d.MasterWeightOptimizer(net, torch.optim.AdamW, _groups(net), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine())
    _train(net, opt, 3, sched)
    saved = {"model": {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in net.state_dict().items()},
             "optim": copy.deepcopy(opt.state_dict()), "sched": sched.state_dict()}  # torch's are references
    assert all(isinstance(k, int) for k in saved["optim"]["state"])
    expected = _train(net, opt, 4, sched, start=3)
    after = _snapshot(net, opt)

    fresh = _net(seed=1, recipe=recipe)
    fresh_opt = d.MasterWeightOptimizer(fresh, torch.optim.AdamW, _groups(fresh), lr=5.0)
    fresh_sched = torch.optim.lr_scheduler.LambdaLR(fresh_opt, _warmup_cosine())
    fresh.load_state_dict(saved["model"])
    fresh_opt.load_state_dict(saved["optim"])
    fresh_sched.load_state_dict(saved["sched"])
    assert [g["lr"] for g in fresh_opt.param_groups] == [g["lr"] for g in saved["optim"]["param_groups"]]
    assert _train(fresh, fresh_opt, 4, fresh_sched, start=3) == expected
    _assert_same(_snapshot(fresh, fresh_opt), after)


def test_load_state_dict_refuses_a_state_dict_of_other_groups():
    net = _net()
    opt = d.MasterWeightOptimizer(net, torch.optim.AdamW, _groups(net), lr=1e-2)
    other = d.MasterWeightOptimizer(_net(), torch.optim.AdamW, lr=1e-2)
    with pytest.raises(ValueError, match="3 param groups|1 param groups"):
        opt.load_state_dict(other.state_dict())
    plain_net = _net(fp8=False)
    plain = torch.optim.AdamW(_groups(plain_net), lr=1e-2)
    _train(plain_net, plain, 1)
    with pytest.raises(KeyError, match="no 'master' for FP8 parameter fc1.weight"):
        opt.load_state_dict(plain.state_dict())


def test_bad_arguments_name_the_fix():
    net = _net()
    with pytest.raises(TypeError, match="torch.optim.Optimizer class"):
        d.MasterWeightOptimizer(net, torch.optim.AdamW(net.parameters()))
    with pytest.raises(ValueError, match="not a parameter of the model"):
        d.MasterWeightOptimizer(net, torch.optim.AdamW, [nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match="more than one parameter group"):
        d.MasterWeightOptimizer(net, torch.optim.AdamW, [{"params": [net.fc1.bias]}, {"params": [net.fc1.bias]}])
    opt = d.MasterWeightOptimizer(net, torch.optim.AdamW, [net.fc1.bias])
    with pytest.raises(ValueError, match="fc1.weight is an FP8 parameter"):
        opt.add_param_group({"params": [net.fc1.weight]})
    opt.add_param_group({"params": [net.fc2.bias], "lr": 0.5})  # a high-precision one can join later
    assert opt.inner.param_groups[-1]["lr"] == 0.5
    with pytest.raises(TypeError, match="read-only"):
        opt.state[net.fc1.bias] = {}


# ---- non-finite gradients -------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe_name", list(d.RECIPES))
@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_a_non_finite_gradient_raises_with_nothing_changed(recipe_name, bad):
    """Identically for every recipe: the step is refused, naming the parameter, and weights,
    masters and optimizer state stay as they were."""
    net = _net(recipe=d.RECIPES[recipe_name])
    opt = d.MasterWeightOptimizer(net, torch.optim.AdamW, lr=1e-2)
    _train(net, opt, 2)
    before, state = _snapshot(net, opt), copy.deepcopy(opt.state_dict())
    net(_batch(5)).pow(2).mean().backward()
    net.fc2.weight.grad[1, 2] = float(bad)
    with pytest.raises(FloatingPointError, match=r"non-finite gradients \(NaN or Inf\) in 1 parameter\(s\): fc2.weight"):
        opt.step()
    _assert_same(_snapshot(net, opt), before)
    after = opt.state_dict()["state"]
    for pid, s in state["state"].items():
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(after[pid][k]), torch.as_tensor(v)), (pid, k)


def test_a_non_finite_loss_mid_run_is_skipped_when_asked():
    net = _net()
    opt = d.MasterWeightOptimizer(net, torch.optim.AdamW, lr=1e-2, nonfinite="skip")
    _train(net, opt, 1)
    before = _snapshot(net, opt)
    (net(_batch(1)).pow(2).mean() * float("nan")).backward()  # a loss gone NaN
    with pytest.warns(UserWarning, match="step skipped"):
        opt.step()
    opt.zero_grad()
    assert opt.skipped_steps == 1
    _assert_same(_snapshot(net, opt), before)
    _train(net, opt, 1, start=2)  # training goes on from the same state
    assert all(torch.isfinite(m).all() for m in opt.masters.values())


def test_ignore_takes_no_check():
    net = _net(recipe=d.RECIPES["current"])
    opt = d.MasterWeightOptimizer(net, torch.optim.SGD, lr=0.1, nonfinite="ignore")
    net(_batch(0)).pow(2).mean().backward()
    net.fc1.weight.grad[0, 0] = float("nan")
    opt.step()  # no error: the NaN reaches the master, as documented
    assert torch.isnan(opt.masters["fc1.weight"]).any()
    with pytest.raises(ValueError, match="nonfinite='often'"):
        d.MasterWeightOptimizer(_net(), torch.optim.SGD, lr=0.1, nonfinite="often")


def test_a_non_finite_master_is_not_loaded():
    net = _net()
    opt = d.MasterWeightOptimizer(net, torch.optim.AdamW, lr=1e-2)
    state = copy.deepcopy(opt.state_dict())
    pid = next(i for i, s in state["state"].items() if "master" in s)
    state["state"][pid]["master"][0, 0] = float("inf")
    with pytest.raises(FloatingPointError, match="master of fc1.weight holds NaN or Inf"):
        opt.load_state_dict(state)


def _nan_on_one_rank(policy):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from dist_utils import DEVICE

    net = _net(recipe=d.RECIPES["mxfp8"]).to(DEVICE)
    mesh = init_device_mesh(DEVICE, (dist.get_world_size(),))
    fully_shard(net, mesh=mesh)
    opt = d.MasterWeightOptimizer(net, torch.optim.AdamW, lr=1e-2, nonfinite=policy)
    net(_batch(0).to(DEVICE)).pow(2).mean().backward()
    if dist.get_rank() == dist.get_world_size() - 1:  # only this rank's shard of the gradient is bad
        net.fc1.weight.grad.to_local()[0, 0] = float("nan")
    try:
        opt.step()
    except FloatingPointError as err:
        return str(err)
    return f"stepped, skipped={opt.skipped_steps}"


def test_a_nan_on_one_rank_stops_every_rank_alike(pools):
    from dist_utils import WORLD_SIZES

    msgs = pools[WORLD_SIZES[0]].run(_nan_on_one_rank, "raise")
    assert len(set(msgs)) == 1 and "fc1.weight" in msgs[0], msgs
    assert pools[WORLD_SIZES[0]].run(_nan_on_one_rank, "skip") == ["stepped, skipped=1"] * WORLD_SIZES[0]


def test_switching_recipes_keeps_masters_and_moments_exactly():
    """The recipe-switch path: masters exported from the optimizer (FP32, exact), imported into a
    model of another recipe, and the optimizer's moments carried over; only the FP8 bytes
    (requantized in the new recipe) and the old recipe's scaling state are new."""
    old = _net(recipe=d.RECIPES["delayed"])
    old_opt = d.MasterWeightOptimizer(old, torch.optim.AdamW, lr=1e-2)
    _train(old, old_opt, 3)
    hp = d.export_hp_state_dict(old, torch.float32, optimizer=old_opt)
    assert torch.equal(hp["fc1.weight"], old_opt.masters["fc1.weight"])  # the master, not its FP8 rounding
    assert not torch.equal(hp["fc1.weight"], old.fc1.weight.dequantize(torch.float32))
    new = _net(seed=7, recipe=d.RECIPES["blockwise1d"])
    new_opt = d.MasterWeightOptimizer(new, torch.optim.AdamW, lr=1e-2)
    d.load_hp_state_dict(new, hp, optimizer=new_opt)
    new_opt.load_state_dict(old_opt.state_dict())
    for name, m in old_opt.masters.items():
        assert torch.equal(new_opt.masters[name], m), name
        expected = d.quantize(m.detach(), d.RECIPES["blockwise1d"])
        got = dict(new.named_parameters())[name]
        for usage in got.usages:
            assert torch.equal(got.plane(usage).data.view(torch.uint8), expected.plane(usage).data.view(torch.uint8))
    for p_old, p_new in zip(old.parameters(), new.parameters()):
        s_old, s_new = old_opt.state[p_old], new_opt.state[p_new]
        assert torch.equal(s_old["exp_avg"], s_new["exp_avg"]) and torch.equal(s_old["exp_avg_sq"], s_new["exp_avg_sq"])
        assert "rowwise_amax_history" not in s_new  # the delayed-scaling history stayed behind


def _nan_master_in_checkpoint(root):
    import os

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from dist_utils import DEVICE

    def build():
        net = _net(recipe=d.RECIPES["current"]).to(DEVICE)
        fully_shard(net, mesh=init_device_mesh(DEVICE, (dist.get_world_size(),)))
        return net, d.MasterWeightOptimizer(net, torch.optim.AdamW, lr=1e-2)

    net, opt = build()
    _train(net, opt, 1)
    model_sd, optim_sd = get_state_dict(net, opt)
    d.save_checkpoint({"model": model_sd, "optim": optim_sd}, root, 1)
    with torch.no_grad():  # the run diverges on the last rank's shard only
        if dist.get_rank() == dist.get_world_size() - 1:
            opt.masters["fc1.weight"].to_local()[0, 0] = float("nan")
    model_sd, optim_sd = get_state_dict(net, opt)
    out = {}
    try:
        d.save_checkpoint({"model": model_sd, "optim": optim_sd}, root, 2)
        out["save"] = "saved"
    except d.CheckpointError as err:
        out["save"] = str(err)
    out["latest"] = os.path.basename(d.latest_checkpoint(root))
    out["forced"] = os.path.basename(d.save_checkpoint({"model": model_sd, "optim": optim_sd}, root, 2,
                                                       allow_nonfinite=True))
    fresh, fresh_opt = build()
    model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
    state = {"model": model_sd, "optim": optim_sd}
    try:  # load_checkpoint refuses it before writing anything
        d.load_checkpoint(state, d.latest_checkpoint(root))
        out["load"] = "loaded"
    except d.CheckpointError as err:
        out["load"] = str(err)
    d.load_checkpoint(state, d.latest_checkpoint(root), allow_nonfinite=True)  # forced: the optimizer refuses it
    try:
        set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        out["set"] = "loaded"
    except FloatingPointError as err:
        out["set"] = str(err)
    return out


def test_non_finite_masters_are_neither_saved_nor_loaded_on_any_rank(pools, tmp_path):
    """A NaN in one rank's master shard: the save is refused on every rank (nothing written,
    ``latest`` unchanged) unless allowed; a checkpoint holding it is refused at load on every rank."""
    from dist_utils import WORLD_SIZES

    outs = pools[WORLD_SIZES[0]].run(_nan_master_in_checkpoint, str(tmp_path / "ckpt"))
    for out in outs:
        assert "refusing to save" in out["save"] and "fc1.weight" in out["save"] and "allow_nonfinite" in out["save"], out
        assert out["latest"] == "step-00000001" and out["forced"] == "step-00000002", out
        assert "master of fc1.weight holds NaN or Inf" in out["load"] and "allow_nonfinite" in out["load"], out
        assert "master of fc1.weight holds NaN or Inf" in out["set"], out
