"""``load_checkpoint`` takes a param group's keys from the checkpoint, as torch's
``Optimizer.load_state_dict`` takes the saved param groups whole: resuming into a fresh optimizer
whose groups lack a key a scheduler added (``initial_lr``) loads it, whether the fresh scheduler
is created before the load or after it; extra tensors, extra groups and entries elsewhere (model,
optimizer state) are still refused. Real gloo ranks, real DCP files."""

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim.lr_scheduler import LambdaLR

import dtensor_fp8 as d
from dtensor_fp8.checkpoint import CheckpointError
from dist_utils import WORLD_SIZES
from test_checkpoint import _build, _full_planes, _steps

WORLD = WORLD_SIZES[0]
SAVE_AT, TOTAL = 3, 7
RECIPE = "mxfp8"
#: where the optimizer's state dict sits in the app state: not named "optim" on purpose (the
#: optimizer subtree is found by its structure, ``state`` + ``param_groups``)
OPT_KEY = "trainer_opt"


def _schedule(step: int) -> float:
    """A warm-up then a decay: the LR differs at every step."""
    return min(1.0, (step + 1) / 3) * 0.7 ** max(0, step - 2)


def _train(model, opt, sched, steps: int, seed: int) -> tuple[list, list]:
    losses, lrs = [], []
    for i in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        losses += _steps(model, opt, 1, seed + i)
        sched.step()
    return losses, lrs


def _app_state(model, opt, sched=None) -> dict:
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, OPT_KEY: optim_sd, "step": 0}
    if sched is not None:
        state["sched"] = sched.state_dict()
    return state


def _uninterrupted(root_with_sched: str, root_without: str):
    """Train TOTAL steps, saving at SAVE_AT twice: with the scheduler's state, and without it (a
    run that re-creates its scheduler from the step)."""
    model, opt = _build(RECIPE, "reshard")
    sched = LambdaLR(opt, _schedule)
    assert "initial_lr" in opt.param_groups[0]
    _train(model, opt, sched, SAVE_AT, seed=0)
    state = _app_state(model, opt, sched)
    state["step"] = SAVE_AT
    d.save_checkpoint(state, root_with_sched, SAVE_AT)
    del state["sched"]
    d.save_checkpoint(state, root_without, SAVE_AT)
    losses, lrs = _train(model, opt, sched, TOTAL - SAVE_AT, seed=100)
    return losses, lrs, _full_planes(model, opt)


def _resume(path: str, when: str):
    """A fresh model and optimizer resumed from ``path``; the fresh scheduler created ``"before"``
    the load (its state loaded too, as examples/train.py does) or ``"after"`` it (from the step)."""
    model, opt = _build(RECIPE, "reshard")
    sched = LambdaLR(opt, _schedule) if when == "before" else None
    if when == "after":
        assert "initial_lr" not in opt.param_groups[0]  # what the load has to bring
    state = _app_state(model, opt, sched)
    d.load_checkpoint(state, path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state[OPT_KEY])
    if when == "before":
        sched.load_state_dict(state["sched"])
    else:
        # torch's resume: a scheduler given last_epoch reads each group's initial_lr
        sched = LambdaLR(opt, _schedule, last_epoch=state["step"] - 1)
    losses, lrs = _train(model, opt, sched, TOTAL - SAVE_AT, seed=100)
    return losses, lrs, _full_planes(model, opt)


def _assert_same_planes(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8)), key


@pytest.fixture(scope="module")
def saved(pools, tmp_path_factory):
    root = tmp_path_factory.mktemp("param_groups")
    with_sched, without = str(root / "with_sched"), str(root / "without_sched")
    results = pools[WORLD].run(_uninterrupted, with_sched, without)
    return d.latest_checkpoint(with_sched), d.latest_checkpoint(without), results


@pytest.mark.parametrize("when", ["before", "after"])
def test_resume_with_a_fresh_scheduler_is_bit_identical(pools, saved, when):
    with_sched, without, uninterrupted = saved
    resumed = pools[WORLD].run(_resume, with_sched if when == "before" else without, when)
    for rank, ((losses, lrs, planes), (exp_losses, exp_lrs, exp_planes)) in enumerate(zip(resumed, uninterrupted)):
        assert lrs == exp_lrs and len(set(lrs)) == len(lrs), f"rank {rank}: {lrs} vs {exp_lrs}"
        assert losses == exp_losses, f"rank {rank}"  # bit-identical
        _assert_same_planes(planes, exp_planes)


# ---- what is still refused ----------------------------------------------------------------------------------
def _save_with(root: str, where: str):
    """A checkpoint of a trained model with one extra entry (see EXTRA) its resumer does not ask for."""
    model, opt = _build(RECIPE, "reshard")
    sched = LambdaLR(opt, _schedule)
    _train(model, opt, sched, 1, seed=0)
    state = _app_state(model, opt)
    EXTRA[where](state)
    d.save_checkpoint(state, root, 1)


