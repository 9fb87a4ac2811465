"""One checkpoint for all pipeline stages, each loading its own part (torchtitan's way), resumed
bit-exactly: FP8 planes, masters, optimizer state, delayed scaling's histories (weight and GEMM
operands) and losses equal the uninterrupted run's byte for byte.

Every stage saves its own entries (whole-model names: each stage is the whole model with the other
stages' blocks deleted, tests/test_pipeline.py) into one directory, through
``dtensor_fp8.save_checkpoint`` and through plain ``dcp.save``; a fresh pipeline loads it stage by
stage with ``load_checkpoint(...)`` (``verify=False`` for the plain save) and
with plain ``dcp.load``. Optimizer state dicts as torch's ``get_state_dict`` gives them, and
flattened (``StateDictOptions(flatten_optimizer_state_dict=True)``, as torchtitan saves them and
as two stages on one rank need). A model without FP8 (fp32, plain ``torch.optim.SGD``) too.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

import dtensor_fp8 as d
from dtensor_fp8 import gemm
from dist_utils import WORLD_SIZES
from test_pipeline import LR, RECIPES, Layout, _layout, _one_thread, build_pipeline, pipeline_step

SAVE_AT, AFTER = 2, 2
#: (layout, schedule, optimizer state dict form, how it is saved and loaded)
CASES = {
    # torch's get_state_dict as it is: each stage's param group lists that stage's parameters
    "pp_fsdp-gpipe-nested": ("pp_fsdp", "gpipe", "nested", ("save_checkpoint",)),
    # two stages per rank: state dicts merged as torchtitan merges them (flattened optimizer state)
    "pp_fsdp-interleaved-flat": ("pp_fsdp", "interleaved", "flat", ("save_checkpoint", "dcp")),
    "pp-1f1b-flat": ("pp", "1f1b", "flat", ("save_checkpoint", "dcp")),
}
RECIPE_NAMES = [*RECIPES, "fp32"]


def _recipe(name):
    return (None, False) if name == "fp32" else RECIPES[name]


def _state_dict(run, form: str) -> dict:
    """Every stage's model and optimizer state dicts on this rank, merged (torchtitan's ModelWrapper and
    OptimizersContainer do the same)."""
    options = StateDictOptions(flatten_optimizer_state_dict=form == "flat")
    model_sd, optim_sd = {}, {}
    for module, opt in zip(run.modules, run.opts):
        m, o = get_state_dict(module, opt, options=options)
        model_sd.update(m)
        if form == "nested":
            assert not optim_sd, "nested optimizer state dicts of two stages would collide: flatten them"
        optim_sd.update(o)
    return {"model": model_sd, "optim": optim_sd}


def _set_state_dict(run, state: dict, form: str) -> None:
    options = StateDictOptions(flatten_optimizer_state_dict=form == "flat", strict=len(run.modules) == 1)
    for module, opt in zip(run.modules, run.opts):
        set_state_dict(module, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    t = (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().contiguous()
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t.reshape(-1).view(torch.uint8)


def _everything(run) -> dict:
    """Every parameter (FP8 planes), master, optimizer state entry and scaling state of this rank's
    stages, gathered, as bytes (collectives over each stage's mesh: every rank calls it)."""
    out = {}
    for module, opt in zip(run.modules, run.opts):
        for name, p in module.named_parameters():
            local = d.placement.local_tensor(p)
            if isinstance(local, d.QuantizedTensor):
                full = p.full_tensor() if isinstance(p, DTensor) else p
                for usage, plane in full.planes.items():
                    out[f"{name}/{usage}/data"] = _bytes(plane.data)
                    out[f"{name}/{usage}/scale_inv"] = _bytes(plane.scale_inv)
                for key, value in local.param_state.scaling.entries().items():
                    out[f"{name}/{key}"] = _bytes(value)
            else:
                out[name] = _bytes(p)
        for i, state in opt.state_dict()["state"].items():
            for key, value in state.items():
                out[f"optim{run.modules.index(module)}/{i}/{key}"] = _bytes(value) if isinstance(value, torch.Tensor) else value
    return out


def _uninterrupted(case: str, recipe_name: str, root: str):
    layout_name, schedule, form, paths = CASES[case]
    recipe, fp8_gemms = _recipe(recipe_name)
    with _one_thread(), gemm.fp8_gemms("on" if fp8_gemms else "off"):
        run = build_pipeline(_layout(layout_name, schedule), schedule, recipe)
        for step in range(SAVE_AT):
            pipeline_step(run, step)
        state = {**_state_dict(run, form), "step": SAVE_AT}
        if "save_checkpoint" in paths:
            d.save_checkpoint(state, root, SAVE_AT)
        if "dcp" in paths:
            dcp.save(state, checkpoint_id=f"{root}/plain")
        losses = [pipeline_step(run, step) for step in range(SAVE_AT, SAVE_AT + AFTER)]
        return losses, _everything(run)


def _resumed(case: str, recipe_name: str, root: str):
    layout_name, schedule, form, paths = CASES[case]
    recipe, fp8_gemms = _recipe(recipe_name)
    out = {}
    for path in paths:
        with _one_thread(), gemm.fp8_gemms("on" if fp8_gemms else "off"):
            run = build_pipeline(_layout(layout_name, schedule), schedule, recipe)
            state = {**_state_dict(run, form), "step": 0}
            if path == "save_checkpoint":
                loaded = d.load_checkpoint(state, d.latest_checkpoint(root), coverage="group")
                assert loaded == ([], [])
            else:
                dcp.load(state, checkpoint_id=f"{root}/plain")
            assert state["step"] == SAVE_AT
            _set_state_dict(run, state, form)
            losses = [pipeline_step(run, step) for step in range(SAVE_AT, SAVE_AT + AFTER)]
            out[path] = (losses, _everything(run))
    return out


@pytest.mark.parametrize("recipe_name", RECIPE_NAMES)
@pytest.mark.parametrize("case", list(CASES))
def test_every_stage_resumes_its_part_bit_exactly(pools, tmp_path, case, recipe_name):
    layout = _layout(*CASES[case][:2])
    if layout.world not in WORLD_SIZES:
        pytest.skip(f"needs {layout.world} ranks")
    root = str(tmp_path / "ckpt")
    pool = pools[layout.world]
    uninterrupted = pool.run(_uninterrupted, case, recipe_name, root)
    resumed = pool.run(_resumed, case, recipe_name, root)
    for rank, ((losses, final), by_path) in enumerate(zip(uninterrupted, resumed, strict=True)):
        assert by_path.keys() == set(CASES[case][3])
        for path, (resumed_losses, resumed_final) in by_path.items():
            assert resumed_losses == losses, (rank, path)  # bit-identical, step by step
            assert resumed_final.keys() == final.keys(), (rank, path)
            for key, value in final.items():
                same = torch.equal(resumed_final[key], value) if isinstance(value, torch.Tensor) else resumed_final[key] == value
                assert same, (rank, path, key)


# ---- what is still refused ---------------------------------------------------------------------------
def _refusals(root: str):
    """A 5-block pipeline (3 + 2) saves; a 4-block one (2 + 2) loads. Returns what each call said."""
    said = {}
    with _one_thread():
        deeper = build_pipeline(Layout(2, 2, 1, (3, 2)), "gpipe", RECIPES["current"][0])
        pipeline_step(deeper, 0)
        state = {**_state_dict(deeper, "nested"), "step": 1}
        d.save_checkpoint(state, root, 1)
        # a param group's hyper-parameter that differs between stages is still refused (one copy is stored)
        if deeper.mesh["pp"].get_local_rank() == 1:
            state["optim"]["param_groups"][0]["lr"] = LR / 2
        try:
            d.save_checkpoint(state, root, 2)
        except d.CheckpointError as err:
            said["divergent lr"] = str(err)
        run = build_pipeline(Layout(2, 2, 1, (2, 2)), "gpipe", RECIPES["current"][0])
        before = _everything(run)
        state = {**_state_dict(run, "nested"), "step": 0}
        for coverage in ("rank", "group"):
            try:
                d.load_checkpoint(state, d.latest_checkpoint(root), coverage=coverage)
            except d.CheckpointError as err:
                said[coverage] = str(err)
        assert state["step"] == 0
        assert all(torch.equal(v, before[k]) if isinstance(v, torch.Tensor) else v == before[k]
                   for k, v in _everything(run).items())  # the refused loads changed nothing
        said["lenient"] = d.load_checkpoint(state, d.latest_checkpoint(root), coverage="group", strict=False)
        said["block 4 saved"] = sorted(k for k in d.checkpoint.read_metadata(d.latest_checkpoint(root)).state_dict_metadata
                                       if ".layers.4." in k)
        assert len(said["block 4 saved"]) > 4  # the planes, recipes, masters, optimizer state of two weights
        assert state["step"] == 1
    return said


def test_entries_no_stage_asks_for_are_still_refused(pools, tmp_path):
    if 4 not in WORLD_SIZES:
        pytest.skip("needs 4 ranks")
    for rank, said in enumerate(pools[4].run(_refusals, str(tmp_path / "ckpt"))):
        assert "'optim.param_groups.0.lr': ranks 0, 1 / ranks 2, 3 hold different values" in said["divergent lr"]
        # each stage alone lacks the other stage's entries: the default refuses, naming the switch
        assert "the state dict does not ask for" in said["rank"] and 'coverage="group"' in said["rank"], said["rank"]
        # no stage asks for block 4's entries: named, whatever rank
        assert "no rank's state dict asks for" in said["group"], said["group"]
        assert "'model.layers.4.down.weight.rowwise_data'" in said["group"], said["group"]
        # strict=False loads the rest and returns exactly block 4's entries (model and optimizer)
        assert said["lenient"].unexpected_keys == said["block 4 saved"], (said["lenient"], said["block 4 saved"])
        assert said["lenient"].missing_keys == []


def test_coverage_names_its_values():
    with pytest.raises(ValueError, match="coverage='stages'.*'rank'.*'group'"):
        d.load_checkpoint({}, "unused", coverage="stages")
