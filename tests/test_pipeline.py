"""Pipeline parallelism with FP8 parameters: torch's own ``torch.distributed.pipelining`` stages and
schedules (GPipe, 1F1B, interleaved 1F1B with two stages per rank) on real gloo process groups:
alone (pp=2), over FSDP2 (pp=2 x dp=2, with torchtitan's PP policy ``reshard_after_forward=False``
and with FSDP2's default ``True``), with stages of unequal size (3 + 1 blocks) and over FSDP2 + TP
(torchtitan's pp x dp x tp), for every recipe and for delayed scaling with FP8 GEMMs.

Each layout trains 6 steps with a ``MasterWeightOptimizer`` per stage and is compared with the same
model trained in one process on the same global batch, split into the same micro-batches:

* the losses and fp32 masters equal the one-process run's (bit for bit without FSDP; within float
  tolerance where FSDP averages gradients in another order);
* after every step every FP8 weight's bytes, gathered over its stage's mesh, are
  ``quantize(full master)`` byte for byte; under delayed scaling with the scale its own history
  gives, whose newest entry is the full master's amax (a weight never holds another's);
* delayed scaling's histories (weight, and GEMM operands with FP8 GEMMs) equal the one-process
  run's, and the FP8 GEMMs ran for every linear and micro-batch.

The stages are built as torchtitan builds them: each stage is the whole model with the other
stages' blocks deleted (parameter names stay the model's own, so one checkpoint serves every
stage: tests/test_pipeline_checkpoint.py), then TP and FSDP2 are applied to the stage
(``fully_shard`` on each block and on the stage, over the stage's ``dp`` sub-mesh), then
``PipelineStage`` over the ``pp`` dimension's group. The stages' inputs and outputs are given to
``PipelineStage`` (static metadata): torch 2.13's dynamic inference would run an extra forward and
backward of the first micro-batch.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import dtensor_fp8 as d
from dtensor_fp8 import gemm
from dist_utils import DEVICE, WORLD_SIZES

DIM = 256  # every weight (256, 256): 128-row shards over dp=2 and 128-column shards over tp=2 are whole blocks
MB_ROWS = 16  # rows per micro-batch (a multiple of 16: torch's FP8 GEMM kernel)
N_MB = 4  # micro-batches per step and pipeline rank
STEPS = 6
LR, MOMENTUM = 0.05, 0.9
#: recipes by test name: the library's five, and delayed scaling with FP8 GEMMs (torch's CPU tensorwise kernel)
RECIPES = {**{name: (r, False) for name, r in d.RECIPES.items()}, "delayed_gemm": (d.RECIPES["delayed"], True)}


class Block(nn.Module):
    """A residual Linear -> GELU -> Linear block."""

    def __init__(self, dim: int):
        super().__init__()
        self.up = nn.Linear(dim, dim, bias=False)
        self.down = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class Stack(nn.Module):
    """Blocks in a ``ModuleDict`` keyed by their index in the whole model (a stage deletes the others)."""

    def __init__(self, n_blocks: int, dim: int):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Block(dim) for i in range(n_blocks)})

    def forward(self, x):
        for block in self.layers.values():
            x = block(x)
        return x


def _hp_model(n_blocks: int, dim: int) -> Stack:
    torch.manual_seed(0)
    model = Stack(n_blocks, dim)
    with torch.no_grad():  # magnitudes spread over rows, so rowwise and columnwise blocks differ
        for block in model.layers.values():
            for lin in (block.up, block.down):
                lin.weight.mul_(torch.logspace(-0.5, 0.5, dim)[:, None])
    return model.to(DEVICE)


class Layout(NamedTuple):
    pp: int
    dp: int
    tp: int
    blocks: tuple  # blocks per stage, in stage order
    reshard: bool = False  # fully_shard(reshard_after_forward=...) of every block and stage
    dim: int = DIM
    stages_per_rank: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp


def _tp_layout() -> Layout:
    # torchtitan's pp x dp x tp: pp=2 x dp=2 x tp=2 where the suite runs 8-rank pools (512-row weights:
    # 128-row shards over tp x dp), else pp=2 x dp=1 x tp=2 (FSDP2 over a one-rank dp dimension)
    return Layout(2, 2, 2, (2, 2), dim=2 * DIM) if 8 in WORLD_SIZES else Layout(2, 1, 2, (2, 2))


LAYOUTS = {
    "pp": Layout(2, 1, 1, (2, 2)),
    # torchtitan's FSDP policy under PP: no reshard after forward (one gather per step, not per micro-batch)
    "pp_fsdp": Layout(2, 2, 1, (2, 2)),
    # FSDP2's default for blocks: every micro-batch's forward and backward gather
    "pp_fsdp_reshard": Layout(2, 2, 1, (2, 2), reshard=True),
    "pp_fsdp_unequal": Layout(2, 2, 1, (3, 1), reshard=True),
    "pp_fsdp_tp": _tp_layout(),
    # 160-row weights over dp=2: 80-row shards split 128-row blocks and MXFP8's 32-row column blocks
    "pp_fsdp_split": Layout(2, 2, 1, (2, 2), reshard=True, dim=160),
}
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}
#: (layout, schedule) pairs run: every schedule where the stages are equal, GPipe for unequal stages (what
#: differs there is which weights each stage's scaling collectives carry, not the order of micro-batches),
#: interleaved (two one-block stages per rank) without TP
CASES = [(layout, schedule) for layout in LAYOUTS for schedule in SCHEDULES
         if (layout != "pp_fsdp_unequal" or schedule == "gpipe") and (layout != "pp_fsdp_tp" or schedule != "interleaved")
         and (layout != "pp_fsdp_split" or schedule == "1f1b")]


def _layout(name: str, schedule: str) -> Layout:
    layout = LAYOUTS[name]
    if schedule == "interleaved":  # two one-block stages per rank: 4 stages
        blocks = (1,) * sum(layout.blocks)
        return layout._replace(blocks=blocks, stages_per_rank=len(blocks) // layout.pp)
    return layout


def _batch(step: int, dp: int, dim: int):
    """The step's global batch, as ``dp`` slices of ``N_MB`` micro-batches each."""
    g = torch.Generator().manual_seed(1000 + step)
    rows = dp * N_MB * MB_ROWS
    x = torch.randn(rows, dim, generator=g)
    target = torch.randn(rows, dim, generator=g)
    return x.to(DEVICE).chunk(dp), target.to(DEVICE).chunk(dp)


