"""Who owns an FP8 weight's state when a user copies the model, builds a second optimizer, picks a
master dtype, or calls torch's own module APIs (issue 50), on real gloo ranks where sharding
matters:

* ``copy.deepcopy(model)`` after the optimizer (an EMA / evaluation copy): writes into the copy
  (``copy_``, ``load_hp_state_dict``) leave the original's masters and weights as they were, and an
  optimizer over the copy trains it on its own; ``torch.save(model)`` / ``torch.load`` round-trip;
* a second ``MasterWeightOptimizer`` starts from the first one's masters (bit-exact), and the first
  refuses to step (nothing changed); ``master_dtype=torch.float16`` is refused at construction;
* ``weight.copy_(src)`` follows torch's shape rules (broadcast, never reshape) and refuses NaN / Inf
  on every rank of a sharded weight, with nothing written;
* an optimizer state missing a key its step needs is refused before anything is loaded;
* ``model.to(torch.bfloat16)`` converts an FP8 model (the bytes are kept);
* ``load_hp_state_dict(..., optimizer=opt)`` loads a model whose frozen FP8 weight is outside the optimizer.
"""

import copy
import io
import re

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel

import dtensor_fp8 as d
from conftest import assert_bytes_equal
from dist_utils import DEVICE, WORLD_SIZES

RECIPES = d.RECIPES
DIM = 256

needs_two = pytest.mark.skipif(2 not in WORLD_SIZES, reason="needs 2 ranks")


def _values(seed: int, shape=(DIM, DIM)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 0.5).to(DEVICE)


