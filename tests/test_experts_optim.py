"""MoE expert weights under ``MasterWeightOptimizer`` and DCP: fp32 masters per expert weight,
requantized per expert after each step (the bytes of a per-expert ``quantize`` of the master), and
checkpoints that load byte-exact at another FSDP world size and resume training bit-exact."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import dtensor_fp8 as d
from dtensor_fp8.formats.base import Plane

from dist_utils import DEVICE, WORLD_SIZES
from test_experts_fsdp import COUNTS, DIM, NAMES, TOKENS, Experts, fp8_experts

EXPERT_WEIGHTS = ("w1", "w2", "w3")


def test_delayed_requantize_is_per_expert():
    """Delayed scaling keeps an amax history per expert: requantizing the 3-D weight with its stacked
    states is, byte for byte and state for state, each expert's 2-D requantization with its own."""
    base = d.DelayedScaling(amax_history_len=4)
    w = torch.randn(3, 64, 128) * torch.tensor([0.01, 1.0, 100.0]).reshape(-1, 1, 1)
    recipe = d.per_expert(base, w.shape)
    q = d.quantize(w, recipe)
    plane = q.plane("rowwise")
    state = recipe.initial_scaling_state(plane)
    assert state["amax_history"].shape == (3, 4)
    hp = (w * 1.5).reshape(-1, 128)
    for _ in range(2):  # twice: the second uses the history the first recorded
        new_plane, new_state = recipe.requantize_plane(hp, "rowwise", plane, state=state)
        for e in range(3):
            one = Plane(plane.data[e * 64:(e + 1) * 64], plane.scale_inv[e:e + 1])
            ref, ref_state = base.requantize_plane(hp[e * 64:(e + 1) * 64], "rowwise", one,
                                                   state={k: v[e] for k, v in state.items()})
            assert torch.equal(new_plane.data[e * 64:(e + 1) * 64].view(torch.uint8), ref.data.view(torch.uint8))
            assert torch.equal(new_plane.scale_inv[e], ref.scale_inv.reshape(-1))
            for k in state:
                assert torch.equal(new_state[k][e], ref_state[k].reshape(new_state[k][e].shape)), k
        plane, state = new_plane, new_state
    assert len(set(plane.scale_inv.reshape(-1).tolist())) == 3  # one scale per expert


def _build(name, world_mesh=True, lr=1e-2):
    model = fp8_experts(d.RECIPES[name])
    if world_mesh and dist.get_world_size() > 1:
        fully_shard(model, mesh=init_device_mesh(DEVICE, (dist.get_world_size(),)), reshard_after_forward=True)
    return model, d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=lr)


def _steps(model, opt, n, seed):
    losses = []
    world, rank = dist.get_world_size(), dist.get_rank()
    counts = torch.tensor(COUNTS, device=DEVICE)
    for step in range(n):
        g = torch.Generator().manual_seed(seed + step)
        x = torch.randn(world, TOKENS, DIM, generator=g).to(DEVICE)[rank]  # each rank its own tokens
        loss = model(x, counts).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _local(p):
    return p.to_local() if hasattr(p, "to_local") else p


def _check_requantized(model, opt, name):
    """Each rank's FP8 shard is the per-expert quantize of its fp32 master shard (stateless recipes),
    or within FP8 rounding of it (delayed: scales from the history)."""
    recipe = d.RECIPES[name]
    for pname in EXPERT_WEIGHTS:
        p = getattr(model, pname)
        q, master = _local(p), _local(opt.masters[pname])
        assert master.dtype == torch.float32 and master.shape == q.shape
        if name == "delayed":
            err = (q.dequantize(torch.float32) - master).abs().max() / master.abs().max()
            assert err < 0.07, (pname, float(err))
            continue
        for usage, plane in q.planes.items():
            m = q.shape[1]
            for e in range(q.shape[0]):
                ref = d.quantize(master[e], recipe).plane(usage)
                assert torch.equal(plane.data[e * m:(e + 1) * m].view(torch.uint8), ref.data.view(torch.uint8)), (pname, e)
                rows = plane.scale_inv.shape[0] // q.shape[0]
                assert torch.equal(plane.scale_inv[e * rows:(e + 1) * rows].view(torch.uint8),
                                   ref.scale_inv.contiguous().view(torch.uint8)), (pname, e)


