"""Checkpoint directories: written aside, swapped in whole, named by a ``latest`` pointer.

[Note: atomic steps]
A checkpoint root holds complete step directories and a ``latest`` file naming one of them::

    root/latest                      "step-00000002"
    root/step-00000001/              .metadata, __0_0.distcp, __1_0.distcp, checksums.json
    root/step-00000002/
    root/.step-00000003.partial/     a save in progress (or one that a killed rank left)

A save writes into ``.step-<n>.partial``; only once every rank has finished (DCP writes
``.metadata`` last, after all ranks' shards), rank 0 swaps it in: a new step is one rename; a
re-save of an existing step renames the old directory to ``.step-<n>.old``, the partial one to
``step-<n>``, then removes the old one. ``latest`` is replaced atomically (a temporary file
renamed) after the swap. So ``latest`` never names a directory without its complete contents:
a rank that dies during a save leaves the previous directory and ``latest`` as they were. The one
moment between the two renames of a re-save (rank 0 killed there) leaves ``step-<n>`` missing and
both others complete; :func:`resolve_latest` then returns the new, complete ``.partial``, and the
next save renames it back in place (:func:`prepare_save`). The next save also removes partial and
old directories that killed saves left.

One job saves into a root at a time: rank 0 holds ``root/.owner`` while the job lives (``owner.py``);
a save of another live job is refused before anything is written. Step directories and the files
in them must resolve inside their root: a symlink leading out of it is refused, never followed.
"""

from __future__ import annotations

import os
import re
import shutil

from . import owner
from ..agreement import CheckpointError

LATEST = "latest"
METADATA_FILE = ".metadata"  # DCP's (torch.distributed.checkpoint.filesystem._metadata_fn)
_AUX = re.compile(r"^\.(?P<name>step-\d+)\.(?P<kind>partial|old)$")


def step_dir_name(step: int) -> str:
    """``step-00000042`` for step 42 (sorts by step)."""
    if int(step) != step or step < 0:
        raise CheckpointError(f"save_checkpoint: step must be a non-negative integer, got {step!r}")
    return f"step-{int(step):08d}"


def partial_dir(root: str, name: str) -> str:
    return os.path.join(root, f".{name}.partial")


def _old_dir(root: str, name: str) -> str:
    return os.path.join(root, f".{name}.old")


def is_complete(path: str) -> bool:
    """A directory DCP finished writing (``.metadata`` is written last, by a rename)."""
    return os.path.isfile(os.path.join(path, METADATA_FILE))


