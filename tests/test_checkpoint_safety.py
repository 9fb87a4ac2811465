"""Checkpoint files that lose nothing and run no code: atomic steps, errors on every rank, crafted and
garbage metadata, corrupted shards, missing files, models of another depth. Real gloo ranks and
real DCP files on disk; faults are real files edited on disk, or one injected storage failure."""

import datetime
import json
import os
import pickle
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import dtensor_fp8 as d
from dtensor_fp8.checkpoint import CheckpointError, CheckpointRecipeError, read_metadata
from dtensor_fp8.checkpoint.checksum import CHECKSUMS_FILE, entry_key
from dist_utils import BACKEND, DEVICE, WORLD_SIZES
from test_checkpoint import _app_state, _assert_same, _build, _full_planes, _restore, _steps

WORLD = WORLD_SIZES[0]
needs_two = pytest.mark.skipif(WORLD < 2, reason="needs a second rank")


def _save(root, step=1, recipe="mxfp8", train=1):
    model, opt = _build(recipe, "reshard")
    _steps(model, opt, train, seed=0)
    d.save_checkpoint({**_app_state(model, opt), "step": step}, root, step)
    return _full_planes(model, opt)


def _try_load(path, recipe="mxfp8", strict=True, verify=True):
    """Load into a fresh model; return (error class and message, or None; whether the model is untouched)."""
    model, opt = _build(recipe, "reshard")
    before = _full_planes(model, opt)
    state = {**_app_state(model, opt), "step": 0}
    try:
        d.load_checkpoint(state, path, strict=strict, verify=verify)
        _restore(model, opt, state)
    except Exception as err:  # noqa: BLE001  (returned to the test)
        after = _full_planes(model, opt)
        untouched = after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in after)
        return (type(err).__name__, str(err)), untouched, None
    return None, None, _full_planes(model, opt)


# ---- atomic steps -------------------------------------------------------------------------------------------
def _kill_during_resave(rank, root, world):
    os.environ.update(MASTER_ADDR="127.0.0.1")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=8),
                            store=dist.FileStore(os.path.join(root, "store"), world))
    ckpt = os.path.join(root, "ckpt")
    planes = _save(ckpt, step=1)
    if rank == 0:
        torch.save(planes, os.path.join(root, "expected.pt"))
    model, opt = _build("mxfp8", "reshard")
    _steps(model, opt, 3, seed=7)
    from torch.distributed.checkpoint import filesystem

    if rank == 1:
        def die(*args, **kwargs):
            os._exit(17)  # killed in the middle of re-saving the step `latest` names

        filesystem.FileSystemWriter.write_data = die
    try:
        d.save_checkpoint(_app_state(model, opt), ckpt, 1)
    except CheckpointError as err:  # rank 0: the group times out
        with open(os.path.join(root, "rank0_error.txt"), "w") as f:
            f.write(str(err))
        os._exit(0)
    os._exit(1)


def _save_step(root, step):
    return _save(root, step=step)


def test_rank_killed_during_resave_keeps_latest_complete(pools):
    """A rank dies (os._exit) while the step `latest` names is being re-saved: `latest` still names
    that step, which is complete and loads exactly the first save; the next save removes the
    partial directory the killed one left."""
    if BACKEND != "gloo":
        pytest.skip("spawns its own two-rank gloo group on the CPU")
    root = tempfile.mkdtemp()
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_kill_during_resave, args=(r, root, 2)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 17]
    with open(os.path.join(root, "rank0_error.txt")) as f:
        assert "lost contact with the other ranks" in f.read()
    ckpt = os.path.join(root, "ckpt")
    assert d.latest_checkpoint(ckpt) == os.path.join(ckpt, "step-00000001")
    assert os.path.isdir(os.path.join(ckpt, ".step-00000001.partial"))  # what the killed save left
    expected = torch.load(os.path.join(root, "expected.pt"), weights_only=True)
    for error, _, planes in pools[WORLD].run(_try_load, d.latest_checkpoint(ckpt)):
        assert error is None
        _assert_same(planes, expected)
    pools[WORLD].run(_save_step, ckpt, 2)
    assert sorted(os.listdir(ckpt)) == [".owner", "latest", "step-00000001", "step-00000002"]