def _train_and_check(name):
    model, opt = _build(name)
    losses = _steps(model, opt, 3, seed=0)
    _check_requantized(model, opt, name)
    assert losses[-1] < losses[0], losses
    return losses


@pytest.mark.parametrize("name", NAMES)
def test_masters_requantized_per_expert(pools, name):
    pools[WORLD_SIZES[0]].run(_train_and_check, name)


def _meta_build(name):
    """The meta-device flow: quantize_module_ on meta, fully_shard, to_empty, the init writes each
    rank's values, the optimizer makes the bytes: each rank's shard is then the per-expert quantize
    of its init values (its masters), and a step trains."""
    model = fp8_experts(d.RECIPES[name], meta=True)
    assert all(_local(getattr(model, n)).bytes_pending for n in EXPERT_WEIGHTS)
    fully_shard(model, mesh=init_device_mesh(DEVICE, (dist.get_world_size(),)), reshard_after_forward=True)
    model.to_empty(device=DEVICE)
    torch.manual_seed(dist.get_rank())
    with torch.no_grad():
        for n in EXPERT_WEIGHTS:
            torch.nn.init.trunc_normal_(getattr(model, n), std=0.02)
    opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-3)
    _check_requantized(model, opt, name)
    _steps(model, opt, 1, seed=0)
    _check_requantized(model, opt, name)


@pytest.mark.parametrize("name", ["current", "mxfp8"])
def test_meta_build_makes_per_expert_bytes(pools, name):
    pools[WORLD_SIZES[0]].run(_meta_build, name)


def _full(model, opt):
    """Every FP8 plane (bytes) and master, gathered to full tensors on CPU."""
    out = {}
    for pname in EXPERT_WEIGHTS:
        p = getattr(model, pname)
        q = _local(p)
        for usage in q.usages:
            full = d.for_usage(p, usage).full_tensor() if hasattr(p, "to_local") else q
            plane = full.plane(usage)
            out[f"{pname}/{usage}/data"] = plane.data.view(torch.uint8).cpu().clone()
            out[f"{pname}/{usage}/scale"] = plane.scale_inv.contiguous().view(torch.uint8).cpu().clone()
        m = opt.masters[pname]
        out[f"{pname}/master"] = (m.full_tensor() if hasattr(m, "full_tensor") else m).detach().cpu().clone()
    return out


def _save(root, name, steps):
    model, opt = _build(name)
    before = _steps(model, opt, steps, seed=0)
    model_sd, optim_sd = get_state_dict(model, opt)
    d.save_checkpoint({"model": model_sd, "optim": optim_sd}, root, steps)
    saved = _full(model, opt)
    after = _steps(model, opt, 2, seed=100)
    return saved, before, after, _full(model, opt)


def _load(root, name, continue_steps):
    model, opt = _build(name)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    d.load_checkpoint(state, d.latest_checkpoint(root))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = _full(model, opt)
    after = _steps(model, opt, continue_steps, seed=100)
    return loaded, after, _full(model, opt)


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_reshards_and_resumes_exactly(pools, tmp_path, name):
    """Saved at FSDP 2, loaded at FSDP 4 (and 2): the same bytes and masters; resuming at 2 gives
    the uninterrupted run's losses, planes and masters bit for bit."""
    if 2 not in WORLD_SIZES:
        pytest.skip("saves at 2 ranks")
    root = str(tmp_path / "ckpt")
    saved, _, uninterrupted, final = pools[2].run(_save, root, name, 2)[0]
    loaded, resumed, resumed_final = pools[2].run(_load, root, name, 2)[0]
    _same(loaded, saved)
    assert resumed == uninterrupted
    _same(resumed_final, final)
    if 4 in WORLD_SIZES:
        for loaded4, _, _ in pools[4].run(_load, root, name, 0):
            _same(loaded4, saved)


