"""DCP checkpoints of FP8 parameters on real gloo groups and real files."""

import os
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import dtensor_fp8 as d
from dist_utils import BACKEND, DEVICE, WORLD_SIZES
from test_fsdp import _hp_model, _shard
from test_placement import RECIPES

# 512 x 1024 weights: dim-0 shards of 128 rows (whole 128-row blocks) on up to 4 ranks
DIM, HIDDEN = 512, 1024


def _build(recipe_name, mode, lr=1e-2):
    model = d.quantize_module_(_hp_model(dim=DIM, hidden=HIDDEN), RECIPES[recipe_name])
    if mode != "none":
        _shard(model, mode)
    opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=lr)
    return model, opt


def _steps(model, opt, n, seed):
    losses = []
    world = dist.get_world_size()
    for step in range(n):
        g = torch.Generator().manual_seed(seed + step)
        x = torch.randn(8 * world, DIM, generator=g).to(DEVICE).chunk(world)[dist.get_rank()]
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _full_planes(model, opt):
    """Every FP8 plane (bytes) and master of the model, gathered to full tensors on CPU."""
    out = {}
    for name, p in model.named_parameters():
        q = p.to_local() if hasattr(p, "to_local") else p
        if not isinstance(q, d.QuantizedTensor):
            continue
        for usage in q.usages:
            full = d.for_usage(p, usage).full_tensor() if hasattr(p, "to_local") else q
            plane = full.plane(usage)
            out[f"{name}/{usage}/data"] = plane.data.view(torch.uint8).cpu().clone()
            out[f"{name}/{usage}/scale"] = plane.scale_inv.contiguous().view(torch.uint8).cpu().clone()
    for name, m in opt.masters.items():
        out[f"{name}/master"] = (m.full_tensor() if hasattr(m, "full_tensor") else m).detach().cpu().clone()
    return out


def _app_state(model, opt) -> dict:
    """What a training loop checkpoints, through torch's own state-dict helpers (FQN keys)."""
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def _restore(model, opt, state: dict) -> None:
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _save(root, recipe_name, mode, step=2, drop=None, recipe_as_repr=False):
    model, opt = _build(recipe_name, mode)
    _steps(model, opt, step, seed=0)
    state = _app_state(model, opt)
    if drop:  # a checkpoint written without one plane
        del state["model"]["0.weight"][drop]
    if recipe_as_repr:  # what dtensor_fp8 wrote before versioned recipe configs
        for entry in state["model"].values():
            if isinstance(entry, dict):
                entry["recipe"] = repr(RECIPES[recipe_name])
    d.save_checkpoint(state, root, step)
    return _full_planes(model, opt)


def _load(root, recipe_name, mode, continue_steps=0):
    model, opt = _build(recipe_name, mode)
    state = _app_state(model, opt)
    d.load_checkpoint(state, d.latest_checkpoint(root))
    _restore(model, opt, state)
    planes = _full_planes(model, opt)
    losses = _steps(model, opt, continue_steps, seed=100) if continue_steps else []
    return planes, losses, (_full_planes(model, opt) if continue_steps else None)


def _assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8)), key


RESHARDS = [  # (save world, save mode) -> (load world, load mode)
    ((2, "reshard"), (1, "none")),
    ((2, "reshard"), (4, "reshard")),
    ((4, "reshard"), (2, "reshard")),
    ((2, "reshard"), (4, "hsdp")),
    ((4, "hsdp"), (2, "reshard")),
]


@pytest.mark.parametrize("saved,loaded", RESHARDS, ids=lambda s: f"{s[0]}{s[1]}")
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_reshard_is_byte_exact(pools, tmp_path, recipe_name, saved, loaded):
    for world in (saved[0], loaded[0]):
        if world > 1 and world not in WORLD_SIZES:
            pytest.skip(f"needs {world} ranks")
    root = str(tmp_path / "ckpt")
    expected = pools[saved[0]].run(_save, root, recipe_name, saved[1])[0]
    for planes, _, _ in pools[loaded[0]].run(_load, root, recipe_name, loaded[1]):
        _assert_same(planes, expected)