def _resave(root):
    first = _save(root, step=1)
    second = _save(root, step=1, train=3)
    return first, second


def test_resave_replaces_the_step_whole(pools, tmp_path):
    root = str(tmp_path / "ckpt")
    first, second = pools[WORLD].run(_resave, root)[0]
    assert sorted(os.listdir(root)) == [".owner", "latest", "step-00000001"]
    for error, _, planes in pools[WORLD].run(_try_load, d.latest_checkpoint(root)):
        assert error is None
        _assert_same(planes, second)
    assert any(not torch.equal(first[k], second[k]) for k in first)  # the re-save wrote other bytes


def _fail_on(root, fail_rank):
    """A save in which rank ``fail_rank``'s storage fails; returns what each rank raised."""
    from torch.distributed.checkpoint import filesystem

    _save(root, step=1)
    model, opt = _build("current", "reshard")
    original = filesystem.FileSystemWriter.write_data
    if dist.get_rank() == fail_rank:
        def broken(*args, **kwargs):
            raise OSError("disk full (injected)")

        filesystem.FileSystemWriter.write_data = broken
    try:
        d.save_checkpoint(_app_state(model, opt), root, 2)
    except CheckpointError as err:
        return type(err).__name__, str(err)
    finally:
        filesystem.FileSystemWriter.write_data = original
    return None


@needs_two
def test_write_error_on_one_rank_raises_on_every_rank(pools, tmp_path):
    root = str(tmp_path / "ckpt")
    for kind, msg in pools[WORLD].run(_fail_on, root, 1):
        assert kind == "CheckpointError"
        assert "rank 1: OSError: disk full (injected)." in msg and "Traceback" not in msg and len(msg) < 1000, msg
        assert "every rank" not in msg
        assert "Nothing was committed" in msg
    assert sorted(os.listdir(root)) == [".owner", "latest", "step-00000001"]  # no partial directory left
    assert d.latest_checkpoint(root).endswith("step-00000001")


def _save_into_file_root(root):
    try:
        d.save_checkpoint({"x": torch.zeros(4)}, root, 1)
    except CheckpointError as err:
        return str(err)
    return None


@needs_two
def test_rank0_directory_error_raises_on_every_rank(pools, tmp_path):
    """Only rank 0 prepares the directories; its failure must not leave the others waiting."""
    root = tmp_path / "not_a_dir"
    root.write_text("a file where the checkpoint root should be")
    msgs = pools[WORLD].run(_save_into_file_root, str(root))
    assert all(m is not None and "rank 0 of 2" in m and f"{root} exists and is not a directory" in m for m in msgs), msgs


def _load_with_extra_key_on_rank1(path):
    model, opt = _build("mxfp8", "reshard")
    state = {**_app_state(model, opt), "step": 0}
    if dist.get_rank() == 1:
        state["only_on_rank_1"] = torch.zeros(3)
    try:
        d.load_checkpoint(state, path)
    except CheckpointError as err:
        return str(err)
    return None


@needs_two
def test_load_error_on_one_rank_raises_on_every_rank(pools, tmp_path):
    root = str(tmp_path / "ckpt")
    pools[WORLD].run(_save, root)
    msgs = pools[WORLD].run(_load_with_extra_key_on_rank1, d.latest_checkpoint(root))
    assert msgs[0] == msgs[1] and "'only_on_rank_1'" in msgs[0] and "[rank 1 of 2]" in msgs[0], msgs


