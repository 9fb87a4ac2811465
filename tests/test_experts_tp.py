"""Tensor parallelism on FP8 expert weights (issue 48): torchtitan's layout of routed experts under TP,
``w1`` / ``w3`` ``[E, F, D]`` by ``Shard(1)`` (each rank ``F / tp`` rows of every expert) and ``w2``
``[E, D, F]`` by ``Shard(2)``, every recipe, alone (2 gloo ranks) and under FSDP2 over the experts
(dp 2 x tp 2, 4 ranks): each rank's pieces are the per-expert ``quantize`` of the full weight cut at
its rows / columns, gathers give the full weight's planes back as uint8, the grouped GEMMs on the
pieces (forward rowwise, input gradient columnwise) equal the emulated reference of the same
partial sums, and an optimizer step requantizes each piece as per-expert ``quantize`` of the master
(one scale per expert across the TP ranks for per-tensor recipes)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

import dtensor_fp8 as d
from dist_utils import DEVICE, WORLD_SIZES
from test_experts_fsdp import DIM, HIDDEN, NAMES, Experts, fp8_experts, inputs, reference

TP = 2
#: torchtitan's expert TP placements (torchtitan/models/common/moe_sharding.py)
PLACEMENTS = {"w1": Shard(1), "w2": Shard(2), "w3": Shard(1)}


def _bytes(t):
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def _equal(a: d.QuantizedTensor, b: d.QuantizedTensor) -> list[str]:
    """The stored planes of ``b`` that ``a`` does not hold byte for byte."""
    return [u for u, p in b.planes.items()
            if not (torch.equal(_bytes(a.planes[u].data), _bytes(p.data))
                    and torch.equal(_bytes(a.planes[u].scale_inv.contiguous()), _bytes(p.scale_inv.contiguous())))]


class _SumOverTP(torch.autograd.Function):
    """The row-parallel ``w2``'s partial outputs summed over the TP ranks; the gradient passes as it is
    (each rank's ``w2`` piece needs the whole output gradient), as TP's own reduction does."""

    @staticmethod
    def forward(ctx, y, group):
        y = y.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        return g, None


def _tp_forward(model, x, counts, group):
    """torchtitan's routed experts under TP on each rank's pieces (its ``local_map`` region)."""
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    w1, w2, w3 = (getattr(model, n).to_local().bfloat16().transpose(-2, -1) for n in ("w1", "w2", "w3"))
    h = F.silu(model._grouped_mm(A=x.bfloat16(), B_t=w1, offs=offs)) * model._grouped_mm(A=x.bfloat16(), B_t=w3, offs=offs)
    return _SumOverTP.apply(model._grouped_mm(A=h, B_t=w2, offs=offs), group).type_as(x)


def _cut(values: dict, name: str, r: int) -> dict:
    """TP rank ``r``'s piece of a weight's per-usage values (its ``PLACEMENTS`` dim, ``TP`` pieces)."""
    dim = PLACEMENTS[name].dim
    return {u: v.chunk(TP, dim)[r] for u, v in values.items()}


def _tp_reference(full, x, counts, upstream):
    """The one-process reference of the same partial sums: each TP rank's pieces of the per-expert
    ``quantize`` values, its partial output and input gradient, summed as the ranks sum them."""
    parts = [reference({n: _cut(full[n], n, r) for n in full}, x, counts, upstream) for r in range(TP)]
    y = sum(p[0].bfloat16() for p in parts[1:]) + parts[0][0].bfloat16()
    return y.float(), parts[0][1] + sum(p[1] for p in parts[1:])


def _mesh(tp=TP):
    world = dist.get_world_size()
    return init_device_mesh(DEVICE, (world // tp, tp), mesh_dim_names=("dp", "tp"))


def _tp_experts(recipe, mesh):
    """The FP8 experts with torchtitan's TP placements (sliced on each rank, no communication), then
    FSDP2 over the experts on ``dp`` when it has more than one rank."""
    model = fp8_experts(recipe)
    for n, placement in PLACEMENTS.items():
        model.register_parameter(n, nn.Parameter(distribute_tensor(getattr(model, n).detach(), mesh["tp"], [placement],
                                                                   src_data_rank=None)))
    model.forward = functools.partial(_tp_forward, model)  # through model(...): FSDP2's hooks gather
    if mesh["dp"].size() > 1:
        fully_shard(model, mesh=mesh["dp"], reshard_after_forward=True)
    return model


def _pieces_and_gathers(name):
    """Each TP rank's piece is the full weight's per-expert quantize cut at its rows (w1, w3) or
    columns (w2); ``full_tensor()`` of each direction gives the full weight's planes back."""
    recipe, mesh = d.RECIPES[name], _mesh()
    plain = Experts()
    model = _tp_experts(recipe, mesh)
    r = mesh["tp"].get_local_rank()
    bad = []
    for n, placement in PLACEMENTS.items():
        w = getattr(plain, n).detach()
        full = d.quantize(w, d.per_expert(recipe, w.shape))
        p = getattr(model, n)
        local = p.to_local()
        if mesh["dp"].size() == 1:  # the piece itself; under FSDP2 its dp shard (checked gathered below)
            want = d.quantize(w, d.per_expert(recipe, w.shape)).chunk(TP, placement.dim)[r]
            bad += [f"{n}/piece/{u}" for u in _equal(local, want)]
            if placement.dim == 1 and name in ("mxfp8", "blockwise1d", "blockwise2d"):  # whole blocks: its own quantize
                own = d.quantize(w.chunk(TP, 1)[r], d.per_expert(recipe, local.shape))
                bad += [f"{n}/own/{u}" for u in _equal(local, own)]
        for usage in local.usages:
            gathered = d.for_usage(p, usage).full_tensor()
            assert isinstance(gathered, d.QuantizedTensor) and tuple(gathered.shape) == tuple(w.shape)
            stored = recipe.stored_usage(usage)
            assert set(gathered.planes) == {stored}, (n, usage, set(gathered.planes))  # one direction moved
            bad += [f"{n}/gathered/{u}" for u in _equal(gathered, full.with_usages(usage))]
    return bad


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("name", NAMES)
def test_tp_pieces_of_expert_weights_and_their_gathers(pools, name, world):
    for bad in pools[world].run(_pieces_and_gathers, name):
        assert bad == [], bad


def _tp_step(name):
    """Forward and input gradient on the TP pieces equal the reference's partial sums bit for bit,
    twice (the second after an optimizer step: the pieces requantized from their masters, with one
    scale per expert over the TP ranks for per-tensor recipes, equal per-expert quantize of the
    gathered master)."""
    recipe, mesh = d.RECIPES[name], _mesh()
    model = _tp_experts(recipe, mesh)
    opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-2)
    group = mesh["tp"].get_group()
    x, counts, upstream = inputs()
    out = []
    for step in range(2):
        full = {}
        for n in PLACEMENTS:  # the values the reference reads: per-expert quantize of the master (or the bytes)
            p = getattr(model, n)
            master = opt.masters[n].full_tensor() if step else None
            q = d.for_usage(p, *p.to_local().usages).full_tensor()
            if master is not None and name != "delayed":  # delayed's scales come from its history
                out += [f"step{step}/{n}/{u}" for u in _equal(q, d.quantize(master, d.per_expert(recipe, master.shape)))]
            full[n] = {u: q.dequantize(torch.bfloat16, u) for u in ("rowwise", "columnwise")}
        xx = x.clone().requires_grad_()
        y = model(xx, counts, group)
        (y * upstream).sum().backward()
        grad = xx.grad.clone()
        dist.all_reduce(grad, group=group)
        y_ref, gx_ref = _tp_reference(full, x, counts, upstream)
        out += [] if torch.equal(y, y_ref) else [f"step{step}/y"]
        out += [] if torch.equal(grad, gx_ref) else [f"step{step}/x.grad"]
        opt.step()
        opt.zero_grad()
    if name in ("mxfp8", "blockwise1d"):  # the planes differ, so the input-gradient check can fail
        assert not torch.equal(full["w1"]["rowwise"], full["w1"]["columnwise"])
    return out


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("name", NAMES)
def test_tp_grouped_gemms_and_step_on_expert_pieces(pools, name, world):
    for bad in pools[world].run(_tp_step, name):
        assert bad == [], bad


