"""Trust, round 2 (issue 32): a refused load changes nothing, verification is the default, plain values
are checked against the template and bounded, values that differ between ranks are refused at save.

Real gloo ranks and real DCP files on disk. Each refused load runs into the state dicts of a model
and optimizer that have trained (torch's ``get_state_dict`` aliases their planes, masters, moments
and scaling state), and every tensor (as bytes) and plain value they hold is compared before and
after. Crafted checkpoints are real saves edited on disk as an attacker would: the new bytes
appended to the shard file, ``.metadata`` and ``checksums.json`` rewritten to match."""

import copy
import dataclasses
import io
import json
import os
import pickle
import shutil
import struct
import zipfile

import pytest
import torch
import torch.distributed as dist

import dtensor_fp8 as d
from dtensor_fp8._compat import flatten_state_dict
from dtensor_fp8.checkpoint import CheckpointError, read_metadata
from dtensor_fp8.checkpoint.checksum import CHECKSUMS_FILE, bytes_checksum, entry_key
from dtensor_fp8.placement import local_tensor
from dist_utils import BACKEND, DEVICE, WORLD_SIZES
from test_checkpoint import _app_state, _build, _restore, _steps

WORLD = WORLD_SIZES[0]
RECIPE = "current"  # per-tensor: shards unevenly, so the same model runs on 1, 2 and 3 ranks
needs_two = pytest.mark.skipif(WORLD < 2, reason="needs a second rank")
needs_three = pytest.mark.skipif(BACKEND == "nccl", reason="3 ranks: one GPU per rank under nccl")


# ---- the live state, before and after ---------------------------------------------------------------------
def _bytes(t: torch.Tensor) -> torch.Tensor:
    return local_tensor(t).detach().reshape(-1).contiguous().view(torch.uint8).cpu().clone()


