"""Trust, round 2 (issue 32): one job per checkpoint root, no symlink escapes, messages that tell
what a failed commit left, and write failures named by their errno.

Real gloo ranks (the session's pools, or spawned groups that a test kills), real files; faults are
real: another live job (another pool of processes), a job killed with SIGKILL, a directory where
the ``latest`` pointer's temporary file goes, a full tmpfs, a storage writer whose file stream
fails."""

import datetime
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import dtensor_fp8 as d
from dtensor_fp8.checkpoint import CheckpointError, owner, read_metadata
from dist_utils import BACKEND, DEVICE, WORLD_SIZES

WORLD = WORLD_SIZES[0]
REPO = str(Path(__file__).resolve().parent.parent)
needs_two = pytest.mark.skipif(WORLD < 2, reason="needs a second rank")
single = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _save_value(root, step, value=1.0):
    """Save ``{"x": value, "step": step}``; returns the error message, or None, and the warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            d.save_checkpoint({"x": torch.full((4,), float(value), device=DEVICE), "step": step}, root, step)
            error = None
        except CheckpointError as err:
            error = str(err)
    return error, [str(w.message) for w in caught if "dtensor_fp8" in str(w.message)]


def _value_of(path):
    state = {"x": torch.zeros(4), "step": 0}
    d.load_checkpoint(state, path)
    return state["x"][0].item()


# ---- one job per root --------------------------------------------------------------------------------------
@needs_two
def test_a_second_live_job_is_refused_on_every_rank_before_writing(pools, tmp_path):
    """Job A (one rank) saves into a root; job B (another process group, alive at the same time)
    saving into it is refused on every rank before it writes anything, naming job A; A goes on."""
    root = str(tmp_path / "ckpt")
    assert pools[1].run(_save_value, root, 1) == [(None, [])]
    listing = sorted(os.listdir(root))
    results = pools[WORLD].run(_save_value, root, 2)
    msgs = {error for error, _ in results}
    assert len(msgs) == 1, msgs
    msg = msgs.pop()
    assert f"checkpoint root {root} is in use by another job" in msg, msg
    assert f"pid {pools[1].pids[0]} on {socket.gethostname()}" in msg and "refused before writing anything" in msg, msg
    assert "Fix: save into another root" in msg and f"[rank 0 of {WORLD}]" in msg, msg
    assert sorted(os.listdir(root)) == listing == [".owner", "latest", "step-00000001"]
    assert pools[1].run(_save_value, root, 2) == [(None, [])]  # the owner saves on
    assert d.latest_checkpoint(root).endswith("step-00000002")


@needs_two
@single
def test_a_copied_roots_claim_is_not_a_live_job(pools, tmp_path):
    """A root copied while its job runs (``cp -r``) keeps that job's ``.owner``; another job saving
    into the copy takes the copied claim over at once, saying why, and the first job saves on into
    its own root."""
    root, copy = str(tmp_path / "ckpt"), str(tmp_path / "ckpt-copy")
    assert pools[1].run(_save_value, root, 1) == [(None, [])]
    shutil.copytree(root, copy)
    results = pools[WORLD].run(_save_value, copy, 2)
    assert all(error is None for error, _ in results), results
    assert any(f"took over checkpoint root {copy}" in w and "copied here with the checkpoint" in w
               for w in results[0][1]), results[0][1]
    with open(os.path.join(copy, owner.OWNER_FILE)) as f:
        assert json.load(f)["pid"] == pools[WORLD].pids[0]
    assert _value_of(d.latest_checkpoint(copy)) == 1.0
    assert pools[1].run(_save_value, root, 2) == [(None, [])]  # the original job's root is still its own
    with open(os.path.join(root, owner.OWNER_FILE)) as f:
        assert json.load(f)["pid"] == pools[1].pids[0]


@needs_two
def test_a_killed_jobs_claim_is_taken_over(pools, tmp_path):
    """A job SIGKILLed in the middle of its saves leaves its claim and a partial directory: the next
    job takes the root over at once (the claim's process is gone from this host), says so, and
    removes what the killed save left."""
    root = str(tmp_path / "ckpt")
    code = ("import os, signal, sys, warnings, torch\nwarnings.filterwarnings('ignore')\nimport dtensor_fp8 as d\n"
            "d.save_checkpoint({'x': torch.arange(4.0)}, sys.argv[1], 1)\n"
            "os.makedirs(os.path.join(sys.argv[1], '.step-00000002.partial'))  # the save it is killed in\n"
            "print(os.getpid(), flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code, root], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == -signal.SIGKILL, out.stderr
    dead = int(out.stdout.split()[0])
    with open(os.path.join(root, owner.OWNER_FILE)) as f:
        assert json.load(f)["pid"] == dead
    results = pools[WORLD].run(_save_value, root, 2)
    assert all(error is None for error, _ in results), results
    assert any(f"took over checkpoint root {root}" in w and f"its process {dead} on this host no longer exists" in w
               for w in results[0][1]), results[0][1]
    assert sorted(os.listdir(root)) == [".owner", "latest", "step-00000001", "step-00000002"]
    with open(os.path.join(root, owner.OWNER_FILE)) as f:
        assert json.load(f)["pid"] == pools[WORLD].pids[0]


def _claim_of_another_host(root):
    os.makedirs(root, exist_ok=True)
    record = {"job": "0123456789abcdef", "host": "another-host", "pid": 4242, "boot": "x", "pidns": "y",
              "started": "yesterday", "command": "train.py --run other"}
    with open(os.path.join(root, owner.OWNER_FILE), "w") as f:
        json.dump(record, f)
    return os.path.join(root, owner.OWNER_FILE)


@single
def test_another_hosts_claim_is_judged_by_its_heartbeat(tmp_path, monkeypatch):
    """A claim of another host: refused while its heartbeat (the file's mtime, against the file
    system's clock) is seen to beat; taken over once it has not beaten for the stale limit."""
    monkeypatch.setattr(owner, "HEARTBEAT_S", 0.1)
    monkeypatch.setattr(owner, "STALE_S", 0.6)
    root = str(tmp_path / "ckpt")
    file = _claim_of_another_host(root)
    stop = threading.Event()

    def beat():
        while not stop.wait(0.05):
            os.utime(file)

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    try:
        error, _ = _save_value(root, 1)
    finally:
        stop.set()
        beater.join()
    assert "is in use by another job: job 01234567 (pid 4242 on another-host" in error, error
    assert "`train.py --run other`" in error and "still beating" in error, error
    assert sorted(os.listdir(root)) == [owner.OWNER_FILE]
    started = time.monotonic()
    error, caught = _save_value(root, 1)
    assert error is None and time.monotonic() - started >= 0.5
    assert any("took over" in w and "its heartbeat stopped" in w for w in caught), caught


def _save_with_limits(root, step, beat, stale):
    """``_save_value`` with the heartbeat and the stale limit set on this rank; returns (error,
    seconds the save took)."""
    kept = owner.HEARTBEAT_S, owner.STALE_S
    owner.HEARTBEAT_S, owner.STALE_S = beat, stale
    started = time.monotonic()
    try:
        error, _ = _save_value(root, step)
    finally:
        owner.HEARTBEAT_S, owner.STALE_S = kept
    return error, time.monotonic() - started


@needs_two
def test_a_heartbeat_from_the_future_is_refused_after_the_stale_limit_on_every_rank(pools, tmp_path):
    """Another host's claim whose heartbeat is dated an hour ahead (clocks skewed between hosts): the
    save waits the stale limit, not the hour, then every rank raises the same error naming the
    file, its date and the clocks; nothing is written. The same claim beating (touched, still in
    the future) is a live job: refused as such."""
    root = str(tmp_path / "ckpt")
    file = _claim_of_another_host(root)
    ahead = time.time() + 3600
    os.utime(file, (ahead, ahead))
    results = pools[WORLD].run(_save_with_limits, root, 1, 0.2, 2.0)
    msgs = {error for error, _ in results}
    assert len(msgs) == 1 and None not in msgs, results
    msg = msgs.pop()
    dated = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ahead))
    assert f"{file}, the claim of job 01234567 (pid 4242 on another-host" in msg and f"dated {dated}" in msg, msg
    assert "after the file system's clock" in msg and "this host's clock reads" in msg, msg
    assert f"Fix: if that job is gone, delete {file}" in msg and f"[rank 0 of {WORLD}]" in msg, msg
    assert all(2.0 <= took < 20 for _, took in results), results  # the stale limit, not the hour
    assert sorted(os.listdir(root)) == [owner.OWNER_FILE]
    stop = threading.Event()

    def beat():  # a live job on a host whose clock runs an hour ahead
        while not stop.wait(0.1):
            now = time.time() + 3600
            os.utime(file, (now, now))

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    try:
        results = pools[WORLD].run(_save_with_limits, root, 1, 0.2, 2.0)
    finally:
        stop.set()
        beater.join()
    for error, _ in results:
        assert "is in use by another job" in error and "still beating" in error, error
    assert sorted(os.listdir(root)) == [owner.OWNER_FILE]