def test_expert_rows_cut_inside_blocks_is_refused_naming_the_fix():
    """A TP piece of an expert's rows must be whole blocks (pieces that split them, as 2-D
    ColwiseParallel weights may, are not built for expert weights): 64 rows of a 128-row block."""
    w = torch.randn(2, HIDDEN, DIM)
    q = d.quantize(w, d.per_expert(d.Blockwise(block_dims=2), w.shape))
    with pytest.raises(d.RecipeError, match=r"rows \[0, 64\) of each expert .*128-row blocks.*degree in \[1, 2\]"):
        torch.chunk(q, 4, dim=1)
    # per-tensor recipes: any cut, each piece keeping its expert's one scale
    q = d.quantize(w, d.per_expert(d.CurrentScaling(), w.shape))
    pieces = torch.chunk(q, 4, dim=1)
    assert all(torch.equal(p.plane("rowwise").scale_inv, q.plane("rowwise").scale_inv) for p in pieces)
    assert _equal(torch.cat(pieces, 1), q) == []


def _gathered(model, opt):
    """Every expert weight's stored planes (bytes) and master, gathered whole."""
    out = {}
    for n in PLACEMENTS:
        p = getattr(model, n)
        for usage in p.to_local().usages:
            plane = d.for_usage(p, usage).full_tensor().plane(usage)
            out[f"{n}/{usage}"] = _bytes(plane.data).clone()
            out[f"{n}/{usage}/scale"] = _bytes(plane.scale_inv.contiguous()).clone()
        out[f"{n}/master"] = opt.masters[n].full_tensor().detach().clone()
    return out