def _train_through(root, recipe_name, save_at, total):
    model, opt = _build(recipe_name, "reshard")
    before = _steps(model, opt, save_at, seed=0)
    d.save_checkpoint(_app_state(model, opt), root, save_at)
    after = _steps(model, opt, total - save_at, seed=100)
    return before, after, _full_planes(model, opt)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_training_after_load_is_identical(pools, tmp_path, recipe_name):
    world = WORLD_SIZES[0]
    root = str(tmp_path / "ckpt")
    _, uninterrupted, final = pools[world].run(_train_through, root, recipe_name, 3, 8)[0]
    _, resumed, resumed_final = pools[world].run(_load, root, recipe_name, "reshard", 5)[0]
    assert resumed == uninterrupted  # bit-identical losses over 5 steps
    _assert_same(resumed_final, final)


# ---- what is on disk -------------------------------------------------------------------------------------------
_PLAIN_TORCH_READER = r"""
import sys, torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save(sys.argv[1], sys.argv[2])
sd = torch.load(sys.argv[2], weights_only=True)   # no pickled classes allowed
assert "dtensor_fp8" not in sys.modules and "transformer_engine" not in sys.modules
def walk(prefix, obj):
    if isinstance(obj, dict):
        for k, v in obj.items():
            walk(f"{prefix}.{k}" if prefix else k, v)
    else:
        print(prefix, type(obj).__name__, getattr(obj, "dtype", ""), tuple(getattr(obj, "shape", ())))
walk("", sd)
"""