def _loss(out, target):
    return F.mse_loss(out, target)


@contextlib.contextmanager
def _one_thread():
    """One intra-op thread: with ranks and other jobs sharing two cores, torch's default threads
    spin against each other (a step 15-20x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ---- what a step leaves, gathered -----------------------------------------------------------------
def _snapshot(model: nn.Module, opt: d.MasterWeightOptimizer) -> dict:
    """Every FP8 weight's full master, full planes and scaling states (weight and GEMM operands), on CPU."""
    out = {}
    masters = opt.masters
    for name, p in model.named_parameters():
        local = d.placement.local_tensor(p)
        if not isinstance(local, d.QuantizedTensor):
            continue
        name = d.optim.canonical_fqn(name)
        full = p.full_tensor() if isinstance(p, DTensor) else p
        master = masters[name]
        entry = {"master": (master.full_tensor() if isinstance(master, DTensor) else master).detach().cpu().clone()}
        for usage, plane in full.planes.items():
            entry[f"{usage}/data"] = plane.data.contiguous().view(torch.uint8).cpu().clone()
            entry[f"{usage}/scale_inv"] = plane.scale_inv.contiguous().view(torch.uint8).cpu().clone()
        for key, value in local.param_state.scaling.entries().items():
            entry[key] = value.detach().float().cpu().clone()
        out[name] = entry
    return out


