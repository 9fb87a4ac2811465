"""Trust, round 3 (issue 39): loading pretrained high-precision weights (``load_hp_checkpoint``,
``load_hp_state_dict``) runs no code, checks every value, and changes nothing unless it succeeds.

Real gloo ranks, real DCP directories and real safetensors files on disk (read through torch's
``HuggingFaceStorageReader``). Each refused load runs into a sharded FP8 model (delayed scaling:
it has weight scaling state) and its optimizer after a training step, and every FP8 byte, scale,
high-precision parameter, master, moment and scaling state is compared as bytes before and after.
The sources are a plain (unquantized) model's state dict, saved as torch saves it, then edited
as a broken download or an attacker would."""

import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import dtensor_fp8 as d
from dtensor_fp8.placement import local_tensor
from dist_utils import DEVICE, WORLD_SIZES

safetensors_torch = pytest.importorskip("safetensors.torch")

WORLD = WORLD_SIZES[0]
DIM = 256
RECIPE = "delayed"
needs_two = pytest.mark.skipif(WORLD < 2, reason="needs a second rank")
single = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _plain(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(DIM, DIM), nn.LayerNorm(DIM), nn.Linear(DIM, DIM))


def _fp8_model(recipe=RECIPE, train=True, hsdp=False):
    """The model a load goes into: sharded (over a 1-D mesh, or HSDP's 2-D one), with an optimizer
    that has stepped (masters, moments and delayed scaling's amax history all hold values of their
    own)."""
    model = d.quantize_module_(_plain(seed=1).to(DEVICE), d.RECIPES[recipe])
    world = dist.get_world_size()
    mesh = init_device_mesh(DEVICE, (2, world // 2), mesh_dim_names=("replicate", "shard")) if hsdp else \
        init_device_mesh(DEVICE, (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-2)
    if train:
        x = torch.randn(4 * dist.get_world_size(), DIM, generator=torch.Generator().manual_seed(5)).to(DEVICE)
        model(x.chunk(dist.get_world_size())[dist.get_rank()]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _bytes(t):
    return local_tensor(t).detach().reshape(-1).contiguous().view(torch.uint8).cpu().clone()


def _live(model, opt) -> dict:
    """Every tensor a load could reach, as bytes."""
    out = {}
    for name, p in model.named_parameters():
        q = local_tensor(p)
        if isinstance(q, d.QuantizedTensor):
            for usage, plane in q.planes.items():
                out[f"param/{name}/{usage}/data"] = _bytes(plane.data)
                out[f"param/{name}/{usage}/scale"] = _bytes(plane.scale_inv)
        else:
            out[f"param/{name}"] = _bytes(p)
    for name, m in opt.masters.items():
        out[f"master/{name}"] = _bytes(m)
    for i, inner in enumerate(opt.inner.state.values()):
        for key, value in inner.items():
            out[f"inner/{i}/{key}"] = _bytes(value)
    for (name, usage), fields in opt.scaling_states.items():
        for key, value in fields.items():
            out[f"scaling/{name}/{usage}/{key}"] = _bytes(value)
    return out


def _changed(before, after):
    assert before.keys() == after.keys()
    return sorted(k for k in before if not torch.equal(before[k], after[k]))


def _source_state(seed=7) -> dict:
    return {k: v.detach().clone() for k, v in _plain(seed).state_dict().items()}


# ---- sources on disk --------------------------------------------------------------------------------------
class _RunsCommand:
    """Unpickling this runs a shell command (creates a marker file)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _write(base, name, state, kind):
    path = os.path.join(base, f"{name}-{kind}")
    if kind == "dcp":
        dcp.save(state, checkpoint_id=path, no_dist=True)
    else:
        os.makedirs(path)
        safetensors_torch.save_file(state, os.path.join(path, "model.safetensors"))
    return path


def _variant(name, marker=None):
    state = _source_state()
    if name == "nan":
        state["0.weight"][3, 5] = float("nan")
    elif name == "inf-bias":
        state["2.bias"][-1] = float("inf")
    elif name == "int32":
        state["2.weight"] = torch.randint(-3, 3, (DIM, DIM), dtype=torch.int32)
    elif name == "extra":
        state["lm_head.weight"] = torch.zeros(4, DIM)
    elif name == "missing":
        del state["2.bias"]
    elif name == "code":
        state["0.bias"] = _RunsCommand(marker)  # a value entry under a key the model has
    elif name == "shape":
        state["2.bias"] = torch.zeros(DIM // 2)
    return state


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("hp-sources"))
    for name in ("good", "nan", "inf-bias", "int32", "extra", "missing", "shape"):
        for kind in ("dcp", "hf"):
            _write(base, name, _variant(name), kind)
    return base


def _load_into_live(source, kind, strict=True, allow_nonfinite=False, recipe=RECIPE, hsdp=False):
    """Load into a trained model; returns (error or None, result, what changed)."""
    model, opt = _fp8_model(recipe, hsdp=hsdp)
    before = _live(model, opt)
    error = result = None
    options = {"allow_nonfinite": True} if allow_nonfinite else {}
    try:
        if kind == "dcp":
            result = d.load_hp_checkpoint(model, source, optimizer=opt, strict=strict, **options)
        elif kind == "dcp-reader":  # torch's own reader, which would unpickle .metadata with pickle
            result = d.load_hp_checkpoint(model, storage_reader=dcp.FileSystemReader(source), optimizer=opt,
                                          strict=strict, **options)
        else:
            result = d.load_hp_checkpoint(model, storage_reader=dcp.HuggingFaceStorageReader(source), optimizer=opt,
                                          strict=strict, **options)
    except Exception as err:  # noqa: BLE001  (returned to the test)
        error = (type(err).__name__, str(err))
    return error, result and tuple(map(list, result)), _changed(before, _live(model, opt))


def _refused(results, *parts):
    """The same error on every rank, naming every part; nothing changed on any rank."""
    msgs = {error[1] for error, _, _ in results if error}
    assert all(error for error, _, _ in results) and len(msgs) == 1, results
    msg = msgs.pop()
    assert all(part in msg for part in parts), msg
    assert "Traceback" not in msg and "were not modified" in msg, msg
    for _, _, changed in results:
        assert changed == [], changed
    return msg


def _hf_file(base, name):
    return os.path.join(base, f"{name}-hf", "model.safetensors")


def _dcp_file(base, name):
    return os.path.join(base, f"{name}-dcp", "__0_0.distcp")


# ---- runs no code ---------------------------------------------------------------------------------------------
@needs_two
def test_a_crafted_value_entry_runs_no_code_and_is_refused(pools, tmp_path):
    """A DCP directory whose '0.bias' is a pickled object that runs a command when unpickled (plain
    dcp.load with DefaultLoadPlanner runs it): refused on every rank naming the entry and file, the
    command never runs, nothing changes."""
    marker = tmp_path / "pwned"
    path = _write(str(tmp_path), "code", _variant("code", str(marker)), "dcp")
    results = pools[WORLD].run(_load_into_live, path, "dcp")
    msg = _refused(results, "entry '0.bias'", os.path.join(path, "__0_0.distcp"), "plain value", "not read")
    assert not marker.exists(), msg
    for kind, strict in (("dcp", False), ("dcp-reader", True)):  # not read with strict=False, nor through
        results = pools[WORLD].run(_load_into_live, path, kind, strict)  # torch's FileSystemReader
        _refused(results, "entry '0.bias'", "not read")
        assert not marker.exists()
    dcp.load({"0.bias": torch.zeros(DIM)}, checkpoint_id=path, planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    assert marker.exists()  # the payload is live: plain DCP runs it


# ---- every value checked -------------------------------------------------------------------------------------
@needs_two
@pytest.mark.parametrize("kind", ["dcp", "hf"])
def test_non_finite_values_are_refused_naming_entry_and_file(pools, sources, kind):
    """A NaN weight and an Inf bias: refused on every rank (the NaN sits in one rank's shard),
    naming the entry, the file and the switch; nothing changed. allow_nonfinite=True loads them."""
    for name, entry in (("nan", "0.weight"), ("inf-bias", "2.bias")):
        path = os.path.join(sources, f"{name}-{kind}")
        file = _hf_file(sources, name) if kind == "hf" else _dcp_file(sources, name)
        _refused(pools[WORLD].run(_load_into_live, path, kind), f"entry '{entry}'", file, "NaN or Inf",
                 "allow_nonfinite=True")
    for error, _, changed in pools[WORLD].run(_load_into_live, os.path.join(sources, f"nan-{kind}"), kind, True, True):
        assert error is None and changed, error


@needs_two
@pytest.mark.parametrize("kind", ["dcp", "hf"])
def test_integer_values_for_floating_weights_are_refused(pools, sources, kind):
    path = os.path.join(sources, f"int32-{kind}")
    file = _hf_file(sources, "int32") if kind == "hf" else _dcp_file(sources, "int32")
    _refused(pools[WORLD].run(_load_into_live, path, kind), "entry '2.weight'", file, "torch.int32", "floating")


@needs_two
@pytest.mark.parametrize("kind", ["dcp", "hf"])
def test_strict_refuses_extra_and_missing_entries_and_non_strict_returns_them(pools, sources, kind):
    """strict=True: an extra 'lm_head.weight' and a missing '2.bias' are refused naming them.
    strict=False: the common entries load and the others are returned as nn.Module's
    load_state_dict returns them; the missing bias keeps its values."""
    _refused(pools[WORLD].run(_load_into_live, os.path.join(sources, f"extra-{kind}"), kind), "'lm_head.weight'",
             "strict=False")
    _refused(pools[WORLD].run(_load_into_live, os.path.join(sources, f"missing-{kind}"), kind), "'2.bias'",
             "strict=False")
    for error, result, changed in pools[WORLD].run(_load_into_live, os.path.join(sources, f"extra-{kind}"), kind, False):
        assert error is None and result == ([], ["lm_head.weight"]) and changed, (error, result)
    for error, result, changed in pools[WORLD].run(_load_into_live, os.path.join(sources, f"missing-{kind}"), kind, False):
        assert error is None and result == (["2.bias"], []), (error, result)
        assert "param/2.bias" not in changed and "param/0.bias" in changed, changed


@needs_two
@pytest.mark.parametrize("kind", ["dcp", "hf"])
def test_a_wrong_shape_is_refused_naming_both_shapes(pools, sources, kind):
    _refused(pools[WORLD].run(_load_into_live, os.path.join(sources, f"shape-{kind}"), kind), "'2.bias'", "(128,)",
             "(256,)")


@pytest.mark.skipif(4 not in WORLD_SIZES, reason="needs 4 ranks")
def test_hsdp_refuses_alike_on_every_rank_and_loads_exactly(pools, sources):
    """On 4 ranks under HSDP (2 replicas x 2 shards), the NaN lies in the shards of two ranks: all
    four refuse alike with nothing changed; the good source loads on all four."""
    _refused(pools[4].run(_load_into_live, os.path.join(sources, "nan-hf"), "hf", True, False, RECIPE, True),
             "entry '0.weight'", "NaN or Inf")
    for error, result, changed in pools[4].run(_load_into_live, os.path.join(sources, "good-dcp"), "dcp", True, False,
                                               RECIPE, True):
        assert error is None and result == ([], []) and changed, error


# ---- all or nothing --------------------------------------------------------------------------------------------
@needs_two
def test_a_file_cut_short_inside_a_weight_changes_nothing(pools, sources, tmp_path):
    """A DCP file cut short inside its last weight: the entries read before it (the biases, the
    first weight) must not reach the model."""
    path = str(tmp_path / "cut")
    shutil.copytree(os.path.join(sources, "good-dcp"), path)
    file = os.path.join(path, "__0_0.distcp")
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) - 1000)
    _refused(pools[WORLD].run(_load_into_live, path, "dcp"), file, "truncated")


@needs_two
@pytest.mark.parametrize("kind", ["dcp", "hf"])
def test_a_good_source_loads_exactly(pools, sources, kind):
    """The reference: the FP8 bytes are quantize(weights), the masters the weights, the rest exact."""
    results = pools[WORLD].run(_load_exactly, os.path.join(sources, f"good-{kind}"), kind)
    assert results == [True] * WORLD


def _load_exactly(path, kind):
    model, opt = _fp8_model()
    reader = dict(storage_reader=dcp.HuggingFaceStorageReader(path)) if kind == "hf" else {}
    result = d.load_hp_checkpoint(model, None if reader else path, optimizer=opt, **reader)
    assert tuple(result) == ([], [])
    want = _source_state()
    for name, p in model.named_parameters():
        local = local_tensor(p)
        if isinstance(local, d.QuantizedTensor):
            full, q = p.full_tensor(), d.quantize(want[name].to(DEVICE), d.RECIPES[RECIPE])
            for usage, plane in q.planes.items():
                assert torch.equal(_bytes(full.planes[usage].data), _bytes(plane.data)), name
            assert torch.equal(opt.masters[name].full_tensor().cpu(), want[name]), name
        else:
            assert torch.equal(p.full_tensor().cpu(), want[name]), name
    return True


# ---- errors that name the cause -------------------------------------------------------------------------------
@needs_two
def test_an_fp8_checkpoint_given_to_load_hp_checkpoint_says_so(pools, tmp_path):
    root = str(tmp_path / "ckpt")
    pools[WORLD].run(_save_fp8, root)
    path = d.latest_checkpoint(root)
    _refused(pools[WORLD].run(_load_into_live, path, "dcp"), "FP8 weights", "load_checkpoint", path)


def _save_fp8(root):
    model, opt = _fp8_model(train=False)
    d.save_checkpoint({"model": model.state_dict()}, root, 1)


@needs_two
@pytest.mark.parametrize("damage", ["garbage", "empty", "truncated-header", "truncated-data"])
def test_a_broken_safetensors_file_is_named(pools, sources, tmp_path, damage):
    path = str(tmp_path / damage)
    shutil.copytree(os.path.join(sources, "good-hf"), path)
    file = os.path.join(path, "model.safetensors")
    with open(file, "rb") as f:
        data = f.read()
    data = {"garbage": os.urandom(600), "empty": b"", "truncated-header": data[:40],
            "truncated-data": data[:-1000]}[damage]
    with open(file, "wb") as f:
        f.write(data)
    _refused(pools[WORLD].run(_load_into_live, path, "hf"), file, "safetensors")


# ---- load_hp_state_dict: the same checks, in memory ----------------------------------------------------------------
def _load_state_into_live(edit, strict=True):
    model, opt = _fp8_model()
    state = _source_state()
    mesh = init_device_mesh(DEVICE, (dist.get_world_size(),))
    if edit == "nan-on-last-rank":  # a sharded entry whose NaN only the last rank holds
        from torch.distributed.tensor import Shard

        w = state["0.weight"].to(DEVICE).chunk(dist.get_world_size())[dist.get_rank()].clone()
        if dist.get_rank() == dist.get_world_size() - 1:
            w[0, 0] = float("nan")
        state["0.weight"] = DTensor.from_local(w, mesh, [Shard(0)], run_check=False)
    elif edit == "int":
        state["2.weight"] = state["2.weight"].to(torch.int64)
    elif edit == "broadcast":
        state["2.weight"] = state["2.weight"][0]  # (256,) where (256, 256) is asked for
    elif edit == "fp8-entry":
        state["0.weight"] = {"rowwise_data": torch.zeros(DIM, DIM, dtype=torch.uint8), "recipe": "{}"}
    elif edit == "extra":
        state["lm_head.weight"] = torch.zeros(4, DIM)
    elif edit == "overflow":  # finite in float64, Inf once written into the float32 weight
        state["2.weight"] = state["2.weight"].double()
        state["2.weight"][1, 1] = 1e300
    elif edit == "meta":
        state["2.bias"] = torch.empty(DIM, device="meta")
    before = _live(model, opt)
    error = result = None
    try:
        result = d.load_hp_state_dict(model, state, optimizer=opt, strict=strict)
    except Exception as err:  # noqa: BLE001
        error = (type(err).__name__, str(err))
    return error, result and tuple(map(list, result)), _changed(before, _live(model, opt))


@needs_two
@pytest.mark.parametrize("edit,parts", [
    ("nan-on-last-rank", ["entry '0.weight'", "NaN or Inf", f"rank {WORLD - 1} of {WORLD}", "allow_nonfinite=True"]),
    ("int", ["entry '2.weight'", "torch.int64", "floating"]),
    ("broadcast", ["entry '2.weight'", "(256,)", "(256, 256)"]),
    ("fp8-entry", ["entry '0.weight'", "FP8", "load_checkpoint"]),
    ("extra", ["'lm_head.weight'", "strict=False"]),
    ("overflow", ["entry '2.weight'", "beyond torch.float32's range", "allow_nonfinite=True"]),
    ("meta", ["entry '2.bias'", "meta tensor"]),
])
def test_load_hp_state_dict_checks_every_value_first(pools, edit, parts):
    _refused(pools[WORLD].run(_load_state_into_live, edit), *parts)


@needs_two
def test_load_hp_state_dict_non_strict_returns_what_it_left_out(pools):
    for error, result, changed in pools[WORLD].run(_load_state_into_live, "extra", False):
        assert error is None and result == ([], ["lm_head.weight"]) and changed, error