def test_checkpoint_is_plain_tensors(pools, tmp_path):
    root = str(tmp_path / "ckpt")
    pools[WORLD_SIZES[0]].run(_save, root, "mxfp8", "reshard")
    out = subprocess.run(
        [sys.executable, "-c", _PLAIN_TORCH_READER, os.path.join(root, "step-00000002"), str(tmp_path / "plain.pt")],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    assert lines["model.0.weight.rowwise_data"] == "Tensor torch.uint8 (1024, 512)"
    assert lines["model.0.weight.rowwise_scale_inv"] == "Tensor torch.uint8 (1024, 16)"  # E8M0 bytes
    assert lines["model.0.weight.columnwise_scale_inv"] == "Tensor torch.uint8 (32, 512)"
    assert lines["model.0.weight.recipe"].startswith("str")
    assert lines["optim.state.0.weight.master"] == "Tensor torch.float32 (1024, 512)"
    assert lines["optim.state.0.weight.exp_avg"] == "Tensor torch.float32 (1024, 512)"


# ---- bad input ---------------------------------------------------------------------------------------------------
def _load_expecting_error(root, recipe_name):
    model, opt = _build(recipe_name, "reshard")
    before = _full_planes(model, opt)
    state = _app_state(model, opt)
    try:
        d.load_checkpoint(state, d.latest_checkpoint(root))
        _restore(model, opt, state)
    except (d.RecipeError, RuntimeError) as err:
        after = _full_planes(model, opt)
        _assert_same(after, before)  # nothing half-loaded
        return f"{type(err).__name__}: {err}"
    return "loaded"


def test_recipe_mismatch_names_the_parameter(pools, tmp_path):
    root = str(tmp_path / "ckpt")
    world = WORLD_SIZES[0]
    pools[world].run(_save, root, "mxfp8", "reshard")
    msgs = pools[world].run(_load_expecting_error, root, "blockwise1d")
    assert all("0.weight" in m and "MXFP8" in m and "Blockwise" in m for m in msgs), msgs


@pytest.mark.parametrize("recipe_name", ["delayed", "blockwise1d"])
def test_checkpoint_with_recipes_as_repr_strings_loads_exactly(pools, tmp_path, recipe_name):
    """Checkpoints of the format before versioned recipe configs stay loadable."""
    root = str(tmp_path / "ckpt")
    world = WORLD_SIZES[0]
    expected = pools[world].run(_save, root, recipe_name, "reshard", 2, None, True)[0]
    for planes, _, _ in pools[world].run(_load, root, recipe_name, "reshard"):
        _assert_same(planes, expected)


def test_missing_plane_names_the_parameter(pools, tmp_path):
    root = str(tmp_path / "ckpt")
    world = WORLD_SIZES[0]
    pools[world].run(_save, root, "mxfp8", "reshard", 2, "columnwise_data")
    msgs = pools[world].run(_load_expecting_error, root, "mxfp8")
    assert all("0.weight" in m and "columnwise_data" in m for m in msgs), msgs


class _OpaqueExtraState(torch.nn.Module):
    """Keeps state as TE modules do: ``get_extra_state`` returns a pickled-bytes uint8 tensor whose
    length changes (TE's is empty until the first FP8 forward)."""

    def __init__(self, meta: bytes = b""):
        super().__init__()
        self.meta = meta

    def get_extra_state(self):
        return torch.tensor(list(self.meta), dtype=torch.uint8)

    def set_extra_state(self, state):
        self.meta = bytes(state.tolist())

    def forward(self, x):
        return x


def _with_extra_state(recipe_name, seed, meta=b""):
    model = d.quantize_module_(_hp_model(seed=seed), RECIPES[recipe_name])
    model.append(_OpaqueExtraState(meta))
    _shard(model, "reshard")
    return model


def _saved_with_extra_state(root, recipe_name):
    model = _with_extra_state(recipe_name, 1, b"amax history, scales, recipe" * 3)
    d.save_checkpoint({"model": model.state_dict()}, root, 1)
    return model


def _extra_state_roundtrip(root, recipe_name):
    model = _saved_with_extra_state(root, recipe_name)
    fresh = _with_extra_state(recipe_name, 2)
    state = {"model": fresh.state_dict()}
    d.load_checkpoint(state, d.latest_checkpoint(root))
    fresh.load_state_dict(state["model"])
    same_weights = all(torch.equal(d.placement.local_tensor(a).plane("rowwise").data.view(torch.uint8),
                                   d.placement.local_tensor(b).plane("rowwise").data.view(torch.uint8))
                       for a, b in zip(model[0].parameters(), fresh[0].parameters()))
    return fresh[-1].meta, same_weights


def test_module_extra_state_of_another_length_loads(pools, tmp_path):
    """A fresh TE module's extra state is empty; a trained one's is a blob of some length. Loading
    must take the saved blob whatever the fresh one's length (DCP itself needs equal shapes)."""
    world = WORLD_SIZES[0]
    results = pools[world].run(_extra_state_roundtrip, str(tmp_path / "ckpt"), "current")
    assert all(meta == b"amax history, scales, recipe" * 3 and same for meta, same in results), results


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # one process on purpose
def test_extra_state_of_another_length_is_not_a_mismatch(tmp_path):
    """An extra state merely longer in the checkpoint than in the fresh model loads at its saved
    length; real mismatches (a missing entry, another shape) are named (one process, no group)."""
    root = str(tmp_path / "ckpt")
    d.save_checkpoint({"w": torch.arange(6.0), "m._extra_state": torch.arange(10, dtype=torch.uint8)}, root, 1)
    path = d.latest_checkpoint(root)
    fresh = {"w": torch.zeros(6), "m._extra_state": torch.zeros(0, dtype=torch.uint8), "gone": torch.zeros(2)}
    with pytest.raises(d.CheckpointError, match=r"asks for 1 entry the checkpoint lacks: \['gone'\]"):
        d.load_checkpoint(fresh, path)
    del fresh["gone"]
    d.load_checkpoint(fresh, path)
    assert torch.equal(fresh["m._extra_state"], torch.arange(10, dtype=torch.uint8))
    assert torch.equal(fresh["w"], torch.arange(6.0))
    with pytest.raises(d.CheckpointError, match=r"'w' is torch.float32 \(6,\) in the checkpoint, torch.float32 \(7,\)"):
        d.load_checkpoint({"w": torch.zeros(7)}, path, strict=False)


def test_truncated_shard_file_names_entries_and_loads_nothing(pools, tmp_path):
    root = str(tmp_path / "ckpt")
    world = WORLD_SIZES[0]
    pools[world].run(_save, root, "mxfp8", "reshard")
    path = d.latest_checkpoint(root)
    shard = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[-1]
    with open(os.path.join(path, shard), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(path, shard)) // 3)
    msgs = pools[world].run(_load_expecting_error, root, "mxfp8")
    assert all(m.startswith("CheckpointError") and shard in m and "truncated" in m and "model.0.weight." in m
               and "was not modified" in m for m in msgs), msgs


# ---- a save interrupted by a failing rank ----------------------------------------------------------------------
def _save_then_fail(root, recipe_name):
    model, opt = _build(recipe_name, "reshard")
    _steps(model, opt, 1, seed=0)
    d.save_checkpoint(_app_state(model, opt), root, 1)
    good = _full_planes(model, opt)
    _steps(model, opt, 1, seed=1)
    from torch.distributed.checkpoint import filesystem

    if dist.get_rank() == 1:  # this rank's storage fails in the middle of the next save
        def broken(*args, **kwargs):
            raise OSError("disk full (injected)")

        filesystem.FileSystemWriter.write_data = broken
    with pytest.raises(BaseException):  # DCP's CheckpointException is a BaseException
        d.save_checkpoint(_app_state(model, opt), root, 2)
    return good


def test_failed_save_keeps_previous_checkpoint(pools, tmp_path):
    root = str(tmp_path / "ckpt")
    world = WORLD_SIZES[0]
    if world < 2:
        pytest.skip("needs a second rank to fail")
    good = pools[world].run(_save_then_fail, root, "current")[0]
    pools[world].close()  # its writer was patched: start clean
    assert d.latest_checkpoint(root).endswith("step-00000001")
    for planes, _, _ in pools[world].run(_load, root, "current", "reshard"):
        _assert_same(planes, good)


def _kill_during_save(rank, root):
    import datetime

    os.environ.update(MASTER_ADDR="127.0.0.1")
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=8),
                            store=dist.FileStore(os.path.join(root, "store"), 2))
    model, opt = _build("mxfp8", "reshard")
    _steps(model, opt, 1, seed=0)
    d.save_checkpoint(_app_state(model, opt), os.path.join(root, "ckpt"), 1)
    from torch.distributed.checkpoint import filesystem

    if rank == 1:
        def die(*args, **kwargs):
            os._exit(17)  # the rank is killed mid-save

        filesystem.FileSystemWriter.write_data = die
    try:
        d.save_checkpoint(_app_state(model, opt), os.path.join(root, "ckpt"), 2)
    except BaseException:  # noqa: BLE001  (rank 0 sees the group time out)
        os._exit(0)
    os._exit(1)


