"""``MasterWeightOptimizer.follow_model`` after something re-pointed its ``param_groups`` (dtensor_fp8/optim_follow.py):
what accelerate's ``prepare`` does, reproduced with plain torch in one process (tests/test_accelerate.py
runs accelerate itself on 2 ranks)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dtensor_fp8 as d


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    d.quantize_module_(model, d.RECIPES["mxfp8"])
    return model


def _step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 64, generator=g)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _planes(model):
    return {n: p.plane("rowwise").data.view(torch.uint8).clone() for n, p in model.named_parameters()
            if isinstance(p, d.QuantizedTensor)}


def _collapse(opt) -> list:
    """Point group 0 at a new list matched by ``data_ptr()``, as accelerate's ``prepare`` does: every
    FP8 parameter's is 0, so one parameter fills every FP8 slot. Returns the list it held before."""
    params = list(opt.param_groups[0]["params"])
    assert {p.data_ptr() for p in params if isinstance(p, d.QuantizedTensor)} == {0}
    by_ptr = {p.data_ptr(): p for p in params}
    collapsed = [by_ptr[p.data_ptr()] for p in params]
    opt.param_groups[0]["params"] = collapsed
    assert len({id(p) for p in collapsed}) < len(params)
    return params


def test_groups_collapsed_by_a_data_ptr_match_are_restored():
    """A collapsed group (see ``_collapse``): ``follow_model()`` restores the groups, and so does
    the next action (``zero_grad``)."""
    model = _model()
    opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-2)
    params = _collapse(opt)
    opt.follow_model()
    assert opt.param_groups[0]["params"] == params and all(a is b for a, b in zip(opt.param_groups[0]["params"], params))
    _collapse(opt)
    opt.zero_grad()
    assert all(a is b for a, b in zip(opt.param_groups[0]["params"], params))


def test_param_groups_is_a_plain_read_and_own_accessors_refuse_groups_not_followed():
    """Reading ``param_groups`` (as every LR scheduler does each step) is a plain read: it shows the
    list put there and rebuilds nothing; ``masters`` and ``master_of`` (this class's own accessors,
    read perhaps on one rank) refuse until ``follow_model()`` followed the model, naming the fix;
    torch's ``state`` and ``state_dict()`` (read on every rank by torch's state-dict helpers, as
    accelerate's ``save_state`` does right after ``prepare``) follow it. Before this the
    ``param_groups`` getter itself followed the model."""
    model = _model()
    opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-2)
    masters = dict(opt.masters)
    state_view = opt.state
    for follows in (lambda: opt.follow_model(), lambda: len(opt.state), opt.state_dict):
        params = _collapse(opt)
        collapsed = opt.param_groups[0]["params"]
        assert [g["lr"] for g in opt.param_groups] == [1e-2]  # what a scheduler reads
        assert opt.param_groups[0]["params"] is collapsed
        for read in (lambda: opt.masters, lambda: opt.master_of(model[0].weight)):
            with pytest.raises(RuntimeError, match=r"not followed yet\. Fix: call opt\.follow_model\(\) first"):
                read()
        follows()
        assert opt.param_groups[0]["params"] is not collapsed
        assert all(a is b for a, b in zip(opt.param_groups[0]["params"], params))
        assert opt.masters.keys() == masters.keys() and all(opt.masters[k] is m for k, m in masters.items())
        assert opt.state is state_view  # one object: torch's helpers may hold it while reading
        assert len(opt.state_dict()["state"]) == len(list(model.parameters()))


def test_replaced_parameters_are_followed_exactly():
    """The model's parameters replaced by new objects (as ``fully_shard`` inside ``prepare`` does)
    and the groups pointed at them: the optimizer moves its masters, moments and scaling state to
    the new parameters, keeps its identity, hooks and LR schedule, and trains bit-identically to an
    optimizer that never saw a replacement."""
    control, model = _model(), _model()
    ref_opt = d.MasterWeightOptimizer(control, torch.optim.AdamW, lr=1e-2)
    opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 0.5 ** s)
    calls = []
    opt.register_step_post_hook(lambda *_: calls.append(1))
    assert _step(model, opt, 0) == _step(control, ref_opt, 0)
    sched.step()
    ref_sched.step()
    for layer in (model[0], model[2]):  # new parameter objects holding the same values
        layer.weight = nn.Parameter(copy.deepcopy(layer.weight.detach()))
        layer.bias = nn.Parameter(layer.bias.detach().clone())
    opt.param_groups[0]["params"] = [p for p in model.parameters()]
    for s in range(1, 4):
        assert _step(model, opt, s) == _step(control, ref_opt, s)
        sched.step()
        ref_sched.step()
    assert len(calls) == 4 and opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    assert all(p.grad is None for p in model.parameters())
    got, want = _planes(model), _planes(control)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


def test_parameters_the_model_no_longer_has_are_named():
    model = _model()
    opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-2)
    del model[2]
    opt.param_groups[0]["params"] = list(model.parameters())
    with pytest.raises(ValueError, match="2.weight, 2.bias no longer name parameters of its model"):
        opt.step()