# ---- the pipeline run --------------------------------------------------------------------------------
def _build_stages(layout: Layout, recipe, mesh):
    """This rank's stage modules (torchtitan's way: the whole model, other stages' blocks deleted)."""
    pp_rank = mesh["pp"].get_local_rank()
    n_stages = len(layout.blocks)
    stage_ids = [pp_rank + k * layout.pp for k in range(layout.stages_per_rank)]
    starts = [sum(layout.blocks[:s]) for s in range(n_stages)]
    whole = _hp_model(sum(layout.blocks), layout.dim)
    modules = []
    for s in stage_ids:
        module = copy.deepcopy(whole)
        keep = {str(i) for i in range(starts[s], starts[s] + layout.blocks[s])}
        for key in [k for k in module.layers if k not in keep]:
            del module.layers[key]
        if recipe is not None:
            d.quantize_module_(module, recipe)
        if layout.tp > 1:
            for block in module.layers.values():
                d.parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        if layout.dp > 1 or layout.tp > 1:
            for block in module.layers.values():
                fully_shard(block, mesh=mesh["dp"], reshard_after_forward=layout.reshard)
            fully_shard(module, mesh=mesh["dp"], reshard_after_forward=layout.reshard)
        modules.append(module)
    return stage_ids, modules


class Pipeline(NamedTuple):
    """This rank's part of a pipeline: its stages' modules, their optimizers and the schedule."""

    layout: Layout
    mesh: object
    stage_ids: list
    modules: list
    opts: list
    schedule: object
    dp_rank: int
    reporting: bool  # the first rank of its stage's dp x tp mesh

    @property
    def first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def last(self) -> bool:
        return len(self.layout.blocks) - 1 in self.stage_ids


def build_pipeline(layout: Layout, schedule_name: str, recipe) -> Pipeline:
    """The stages of ``layout`` this rank holds (``recipe``: None keeps the model in fp32 with a plain
    torch optimizer), a ``MasterWeightOptimizer`` per stage and the schedule."""
    dims = [("pp", layout.pp)] + [(n, s) for n, s in (("dp", layout.dp), ("tp", layout.tp)) if s > 1 or layout.tp > 1]
    mesh = init_device_mesh(DEVICE, tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))
    assert mesh.size() == torch.distributed.get_world_size()
    stage_ids, modules = _build_stages(layout, recipe, mesh)
    n_stages = len(layout.blocks)

    def example(requires_grad):  # static metadata: a micro-batch's activation
        return torch.empty(MB_ROWS, layout.dim, device=DEVICE, requires_grad=requires_grad)

    # every stage's input but the first's carries a gradient
    stages = [PipelineStage(m, s, n_stages, torch.device(DEVICE), input_args=(example(s > 0),),
                            output_args=(example(True),), group=mesh["pp"].get_group())
              for s, m in zip(stage_ids, modules)]
    schedule = SCHEDULES[schedule_name](stages if layout.stages_per_rank > 1 else stages[0], N_MB, loss_fn=_loss)
    if recipe is None:
        opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM) for m in modules]
    else:
        opts = [d.MasterWeightOptimizer(m, torch.optim.SGD, lr=LR, momentum=MOMENTUM) for m in modules]
    dp_rank = mesh["dp"].get_local_rank() if "dp" in mesh.mesh_dim_names else 0
    reporting = all(mesh[n].get_local_rank() == 0 for n in mesh.mesh_dim_names if n != "pp")
    return Pipeline(layout, mesh, stage_ids, modules, opts, schedule, dp_rank, reporting)


def pipeline_step(run: Pipeline, step: int) -> list[float]:
    """One training step: the schedule over the step's batch (this dp rank's slice), then every
    stage's optimizer. Returns the micro-batches' losses (on the ranks of the last stage)."""
    xs, targets = _batch(step, run.layout.dp, run.layout.dim)
    losses: list = []
    args = (xs[run.dp_rank],) if run.first else ()
    kwargs = {"target": targets[run.dp_rank], "losses": losses} if run.last else {}
    run.schedule.step(*args, **kwargs)
    for opt in run.opts:
        opt.step()
        opt.zero_grad()
    return [float(v.detach()) for v in losses]


def _train_pipeline(layout_name: str, schedule_name: str, recipe_name: str):
    with _one_thread():
        return _train_pipeline_stages(layout_name, schedule_name, recipe_name)