@single
def test_a_job_whose_root_was_taken_over_stops_saving_there(tmp_path):
    """A job paused past the stale limit whose root another job took over: its next save is
    refused, naming the job that holds the root now, instead of overwriting that job's steps."""
    root = str(tmp_path / "ckpt")
    assert _save_value(root, 1) == (None, [])
    _claim_of_another_host(root)  # what the other job's takeover leaves
    error, _ = _save_value(root, 2)
    assert f"checkpoint root {root} was taken over by another job, job 01234567" in error, error
    assert "does not save there any more" in error and sorted(os.listdir(root)) == [".owner", "latest", "step-00000001"]


# ---- symlinks leading out of a root ----------------------------------------------------------------------------
def _latest_or_error(root):
    try:
        return d.latest_checkpoint(root)
    except CheckpointError as err:
        return f"error: {err}"


def _load_or_error(path):
    try:
        return _value_of(path)
    except CheckpointError as err:
        return f"error: {err}"


@single
@needs_two
def test_symlinks_leading_out_of_a_root_are_refused(pools, tmp_path):
    """A step directory that is a symlink to another root's step, and checkpoint files that are
    symlinks out of their directory, are refused on every rank, naming the link and its target; a
    save finding a link where its partial directory goes removes the link, not what it names."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    pools[WORLD].run(_save_value, a, 1, 1.0)
    pools[WORLD].run(_save_value, b, 1, 2.0)
    step_a, step_b = os.path.join(a, "step-00000001"), os.path.join(b, "step-00000001")
    shutil.rmtree(step_a)
    os.symlink(step_b, step_a)
    for msg in pools[WORLD].run(_latest_or_error, a):
        assert msg.startswith("error: ") and f"{step_a} is a symlink to {os.path.realpath(step_b)}, outside {a}" in msg
    data_file = next(iter(read_metadata(step_b).storage_data.values())).relative_path
    for name in (data_file, ".metadata"):
        copy = str(tmp_path / f"copy-{name}")
        shutil.copytree(step_b, copy)
        os.remove(os.path.join(copy, name))
        os.symlink(os.path.join(step_b, name), os.path.join(copy, name))
        for msg in pools[WORLD].run(_load_or_error, copy):
            assert f"{os.path.join(copy, name)} is a symlink to {os.path.realpath(os.path.join(step_b, name))}" in msg, msg
            assert "is not followed" in msg, msg
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not a checkpoint's")
    os.symlink(outside, os.path.join(a, ".step-00000003.partial"))
    assert pools[WORLD].run(_save_value, a, 3, 3.0) == [(None, [])] * WORLD
    assert (outside / "keep.txt").read_text() == "not a checkpoint's"
    assert pools[WORLD].run(_load_or_error, d.latest_checkpoint(a)) == [3.0] * WORLD


# ---- what a failed commit left ---------------------------------------------------------------------------------
def _resave_expecting_error(root, step, value):
    error, _ = _save_value(root, step, value)
    return error


@single
@needs_two
def test_a_fault_after_the_swap_says_what_was_committed(pools, tmp_path):
    """Rank 0 cannot write the `latest` pointer (a directory sits where its temporary file goes):
    a re-save has already swapped its step in, and every rank's error says so (not "nothing was
    committed"); a new step is in place but `latest` still names the previous one, and the error
    says that."""
    root = str(tmp_path / "ckpt")
    pools[WORLD].run(_save_value, root, 1, 1.0)
    os.mkdir(os.path.join(root, ".latest.tmp"))
    msgs = pools[WORLD].run(_resave_expecting_error, root, 1, 2.0)
    assert len(set(msgs)) == 1 and "[rank 0 of" in msgs[0], msgs
    assert f"EISDIR (Is a directory) on {os.path.join(root, '.latest.tmp')}" in msgs[0], msgs[0]
    assert f"The new state is committed: {os.path.join(root, 'step-00000001')} holds it and `latest` names " \
           "'step-00000001'" in msgs[0] and "othing was committed" not in msgs[0], msgs[0]
    assert _value_of(d.latest_checkpoint(root)) == 2.0
    msgs = pools[WORLD].run(_resave_expecting_error, root, 2, 3.0)
    assert f"The new state is complete in {os.path.join(root, 'step-00000002')}, but `latest` names " \
           "'step-00000001' (the pointer was not rewritten)" in msgs[0], msgs[0]
    os.rmdir(os.path.join(root, ".latest.tmp"))
    assert pools[WORLD].run(_save_value, root, 3, 4.0) == [(None, [])] * WORLD


def _killed_in_commit(rank, root, point):
    os.environ.update(MASTER_ADDR="127.0.0.1")
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=10),
                            store=dist.FileStore(os.path.join(root, "store"), 2))
    ckpt = os.path.join(root, "ckpt")
    d.save_checkpoint({"x": torch.full((4,), 1.0), "step": 1}, ckpt, 1)
    if rank == 0:
        rename = os.rename

        def killed_at_the_point(src, dst):
            rename(src, dst)
            if (point == "between-renames" and str(dst).endswith(".old")) or \
                    (point == "after-swap" and str(src).endswith(".partial")):
                os.kill(os.getpid(), signal.SIGKILL)

        os.rename = killed_at_the_point
    try:
        d.save_checkpoint({"x": torch.full((4,), 2.0), "step": 1}, ckpt, 1)  # a re-save of the step `latest` names
    except CheckpointError as err:
        with open(os.path.join(root, f"rank{rank}_error.txt"), "w") as f:
            f.write(str(err))
        os._exit(0)
    os._exit(1)


@single
@pytest.mark.parametrize("point,truth", [
    ("after-swap", "The new state is committed"),
    ("between-renames", "The swap was cut between its two renames"),
])
def test_a_kill_in_the_commit_says_what_was_committed(tmp_path, point, truth):
    """Rank 0 SIGKILLed inside the swap of a re-save (after it, or between its two renames): the
    surviving rank's error says what is on disk, and `latest` resolves to the new, complete state."""
    if BACKEND != "gloo":
        pytest.skip("spawns its own two-rank gloo group on the CPU")
    root = str(tmp_path)
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_killed_in_commit, args=(r, root, point)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [-signal.SIGKILL, 0]
    with open(os.path.join(root, "rank1_error.txt")) as f:
        msg = f.read()
    assert "lost contact with the other ranks" in msg and truth in msg and "othing was committed" not in msg, msg
    ckpt = os.path.join(root, "ckpt")
    assert _value_of(d.latest_checkpoint(ckpt)) == 2.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the killed job's claim is taken over
        d.save_checkpoint({"x": torch.full((4,), 3.0), "step": 2}, ckpt, 2)  # repairs the swap, removes what was left
    assert sorted(os.listdir(ckpt)) == [".owner", "latest", "step-00000001", "step-00000002"]
    assert _value_of(os.path.join(ckpt, "step-00000001")) == 2.0


