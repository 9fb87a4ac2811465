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


def test_every_unrepresentable_layer_is_listed_and_a_filter_keeps_them_in_high_precision():
    model = _model(rows_second=48)  # 48 rows / columns: not whole 32-element MXFP8 blocks
    with pytest.raises(d.RecipeError) as err:
        d.quantize_module_(model, d.MXFP8())
    msg = str(err.value)
    assert "2 of 3 selected" in msg and "2.weight" in msg and "4.weight" in msg and "0.weight" not in msg
    assert not any(isinstance(p, d.QuantizedTensor) for p in model.parameters())
    d.quantize_module_(model, d.MXFP8(), filter_fn=lambda m, fqn: fqn == "0")
    assert isinstance(model[0].weight, d.QuantizedTensor) and not isinstance(model[2].weight, d.QuantizedTensor)


@pytest.mark.parametrize("recipe_name", list(d.RECIPES))
def test_meta_build_makes_the_bytes_of_the_init_and_masters_of_its_values(recipe_name):
    """One process, no FSDP: a meta model quantized, materialized and initialized by the user's own
    code holds what quantizing the initialized weights gives, and its masters are the init values."""
    recipe = d.RECIPES[recipe_name]
    with torch.device("meta"):
        meta = _model()
    d.quantize_module_(meta, recipe)
    assert all(p.bytes_pending for p in meta.parameters() if isinstance(p, d.QuantizedTensor))
    meta.to_empty(device="cpu")
    torch.manual_seed(1)
    for layer in (meta[0], meta[2], meta[4]):
        layer.reset_parameters()  # kaiming_uniform_ on the FP8 weight: its pending values
    with pytest.raises(d.RecipeError, match=r"finish_init_\(model\)"):
        meta(torch.randn(2, 64))  # no bytes yet: refused with the fix, never garbage
    torch.manual_seed(1)
    ref = _model()
    torch.manual_seed(1)
    for layer in (ref[0], ref[2], ref[4]):
        layer.reset_parameters()
    opt = d.MasterWeightOptimizer(meta, torch.optim.SGD, lr=0.1)
    for i in (0, 2, 4):
        q, want = meta[i].weight, d.quantize(ref[i].weight.detach(), recipe)
        assert not q.bytes_pending and q.hp_init is None  # the master took the values
        for usage, plane in want.planes.items():
            assert torch.equal(q.planes[usage].data.view(torch.uint8), plane.data.view(torch.uint8)), (i, usage)
            assert torch.equal(q.planes[usage].scale_inv.view(torch.uint8), plane.scale_inv.view(torch.uint8)), (i, usage)
        assert torch.equal(opt.masters[f"{i}.weight"], ref[i].weight.detach())
        assert torch.equal(meta[i].bias, ref[i].bias)


def test_init_ops_on_a_weight_whose_bytes_are_made_are_refused():
    model = d.quantize_module_(_model(), d.CurrentScaling())
    before = model[0].weight.planes["rowwise"].data.clone()
    with pytest.raises(d.RecipeError, match="bytes are already made"):
        model[0].reset_parameters()
    assert torch.equal(model[0].weight.planes["rowwise"].data.view(torch.uint8), before.view(torch.uint8))


def test_tied_weights_are_refused_naming_both_places():
    model = _model()
    head = nn.Linear(64, 64)
    model.append(head)
    head.weight = model[4].weight  # a Linear sharing another's weight (as lm_head shares an embedding's)
    with pytest.raises(d.RecipeError) as err:
        d.quantize_module_(model, d.CurrentScaling())
    msg = str(err.value)
    assert "4.weight (64, 128) is tied" in msg and "5.weight" in msg and "filter_fn" in msg
    assert not any(isinstance(p, d.QuantizedTensor) for p in model.parameters())


def test_a_second_quantize_module_with_another_recipe_is_refused_with_the_switch_path():
    model = d.quantize_module_(_model(), d.CurrentScaling())
    before = {n: p for n, p in model.named_parameters()}
    assert d.quantize_module_(model, d.CurrentScaling()) is model  # the same recipe: nothing to do
    with pytest.raises(d.RecipeError) as err:
        d.quantize_module_(model, d.MXFP8())
    msg = str(err.value)
    assert "already an FP8 parameter in CurrentScaling" in msg and "export_hp_state_dict" in msg
    assert "load_hp_state_dict" in msg
    assert {n: p for n, p in model.named_parameters()} == before


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


def _fully_shard_first():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from dist_utils import DEVICE

    model = _model().to(DEVICE)
    fully_shard(model, mesh=init_device_mesh(DEVICE, (dist.get_world_size(),)))
    before = {n: p.to_local().clone() for n, p in model.named_parameters()}
    try:
        d.quantize_module_(model, d.RECIPES["mxfp8"])
    except d.RecipeError as err:
        after = {n: p for n, p in model.named_parameters()}
        untouched = all(not isinstance(p.to_local(), d.QuantizedTensor) and torch.equal(p.to_local(), before[n])
                        for n, p in after.items())
        return str(err), untouched
    return None, None


def test_fully_shard_before_quantize_module_is_named(pools):
    """``fully_shard`` then ``quantize_module_``: the weights were replaced by unsharded FP8 tensors
    and the first forward failed inside FSDP ("'QuantizedTensor' object has no attribute
    '_local_tensor'", or an error blaming the torch version). Refused naming every weight, the
    order and the fix; nothing converted."""
    from dist_utils import WORLD_SIZES

    for msg, untouched in pools[WORLD_SIZES[0]].run(_fully_shard_first):
        assert msg is not None and untouched, msg
        assert "0.weight (128, 64) is already a DTensor" in msg and "4.weight" in msg, msg
        assert "call quantize_module_ before fully_shard" in msg, msg