def test_killed_rank_during_save_keeps_previous_checkpoint(pools):
    if BACKEND != "gloo":
        pytest.skip("spawns its own two-rank gloo group on the CPU")
    root = tempfile.mkdtemp()
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_kill_during_save, args=(r, root)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert procs[1].exitcode == 17 and procs[0].exitcode == 0, [p.exitcode for p in procs]
    ckpt = os.path.join(root, "ckpt")
    assert d.latest_checkpoint(ckpt).endswith("step-00000001")
    planes = pools[1].run(_load, ckpt, "mxfp8", "none")[0][0]
    assert planes  # the previous checkpoint loads


# ---- high-precision export / import -------------------------------------------------------------------------------
def _export_import(root, recipe_name):
    model, opt = _build(recipe_name, "reshard")
    _steps(model, opt, 2, seed=0)
    hp = d.export_hp_state_dict(model, torch.float32)
    full_hp = {k: v.full_tensor() for k, v in hp.items()}
    for name, p in model.named_parameters():
        q = p.to_local()
        assert torch.equal(hp[name].to_local(), q.dequantize(torch.float32))
    import torch.distributed.checkpoint as dcp

    dcp.save(hp, checkpoint_id=root)
    fresh, fresh_opt = _build(recipe_name, "reshard")
    target = {k: torch.zeros_like(v) for k, v in hp.items()}
    dcp.load(target, checkpoint_id=root)
    d.load_hp_state_dict(fresh, target, optimizer=fresh_opt)
    # the imported FP8 weights are quantize(hp values); masters are the hp values
    for name, p in fresh.named_parameters():
        expected = d.quantize(full_hp[name], RECIPES[recipe_name])
        got = p.full_tensor()
        for usage in got.usages:
            assert torch.equal(got.plane(usage).data.view(torch.uint8), expected.plane(usage).data.view(torch.uint8)), name
            assert torch.equal(got.plane(usage).scale_inv.contiguous().view(torch.uint8),
                               expected.plane(usage).scale_inv.contiguous().view(torch.uint8)), name
        assert torch.equal(fresh_opt.masters[name].full_tensor(), full_hp[name])
    return True


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_export_and_import_high_precision(pools, tmp_path, recipe_name):
    pools[WORLD_SIZES[0]].run(_export_import, str(tmp_path / "hp"), recipe_name)