def _train_pipeline_stages(layout_name: str, schedule_name: str, recipe_name: str):
    recipe, fp8_gemms = RECIPES[recipe_name]
    run = build_pipeline(_layout(layout_name, schedule_name), schedule_name, recipe)
    steps, losses = [], []
    with gemm.fp8_gemms("on" if fp8_gemms else "off"), gemm.recording() as log:
        for step in range(STEPS):
            losses.append(pipeline_step(run, step))
            # the gathers are collectives over each stage's mesh: every rank takes part
            snap = {}
            for m, opt in zip(run.modules, run.opts):
                snap.update(_snapshot(m, opt))
            if run.reporting:
                steps.append(snap)
    return {"stage_ids": run.stage_ids, "dp_rank": run.dp_rank, "reporting": run.reporting, "steps": steps,
            "losses": losses, "fp8_gemms_run": len(log)}


# ---- the one-process run ---------------------------------------------------------------------------
@functools.lru_cache(maxsize=3)  # the layouts of one recipe share it (the tests run recipe by recipe)
def _train_one_process(n_blocks: int, dim: int, dp: int, recipe_name: str, fp8_gemms: bool):
    """The same model on one process: the same global batch in the same micro-batches, each
    micro-batch's mean loss backpropagated, the summed gradients divided by the micro-batch count
    (what the schedule's ``scale_grads`` and FSDP's averaging over dp do)."""
    with _one_thread():
        return _train_one_process_steps(n_blocks, dim, dp, recipe_name, fp8_gemms)


def _train_one_process_steps(n_blocks: int, dim: int, dp: int, recipe_name: str, fp8_gemms: bool):
    recipe = RECIPES[recipe_name][0]
    model = d.quantize_module_(_hp_model(n_blocks, dim), recipe)
    opt = d.MasterWeightOptimizer(model, torch.optim.SGD, lr=LR, momentum=MOMENTUM)
    steps, losses = [], []
    with gemm.fp8_gemms("on" if fp8_gemms else "off"):
        for step in range(STEPS):
            xs, targets = _batch(step, dp, dim)
            step_losses = []
            for x, target in zip(xs, targets):
                for xm, tm in zip(x.chunk(N_MB), target.chunk(N_MB)):
                    loss = _loss(model(xm), tm)
                    loss.backward()
                    step_losses.append(float(loss.detach()))
            for p in model.parameters():
                p.grad.div_(N_MB * dp)
            opt.step()
            opt.zero_grad()
            steps.append(_snapshot(model, opt))
            losses.append(step_losses)
    return steps, losses


# ---- the comparison ------------------------------------------------------------------------------------
#: [Tolerance] Without FSDP a stage computes each micro-batch exactly as the one-process run does and
#: the schedule sums and scales the gradients in the same order: everything is bit-identical. Under
#: FSDP the gradient is averaged over dp in another order (a reduce-scatter): fp32 masters differ in
#: the last bits (measured: 1.5e-8 after 6 steps on masters up to ~0.6); a master crossing an FP8
#: rounding boundary would move its weight one FP8 step and feed that into later gradients, which
#: the bound below also covers (test_fsdp.py measured up to 1.7e-3 over 20 steps).
MASTER_ATOL = 2e-3
HISTORY_RTOL = 1e-3


def _expected_planes(master, recipe, entry):
    """quantize(full master): delayed scaling with the scale its own history gives, whose newest
    amax must be this master's."""
    if not isinstance(recipe, d.DelayedScaling):
        return d.quantize(master, recipe).planes
    history, scale = entry["rowwise_amax_history"], entry["rowwise_scale"]
    amax = master.abs().max()
    assert torch.equal(history[-1], amax), f"history's newest amax {history[-1].item()} != master's {amax.item()}"
    fp8_max = torch.tensor(torch.finfo(recipe.fp8_dtype).max, dtype=torch.float32)
    assert torch.equal(scale.reshape(()), fp8_max / history.max()), (scale, history.max())
    return d.quantize(master, recipe, scale=scale).planes


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    return a.shape == b.shape and torch.equal(a, b)