EXTRA = {  # what the saver adds, and the entry a resumer without it is told about
    "group_tensor": lambda s: s[OPT_KEY]["param_groups"][0].__setitem__("lr_tensor", torch.ones(2)),
    "extra_group": lambda s: s[OPT_KEY]["param_groups"].append({"lr": 0.1, "params": []}),
    "model_value": lambda s: s["model"].__setitem__("note", "a plain value"),
    "optimizer_state_value": lambda s: next(iter(s[OPT_KEY]["state"].values())).__setitem__("extra", 3),
}
REFUSED = {
    "group_tensor": [f"{OPT_KEY}.param_groups.0.lr_tensor"],
    "extra_group": [f"{OPT_KEY}.param_groups.1.lr", f"{OPT_KEY}.param_groups.1.params"],
    "model_value": ["model.note"],
    "optimizer_state_value": [f"{OPT_KEY}.state.0.weight.extra"],
}


def _load_refused(path: str):
    model, opt = _build(RECIPE, "reshard")
    before = _full_planes(model, opt)
    state = _app_state(model, opt)  # no scheduler: its groups lack initial_lr, which loads
    try:
        d.load_checkpoint(state, path)
    except CheckpointError as err:
        untouched = all(torch.equal(v, before[k]) for k, v in _full_planes(model, opt).items())
        return str(err), untouched, "initial_lr" in state[OPT_KEY]["param_groups"][0]
    return None, None, None


@pytest.mark.parametrize("where", list(EXTRA))
def test_extra_tensors_groups_and_other_entries_are_still_refused(pools, tmp_path, where):
    root = str(tmp_path / "ckpt")
    pools[WORLD].run(_save_with, root, where)
    for msg, untouched, took_initial_lr in pools[WORLD].run(_load_refused, d.latest_checkpoint(root)):
        assert msg is not None and "does not ask for" in msg, msg
        for key in REFUSED[where]:
            assert repr(key) in msg, (key, msg)
        assert "initial_lr" not in msg, msg  # a plain group key is never the complaint
        assert untouched and not took_initial_lr  # nothing was loaded, into the model or the template


def test_optimizer_state_dicts_are_found_by_structure_with_dcps_keys():
    """Wherever an optimizer state dict sits (here in a list under another key), its groups'
    prefixes and paths are DCP's own; only a plain value for a group the state dict has, under a
    key that group lacks, is taken."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata, ChunkStorageMetadata, TensorProperties, TensorStorageMetadata,
    )

    from dtensor_fp8._compat import flatten_state_dict, set_state_dict_element
    from dtensor_fp8.checkpoint.param_groups import open_param_group_keys

    first = {"state": {"w": {"step": 1}}, "param_groups": [{"lr": 0.1, "params": ["w"]}, {"lr": 0.2, "params": ["v"]}]}
    second = {"state": {}, "param_groups": [{"lr": 0.3, "params": [0]}]}
    sd = {"run": {"opts": [first, second]}, "model": {"state": {}, "param_groups": "not groups"}}
    flat, mappings = flatten_state_dict(sd)
    for i, j in ((0, 0), (0, 1), (1, 0)):
        key = f"run.opts.{i}.param_groups.{j}.lr"
        assert mappings[key] == ("run", "opts", i, "param_groups", j, "lr")
    tensor = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([2]),
                                   [ChunkStorageMetadata(torch.Size([0]), torch.Size([2]))])
    saved = {k: BytesStorageMetadata() for k in flat} | {
        "run.opts.0.param_groups.1.initial_lr": BytesStorageMetadata(),  # taken
        "run.opts.1.param_groups.0.initial_lr": BytesStorageMetadata(),  # taken
        "run.opts.0.param_groups.2.lr": BytesStorageMetadata(),  # no group 2 here
        "run.opts.0.param_groups.0.lr_t": tensor,  # a tensor
        "run.opts.0.param_groups.0.a.b": BytesStorageMetadata(),  # nested
        "run.opts.0.state.w.extra": BytesStorageMetadata(),  # the optimizer's state
        "model.param_groups.0.lr": BytesStorageMetadata(),  # not an optimizer
    }
    taken = open_param_group_keys(sd, flat, saved)
    assert taken == {"run.opts.0.param_groups.1.initial_lr": ("run", "opts", 0, "param_groups", 1, "initial_lr"),
                     "run.opts.1.param_groups.0.initial_lr": ("run", "opts", 1, "param_groups", 0, "initial_lr")}
    set_state_dict_element(sd, taken["run.opts.0.param_groups.1.initial_lr"], 0.25)
    assert first["param_groups"][1] == {"lr": 0.2, "params": ["v"], "initial_lr": 0.25}