def complete_checkpoints(root: str) -> list[str]:
    """Names of the complete checkpoint directories directly under ``root``, sorted."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted(n for n in names if not n.startswith(".") and is_complete(os.path.join(root, n)))


def _fix(root: str) -> str:
    found = complete_checkpoints(root)
    listing = f"complete checkpoints there: {found}" if found else "no complete checkpoint is there"
    return (f"{listing}. Fix: write the name of one of them into {os.path.join(root, LATEST)} "
            "(e.g. `echo step-00000002 > latest`), or pass a checkpoint directory to load_checkpoint directly")


def checked_name(name: str, root: str) -> str:
    """``name`` if it names a directory directly inside ``root``, else a :class:`CheckpointError`."""
    pointer = os.path.join(root, LATEST)
    if not name:
        raise CheckpointError(f"{pointer} is empty (written by hand, or by a tool that failed?); {_fix(root)}")
    seps = {"/", "\\", os.sep} | ({os.altsep} if os.altsep else set())
    if name in (".", "..") or any(s in name for s in seps) or "\0" in name or os.path.isabs(name):
        raise CheckpointError(
            f"{pointer} names {name!r}, which is not a directory name inside {root} (a path, '..' or a separator: "
            f"`latest` may only name a directory of its own root, as save_checkpoint writes it); {_fix(root)}")
    return name


def read_latest(root: str) -> str:
    """The directory name ``root/latest`` holds, checked to lie inside ``root``."""
    pointer = os.path.join(root, LATEST)
    if not os.path.isdir(root):
        raise CheckpointError(f"checkpoint root {root} does not exist (or is not a directory)")
    try:
        with open(pointer) as f:
            text = f.read(4096)
    except FileNotFoundError:
        raise CheckpointError(f"{root} has no {LATEST!r} pointer: no save_checkpoint completed there; {_fix(root)}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{pointer} cannot be read ({type(err).__name__}: {err}); {_fix(root)}") from None
    return checked_name(text.strip(), root)


def escapes(root: str, path: str) -> str | None:
    """Where ``path`` (an entry of the directory ``root``) really is, if a symlink leads it out of
    ``root``; None when it resolves directly inside ``root`` (or does not exist)."""
    if not os.path.lexists(path):
        return None
    real = os.path.realpath(path)
    return None if os.path.dirname(real) == os.path.realpath(root) else real


def check_inside(root: str, path: str, what: str) -> None:
    """A :class:`CheckpointError` if ``path`` is a symlink leading out of ``root``."""
    real = escapes(root, path)
    if real is not None:
        raise CheckpointError(
            f"{path} is a symlink to {real}, outside {root}: {what} must lie in its own directory, and a link "
            "leading out of it is not followed (it would load or overwrite files of another checkpoint, or "
            "anything else). Fix: replace the link by a copy of the directory or file it names")


def resolve_latest(root: str) -> str:
    """The complete checkpoint directory ``root/latest`` names (read-only; see the note)."""
    name = read_latest(root)
    path = os.path.join(root, name)
    for candidate in (path, partial_dir(root, name), _old_dir(root, name)):
        check_inside(root, candidate, f"a step directory of {root}")
    if is_complete(path):
        return path
    if not os.path.exists(path):
        for interrupted in (partial_dir(root, name), _old_dir(root, name)):  # a swap cut between its renames
            if is_complete(interrupted):
                return interrupted
        raise CheckpointError(f"{os.path.join(root, LATEST)} names {name!r}, which does not exist in {root} "
                              f"(deleted or moved?); {_fix(root)}")
    raise CheckpointError(f"{os.path.join(root, LATEST)} names {name!r}, which has no {METADATA_FILE}: not a complete "
                          f"checkpoint (copied in part? written before atomic saves?); {_fix(root)}")


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot sync a directory
        pass
    finally:
        os.close(fd)


def _write_latest(root: str, name: str) -> None:
    tmp = os.path.join(root, f".{LATEST}.tmp")
    with open(tmp, "w") as f:
        f.write(name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST))
    _fsync_dir(root)


def prepare_save(root: str, name: str) -> str:
    """Rank 0, before a save: finish a swap a killed rank 0 cut short, remove partial and old
    directories killed saves left, and create an empty partial directory for ``name``.

    Returns:
        The partial directory to write into.
    """
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"checkpoint root {root} exists and is not a directory: pass a directory path as root")
    os.makedirs(root, exist_ok=True)
    owner.acquire(root)  # before anything is changed: another live job's save is refused here
    try:
        current = read_latest(root)
    except CheckpointError:  # no valid pointer yet: nothing to repair
        current = None
    if current is not None and not os.path.lexists(os.path.join(root, current)):
        for interrupted in (partial_dir(root, current), _old_dir(root, current)):
            if is_complete(interrupted) and escapes(root, interrupted) is None:
                os.rename(interrupted, os.path.join(root, current))
                break
    for entry in os.listdir(root):
        if _AUX.match(entry):
            _remove(os.path.join(root, entry))
    path = partial_dir(root, name)
    os.makedirs(path)
    _fsync_dir(root)
    return path


def _remove(path: str) -> None:
    """Remove a directory tree, or only the link where ``path`` is a symlink (never what it names)."""
    if os.path.islink(path) or not os.path.isdir(path):
        os.unlink(path)
    else:
        shutil.rmtree(path)


def commit_save(root: str, name: str) -> str:
    """Rank 0, once every rank has written the partial directory: swap it in as ``name`` and point
    ``latest`` at it.

    Returns:
        The checkpoint directory.
    """
    final, partial = os.path.join(root, name), partial_dir(root, name)
    owner.check(root)  # still this job's root (a paused job may have lost it to another)
    if not is_complete(partial):
        raise CheckpointError(f"{partial} has no {METADATA_FILE} after every rank finished writing: refusing to "
                              "swap it in (was it removed or written to by another job?)")
    old = None
    if os.path.lexists(final):
        old = _old_dir(root, name)
        os.rename(final, old)
    os.rename(partial, final)
    _fsync_dir(root)
    _write_latest(root, name)
    if old is not None:
        try:
            _remove(old)
        except OSError:  # the next save removes it
            pass
    return final


def discard_save(root: str, name: str) -> None:
    """Rank 0, after a save failed on some rank (every rank stopped writing): remove its partial directory."""
    try:
        _remove(partial_dir(root, name))
    except OSError:  # the next save removes it
        pass


def commit_outcome(root: str, name: str) -> str:
    """What a commit of ``name`` that failed or was cut short (a rank killed, a fault after the swap)
    left in ``root``, read from the disk: a sentence for the error every surviving rank raises."""
    final, partial, old = os.path.join(root, name), partial_dir(root, name), _old_dir(root, name)
    try:
        latest = read_latest(root)
    except CheckpointError:
        latest = None
    pointer = f"`latest` names {latest!r}" if latest else "`latest` names nothing valid"
    if is_complete(partial) and not os.path.lexists(final):
        return (f"The swap was cut between its two renames: {final} is missing and the new state is complete in "
                f"{partial}; latest_checkpoint({root!r}) returns it and the next save renames it in place.")
    if not os.path.lexists(partial) and is_complete(final):
        if latest == name:
            left = f" ({old}, the step's previous copy, is left for the next save to remove)" if os.path.lexists(old) else ""
            return f"The new state is committed: {final} holds it and {pointer}{left}."
        return (f"The new state is complete in {final}, but {pointer} (the pointer was not rewritten): "
                f"latest_checkpoint({root!r}) returns {latest or 'nothing'}; load {final} directly, or save again "
                "to point `latest` at a new step.")
    if os.path.lexists(partial):
        return (f"Nothing was committed: {pointer} as before, and the partial directory {partial} is left for the "
                "next save to remove.")
    return f"{final} {'is complete' if is_complete(final) else 'is not complete'} and {pointer}."
