"""Checkpoint errors, and how a failure on one rank becomes the same error on every rank.

[Note: one error on every rank]
A rank that raises inside ``save_checkpoint`` / ``load_checkpoint`` while the others go on into the
next collective leaves them waiting for the process group's timeout (30 minutes by default) with
nothing said. So every step that can fail on some ranks only (rank 0 preparing directories, a
state dict that differs on one rank, a file one rank cannot read) ends in :func:`agree`: each
rank reports success or its error message to all others (one ``all_gather_object``), and if any
rank failed, every rank raises the same :class:`CheckpointError` naming the ranks and what each
said. DCP's own collectives already share an error among ranks (as a ``CheckpointException``, a
``BaseException`` whose text is a traceback per rank); :func:`describe_dcp_failure` turns it into
the message of the rank that failed. Only a rank that dies (killed, ``os._exit``) still leaves
the others to the group timeout: nothing is left to report; they then raise "lost contact".
"""

from __future__ import annotations

from typing import Callable

import torch.distributed as dist

from ..formats.base import RecipeError

class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded as asked.

    The message names what went wrong, where (entry, file, rank) and the fix. Raised alike on every
    rank. An ``Exception`` (DCP's own ``CheckpointException`` is a ``BaseException``, which
    ``except Exception`` misses).
    """


class CheckpointRecipeError(CheckpointError, RecipeError):
    """A checkpoint whose FP8 recipe or planes do not match the model's (a :class:`RecipeError` too)."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file that asks to unpickle something outside DCP's own classes / torch's
    ``weights_only`` allow-list: refused before anything runs."""


def _message(err: BaseException) -> str:
    text = str(err).strip()
    if isinstance(err, CheckpointError):
        return text
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _error_class(kinds: set[str]) -> type[CheckpointError]:
    if kinds <= {"CheckpointRecipeError", "RecipeError"}:
        return CheckpointRecipeError
    if kinds == {"UnsafeCheckpointError"}:
        return UnsafeCheckpointError
    return CheckpointError


def combined_error(what: str, failures: dict[int, tuple], world: int, after: str = "") -> CheckpointError:
    """The error every rank raises: ``failures`` maps rank -> (exception class name, message, whether
    the message names its ranks itself)."""
    by_text: dict[str, list[int]] = {}
    for rank, (_, text, _) in sorted(failures.items()):
        by_text.setdefault(text, []).append(rank)
    named = all(f[2] for f in failures.values())  # DCP's errors: the same text, naming the failing ranks

    def where(ranks):
        if world == 1 or named:
            return ""
        if len(ranks) == world:
            return f" [every rank of {world}]"
        return f" [rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {world}]"

    if len(by_text) == 1:
        text, ranks = next(iter(by_text.items()))
        msg = f"{what}: {text.rstrip('.')}{where(ranks)}."
    else:
        msg = f"{what}, differently on several ranks:" + "".join(
            f"\n  - {text}{where(ranks)}" for text, ranks in by_text.items())
    return _error_class({f[0] for f in failures.values()})(msg + after)


def agree(what: str, fn: Callable, *args, group=None, after: str = "",
          outcome: Callable[[], str] | None = None, everyone: bool = False):
    """Run ``fn(*args)`` on this rank, then raise the same error on every rank if it failed on any.

    Call it on every rank of ``group`` at the same point (it is a collective). Without an
    initialized process group it just runs ``fn``.

    Args:
        what: what was being done, for the message (e.g. ``"load_checkpoint(ckpt/step-00000002)"``).
        fn: the step; its exceptions (``Exception``, and DCP's ``CheckpointException``) are caught.
        group: the process group (default: the default group).
        after: appended to the message when a rank failed (what the failure left behind).
        outcome: called on every surviving rank when a rank failed or died, instead of ``after``:
            a sentence saying what the failure left behind, read from the disk at that moment (a
            commit that a kill cut short may or may not have swapped its step in).
        everyone: return the list of every rank's result (in rank order), gathered with the reports.

    Returns:
        ``fn``'s result on this rank (every rank's, with ``everyone``).

    Example:
        >>> agree("save_checkpoint(ckpt, 2)", prepare_dirs if rank == 0 else lambda: None)
    """
    from torch.distributed.checkpoint.api import CheckpointException

    error: BaseException | None = None
    result = None
    try:
        result = fn(*args)
    except (Exception, CheckpointException) as err:  # noqa: BLE001  (reported to every rank below)
        error = err
    report = None if error is None else (type(error).__name__, _message(error), getattr(error, "names_ranks", False))
    sent = (report, result if everyone and error is None else None)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        world = dist.get_world_size(group)
        gathered: list = [None] * world
        try:
            dist.all_gather_object(gathered, sent, group=group)
        except Exception as comm:  # noqa: BLE001  (a rank died, or the group timed out)
            own = f"; this rank's own error: {report[1]}" if report else ""
            left = (" " + _outcome(outcome)) if outcome is not None else (
                " Nothing was committed by this step; the next save_checkpoint removes what it left.")
            lost = CheckpointError(
                f"{what}: lost contact with the other ranks ({type(comm).__name__}: {str(comm).splitlines()[0][:200]})"
                f"{own}. A rank died or hangs (killed, out of memory?).{left} Restart the job.")
            lost.ranks_lost = True
            raise lost from (error or comm)
    else:
        world, gathered = 1, [sent]
    failures = {rank: r for rank, (r, _) in enumerate(gathered) if r is not None}
    if failures:
        if outcome is not None:
            after = " " + _outcome(outcome)
        raise combined_error(what, failures, world, after) from error
    return [r for _, r in gathered] if everyone else result


def agree_over(what: str, fn: Callable, *args, group, after: str = ""):
    """:func:`agree` over ``group``, a process group derived from the parameters' meshes
    (``agreement._agreement_group``); None (no parameter is sharded, each rank holds its own
    copy): this rank alone, with the same message.

    Example:
        >>> agree_over("load_hp_checkpoint(ckpt)", check, group=_agreement_group(model.parameters()))
    """
    if group is not None:
        return agree(what, fn, *args, group=group, after=after)
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001  (named as agree names it)
        raise combined_error(what, {0: (type(err).__name__, _message(err), False)}, 1, after) from err


def _outcome(outcome: Callable[[], str]) -> str:
    try:
        return outcome()
    except Exception as err:  # noqa: BLE001  (the disk cannot be read: say so, keep the first error)
        return f"What it left on disk could not be read ({type(err).__name__}: {err})."


def os_error_text(err: OSError, file=None) -> str:
    """``err`` as a sentence naming its errno (``ENOSPC``), the file, and for a full or read-only
    file system the free space and the fix.

    Example:
        >>> os_error_text(OSError(28, "No space left on device"), "ckpt/.step-00000002.partial/__0_0.distcp")
    """
    import errno as errno_names
    import os

    file = os.fspath(file) if file is not None else getattr(err, "filename", None)
    code = errno_names.errorcode.get(err.errno, f"errno {err.errno}") if err.errno else type(err).__name__
    text = f"{code} ({err.strerror or err})" + (f" on {file}" if file else "")
    if err.errno in (errno_names.ENOSPC, errno_names.EDQUOT) and file:
        where = os.path.dirname(os.fspath(file)) or "."
        try:
            st = os.statvfs(where)
            free = f"{st.f_bavail * st.f_frsize} bytes free of {st.f_blocks * st.f_frsize}"
        except OSError:
            free = "free space unknown"
        text += (f": the file system (or quota) holding {where} is full ({free}). Fix: free space there or save "
                 "into a root on another file system")
    elif err.errno == errno_names.EIO:
        text += ": the device or network file system failed the operation; check it (dmesg, the storage's status)"
    elif err.errno == errno_names.EROFS:
        text += ": the file system is mounted read-only"
    return text