def _dcp_across_tp(name, root):
    """Saved (model and optimizer, through DCP on disk) with the experts TP-sharded (dp x tp 2), loaded
    with FSDP2 alone (tp 1) and back into the TP layout: every plane and master as saved, byte for byte;
    torch's full state dict of the same model loads into either layout with the same planes."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                         set_model_state_dict, set_state_dict)

    def build(tp):
        model = _tp_experts(d.RECIPES[name], _mesh(tp))
        return model, d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-2)

    def load(tp):
        model, opt = build(tp)
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        d.load_checkpoint(state, d.latest_checkpoint(root))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return _gathered(model, opt)

    model, opt = build(TP)
    x, counts, upstream = inputs()
    (model(x.clone(), counts, _mesh()["tp"].get_group()) * upstream).sum().backward()
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    d.save_checkpoint({"model": model_sd, "optim": optim_sd}, root, 1)
    saved = _gathered(model, opt)
    bad = [f"tp{tp}/{k}" for tp in (1, TP) for k, v in load(tp).items() if not torch.equal(v, saved[k])]
    # torch's full state dict of the TP pieces (every rank the whole planes) loads into the other layout
    options = StateDictOptions(full_state_dict=True)
    full = get_model_state_dict(model, options=options)
    for tp in (1, TP):
        fresh, fresh_opt = build(tp)
        set_model_state_dict(fresh, full, options=options)
        got = _gathered(fresh, fresh_opt)
        bad += [f"full/tp{tp}/{k}" for k, v in got.items() if not k.endswith("master") and not torch.equal(v, saved[k])]
    return bad


@pytest.mark.parametrize("name", NAMES)
def test_dcp_saved_at_one_tp_degree_loads_at_another(pools, tmp_path, name):
    for bad in pools[WORLD_SIZES[0]].run(_dcp_across_tp, name, str(tmp_path / "ckpt")):
        assert bad == [], bad


def _fsdp_inside_experts():
    model = fp8_experts(d.RECIPES["mxfp8"])
    with pytest.raises(d.RecipeError, match=r"like an FP8 weight of shape \(8, 256, 128\).*FSDP2's shard of a dim in "
                                            r"between.*Shard the experts \(dim 0\) instead"):
        fully_shard(model, mesh=init_device_mesh(DEVICE, (dist.get_world_size(),)), shard_placement_fn=lambda p: Shard(1))


def test_fsdp_shard_inside_experts_is_refused_by_fully_shard(pools):
    """FSDP2's own ``Shard(1)`` of an expert weight (torchtitan's choice with more ranks than experts):
    the slicing accepts whole-block pieces (TP's), but FSDP2 would reassemble each gathered tensor by
    viewing it as the weight's shape, which the scale grids are not: ``fully_shard`` refuses, naming
    the fix."""
    pools[WORLD_SIZES[0]].run(_fsdp_inside_experts)
