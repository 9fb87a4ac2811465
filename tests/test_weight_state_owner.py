"""One owner saves an FP8 weight's scaling state: delayed scaling's weight amax history and scale
are in the weight's model state-dict entry (with the GEMM operand state), not in the optimizer's;
a checkpoint of the older layout (the weight's state under the optimizer, written here explicitly
with ``dcp.save``) still loads it, on real gloo ranks with DCP on disk.
"""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dtensor_fp8 as d
from dist_utils import DEVICE, WORLD_SIZES

DIM = 256
WEIGHT_STATE = ("rowwise_amax_history", "rowwise_scale")
needs_two = pytest.mark.skipif(2 not in WORLD_SIZES, reason="needs 2 ranks")


def _build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.GELU(), nn.Linear(DIM, DIM)).to(DEVICE)
    d.quantize_module_(model, d.RECIPES["delayed"])
    fully_shard(model, mesh=init_device_mesh(DEVICE, (torch.distributed.get_world_size(),)))
    return model, d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-2)


def _steps(model, opt, n, seed):
    torch.manual_seed(seed)
    for _ in range(n):
        x = torch.randn(8, DIM, device=DEVICE)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _weight_states(model) -> dict:
    return {f"{name}.{usage}_{k}": v.clone() for name, p in model.named_parameters()
            if isinstance(p.to_local(), d.QuantizedTensor)
            for usage, state in p.to_local().param_state.scaling.weight.items() for k, v in state.items()}


def _planes(model) -> dict:
    return {name: d.for_usage(p, "rowwise").full_tensor().plane("rowwise").data.view(torch.uint8).clone()
            for name, p in model.named_parameters() if isinstance(p.to_local(), d.QuantizedTensor)}


def _round_trip(root: str, layout: str):
    model, opt = _build()
    _steps(model, opt, 3, seed=1)
    model_sd, optim_sd = get_state_dict(model, opt)
    for fqn in ("0.weight", "2.weight"):  # the owner's entry holds the weight's state; the optimizer's does not
        assert set(WEIGHT_STATE) <= set(model_sd[fqn]), sorted(model_sd[fqn])
        assert not set(WEIGHT_STATE) & set(optim_sd["state"][fqn]), sorted(optim_sd["state"][fqn])
    trained = _weight_states(model)
    assert trained and all(bool(v.abs().sum() > 0) for k, v in trained.items() if k.endswith("amax_history")), trained
    if layout == "old":  # what was written before the owner saved it: under the optimizer's state
        for fqn in ("0.weight", "2.weight"):
            for key in WEIGHT_STATE:
                optim_sd["state"][fqn][key] = model_sd[fqn].pop(key)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=root)
        verify = False
    else:
        d.save_checkpoint({"model": model_sd, "optim": optim_sd}, root, 3)
        root, verify = d.latest_checkpoint(root), True
    _steps(model, opt, 2, seed=2)  # the run continues ...
    after = _planes(model)

    fresh, fresh_opt = _build()  # ... and is resumed from the checkpoint
    assert not torch.equal(next(iter(_weight_states(fresh).values())), next(iter(trained.values())))
    state = dict(zip(("model", "optim"), get_state_dict(fresh, fresh_opt)))
    d.load_checkpoint(state, root, verify=verify)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = _weight_states(fresh)
    assert loaded.keys() == trained.keys()
    for key, value in trained.items():
        assert torch.equal(loaded[key], value), key
    _steps(fresh, fresh_opt, 2, seed=2)
    resumed = _planes(fresh)
    for name, data in after.items():
        assert torch.equal(resumed[name], data), f"{layout}: {name} resumed differently"


@needs_two
@pytest.mark.parametrize("layout", ["new", "old"])
def test_weight_scaling_state_is_saved_by_its_owner_and_old_checkpoints_load(pools, layout, tmp_path):
    pools[2].run(_round_trip, str(tmp_path / "ckpt"), layout)
