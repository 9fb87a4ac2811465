"""Delayed scaling with FP8 GEMMs resumes bit-identically: the GEMMs' operand amax histories are
saved with the model (``param_state.py``), through ``save_checkpoint`` / ``load_checkpoint`` and
through plain ``dcp.save`` / ``dcp.load``, at the saving world size and at another (2 -> 1, 1 -> 2).

FP8 GEMMs run on the CPU with ``fp8_gemms("on")`` (torch's tensorwise kernel). Every rank trains
on the same batch, so FSDP's averaged gradient is the same at any world size ((g + g) / 2 == g)
and the runs at world 1 and 2 are bit-identical: a resume at another world size can then be
compared with the uninterrupted run byte for byte.
"""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import dtensor_fp8 as d
from dtensor_fp8 import gemm
from dist_utils import DEVICE, WORLD_SIZES
from test_fsdp import _hp_model, _shard

DIM, HIDDEN = 256, 512
SAVE_AT, AFTER = 2, 3
RECIPE = d.DelayedScaling(amax_history_len=4)


def _build():
    model = d.quantize_module_(_hp_model(dim=DIM, hidden=HIDDEN), RECIPE)
    _shard(model, "reshard")
    return model, d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-2)


def _steps(model, opt, n, seed):
    losses = []
    with gemm.fp8_gemms("on"), gemm.recording() as log:
        for step in range(n):
            g = torch.Generator().manual_seed(seed + step)
            x = torch.randn(16, DIM, generator=g).to(DEVICE)  # the same batch on every rank
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    assert len(log) == 5 * n, len(log)  # fprop + wgrad of both layers, dgrad of the second: FP8 GEMMs ran
    return losses


def _state(model, opt):
    """Every FP8 byte, master and scaling state (weight and operand), full, on CPU."""
    out = {}
    for name, p in model.named_parameters():
        local = p.to_local()
        if not isinstance(local, d.QuantizedTensor):
            continue
        full = p.full_tensor()
        for usage, plane in full.planes.items():
            out[f"{name}/{usage}/data"] = plane.data.view(torch.uint8).cpu().clone()
            out[f"{name}/{usage}/scale"] = plane.scale_inv.view(torch.uint8).cpu().clone()
        for key, value in local.param_state.scaling.entries().items():
            out[f"{name}/{key}"] = value.cpu().clone()
    for name, m in opt.masters.items():
        out[f"{name}/master"] = m.full_tensor().detach().cpu().clone()
    return out


PATHS = ("save_checkpoint", "dcp")


def _save(model, opt, root):
    """The same state through both paths."""
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    d.save_checkpoint(state, root, SAVE_AT)
    dcp.save(state, checkpoint_id=f"{root}/plain")


def _uninterrupted(root):
    model, opt = _build()
    _steps(model, opt, SAVE_AT, seed=0)
    _save(model, opt, root)
    losses = _steps(model, opt, AFTER, seed=100)
    return losses, _state(model, opt)


def _resumed_both(root):
    return {path: _resumed(root, path) for path in PATHS}


def _resumed(root, path):
    model, opt = _build()
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    fresh = {k: v.clone() for k, v in _state(model, opt).items() if "amax_history" in k}
    assert fresh and all(not v.any() for v in fresh.values())  # a fresh model: empty histories
    if path == "save_checkpoint":
        d.load_checkpoint(state, d.latest_checkpoint(root))
    else:
        dcp.load(state, checkpoint_id=f"{root}/plain")
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = {k: v for k, v in _state(model, opt).items() if "amax_history" in k}
    assert any(v.any() for v in loaded.values())  # the histories came from the checkpoint
    losses = _steps(model, opt, AFTER, seed=100)
    return losses, _state(model, opt)


@pytest.mark.parametrize("saved,loaded", [(2, 2), (2, 1), (1, 2)], ids=lambda w: str(w))
def test_delayed_fp8_gemm_training_resumes_bit_identically(pools, tmp_path, saved, loaded):
    for world in (saved, loaded):
        if world > 1 and world not in WORLD_SIZES:
            pytest.skip(f"needs {world} ranks")
    root = str(tmp_path / "ckpt")
    losses, final = pools[saved].run(_uninterrupted, root)[0]
    for by_path in pools[loaded].run(_resumed_both, root):
        for path, (resumed_losses, resumed_final) in by_path.items():
            assert resumed_losses == losses, path  # bit-identical, step by step
            assert resumed_final.keys() == final.keys()
            for key in final:
                assert torch.equal(resumed_final[key].view(torch.uint8), final[key].view(torch.uint8)), (path, key)


def _old_checkpoint_loads(root):
    """A checkpoint of the previous format (no operand scaling state in the model's entries)."""
    model, opt = _build()
    _steps(model, opt, SAVE_AT, seed=0)
    model_sd, optim_sd = get_state_dict(model, opt)
    for entry in model_sd.values():
        if isinstance(entry, dict):
            for key in [k for k in entry if k.startswith(("input_", "grad_"))]:
                del entry[key]
    d.save_checkpoint({"model": model_sd, "optim": optim_sd}, root, SAVE_AT)
    saved = {k: v for k, v in _state(model, opt).items() if "amax_history" not in k and "_scale" not in k[-7:]}

    fresh, fresh_opt = _build()
    model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
    state = {"model": model_sd, "optim": optim_sd}
    with pytest.raises(d.CheckpointError, match="input_amax_history"):
        d.load_checkpoint(state, d.latest_checkpoint(root))  # strict: the missing entries are named
    result = d.load_checkpoint(state, d.latest_checkpoint(root), strict=False)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = _state(fresh, fresh_opt)
    for key, value in saved.items():  # planes, masters and weight scaling exact
        assert torch.equal(loaded[key].view(torch.uint8), value.view(torch.uint8)), key
    return sorted({k.rsplit(".", 1)[-1] for k in result.missing_keys}), result.unexpected_keys


@pytest.mark.skipif(2 not in WORLD_SIZES, reason="needs 2 ranks")
def test_a_checkpoint_without_operand_states_loads_with_strict_false(pools, tmp_path):
    missing, unexpected = pools[2].run(_old_checkpoint_loads, str(tmp_path / "ckpt"))[0]
    assert missing == ["grad_amax_history", "grad_scale", "input_amax_history", "input_scale"]
    assert unexpected == []