def _older_layout(t):
    """An expert plane or scale grid as dtensor_fp8 saved it before commit 92b7a64 (its
    ``state_dict._matrix_layout``): the planes' matrix ``(E * out, in)`` / ``(E * grid rows, grid
    cols)`` of the same local bytes, sharded as the experts are (``Shard(0)`` of the rows), i.e. the
    entry in the weight's own dims with its leading dims flattened. Checked against a checkpoint
    that commit wrote (2 gloo ranks, ``current``): the same keys, sizes and chunks in ``.metadata``."""
    if not isinstance(t, DTensor):
        return t.reshape(-1, t.shape[-1])
    shape = (math.prod(t.shape[:-1]), t.shape[-1])
    return DTensor.from_local(t.to_local().reshape(-1, t.shape[-1]), t.device_mesh, t.placements, run_check=False,
                              shape=torch.Size(shape), stride=(shape[1], 1))


def _flat(state, prefix=""):
    """A nested state dict's values under DCP's dotted keys."""
    out = {}
    for k, v in state.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _older_layout_refused(root, name):
    model, opt = _build(name)
    _steps(model, opt, 1, seed=0)
    model_sd, optim_sd = get_state_dict(model, opt)
    for pname in EXPERT_WEIGHTS:
        entry = model_sd[pname]
        for key in [k for k in entry if k.endswith(("_data", "_scale_inv"))]:
            entry[key] = _older_layout(entry[key])
    d.save_checkpoint({"model": model_sd, "optim": optim_sd}, root, 1)

    fresh, fresh_opt = _build(name)
    before = _full(fresh, fresh_opt)
    model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
    state = {"model": model_sd, "optim": optim_sd}
    values = {k: _local(v).clone() for k, v in _flat(state).items() if isinstance(v, torch.Tensor)}
    with pytest.raises(d.CheckpointError) as err:
        d.load_checkpoint(state, d.latest_checkpoint(root))
    message = str(err.value)
    key = next(k for k in message.split("'") if k.startswith("model.w"))  # the entry it names
    pname, field = key.split(".")[1:]
    shape = tuple(model_sd[pname][field].shape)
    assert field.endswith(("_data", "_scale_inv")) and len(shape) == 3, message
    assert f"is {(shape[0] * shape[1], shape[2])} in the checkpoint, {shape} in the state dict" in message, message
    assert "before commit 92b7a64" in message and "load_hp_checkpoint(model" in message, message
    assert "[every rank of" in message and "The state dict was not modified" in message, message
    after = _flat(state)
    for k, v in values.items():  # nothing half-loaded: the state dict and the model as they were
        assert torch.equal(_local(after[k]).reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k
    _same(_full(fresh, fresh_opt), before)


@pytest.mark.parametrize("name", ["current", "mxfp8"])
def test_older_expert_layout_is_refused_naming_the_fix(pools, tmp_path, name):
    """A checkpoint whose expert planes are in the layout written before commit 92b7a64 (flattened
    ``(E * out, in)``) is refused on every rank, naming the entry, both shapes and the way over
    (the older version's high-precision export, loaded here with ``load_hp_checkpoint``), and
    leaves the state dict and the model untouched."""
    pools[WORLD_SIZES[0]].run(_older_layout_refused, str(tmp_path / "ckpt"), name)


def _full_state_dict_roundtrip(name):
    """torch's full state dict of FSDP2 expert weights (every rank the whole planes, and delayed
    scaling's per-expert states whole) loads into another FSDP2 model byte for byte."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    model, opt = _build(name)
    _steps(model, opt, 2, seed=0)
    options = StateDictOptions(full_state_dict=True)
    sd = get_model_state_dict(model, options=options)
    fresh, fresh_opt = _build(name)
    set_model_state_dict(fresh, sd, options=options)
    for pname in EXPERT_WEIGHTS:
        a, b = _local(getattr(model, pname)), _local(getattr(fresh, pname))
        for usage, plane in a.planes.items():
            assert torch.equal(plane.data.view(torch.uint8), b.planes[usage].data.view(torch.uint8)), (pname, usage)
            assert torch.equal(plane.scale_inv.view(torch.uint8), b.planes[usage].scale_inv.view(torch.uint8))
        for key, value in a.param_state.scaling.entries().items():
            assert torch.equal(value, b.param_state.scaling.entries()[key]), (pname, key)


@pytest.mark.parametrize("name", ["delayed", "mxfp8"])
def test_full_state_dict_roundtrip(pools, name):
    pools[WORLD_SIZES[0]].run(_full_state_dict_roundtrip, name)