def _model(recipe_name: str, sharded: bool | str = False) -> nn.Module:
    """Linear, LayerNorm, Linear; ``sharded``: FSDP2 (``True``) or TP (``"tp"``, which torch's
    ``copy.deepcopy`` supports: FSDP2 refuses it) over every rank."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, DIM, bias=False), nn.LayerNorm(DIM), nn.Linear(DIM, DIM, bias=False))
    model = model.to(DEVICE)
    d.quantize_module_(model, RECIPES[recipe_name])
    if sharded:
        mesh = init_device_mesh(DEVICE, (torch.distributed.get_world_size(),))
        if sharded == "tp":
            d.parallelize_module(model, mesh, {"0": ColwiseParallel(output_layouts=Replicate()),
                                               "2": ColwiseParallel(output_layouts=Replicate())})
        else:
            fully_shard(model, mesh=mesh)
    return model


def _step(model, opt, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(4, DIM, generator=g).to(DEVICE)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _planes(weight) -> dict:
    """The FP8 bytes and scales of a weight (gathered), as uint8 / float copies."""
    q = _full(weight)
    return {f"{u}/{f}": getattr(p, f).clone() for u, p in q.planes.items() for f in ("data", "scale_inv")}


def _assert_same_planes(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for k in want:
        assert_bytes_equal(got[k], want[k], f"{what}: {k}")


def _masters(opt) -> dict:
    return {n: _full(m).clone() for n, m in opt.masters.items()}


def _assert_same_masters(got: dict, want: dict, what: str) -> None:
    for n in want:
        assert_bytes_equal(got[n], want[n], f"{what}: master of {n}")


# ---- a copy owns its own state -----------------------------------------------------------------------------------
def _copy_writes_leave_the_original(recipe_name: str, sharded: bool | str) -> None:
    model = _model(recipe_name, sharded)
    opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-2)
    _step(model, opt)
    ema = copy.deepcopy(model)
    masters, weights = _masters(opt), {i: _planes(model[i].weight) for i in (0, 2)}
    new = _values(5)
    with torch.no_grad():
        target = ema[0].weight
        target.copy_(distribute_tensor(new, target.device_mesh, target.placements, src_data_rank=None)
                     if sharded else new)
    d.load_hp_state_dict(ema, {"2.weight": _values(6)}, strict=False)
    _assert_same_masters(_masters(opt), masters, "after writes into a deep copy")
    for i in (0, 2):
        _assert_same_planes(_planes(model[i].weight), weights[i], f"original {i}.weight after writes into its copy")
    want = d.quantize(new, RECIPES[recipe_name])
    _assert_same_planes(_planes(ema[0].weight), {f"{u}/{f}": getattr(p, f) for u, p in want.planes.items()
                                                 for f in ("data", "scale_inv")}, "the copy's written weight")
    # each trains on its own: an optimizer over the copy starts from the copy's bytes
    copied = _planes(ema[0].weight)
    opt_ema = d.MasterWeightOptimizer(ema, torch.optim.AdamW, lr=1e-2)
    assert torch.equal(_full(opt_ema.master_of(ema[0].weight)), _full(ema[0].weight).dequantize(torch.float32))
    _step(model, opt, seed=2)
    assert any(not torch.equal(m, masters[n]) for n, m in _masters(opt).items()), "the original did not train"
    _assert_same_planes(_planes(ema[0].weight), copied, "the copy after the original's step")
    trained = _masters(opt)
    _step(ema, opt_ema, seed=3)
    _assert_same_masters(_masters(opt), trained, "the original after the copy's step")


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_writes_into_a_deep_copy_leave_the_original(recipe_name):
    _copy_writes_leave_the_original(recipe_name, sharded=False)


@needs_two
@pytest.mark.parametrize("recipe_name", ["current", "mxfp8"])
def test_writes_into_a_deep_copy_of_a_tp_model_leave_the_original(pools, recipe_name):
    pools[2].run(_copy_writes_leave_the_original, recipe_name, "tp")


@pytest.mark.parametrize("recipe_name", ["delayed", "blockwise1d"])
def test_torch_save_of_a_model_round_trips(recipe_name):
    model = _model(recipe_name)
    opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-2)
    _step(model, opt)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for i in (0, 2):
        _assert_same_planes(_planes(loaded[i].weight), _planes(model[i].weight), f"loaded {i}.weight")
        record = loaded[i].weight.param_state
        assert record.links.master_tensor() is None and record.links.home_parameter() is loaded[i].weight
    assert torch.equal(loaded(torch.ones(2, DIM, device=DEVICE)), model(torch.ones(2, DIM, device=DEVICE)))
    assert loaded.to_empty.module is loaded  # the checked to_empty, bound to the loaded model
    opt_loaded = d.MasterWeightOptimizer(loaded, torch.optim.AdamW, lr=1e-2)
    _step(loaded, opt_loaded)  # trains on its own


# ---- a second optimizer, master dtypes -----------------------------------------------------------------------
def _second_optimizer_keeps_the_masters(recipe_name: str, sharded: bool) -> None:
    model = _model(recipe_name, sharded)
    first = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-2)
    for s in range(2):
        _step(model, first, seed=s)
    masters, weights = _masters(first), {i: _planes(model[i].weight) for i in (0, 2)}
    second = d.MasterWeightOptimizer(model, torch.optim.SGD, lr=0.0)
    _assert_same_masters(_masters(second), masters, "the second optimizer's masters")
    g = torch.Generator().manual_seed(3)
    model(torch.randn(4, DIM, generator=g).to(DEVICE)).sum().backward()
    with pytest.raises(RuntimeError, match=r"later MasterWeightOptimizer was built over 0\.weight.*Nothing was changed"):
        first.step()
    with pytest.raises(RuntimeError, match="later MasterWeightOptimizer"):
        first.load_state_dict(first.state_dict())
    _assert_same_masters(_masters(first), masters, "the first optimizer's masters after its refused step")
    for i in (0, 2):
        _assert_same_planes(_planes(model[i].weight), weights[i], f"{i}.weight after the refused step")
    second.step()  # lr 0: requantizes from the kept masters
    _assert_same_masters(_masters(second), masters, "the second optimizer's masters after its step")


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_a_second_optimizer_keeps_the_first_ones_masters(recipe_name):
    _second_optimizer_keeps_the_masters(recipe_name, sharded=False)


@needs_two
@pytest.mark.parametrize("recipe_name", ["delayed", "blockwise2d"])
def test_a_second_optimizer_keeps_the_masters_under_fsdp2(pools, recipe_name):
    pools[2].run(_second_optimizer_keeps_the_masters, recipe_name, True)


def test_float16_masters_are_refused_at_construction():
    model = _model("mxfp8")
    with pytest.raises(ValueError, match=r"float16 is refused.*NaN.*Fix: master_dtype=torch.bfloat16"):
        d.MasterWeightOptimizer(model, torch.optim.AdamW, master_dtype=torch.float16, lr=1e-3)
    assert model[0].weight.param_state.links.master_tensor() is None  # nothing built, nothing linked
    opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, master_dtype=torch.bfloat16, lr=1e-3)
    opt.state_dict()
    for s in range(2):
        _step(model, opt, seed=s)
    assert all(bool(m.isfinite().all()) for m in opt.masters.values())


# ---- copy_ by torch's rules ------------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_copy_broadcasts_as_torch_and_never_reshapes(recipe_name):
    weight = _model(recipe_name)[0].weight
    kept = _planes(weight)
    plain = torch.empty(DIM, DIM)
    for shape in [(128, 512), (DIM, DIM // 2), (2, DIM, DIM)]:
        with pytest.raises(RuntimeError):
            plain.copy_(torch.ones(shape))  # torch refuses it too
        with pytest.raises(RuntimeError, match=rf"source of shape {re.escape(str(tuple(shape)))}.*broadcastable.*Nothing was written"):
            with torch.no_grad():
                weight.copy_(_values(1, shape))
        _assert_same_planes(_planes(weight), kept, f"after a refused copy_ of {shape}")
    row = _values(2, (DIM,))
    with torch.no_grad():
        weight.copy_(row)
    want = d.quantize(row.expand(DIM, DIM).contiguous(), RECIPES[recipe_name])
    _assert_same_planes(_planes(weight), {f"{u}/{f}": getattr(p, f) for u, p in want.planes.items()
                                          for f in ("data", "scale_inv")}, "a broadcast row")


def _nonfinite_copy_refused(recipe_name: str, bad: float) -> None:
    model = _model(recipe_name, sharded=True)
    opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-2)
    masters, kept = _masters(opt), _planes(model[0].weight)
    weight = model[0].weight
    local = distribute_tensor(_values(3), weight.device_mesh, weight.placements, src_data_rank=None)
    if torch.distributed.get_rank() == 1:  # one rank's shard only: every rank must raise, none wait
        local.to_local()[0, 0] = bad
    with pytest.raises(FloatingPointError, match=r"NaN or Inf.*Nothing was written"):
        with torch.no_grad():
            weight.copy_(local)
    _assert_same_planes(_planes(weight), kept, "after a refused non-finite copy_")
    _assert_same_masters(_masters(opt), masters, "after a refused non-finite copy_")


@needs_two
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("recipe_name", ["current", "mxfp8"])
def test_a_nonfinite_copy_is_refused_on_every_rank(pools, recipe_name, bad):
    pools[2].run(_nonfinite_copy_refused, recipe_name, bad)


# ---- optimizer state, module APIs, frozen weights ---------------------------------------------------------------
def test_an_optimizer_state_missing_a_key_is_refused_before_loading():
    model = _model("delayed")
    opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-2)
    _step(model, opt)
    saved = opt.state_dict()
    broken = {"state": {k: dict(v) for k, v in saved["state"].items()}, "param_groups": saved["param_groups"]}
    del broken["state"][0]["exp_avg_sq"]
    for v in broken["state"][2].values():  # another entry whose values would be loaded first
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            v.add_(1.0)
    masters = _masters(opt)
    inner = {k: v.clone() for k, v in opt.inner.state[opt.inner.param_groups[0]["params"][0]].items()}
    with pytest.raises(KeyError, match=r"0\.weight lacks 'exp_avg_sq'.*Nothing was loaded"):
        opt.load_state_dict(broken)
    _assert_same_masters(_masters(opt), masters, "after a refused load")
    for k, v in opt.inner.state[opt.inner.param_groups[0]["params"][0]].items():
        assert torch.equal(v, inner[k]), k
    _step(model, opt, seed=2)  # and steps on


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_model_to_bfloat16_keeps_the_fp8_bytes(recipe_name):
    model = _model(recipe_name)
    kept = {i: _planes(model[i].weight) for i in (0, 2)}
    x = torch.randn(3, DIM, device=DEVICE)
    with torch.no_grad():  # (a live autograd graph holding the weights stops torch's swap, as for any subclass)
        want = model(x)
    model.to(torch.bfloat16)
    for i in (0, 2):
        assert model[i].weight.dtype == torch.bfloat16
        _assert_same_planes(_planes(model[i].weight), kept[i], f"{i}.weight after model.to(bfloat16)")
    assert model[1].weight.dtype == torch.bfloat16
    got = model(x.bfloat16())
    torch.testing.assert_close(got.float(), want, atol=0.1, rtol=0.05)


def test_a_frozen_fp8_weight_outside_the_optimizer_loads_with_it():
    model = _model("blockwise1d")
    model[0].weight.requires_grad_(False)  # fine-tuning: the first layer frozen, outside the optimizer
    opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, [p for p in model.parameters() if p.requires_grad],
                                  lr=1e-2)
    values = {"0.weight": _values(7), "2.weight": _values(8)}
    d.load_hp_state_dict(model, values, optimizer=opt, strict=False)
    assert torch.equal(_full(opt.master_of(model[2].weight)), values["2.weight"])
    for name, i in (("0.weight", 0), ("2.weight", 2)):
        want = d.quantize(values[name], RECIPES["blockwise1d"])
        _assert_same_planes(_planes(model[i].weight), {f"{u}/{f}": getattr(p, f) for u, p in want.planes.items()
                                                       for f in ("data", "scale_inv")}, name)
    other = _model("blockwise1d")
    other_opt = d.MasterWeightOptimizer(other, torch.optim.AdamW, lr=1e-2)
    kept = _masters(other_opt)
    with pytest.raises(d.CheckpointError, match=r"held by another MasterWeightOptimizer"):
        d.load_hp_state_dict(other, values, optimizer=opt, strict=False)  # an optimizer over another model
    _assert_same_masters(_masters(other_opt), kept, "after the refused load")


# ---- cross-rank errors ------------------------------------------------------------------------------------------
def _nonfinite_init_on_one_rank(recipe_name: str) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False))
    d.quantize_module_(model, RECIPES[recipe_name])
    fully_shard(model, mesh=init_device_mesh(DEVICE, (torch.distributed.get_world_size(),)))
    model.to_empty(device=DEVICE)
    torch.manual_seed(0)
    for layer in model:
        layer.reset_parameters()
    if torch.distributed.get_rank() == 1:  # one rank's shard only
        with torch.no_grad():
            model[1].weight.to_local().hp_init[0, 0] = float("nan")
    with pytest.raises(d.RecipeError, match=r"finish_init_: 1\.weight \(256, 256\).*NaN or Inf.*another rank"):
        d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-3)
    assert all(p.to_local().bytes_pending for p in model.parameters())  # nothing was made


@needs_two
@pytest.mark.parametrize("recipe_name", ["current", "mxfp8"])
def test_a_nonfinite_init_on_one_rank_is_raised_on_every_rank(pools, recipe_name):
    pools[2].run(_nonfinite_init_on_one_rank, recipe_name)


# ---- two pipeline stages holding the same block -----------------------------------------------------------------
def _stages_sharing_a_block(root: str, shared: bool) -> str | None:
    """Each rank is a pipeline stage on its own (1-rank) dp mesh, FSDP2 over it; stage 0 holds blocks
    0 and 1, stage 1 blocks 1 and 2 when ``shared`` (a mistake in the stage split), else 2 only."""
    stage = torch.distributed.get_rank()
    mesh = init_device_mesh(DEVICE, (2, 1), mesh_dim_names=("pp", "dp"))["dp"]
    torch.manual_seed(0)
    blocks = nn.ModuleDict({str(i): nn.Linear(DIM, DIM, bias=False) for i in range(3)}).to(DEVICE)
    keep = {0: ("0", "1"), 1: ("1", "2") if shared else ("2",)}[stage]
    for name in [n for n in blocks if n not in keep]:
        del blocks[name]
    d.quantize_module_(blocks, RECIPES["mxfp8"])
    for block in blocks.values():
        fully_shard(block, mesh=mesh)
    opt = d.MasterWeightOptimizer(blocks, torch.optim.AdamW, lr=1e-2)
    g = torch.Generator().manual_seed(10 + stage)  # each stage its own data: the shared block's copies differ
    x = torch.randn(4, DIM, generator=g).to(DEVICE)
    for name in keep:
        x = blocks[name](x)
    x.square().mean().backward()
    opt.step()
    try:
        d.save_checkpoint({"model": blocks.state_dict()}, root, 1)
    except d.CheckpointError as err:
        return str(err)
    return None


@needs_two
def test_two_fsdp2_stages_holding_one_block_are_refused_at_save(pools, tmp_path):
    errors = pools[2].run(_stages_sharing_a_block, str(tmp_path / "shared"), True)
    assert len(set(errors)) == 1 and errors[0] is not None, errors
    assert "'model.1.weight" in errors[0] and "two pipeline stages holding the same block" in errors[0], errors[0]
    assert "Nothing was written" in errors[0], errors[0]
    assert pools[2].run(_stages_sharing_a_block, str(tmp_path / "split"), False) == [None, None]


def test_a_high_precision_load_before_to_empty_names_the_cause():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(DIM, DIM, bias=False), nn.LayerNorm(DIM))
    d.quantize_module_(model, RECIPES["mxfp8"])
    values = {"0.weight": _values(1), "1.weight": torch.ones(DIM), "1.bias": torch.zeros(DIM)}
    with pytest.raises(d.CheckpointError, match=r"on the meta device.*Fix: call model.to_empty\(device=\.\.\.\) first"):
        d.load_hp_state_dict(model, values)
    model.to_empty(device=DEVICE)
    d.load_hp_state_dict(model, values)  # then it loads
    assert torch.equal(model[1].weight.cpu(), values["1.weight"])


@pytest.mark.parametrize("how", ["path", "hf_reader"])
def test_a_directory_of_pickled_hf_weights_is_named(tmp_path, how):
    import torch.distributed.checkpoint as dcp

    model = _model("mxfp8")
    kept = _planes(model[0].weight)
    torch.save({"0.weight": _values(1)}, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(d.CheckpointError, match=r"pytorch_model\.bin is a Hugging Face checkpoint in torch's pickle "
                                                r"format.*Fix: convert it once"):
        if how == "path":
            d.load_hp_checkpoint(model, str(tmp_path))
        else:
            d.load_hp_checkpoint(model, storage_reader=dcp.HuggingFaceStorageReader(str(tmp_path)))
    _assert_same_planes(_planes(model[0].weight), kept, "after the refused load")


@pytest.mark.parametrize("recipe_name", ["current", "mxfp8"])
def test_to_empty_after_the_optimizer_is_refused_before_emptying_anything(recipe_name):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.LayerNorm(DIM), nn.Linear(DIM, DIM, bias=False)).to(DEVICE)
    d.quantize_module_(model, RECIPES[recipe_name], filter_fn=lambda m, fqn: fqn == "2")  # layer 0 stays fp32
    opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-2)
    _step(model, opt)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not isinstance(p, d.QuantizedTensor)}
    kept, masters = _planes(model[2].weight), _masters(opt)
    with pytest.raises(d.RecipeError, match=r"to_empty.*MasterWeightOptimizer exists.*Fix"):
        model.to_empty(device=DEVICE)
    for n, p in model.named_parameters():  # the modules before the FP8 weight too
        if n in before:
            assert torch.equal(p.detach(), before[n]), f"{n} was emptied by a refused to_empty"
    _assert_same_planes(_planes(model[2].weight), kept, "the FP8 weight after a refused to_empty")
    _assert_same_masters(_masters(opt), masters, "after a refused to_empty")
    ema = copy.deepcopy(model)  # the copy's to_empty is the copy's own (no master: it empties)
    ema.to_empty(device=DEVICE)
    assert model.to_empty.module is model and ema.to_empty.module is ema