def _live(model, opt, state: dict) -> dict:
    """Every tensor (its bytes) and plain value a load could reach: the state dict's entries, and the
    model's planes, the masters, the inner optimizer's state and the scaling state themselves."""
    out = {}
    flat, _ = flatten_state_dict(state)
    for key, value in flat.items():
        out[f"state/{key}"] = _bytes(value) if isinstance(value, torch.Tensor) else copy.deepcopy(value)
    for name, p in model.named_parameters():
        for usage, plane in local_tensor(p).planes.items():
            out[f"param/{name}/{usage}/data"] = _bytes(plane.data)
            out[f"param/{name}/{usage}/scale"] = _bytes(plane.scale_inv)
    for name, m in opt.masters.items():
        out[f"master/{name}"] = _bytes(m)
    for i, inner in enumerate(opt.inner.state.values()):
        for key, value in inner.items():
            out[f"inner/{i}/{key}"] = _bytes(value) if isinstance(value, torch.Tensor) else value
    for (name, usage), fields in opt.scaling_states.items():
        for key, value in fields.items():
            out[f"scaling/{name}/{usage}/{key}"] = _bytes(value)
    out["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return out


def _changed(before: dict, after: dict) -> list:
    assert before.keys() == after.keys()
    return [k for k in before if not (torch.equal(before[k], after[k]) if isinstance(before[k], torch.Tensor)
                                      else before[k] == after[k])]


def _template(model, opt) -> dict:
    return {**_app_state(model, opt), "step": 5, "name": "run", "extra": None}


def _load_into_live(path, verify=True):
    """Load into a model and optimizer that have trained; returns (error or None, what changed)."""
    model, opt = _build(RECIPE, "reshard" if dist.get_world_size() > 1 else "none")
    _steps(model, opt, 2, seed=3)
    state = _template(model, opt)
    before = _live(model, opt, state)
    error = None
    try:
        d.load_checkpoint(state, path, verify=verify)
        _restore(model, opt, state)
    except Exception as err:  # noqa: BLE001  (returned to the test)
        error = (type(err).__name__, str(err))
    return error, _changed(before, _live(model, opt, state))


# ---- checkpoints to refuse ------------------------------------------------------------------------------
def _save_variants(base):
    """One trained model saved as it should be and as a diverged / edited run would save it."""
    model, opt = _build(RECIPE, "reshard")
    _steps(model, opt, 1, seed=0)

    def save(kind, edit=None, **kwargs):
        state = {**_app_state(model, opt), "step": 5, "name": "run", "extra": "x"}
        if edit:
            edit(state)
        d.save_checkpoint(state, os.path.join(base, kind), 1, **kwargs)

    save("good")
    save("betas-str", lambda s: s["optim"]["param_groups"][0].__setitem__("betas", "xx"))
    save("params-int", lambda s: s["optim"]["param_groups"][0].__setitem__("params", 5))
    master = opt.masters["0.weight"]
    with torch.no_grad():  # the run diverges on the last rank's shard
        if dist.get_rank() == dist.get_world_size() - 1:
            local_tensor(master)[0, 0] = float("nan")
    save("nan-master", allow_nonfinite=True)


def _as_value_archive(body: bytes) -> bytes:
    """``body`` as the data.pkl of a torch.save archive (what DCP stores for a plain value)."""
    buf = io.BytesIO()
    torch.save("x", buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for name in src.namelist():
            z.writestr(name, body if name.endswith("data.pkl") else src.read(name))
    return out.getvalue()


def _replace_value(path: str, fqn: str, body: bytes) -> str:
    """Rewrite the stored value ``fqn`` of a checkpoint as an attacker would: the new archive
    appended to its file, ``.metadata`` and ``checksums.json`` rewritten to match. Returns the file."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    md = read_metadata(path)
    info = md.storage_data[MetadataIndex(fqn)]
    data = _as_value_archive(body)
    file = os.path.join(path, info.relative_path)
    with open(file, "ab") as f:
        offset = f.tell()
        f.write(data)
    md.storage_data[MetadataIndex(fqn)] = dataclasses.replace(info, offset=offset, length=len(data))
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    with open(os.path.join(path, CHECKSUMS_FILE)) as f:
        doc = json.load(f)
    doc["entries"][entry_key(fqn, None)].update(checksum=bytes_checksum(data), nbytes=len(data))
    with open(os.path.join(path, CHECKSUMS_FILE), "w") as f:
        json.dump(doc, f)
    return file


DEPTH = 100_000  # a list nested this deep (unpickled without recursion; anything recursive over it crashes)
DEEP_LIST = b"\x80\x02" + b"]" * DEPTH + b"a" * (DEPTH - 1) + b"."
HUGE_STRING = b"\x80\x02\x8d" + struct.pack("<Q", 4 << 30) + b"abc."  # a 4 GiB string, 3 bytes of it


def _crafted(base: str, kind: str, name: str | None = None) -> tuple[str, str | None]:
    """A copy of the good checkpoint (in ``base/<name or kind>``) edited into ``kind``; returns
    (path, the file edited)."""
    path = os.path.join(base, name or kind, "step-00000001")
    shutil.copytree(os.path.join(base, "good", "step-00000001"), path)
    if kind == "no-checksums":
        os.remove(os.path.join(path, CHECKSUMS_FILE))
        return path, None
    if kind == "fp8-bytes":  # 256 bytes of an FP8 plane overwritten, checksums intact
        md = read_metadata(path)
        index, info = next((i, s) for i, s in md.storage_data.items() if i.fqn.endswith("rowwise_data"))
        file = os.path.join(path, info.relative_path)
        with open(file, "r+b") as f:
            f.seek(info.offset + info.length // 2)
            f.write(bytes(range(256)))
        return path, file
    fqn, body = {"deep-name": ("name", DEEP_LIST), "deep-extra": ("extra", DEEP_LIST),
                 "huge-string": ("name", HUGE_STRING)}[kind]
    return path, _replace_value(path, fqn, body)


REFUSALS = {  # kind -> what every rank's message must say
    "nan-master": ["master of 0.weight holds NaN or Inf", "'optim.state.0.weight.master'", "allow_nonfinite=True"],
    "betas-str": ["entry 'optim.param_groups.0.betas'", "holds str 'xx' where the state dict holds a tuple"],
    "params-int": ["entry 'optim.param_groups.0.params'", "holds int 5 where the state dict holds a list"],
    "deep-name": ["entry 'name'", "holds a list of 1 item where the state dict holds str 'run'"],
    "deep-extra": ["entry 'extra'", f"nests deeper than {64} levels"],
    "huge-string": ["entry 'name'", "expected 4294967296 bytes in a unicodestring8, but only 4 remain", "crafted size"],
    "no-checksums": [f"{CHECKSUMS_FILE} is missing", "verify=False"],
    "fp8-bytes": ["checksum mismatch", "rowwise_data"],
}


@pytest.fixture(scope="module")
def variants(pools, tmp_path_factory):
    base = str(tmp_path_factory.mktemp("variants"))
    pools[WORLD].run(_save_variants, base)
    return base


@needs_two
@pytest.mark.parametrize("kind", list(REFUSALS))
def test_a_refused_load_leaves_the_live_state_bit_identical(pools, variants, kind):
    """Every refusal -- a NaN master (saved with allow_nonfinite=True), a value of another kind
    (betas as a string, params as an int: set_state_dict used to fail only after the masters and
    Adam state were overwritten, or load them silently), a list nested 100,000 deep, a crafted 4 GiB
    string, deleted checksums, overwritten FP8 bytes -- raises the same CheckpointError on every
    rank naming the entry and file, and every tensor and plain value of the live training state
    is bit-identical after it."""
    if kind in ("betas-str", "params-int", "nan-master"):
        path, file = os.path.join(variants, kind, "step-00000001"), None
    else:
        path, file = _crafted(variants, kind)
    results = pools[WORLD].run(_load_into_live, path)
    msgs = {error[1] for error, _ in results if error}
    assert all(error and error[0] == "CheckpointError" for error, _ in results), results
    assert len(msgs) == 1, msgs  # the same error on every rank
    msg = msgs.pop()
    assert all(part in msg for part in REFUSALS[kind]), msg
    if file is not None:
        assert file in msg, msg
    assert "The state dict was not modified." in msg and "Traceback" not in msg, msg
    for _, changed in results:
        assert changed == [], changed


@needs_three
def test_a_refused_load_at_another_world_size_changes_nothing(pools, variants):
    """The checkpoint of 2 ranks holding a NaN master, loaded at 3 ranks (the NaN lands in another
    rank's shard) and at 1: refused alike on every rank, nothing changed; the good one loads."""
    for world in (3, 1):
        path = os.path.join(variants, "nan-master", "step-00000001")
        for error, changed in pools[world].run(_load_into_live, path):
            assert error and "master of 0.weight holds NaN or Inf" in error[1] and changed == [], (world, error)
    for error, changed in pools[3].run(_load_into_live, os.path.join(variants, "good", "step-00000001")):
        assert error is None and changed, error  # loaded: the live state took the checkpoint's values


@needs_two
def test_verify_false_loads_a_checkpoint_without_checksums_knowingly(pools, variants):
    path, _ = _crafted(variants, "no-checksums", "no-checksums-knowingly")
    for error, changed in pools[WORLD].run(_load_into_live, path, False):
        assert error is None and changed, error


# ---- the checksum file must cover the checkpoint --------------------------------------------------------------
def _edit_checksums(path, edit):
    file = os.path.join(path, CHECKSUMS_FILE)
    with open(file) as f:
        doc = json.load(f)
    edit(doc["entries"])
    with open(file, "w") as f:
        json.dump(doc, f)


def _load_msg(path):
    try:
        d.load_checkpoint({"x": torch.zeros(8, device=DEVICE), "step": 0}, path)
    except CheckpointError as err:
        return str(err)
    return None


def _save_small(root):
    d.save_checkpoint({"x": torch.arange(8.0, device=DEVICE), "step": 3}, root, 1)


@needs_two
def test_checksums_that_do_not_cover_every_item_are_refused(pools, tmp_path):
    """A checksums.json lacking a stored item, holding one .metadata does not store, or placing one
    in another file: refused on every rank naming the item and the fix (verify=False)."""
    root = str(tmp_path / "ckpt")
    pools[WORLD].run(_save_small, root)
    path = d.latest_checkpoint(root)
    cases = [
        (lambda e: e.pop("step"), "lacks the checksums of 1 stored item(s) (step)"),
        (lambda e: e.update({"ghost": {"checksum": "0", "nbytes": 1, "file": "__0_0.distcp"}}),
         "has 1 item(s) .metadata does not store (ghost)"),
        (lambda e: e["step"].update(file="__9_0.distcp"), "places 1 item(s) in other files than .metadata does (step)"),
    ]
    with open(os.path.join(path, CHECKSUMS_FILE)) as f:
        pristine = f.read()
    for edit, problem in cases:
        with open(os.path.join(path, CHECKSUMS_FILE), "w") as f:
            f.write(pristine)
        _edit_checksums(path, edit)
        msgs = pools[WORLD].run(_load_msg, path)
        assert len(set(msgs)) == 1 and problem in msgs[0] and "verify=False" in msgs[0], msgs


@needs_two
@pytest.mark.parametrize("edit,problem", [
    (100_000, "more than the"),  # larger than what the checkpoint's checksums take
    (20_000, "nests 20001 levels deep; a checksum file nests 8 at most"),
    ("bogus-entries", "more than the"),
], ids=["deep", "deep-within-the-size", "bogus-entries"])
def test_a_crafted_checksum_file_is_bounded_before_it_is_parsed(pools, tmp_path, edit, problem):
    """A checksums.json nested 100,000 deep (json's recursion gave a bare RecursionError), one nested
    20,000 deep within the size the checkpoint's checksums take, and one padded with a million
    bogus entries (about 600 MB per rank to read): refused on every rank naming the file and the
    fix, before the file is parsed."""
    root = str(tmp_path / "ckpt")
    pools[WORLD].run(_save_small, root)
    path = d.latest_checkpoint(root)
    file = os.path.join(path, CHECKSUMS_FILE)
    with open(file) as f:
        doc = json.load(f)
    with open(file, "w") as f:
        if isinstance(edit, int):
            f.write('{"algorithm": "x", "entries": ' + "[" * edit + "]" * edit + "}")
        else:
            doc["entries"].update({f"bogus{i}": {"checksum": "0" * 64, "nbytes": 1, "file": "__0_0.distcp"}
                                   for i in range(1_000_000)})
            json.dump(doc, f)
    msgs = pools[WORLD].run(_load_msg, path)
    assert len(set(msgs)) == 1 and file in msgs[0] and problem in msgs[0] and "verify=False" in msgs[0], msgs
    assert "RecursionError" not in msgs[0], msgs


# ---- values that differ between ranks ------------------------------------------------------------------------
def _save_divergent(root, which):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(DEVICE, (world,))
    odd = rank == 1
    state = {"w": DTensor.from_local(torch.full((2,), float(rank), device=DEVICE), mesh, [Shard(0)]),
             "step": 7 if odd and "step" in which else 5,
             "rng": torch.full((3,), 1.0 + (odd and "rng" in which), device=DEVICE),
             "bias": DTensor.from_local(torch.full((4,), 2.0 + (odd and "bias" in which), device=DEVICE), mesh,
                                        [Replicate()]),
             f"seed.{rank}": rank}  # each rank's own value under its own key: fine
    try:
        d.save_checkpoint(state, root, 1)
    except CheckpointError as err:
        return str(err)
    return None


@needs_three
def test_values_that_differ_between_ranks_are_refused_at_save(pools, tmp_path):
    """On 3 ranks, rank 1's step counter, an unsharded tensor and a replicated DTensor differ from
    ranks 0 and 2's: DCP would store one copy of each. Refused on every rank before anything is
    written, naming each entry and the ranks; the same state with equal values saves."""
    root = str(tmp_path / "ckpt")
    msgs = pools[3].run(_save_divergent, root, ("step", "rng", "bias"))
    assert len(set(msgs)) == 1 and msgs[0], msgs
    msg = msgs[0]
    assert "refusing to save: 3 entries differ between ranks" in msg, msg
    assert "entry 'step': ranks 0, 2 / rank 1 hold different values" in msg, msg
    assert "entry 'rng': ranks 0, 2 / rank 1" in msg and "entry 'bias' (the replicas of its chunk" in msg, msg
    assert "f'rng_state.{rank}'" in msg and "Nothing was written." in msg, msg
    assert not os.path.exists(root)  # refused before the root was even created
    assert pools[3].run(_save_divergent, root, ()) == [None] * 3


def _save_equal_sets(root):
    """Values equal on every rank whose pickles differ between ranks: a set of strings (string
    hashes are salted per process) and a set of ints that collide in the set's table, inserted in
    another order on each rank. Returns (the ints' pickle on this rank, the save's error)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    colliding = [8 * i for i in range(6)]  # one slot of an 8-slot table: iteration order = insertion order
    ints = set(colliding[rank % len(colliding):] + colliding[:rank % len(colliding)])
    state = {"x": torch.arange(4.0, device=DEVICE), "tags": {f"tag-{i}" for i in range(50)}, "ints": ints,
             "nested": {"b": [ints], "a": {"c": ints}}}
    try:
        d.save_checkpoint(state, root, 1)
        error = None
    except CheckpointError as err:
        error = str(err)
    loaded = {"x": torch.zeros(4, device=DEVICE), "tags": set(), "ints": set(), "nested": {"b": None, "a": {"c": None}}}
    if error is None:
        d.load_checkpoint(loaded, d.latest_checkpoint(root))
    return pickle.dumps(ints), error, (loaded["tags"], loaded["ints"], loaded["nested"])


@needs_two
def test_plain_values_equal_on_every_rank_are_equal_whatever_their_pickles(pools, tmp_path):
    """A set of strings equal on every rank was refused as "divergent" (its pickle lists the
    strings in each process's hash order): equal values save, and load back equal."""
    results = pools[WORLD].run(_save_equal_sets, str(tmp_path / "ckpt"))
    assert len({ints for ints, _, _ in results}) > 1  # the pickles do differ between ranks
    for _, error, (tags, ints, nested) in results:
        assert error is None, error
        assert tags == {f"tag-{i}" for i in range(50)} and ints == {8 * i for i in range(6)}
        assert nested == {"b": [ints], "a": {"c": ints}}, nested


# ---- bounds before unpickling -------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_value_claiming_more_than_a_value_may_take_is_named(tmp_path):
    """.metadata claiming a 4 GiB plain value: refused naming the entry, the file and the crafted
    size before anything is read."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    root = str(tmp_path / "ckpt")
    d.save_checkpoint({"x": torch.arange(8.0), "name": "run"}, root, 1)
    path = d.latest_checkpoint(root)
    md = read_metadata(path)
    info = md.storage_data[MetadataIndex("name")]
    md.storage_data[MetadataIndex("name")] = dataclasses.replace(info, length=4 << 30)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    state = {"x": torch.zeros(8), "name": ""}
    with pytest.raises(CheckpointError, match=r"entry 'name' in .*__0_0.distcp: .metadata gives this plain value "
                                              r"4294967296 stored bytes, above the 268435456 a value may take"):
        d.load_checkpoint(state, path)
    assert state["name"] == "" and torch.equal(state["x"], torch.zeros(8))


def test_check_value_bounds_and_kinds(monkeypatch):
    """check_value without a checkpoint: numbers for numbers, None only where None was, lengths
    free, depth and item counts bounded, messages point inside the value."""
    from dtensor_fp8.checkpoint import values
    from dtensor_fp8.checkpoint.values import MAX_VALUE_DEPTH, check_value

    check_value({"lr": 1, "betas": (0.9, 0.95), "params": ["a", "b", "c"]},
                {"lr": 0.1, "betas": (0.9, 0.999), "params": ["a"]}, "e")
    check_value({"anything": [1, {"x": b""}]}, None, "e")
    for value, template, problem in [
        ({"lr": "0.5"}, {"lr": 0.1}, r"at \['lr'\]: the checkpoint holds str '0.5' where the state dict holds float"),
        ([True], [1], r"at \[0\]: the checkpoint holds bool True where the state dict holds int 1"),
        ([None], [1.0], r"holds NoneType None where the state dict holds float 1.0"),
        ((1, 2), [1, 2], "holds a tuple of 2 items where the state dict holds a list of 2 items"),
        ([["a", 3]], [["a"]], r"at \[0\]\[1\]: the checkpoint holds int 3 where the state dict holds str 'a'"),
    ]:
        with pytest.raises(CheckpointError, match=problem):
            check_value(value, template, "e")
    deep = []
    for _ in range(MAX_VALUE_DEPTH + 5):
        deep = [deep]
    with pytest.raises(CheckpointError, match=f"nests deeper than {MAX_VALUE_DEPTH} levels"):
        check_value(deep, None, "e")
    monkeypatch.setattr(values, "MAX_VALUE_ITEMS", 10_000)  # the default, 10 million, takes seconds to reach
    wide = [[0] * 100] * 200  # 20,000 items through shared references (a pickle of ~300 bytes)
    with pytest.raises(CheckpointError, match="holds more than 10000 items"):
        check_value(wide, None, "e")