def test_get_state_dict_path(pools):
    # get_state_dict keeps the FP8 entries under the parameter's FQN
    assert pools[WORLD_SIZES[0]].run(_gsd_keys, "mxfp8")[0] == ["0.weight", "2.weight"]


def _gsd_keys(recipe_name):
    model, _ = _build(recipe_name, "reshard")
    sd = get_state_dict(model, optimizers=[])[0]
    assert isinstance(sd["0.weight"], dict) and sd["0.weight"]["rowwise_data"].dtype == torch.uint8
    return sorted(sd)


def _async_save(root, recipe_name):
    import torch.distributed.checkpoint as dcp

    model, opt = _build(recipe_name, "reshard")
    _steps(model, opt, 2, seed=0)
    # DCP writes from a background thread: give it its own process group (as DCP recommends), so
    # its collectives never interleave with the training step's.
    group = dist.new_group(backend="gloo")
    future = dcp.async_save(_app_state(model, opt), checkpoint_id=root,
                            process_group=group)
    expected = _full_planes(model, opt)
    _steps(model, opt, 1, seed=5)  # training goes on while the checkpoint is written
    future.result()
    return expected


def _load_path(root, recipe_name):
    model, opt = _build(recipe_name, "reshard")
    state = _app_state(model, opt)
    d.load_checkpoint(state, root, verify=False)  # dcp.async_save writes no checksums
    _restore(model, opt, state)
    return _full_planes(model, opt)


@pytest.mark.parametrize("recipe_name", ["mxfp8", "current"])
def test_async_save_is_exact(pools, tmp_path, recipe_name):
    world = WORLD_SIZES[0]
    root = str(tmp_path / "async")
    expected = pools[world].run(_async_save, root, recipe_name)[0]
    for planes in pools[world].run(_load_path, root, recipe_name):
        _assert_same(planes, expected)


# ---- torch's full state dicts (one file, any world size) --------------------------------------------------
def _save_full(path, recipe_name):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    model, opt = _build(recipe_name, "reshard")
    _steps(model, opt, 2, seed=0)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, opt, options=options)
    if dist.get_rank() == 0:  # cpu_offload keeps the full tensors on rank 0 only
        assert all(t.device.type == "cpu" and not hasattr(t, "placements")
                   for t in _tensors({"model": model_sd, "optim": optim_sd}))
        torch.save({"model": model_sd, "optim": optim_sd}, path)
    dist.barrier()
    return _full_planes(model, opt), _steps(model, opt, 2, seed=100)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _load_full(path, recipe_name, mode):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    model, opt = _build(recipe_name, mode, lr=7.0)
    full = torch.load(path, weights_only=True)  # plain tensors, strings and numbers only
    set_state_dict(model, opt, model_state_dict=full["model"], optim_state_dict=full["optim"],
                   options=StateDictOptions(full_state_dict=True))
    return _full_planes(model, opt), _steps(model, opt, 2, seed=100)


@pytest.mark.parametrize("recipe_name", ["mxfp8", "delayed", "blockwise2d"])
def test_full_state_dict_with_cpu_offload_reshards_exactly(pools, tmp_path, recipe_name):
    """``StateDictOptions(full_state_dict=True, cpu_offload=True)``: one file on rank 0 holding full
    FP8 planes, masters and optimizer state; loaded at 1 and 2 ranks, bytes and the training that
    follows are identical."""
    world = WORLD_SIZES[0]
    path = str(tmp_path / "full.pt")
    saved = pools[world].run(_save_full, path, recipe_name)
    expected = saved[0][0]
    for loaded_world, mode in ((1, "none"), (world, "reshard")):
        for rank, (planes, resumed) in enumerate(pools[loaded_world].run(_load_full, path, recipe_name, mode)):
            _assert_same(planes, expected)
            if loaded_world == world:
                assert resumed == saved[rank][1]  # each rank's batches, as the saving run went on