# ---- write failures named ----------------------------------------------------------------------------------------
def _save_big(root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh(DEVICE, (dist.get_world_size(),))
    state = {"w": distribute_tensor(torch.zeros(dist.get_world_size() * 65536, device=DEVICE), mesh, [Shard(0)])}
    try:
        d.save_checkpoint(state, root, 1)
    except CheckpointError as err:
        return str(err)
    return None


@needs_two
def test_a_full_file_system_is_named_on_every_rank(pools, tmp_path):
    """A save into a 128 KiB tmpfs: every rank's error names ENOSPC, the file and the free space
    (torch.save alone says "unexpected pos"); nothing is committed and the partial directory goes."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root); test_a_failing_storage_write_is_named_with_its_errno "
                    "covers the same path through a storage writer")
    try:
        root = str(mnt / "ckpt")
        msgs = pools[WORLD].run(_save_big, root)
        assert len(set(msgs)) == 1 and msgs[0], msgs
        assert "ENOSPC (No space left on device) on " + os.path.join(root, ".step-00000001.partial", "__") in msgs[0]
        assert "bytes free of 131072" in msgs[0] and "Nothing was committed" in msgs[0], msgs[0]
        assert sorted(os.listdir(root)) == [".owner"]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@single
def test_a_failing_storage_write_is_named_with_its_errno(tmp_path):
    """The writer's file streams fail after 1000 bytes with ENOSPC (a real file, a real OSError):
    the error names the errno and the file, not only torch.save's "unexpected pos"."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystem

    from dtensor_fp8.checkpoint.dcp_write import ChecksumFileSystemWriter, ChecksumSavePlanner, _RecordingFileSystem

    class QuotaStream:
        def __init__(self, f):
            self.f, self.left = f, 1000

        def write(self, data):
            n = memoryview(data).nbytes
            if n > self.left:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.left -= n
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

    class QuotaFileSystem(FileSystem):
        def create_stream(self, path, mode):
            import contextlib

            @contextlib.contextmanager
            def stream():
                with FileSystem.create_stream(self, path, mode) as f:
                    yield QuotaStream(f) if "w" in mode else f
            return stream()

    class Recording(_RecordingFileSystem, QuotaFileSystem):
        pass

    class Writer(ChecksumFileSystemWriter):
        def __init__(self, path):
            super().__init__(path)
            self.fs = Recording()

    path = str(tmp_path / "ckpt")
    with pytest.raises(BaseException) as info:  # DCP's CheckpointException is a BaseException
        dcp.save({"x": torch.zeros(4096)}, storage_writer=Writer(path), planner=ChecksumSavePlanner())
    text = str(info.value)
    assert f"ENOSPC (No space left on device) on {os.path.join(path, '__0_0.distcp')}" in text, text
    assert "bytes free" in text and "torch reported" in text, text
