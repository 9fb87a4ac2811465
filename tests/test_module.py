"""``quantize_module_``: all or nothing, every bad weight named; the delayed-scaling first scale."""

import pytest
import torch
from torch import nn

import dtensor_fp8 as d


def _model(rows_second=128):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, rows_second), nn.ReLU(), nn.Linear(rows_second, 64))


def _weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("recipe_name", list(d.RECIPES))
@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_non_finite_weights_are_refused_by_every_recipe_alike(recipe_name, bad):
    model = _model()
    with torch.no_grad():
        model[2].weight[3, 5] = float(bad)
    before = _weights(model)
    with pytest.raises(d.RecipeError) as err:
        d.quantize_module_(model, d.RECIPES[recipe_name])
    msg = str(err.value)
    assert "nothing was converted" in msg and "2.weight (128, 128)" in msg
    assert ("1 NaN and 0 infinite" if bad == "nan" else "0 NaN and 1 infinite") in msg
    assert "filter_fn" in msg  # the fix
    # All or nothing: no layer was converted, every weight (the first layer's too) untouched.
    assert not any(isinstance(p, d.QuantizedTensor) for p in model.parameters())
    after = _weights(model)
    for n in before:  # compared as bytes: the NaN too
        assert torch.equal(before[n].view(torch.int32), after[n].view(torch.int32)), n
    assert not hasattr(model, "_dtensor_fp8_hp_init") or not model._dtensor_fp8_hp_init


def test_every_unrepresentable_layer_is_listed_and_a_filter_keeps_them_in_high_precision():
    model = _model(rows_second=48)  # 48 rows / columns: not whole 32-element MXFP8 blocks
    with pytest.raises(d.RecipeError) as err:
        d.quantize_module_(model, d.MXFP8())
    msg = str(err.value)
    assert "2 of 3 selected" in msg and "2.weight" in msg and "4.weight" in msg and "0.weight" not in msg
    assert not any(isinstance(p, d.QuantizedTensor) for p in model.parameters())
    d.quantize_module_(model, d.MXFP8(), filter_fn=lambda m, fqn: fqn == "0")
    assert isinstance(model[0].weight, d.QuantizedTensor) and not isinstance(model[2].weight, d.QuantizedTensor)


def test_meta_weights_are_refused_with_the_fix():
    with torch.device("meta"):
        model = _model()
    with pytest.raises(d.RecipeError, match=r"meta device: materialize and initialize first \(module.to_empty"):
        d.quantize_module_(model, d.CurrentScaling())


def test_a_retry_after_a_failure_keeps_the_high_precision_init():
    """The masters of a model converted after a failed attempt start from the exact init."""
    model = _model()
    init = model[0].weight.detach().clone()
    with torch.no_grad():
        model[4].weight[0, 0] = float("nan")
    with pytest.raises(d.RecipeError):
        d.quantize_module_(model, d.MXFP8())
    with torch.no_grad():
        model[4].weight[0, 0] = 0.0
    d.quantize_module_(model, d.MXFP8())
    opt = d.MasterWeightOptimizer(model, torch.optim.SGD, lr=0.1)
    assert torch.equal(opt.masters["0.weight"], init)


def test_delayed_scaling_first_scale_is_seeded_from_the_weight():
    """A realistic init (std 0.002): with TE's initial scale 1, 37 % of the weights would be zero in
    E4M3 and the step-0 output 40 % off; seeded from the weight's amax, the step-0 forward is as
    accurate as current scaling's (the same scale: fp8_max / amax)."""
    torch.manual_seed(0)
    w = torch.randn(256, 512) * 0.002
    x = torch.randn(16, 512)
    q = d.quantize(w, d.DelayedScaling())
    zero = (q.plane("rowwise").data.view(torch.uint8) & 0x7F == 0).float().mean().item()
    assert zero < 0.01, zero
    ref = x @ w.t()
    err = ((torch.nn.functional.linear(x, q) - ref).norm() / ref.norm()).item()
    cur = d.quantize(w, d.CurrentScaling())
    assert torch.equal(q.plane("rowwise").scale_inv, cur.plane("rowwise").scale_inv)
    assert err < 0.05, err
    at_one = d.quantize(w, d.DelayedScaling(), scale=1.0)  # TE's initial state, still available
    zero_at_one = (at_one.plane("rowwise").data.view(torch.uint8) & 0x7F == 0).float().mean().item()
    assert zero_at_one > 0.3, zero_at_one