def _merged_steps(results: list) -> list[dict]:
    """Per step, every stage's snapshot (from the first rank of each stage's dp x tp mesh)."""
    steps = [{} for _ in range(STEPS)]
    for r in results:
        if r["reporting"]:
            for merged, snap in zip(steps, r["steps"], strict=True):
                assert not set(merged) & set(snap), "two stages report the same weight"
                merged.update(snap)
    return steps


def _check_against_one_process(layout: Layout, recipe_name: str, results: list, reference) -> None:
    recipe, fp8_gemms = RECIPES[recipe_name]
    ref_steps, ref_losses = reference
    exact = layout.dp == 1 and layout.tp == 1
    n_stages = len(layout.blocks)
    # the losses of every micro-batch, from the ranks holding the last stage (one per dp rank)
    losses = {}
    for r in results:
        if n_stages - 1 in r["stage_ids"]:
            losses.setdefault(r["dp_rank"], r["losses"])
    assert sorted(losses) == list(range(layout.dp))
    got = torch.tensor([sum((losses[rank][step] for rank in range(layout.dp)), []) for step in range(STEPS)])
    want = torch.tensor(ref_losses)
    if exact:
        assert _same_bytes(got, want), (got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=0)
    assert got[-1].mean() < got[0].mean() * 0.95, got  # it trains
    for step, (merged, ref) in enumerate(zip(_merged_steps(results), ref_steps, strict=True)):
        assert merged.keys() == ref.keys(), (step, sorted(merged), sorted(ref))
        for name, entry in merged.items():
            where = f"{recipe_name}, step {step + 1}, {name}"
            master = entry["master"]
            if exact:
                assert _same_bytes(master, ref[name]["master"]), where
            else:
                torch.testing.assert_close(master, ref[name]["master"], rtol=0, atol=MASTER_ATOL, msg=where)
            want = _expected_planes(master, recipe, entry)
            assert {k.split("/")[0] for k in entry if "/" in k} == set(want), where
            for usage, plane in want.items():
                assert torch.equal(entry[f"{usage}/data"], plane.data.contiguous().view(torch.uint8)), f"{where} {usage} bytes"
                assert _same_bytes(entry[f"{usage}/scale_inv"], plane.scale_inv), f"{where} {usage} scales"
            for key in (k for k in ref[name] if "amax_history" in k or k.endswith("_scale")):
                if exact:
                    assert _same_bytes(entry[key], ref[name][key]), f"{where} {key}"
                else:
                    torch.testing.assert_close(entry[key], ref[name][key], rtol=HISTORY_RTOL, atol=0, msg=f"{where} {key}")
            if fp8_gemms and layout.tp == 1:  # the GEMMs recorded operand amaxes (not a history of zeros)
                assert entry["input_amax_history"][-1] > 0 and entry["grad_amax_history"][-1] > 0, where
    if fp8_gemms and layout.tp == 1:  # fprop, dgrad and wgrad of every linear and micro-batch (no dgrad into the input)
        for r in results:
            want = STEPS * N_MB * sum(3 * 2 * layout.blocks[s] - (s == 0) for s in r["stage_ids"])
            assert r["fp8_gemms_run"] == want, (r["stage_ids"], r["fp8_gemms_run"], want)


@pytest.mark.parametrize("layout_name,schedule_name", CASES, ids=[f"{a}-{b}" for a, b in CASES])
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_pipeline_trains_like_one_process(pools, layout_name, schedule_name, recipe_name):
    layout = _layout(layout_name, schedule_name)
    if layout.world not in WORLD_SIZES:
        pytest.skip(f"needs {layout.world} ranks")
    results = pools[layout.world].run(_train_pipeline, layout_name, schedule_name, recipe_name)
    # Under TP the local GEMMs run the emulated linear (docs/README.md, Limitations): the one-process
    # run that computes the same is the one without FP8 GEMMs.
    emulated = RECIPES[recipe_name][1] and layout.tp > 1
    if emulated:
        assert all(r["fp8_gemms_run"] == 0 for r in results)
    reference = _train_one_process(sum(layout.blocks), layout.dim, layout.dp, recipe_name,
                                   RECIPES[recipe_name][1] and not emulated)
    _check_against_one_process(layout, recipe_name, results, reference)
