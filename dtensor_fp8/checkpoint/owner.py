"""One job per checkpoint root: ``root/.owner``, claimed by the saving job's rank 0 and kept fresh
by a heartbeat.

[Note: one job per root]
Two jobs saving into one root overwrite each other's steps, ``latest`` and partial directories,
and each of their saves can return normally while every committed step is a mix of both. So the
first save of a job (its rank 0 process) claims the root: it creates ``root/.owner`` (a temporary
file hard-linked into place, which fails if the file exists: atomic on local and network file
systems), holding who the job is (host, pid, start time, command line). A daemon thread of that
process touches the file every :data:`HEARTBEAT_S` seconds (5) while the process lives, and
removes it at exit.

A save that finds another job's claim decides whether that job is alive:

- the claim names a process of this host (same boot and pid namespace): alive while a process
  with that pid and that start time (``/proc/<pid>/stat``) exists, dead otherwise (a reused pid
  has another start time);
- a process of another host: alive while its heartbeat beats. Its heartbeat (the file's mtime, compared with the mtime of a probe file written now, so
  both come from the file system's clock and hosts' clocks do not matter) is older than
  :data:`STALE_S` seconds (30): dead;
- else the save watches the file until it is touched again (the job is alive: the save is
  refused on every rank, naming the job, before anything is written) or its heartbeat grows older
  than the stale limit (dead), so it waits at most that long;
- a heartbeat dated after the file system's clock (hosts' clocks skewed, the file touched by hand)
  has no known age: watched for the stale limit, it is alive if it beats, and otherwise the save
  is refused on every rank naming the file, its date and the clocks (a heartbeat an hour ahead
  would otherwise hold the save for that hour while the other ranks time out).

A claim copied with the root (``cp -r ckpt ckpt2`` while the job runs) names a live job that
never saved into the copy: each claim records the inode of the directory it was made in (the
same on every host mounting the file system), and a claim made in another directory is taken
over at once, as a dead job's is.

A dead job's claim is taken over: renamed aside (one rename: of several contenders, one wins),
checked to be the claim judged dead, removed, and replaced by this job's own; a claim another
contender took in between is put back. The owner checks its claim again before each commit: a job
paused longer than the stale limit (SIGSTOP, a stalled file system) whose root was taken over
stops saving there instead of overwriting the new owner's steps. Loads take no claim.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
import uuid
import warnings

from ..agreement import CheckpointError

OWNER_FILE = ".owner"
#: seconds between two touches of a held claim (read at each beat)
HEARTBEAT_S = 5.0
#: seconds without a heartbeat after which another host's claim is dead (at least 3 heartbeats)
STALE_S = 30.0

_mutex = threading.Lock()
_held: dict[str, str] = {}  # realpath(root) -> owner file, the roots this process has claimed
_identity: dict | None = None
_thread: threading.Thread | None = None


def settings() -> tuple[float, float]:
    """``(HEARTBEAT_S, STALE_S)``, checked: the stale limit must span several heartbeats."""
    beat, stale = float(HEARTBEAT_S), float(STALE_S)
    if beat <= 0 or stale < 3 * beat:
        raise CheckpointError(f"owner.HEARTBEAT_S={beat} and owner.STALE_S={stale}: the heartbeat must be positive "
                              "and the stale limit at least 3 heartbeats (a live job must beat several times before "
                              "another may judge it dead)")
    return beat, stale


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read(4096).strip()
    except OSError:
        return None


def _me() -> dict:
    global _identity, _thread
    if _identity is None or _identity["pid"] != os.getpid():  # a forked child is another job
        _identity = {"job": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(),
                     "boot": _read_text("/proc/sys/kernel/random/boot_id"),
                     "pidns": _pid_namespace(), "pstart": _process_start(os.getpid()),
                     "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                     "command": " ".join(sys.argv)[:300]}
        _held.clear()
        _thread = None
    return _identity


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def describe(record: dict | None) -> str:
    """Who a claim names, for messages."""
    if not record or "job" not in record:
        return "an unknown job (its claim file is unreadable)"
    return (f"job {str(record.get('job'))[:8]} (pid {record.get('pid')} on {record.get('host')}, started "
            f"{record.get('started')}: `{record.get('command')}`)")


def _read(file: str) -> tuple[dict | None, int | None]:
    """``(record, mtime_ns)`` of a claim file; ``(None, None)`` if there is none."""
    try:
        mtime = os.stat(file).st_mtime_ns
        with open(file) as f:
            text = f.read(65536)
    except FileNotFoundError:
        return None, None
    try:
        record = json.loads(text)
        if not isinstance(record, dict):
            raise ValueError("not an object")
    except ValueError:
        record = {"unreadable": text[:100]}
    return record, mtime


def _root_id(root: str) -> int:
    """The root directory's inode number: the same for the directory on every host that mounts its
    file system, another for a copy of it (see "a copied root" in the note)."""
    return os.stat(root).st_ino


def _copied_from_elsewhere(root: str, other: dict) -> str | None:
    """Why the claim ``other`` in ``root`` is not a claim on ``root`` (it was copied here with the
    root's files), or None."""
    claimed = other.get("root_id")
    if isinstance(claimed, int) and claimed != _root_id(root):
        return (f"its claim was made on another directory (inode {claimed}, this root's is {_root_id(root)}) and "
                f"copied here with the checkpoint (a copied root keeps the {OWNER_FILE} file of the job that saved it)")
    return None


def _create(root: str, file: str, me: dict) -> bool:
    """Claim ``root`` if nobody has: False if the claim file exists."""
    tmp = os.path.join(root, f"{OWNER_FILE}.{me['job']}.tmp")
    me = {**me, "root_id": _root_id(root)}
    with open(tmp, "w") as f:
        json.dump(me, f)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, file)
    except FileExistsError:
        return False
    except OSError:  # a file system without hard links: exclusive creation instead
        try:
            fd = os.open(file, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass
    return True


def _fs_now(root: str) -> int:
    """The file system's clock now (ns): the mtime of a probe file written into ``root``."""
    probe = os.path.join(root, f"{OWNER_FILE}.{_me()['job']}.probe")
    fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        os.write(fd, b"t")
        return os.fstat(fd).st_mtime_ns
    finally:
        os.close(fd)
        os.unlink(probe)


def _process_start(pid) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot, ``/proc/<pid>/stat`` field 22),
    or None if there is no such process (or no ``/proc``)."""
    text = _read_text(f"/proc/{int(pid)}/stat")
    if not text or ")" not in text:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return fields[19] if len(fields) > 19 else None


def _dead_because(root: str, file: str, other: dict, mtime: int) -> str | None:
    """Why the job of ``other`` is dead (a reason), or None when it is alive: a process of this host
    that still runs, or a heartbeat seen beating (see the note)."""
    me = _me()
    if (me["boot"] and me["pstart"] and other.get("host") == me["host"] and other.get("boot") == me["boot"]
            and other.get("pidns") == me["pidns"] and isinstance(other.get("pid"), int)):
        started = _process_start(other["pid"])
        if started is None:
            return f"its process {other['pid']} on this host no longer exists"
        if other.get("pstart") is not None and started != other.get("pstart"):
            return f"its process {other['pid']} on this host has ended (the pid is another process's now)"
        return None
    beat, stale = settings()
    watched = time.monotonic()
    while True:
        now = _fs_now(root)
        age = (now - mtime) / 1e9
        if age > stale:
            return f"its heartbeat stopped {age:.1f} s ago (the stale limit is {stale:g} s)"
        if age < 0 and time.monotonic() - watched > stale:
            raise _from_the_future(file, other, mtime, now, stale)
        time.sleep(min(beat / 4, 0.5))
        record, now_mtime = _read(file)
        if now_mtime is None:
            return "it released the root"
        if now_mtime != mtime or record.get("job") != other.get("job"):
            return None  # touched (or claimed anew): a live job


def _when(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9)) + f".{int(ns % 10**9) // 10**6:03d}"


def _from_the_future(file: str, other: dict, mtime: int, fs_now: int, stale: float) -> CheckpointError:
    """A claim whose heartbeat is dated after the file system's clock and did not beat while
    watched for the stale limit: its age is unknown, so it is neither alive nor dead."""
    return CheckpointError(
        f"{file}, the claim of {describe(other)}, has its heartbeat dated {_when(mtime)}, "
        f"{(mtime - fs_now) / 1e9:.1f} s after the file system's clock ({_when(fs_now)}; this host's clock reads "
        f"{_when(time.time_ns())}), and it did not beat in {stale:g} s of watching: its age is unknown (clocks "
        "skewed between hosts, or the file touched by hand), so this job neither waits for it nor takes the root "
        f"over. Fix: if that job is gone, delete {file}; otherwise set the hosts' clocks right (NTP), or save into "
        "another root")


def acquire(root: str) -> None:
    """Claim ``root`` for this job (rank 0, before a save changes anything; see the note).

    Args:
        root: the checkpoint root (created by the caller).

    Raises:
        CheckpointError: another live job holds the root, or took it over from this one.

    Example:
        >>> acquire("ckpt")  # rank 0, in prepare_save
    """
    me = _me()
    key, file = os.path.realpath(root), os.path.join(root, OWNER_FILE)
    for _ in range(8):  # each round ends in a claim, a refusal, or a race lost to another contender
        other, mtime = _read(file)
        if other is None and _create(root, file, me):
            _hold(key, file)
            return
        if other is None:
            continue
        copied = _copied_from_elsewhere(root, other)
        if other.get("job") == me["job"] and copied is None:
            os.utime(file)
            _hold(key, file)
            return
        if key in _held and copied is None:
            with _mutex:
                _held.pop(key, None)
            raise _taken_over(root, other)
        reason = copied or _dead_because(root, file, other, mtime)
        if reason is None:
            beat, stale = settings()
            raise CheckpointError(
                f"checkpoint root {root} is in use by another job: {describe(other)}, whose heartbeat in {file} is "
                f"still beating (every {beat:g} s). Two jobs saving into one root overwrite each other's steps, so "
                "this save was refused before writing anything. Fix: save into another root, or stop that job "
                f"first (a killed job's claim goes stale {stale:g} s after its last heartbeat and is then taken over; "
                f"delete {file} by hand only if you are sure that job is gone)")
        if reason != "it released the root" and _take_over(root, file, other):
            warnings.warn(f"dtensor_fp8: took over checkpoint root {root} from {describe(other)}: {reason}",
                          stacklevel=3)
    raise CheckpointError(f"could not claim checkpoint root {root}: {file} kept changing hands (several jobs starting "
                          "to save there at once?). Fix: give each job its own root")


def _take_over(root: str, file: str, judged: dict) -> bool:
    """Replace the claim judged dead: True if it was removed (this job then claims the root)."""
    aside = os.path.join(root, f"{OWNER_FILE}.{_me()['job']}.stale")
    try:
        os.rename(file, aside)
    except FileNotFoundError:
        return False
    moved, _ = _read(aside)
    if moved is not None and moved.get("job") != judged.get("job"):
        # another contender claimed the root between our read and the rename: put its claim back
        try:
            os.link(aside, file)
        except OSError:
            pass
        os.unlink(aside)
        return False
    os.unlink(aside)
    return True


def check(root: str) -> None:
    """Before a commit: ``root`` is still this job's (a :class:`CheckpointError` if another job took it).

    Args:
        root: a root this job claimed with :func:`acquire`.

    Example:
        >>> check("ckpt")  # rank 0, in commit_save
    """
    other, _ = _read(os.path.join(root, OWNER_FILE))
    if other is None:  # removed by hand: claim it again
        acquire(root)
    elif other.get("job") != _me()["job"]:
        raise _taken_over(root, other)


def _taken_over(root: str, other: dict) -> CheckpointError:
    _, stale = settings()
    return CheckpointError(
        f"checkpoint root {root} was taken over by another job, {describe(other)}, while this job held it (this "
        f"job's heartbeat stopped for more than {stale:g} s: a paused or stalled process?). Two jobs writing one "
        "root overwrite each other's steps, so this job does not save there any more. Fix: save into another root")


def _hold(key: str, file: str) -> None:
    global _thread
    with _mutex:
        _held[key] = file
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_heartbeat, name="dtensor_fp8-checkpoint-heartbeat", daemon=True)
            _thread.start()


def _heartbeat() -> None:
    job = _me()["job"]
    while True:
        try:
            beat = settings()[0]
        except CheckpointError:
            beat = 5.0
        time.sleep(beat)
        with _mutex:
            held = list(_held.items())
        for key, file in held:
            record, _ = _read(file)
            if record is not None and record.get("job") != job:
                continue  # taken over: left to acquire() / check() to report, never touched
            try:
                if record is None:
                    raise FileNotFoundError(file)
                os.utime(file)
            except OSError:  # the root was removed: nothing to hold (a later save claims it again)
                with _mutex:
                    if _held.get(key) == file:
                        del _held[key]


def _after_fork_in_child() -> None:
    """A forked child is another job: none of the parent's claims, a fresh lock (the parent's
    heartbeat thread may have held it at the fork) and no thread yet."""
    global _mutex, _identity, _thread
    _mutex = threading.Lock()
    _held.clear()
    _identity = None
    _thread = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _release() -> None:
    """At a normal exit: remove this process's claims (a killed process's go stale)."""
    if _identity is None or _identity["pid"] != os.getpid():
        return
    for file in list(_held.values()):
        record, _ = _read(file)
        if record is not None and record.get("job") == _identity["job"]:
            try:
                os.unlink(file)
            except OSError:
                pass