# ---- the `latest` pointer ----------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("content,problem", [
    ("", "is empty"), ("  \n", "is empty"), ("../outside", "not a directory name inside"),
    ("/etc", "not a directory name inside"), ("step-1/../../x", "not a directory name inside"),
    ("..", "not a directory name inside"), ("missing-step", "does not exist"), ("half", "has no .metadata"),
])
def test_latest_names_only_complete_directories_of_its_root(tmp_path, content, problem):
    root = tmp_path / "ckpt"
    d.save_checkpoint({"x": torch.arange(3.0)}, str(root), 1)
    (root / "half").mkdir()
    (tmp_path / "outside").mkdir()
    (root / "latest").write_text(content)
    with pytest.raises(CheckpointError, match=problem) as err:
        d.latest_checkpoint(str(root))
    assert "complete checkpoints there: ['step-00000001']" in str(err.value) and "Fix:" in str(err.value)
    d.save_checkpoint({"x": torch.arange(3.0)}, str(root), 2)  # a save writes a valid pointer again
    assert d.latest_checkpoint(str(root)) == str(root / "step-00000002")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_no_latest_names_the_fix(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        d.latest_checkpoint(str(tmp_path / "nothing"))
    with pytest.raises(CheckpointError, match="has no 'latest' pointer.*no complete checkpoint is there"):
        d.latest_checkpoint(str(tmp_path))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_swap_cut_between_its_renames_resolves_and_is_repaired(tmp_path):
    """Rank 0 killed between the two renames of a re-save: `step-1` missing, the new complete
    `.step-1.partial` and the old `.step-1.old` beside it. latest_checkpoint returns the new one;
    the next save renames it back in place and removes the old one."""
    root = tmp_path / "ckpt"
    d.save_checkpoint({"x": torch.full((3,), 1.0)}, str(root), 1)
    os.rename(root / "step-00000001", root / ".step-00000001.old")
    d.save_checkpoint({"x": torch.full((3,), 2.0)}, str(tmp_path / "other"), 1)
    os.rename(tmp_path / "other" / "step-00000001", root / ".step-00000001.partial")
    found = d.latest_checkpoint(str(root))
    assert found == str(root / ".step-00000001.partial")
    state = {"x": torch.zeros(3)}
    d.load_checkpoint(state, found)
    assert torch.equal(state["x"], torch.full((3,), 2.0))
    d.save_checkpoint({"x": torch.full((3,), 3.0)}, str(root), 2)
    assert sorted(os.listdir(root)) == [".owner", "latest", "step-00000001", "step-00000002"]
    d.load_checkpoint(state, str(root / "step-00000001"))
    assert torch.equal(state["x"], torch.full((3,), 2.0))


# ---- opening a checkpoint runs no code ---------------------------------------------------------------------
class _RunsCommand:
    """Unpickling this runs a shell command (creates a marker file)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _load_msg(path, verify=True):
    try:
        d.load_checkpoint({"step": 0, "x": torch.zeros(4)}, path, verify=verify, strict=False)
    except CheckpointError as err:
        return type(err).__name__, str(err)
    return None


def _craft_metadata(path, marker):
    """A real .metadata with a payload in a field DCP leaves opaque (planner_data)."""
    md = read_metadata(path)
    md.planner_data = {"innocent": _RunsCommand(marker)}
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def _save_small(root):
    d.save_checkpoint({"step": 3, "x": torch.arange(4.0)}, root, 1)


def test_crafted_metadata_runs_nothing(pools, tmp_path):
    root = str(tmp_path / "ckpt")
    pools[WORLD].run(_save_small, root)
    path = d.latest_checkpoint(root)
    marker = tmp_path / "pwned"
    _craft_metadata(path, str(marker))
    for kind, msg in pools[WORLD].run(_load_msg, path):
        assert kind == "UnsafeCheckpointError", msg
        assert os.path.join(path, ".metadata") in msg and "posix.system" in msg and "refused" in msg, msg
    assert not marker.exists()
    with open(os.path.join(path, ".metadata"), "rb") as f:  # the payload is live: plain pickle runs it
        pickle.load(f)
    assert marker.exists()


@pytest.mark.parametrize("garbage", [b"", b"\x80\x04garbage" * 7, os.urandom(300)], ids=["empty", "bad-pickle", "random"])
def test_garbage_metadata_is_named(pools, tmp_path, garbage):
    root = str(tmp_path / "ckpt")
    pools[WORLD].run(_save_small, root)
    path = d.latest_checkpoint(root)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(garbage)
    for kind, msg in pools[WORLD].run(_load_msg, path):
        assert kind == "CheckpointError" and "is not a DCP metadata file" in msg and ".metadata" in msg, msg
        assert "restore the file from a copy" in msg


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_crafted_value_entry_runs_nothing(tmp_path):
    """A value entry whose unpickling runs a command (plain dcp.save pickles it; plain dcp.load would
    run it): refused, naming the entry."""
    path = str(tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    dcp.save({"x": torch.arange(4.0), "step": _RunsCommand(str(marker))}, checkpoint_id=path)
    kind, msg = _load_msg(path, verify=False)  # plain DCP writes no checksums
    assert kind == "UnsafeCheckpointError" and "'step'" in msg and "posix.system" in msg and not marker.exists(), msg
    dcp.load({"x": torch.zeros(4), "step": 0}, checkpoint_id=path)  # the payload is live: plain DCP runs it
    assert marker.exists()


def _metadata_both_ways(path):
    """A checkpoint with every kind of entry DCP stores; its .metadata read with the allow-list
    unpickler equals what plain pickle reads."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh(DEVICE, (dist.get_world_size(),))
    state = {
        "sharded": distribute_tensor(torch.randn(8, 4, device=DEVICE), mesh, [Shard(0)]),
        "replicated": distribute_tensor(torch.randn(3, device=DEVICE), mesh, [Replicate()]),
        "u8": torch.zeros(4, 4, dtype=torch.uint8), "bf16": torch.zeros(2, dtype=torch.bfloat16),
        "e4m3": torch.zeros(4, dtype=torch.float8_e4m3fn), "flag": torch.tensor(True),
        "channels_last": torch.zeros(1, 2, 3, 4).to(memory_format=torch.channels_last),
        "groups": [{"lr": 1e-3, "betas": (0.9, 0.99), "params": ["w"], "foreach": None}],
        "step": 7, "name": "run", "nothing": None,
    }
    dcp.save(state, checkpoint_id=path)
    safe = read_metadata(path)
    with open(os.path.join(path, ".metadata"), "rb") as f:
        plain = pickle.load(f)
    safe.storage_meta = plain.storage_meta = None  # holds the load id
    return safe == plain


def test_real_metadata_reads_with_the_allow_list(pools, tmp_path):
    assert all(pools[WORLD].run(_metadata_both_ways, str(tmp_path / "ckpt")))


# ---- corruption ---------------------------------------------------------------------------------------------
def _master_item(path, file_name):
    """The largest FP32 master chunk stored in ``file_name``: (index, storage info)."""
    md = read_metadata(path)
    items = [(info.length, index, info) for index, info in md.storage_data.items()
             if info.relative_path == file_name and index.fqn.endswith(".master")]
    return max(items, key=lambda t: t[0])[1:]


@needs_two
def test_overwritten_bytes_are_detected_on_any_world_size(pools, tmp_path):
    """256 bytes overwritten inside a shard file (size unchanged): a clear error naming the entry and
    the file, at the saving world size and at one rank (which reads the other rank's items), with
    the model untouched. Without verification the damage loads silently, as plain DCP loads it."""
    root = str(tmp_path / "ckpt")
    saved = pools[WORLD].run(_save, root)[0]
    path = d.latest_checkpoint(root)
    index, info = _master_item(path, "__1_0.distcp")
    file = os.path.join(path, "__1_0.distcp")
    size = os.path.getsize(file)
    with open(file, "r+b") as f:  # finite values (fp32 12345.0): damage nothing else would notice
        f.seek(info.offset + info.length // 2 // 4 * 4)
        f.write(torch.full((64,), 12345.0).numpy().tobytes())
    assert os.path.getsize(file) == size
    for world in (WORLD, 1):
        for (kind, msg), untouched, _ in pools[world].run(_try_load, path):
            assert kind == "CheckpointError" and "checksum mismatch" in msg, msg
            assert f"entry {index.fqn!r}" in msg and file in msg and "written by rank 1" in msg, msg
            assert untouched
    results = pools[WORLD].run(_try_load, path, "mxfp8", True, False)
    assert all(error is None for error, _, _ in results), [r[0] for r in results]
    loaded = results[0][2]  # verify=False (as plain DCP): the damage goes through silently
    param = index.fqn[len("optim.state."):-len(".master")]
    assert [k for k in saved if not torch.equal(saved[k], loaded[k])] == [f"{param}/master"]


def test_checksum_file_is_plain_json_covering_every_item(pools, tmp_path):
    root = str(tmp_path / "ckpt")
    pools[WORLD].run(_save, root)
    path = d.latest_checkpoint(root)
    with open(os.path.join(path, CHECKSUMS_FILE)) as f:
        entries = json.load(f)["entries"]
    stored = read_metadata(path).storage_data
    assert sorted(entries) == sorted(entry_key(i.fqn, i.offset) for i in stored)
    assert all(entries[entry_key(i.fqn, i.offset)]["file"] == info.relative_path for i, info in stored.items())


# ---- errors that help ---------------------------------------------------------------------------------------
@needs_two
def test_missing_rank_file_is_named(pools, tmp_path):
    root = str(tmp_path / "ckpt")
    pools[WORLD].run(_save, root)
    path = d.latest_checkpoint(root)
    os.remove(os.path.join(path, "__1_0.distcp"))
    for (kind, msg), untouched, _ in pools[WORLD].run(_try_load, path):
        assert kind == "CheckpointError" and untouched  # an Exception, not DCP's BaseException
        assert f"{os.path.join(path, '__1_0.distcp')} is missing (written by rank 1" in msg and len(msg) < 1500, msg
        assert "model.0.weight." in msg and "Traceback" not in msg


def _layers(depth, dim=256):
    torch.manual_seed(0)
    model = d.quantize_module_(nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(depth)]).to(DEVICE),
                               d.MXFP8())
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(DEVICE, (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-3)


def _save_depth(root, depth):
    model, opt = _layers(depth)
    d.save_checkpoint(_app_state(model, opt), root, 1)


def _load_depth(path, depth, strict=True):
    model, opt = _layers(depth)
    state = _app_state(model, opt)
    try:
        result = d.load_checkpoint(state, path, strict=strict)
    except CheckpointError as err:
        return str(err)
    _restore(model, opt, state)
    return result


def test_model_of_another_depth_is_refused_naming_the_entries(pools, tmp_path):
    root = str(tmp_path / "ckpt")
    pools[WORLD].run(_save_depth, root, 2)
    path = d.latest_checkpoint(root)
    shallower = pools[WORLD].run(_load_depth, path, 1)[0]
    assert "holds" in shallower and "does not ask for" in shallower and "'model.1.weight.rowwise_data'" in shallower
    assert "strict=False" in shallower and "high precision" not in shallower, shallower
    deeper = pools[WORLD].run(_load_depth, path, 3)[0]
    assert "the checkpoint lacks" in deeper and "'model.2.weight.rowwise_data'" in deeper, deeper
    assert "high precision" not in deeper, deeper
    partial = pools[WORLD].run(_load_depth, path, 1, False)[0]
    assert "model.1.weight.recipe" in partial.unexpected_keys and partial.missing_keys == []


def _save_hp(root):
    model, opt = _layers(2)
    d.save_checkpoint({"model": d.export_hp_state_dict(model, torch.float32)}, root, 1)


def _load_fp8_from_hp(path):
    model, _ = _layers(2)
    try:
        d.load_checkpoint({"model": model.state_dict()}, path)
    except CheckpointRecipeError as err:
        return str(err)
    return None


def test_high_precision_checkpoint_into_fp8_model_says_so(pools, tmp_path):
    root = str(tmp_path / "ckpt")
    pools[WORLD].run(_save_hp, root)
    msg = pools[WORLD].run(_load_fp8_from_hp, d.latest_checkpoint(root))[0]
    assert msg and "in high precision" in msg and "load_hp_state_dict" in msg and "'model.0.weight'" in msg, msg


def test_plain_torch_reads_a_checkpoint_with_checksums(pools, tmp_path):
    """checksums.json beside .metadata: DCP's own tools read the checkpoint without dtensor_fp8."""
    root = str(tmp_path / "ckpt")
    pools[WORLD].run(_save, root)
    code = ("import sys, torch\nfrom torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
            "dcp_to_torch_save(sys.argv[1], sys.argv[2])\nsd = torch.load(sys.argv[2], weights_only=True)\n"
            "assert 'dtensor_fp8' not in sys.modules\nprint(sd['step'], sd['model']['0.weight']['rowwise_data'].dtype)")
    out = subprocess.run([sys.executable, "-c", code, d.latest_checkpoint(root), str(tmp_path / "plain.pt")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["1", "torch.uint8"], out.stderr


def test_checksum_block_sums_wrap_like_torch():
    """The CPU checksum's numpy block sums equal torch's int64 reduction (the CUDA path), where sums
    wrap around 2**64, and any flipped bit, any swapped pair of 4 KiB blocks changes the checksum."""
    import numpy as np

    from dtensor_fp8.checkpoint.checksum import BLOCK_BYTES, _block_sums, tensor_checksum

    words = torch.randint(-2**62, 2**62, (4 * BLOCK_BYTES // 8,), generator=torch.Generator().manual_seed(0))
    assert np.array_equal(_block_sums(words.view(torch.uint8)), words.view(-1, BLOCK_BYTES // 8).sum(1).numpy())
    data = torch.randint(0, 256, (4 * BLOCK_BYTES + 100,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    base = tensor_checksum(data)
    for pos in (0, 5000, 4 * BLOCK_BYTES + 50):  # a block, another block, the partial tail
        flipped = data.clone()
        flipped[pos] ^= 1
        assert tensor_checksum(flipped) != base
    swapped = data.clone()
    swapped[:BLOCK_BYTES], swapped[BLOCK_BYTES:2 * BLOCK_BYTES] = data[BLOCK_BYTES:2 * BLOCK_BYTES], data[:BLOCK_BYTES]
    assert tensor_checksum(swapped) != base
    assert tensor_checksum(data[:-1]) != base  # length is part of it


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_verification_policy(tmp_path):
    """Verification by default: a checkpoint without checksums (plain dcp.save) is refused naming
    the file and the switch, and loads with verify=False; a damaged checksums.json is named (and
    verify=False still loads the checkpoint)."""
    plain = str(tmp_path / "plain")
    dcp.save({"x": torch.arange(4.0)}, checkpoint_id=plain)  # plain DCP: no checksums
    state = {"x": torch.zeros(4)}
    for verify in (True, None):
        with pytest.raises(CheckpointError, match=f"{CHECKSUMS_FILE} is missing.*verify=False"):
            d.load_checkpoint(state, plain, verify=verify)
        assert torch.equal(state["x"], torch.zeros(4))
    d.load_checkpoint(state, plain, verify=False)
    assert torch.equal(state["x"], torch.arange(4.0))
    root = str(tmp_path / "ckpt")
    d.save_checkpoint({"x": torch.arange(4.0)}, root, 1)
    path = d.latest_checkpoint(root)
    with open(os.path.join(path, CHECKSUMS_FILE), "w") as f:
        f.write("{not json")
    with pytest.raises(CheckpointError, match=f"{CHECKSUMS_FILE} is not readable JSON.*verify=False"):
        d.load_checkpoint(state, path)
    d.load_checkpoint(state, path, verify=False)


def test_verify_means_the_same_in_every_loader():
    """``verify`` takes the same values in every loader (``checksum_policy``): True requires
    checksums.json, False skips it, "if_present" verifies it where it exists; None is the loader's
    own default (load_checkpoint: True, load_hp_checkpoint: "if_present", as before); anything else
    is refused naming the value."""
    from dtensor_fp8.checkpoint.dcp_io import checksum_policy

    assert [checksum_policy(v, True) for v in (True, False, "if_present", None)] == [
        "required", "skip", "if_present", "required"]
    assert [checksum_policy(v, "if_present") for v in (True, False, "if_present", None)] == [
        "required", "skip", "if_present", "if_present"]
    with pytest.raises(ValueError, match="verify='yes'.*'if_present'"):
        checksum_policy("yes", True)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_load_checkpoint_verifies_where_present_when_asked(tmp_path):
    """load_checkpoint(verify="if_present"): a plain dcp.save directory (no checksums) loads; a
    checkpoint whose checksums.json is damaged is still refused naming the file."""
    plain = str(tmp_path / "plain")
    dcp.save({"x": torch.arange(4.0)}, checkpoint_id=plain)
    state = {"x": torch.zeros(4)}
    d.load_checkpoint(state, plain, verify="if_present")
    assert torch.equal(state["x"], torch.arange(4.0))
    root = str(tmp_path / "ckpt")
    d.save_checkpoint({"x": torch.arange(4.0) + 1}, root, 1)
    path = d.latest_checkpoint(root)
    d.load_checkpoint(state, path, verify="if_present")
    assert torch.equal(state["x"], torch.arange(4.0) + 1)
    with open(os.path.join(path, CHECKSUMS_FILE), "w") as f:
        f.write("{not json")
    with pytest.raises(CheckpointError, match=f"{CHECKSUMS_FILE} is not readable JSON"):
        d.load_checkpoint(state, path, verify="if_present")
