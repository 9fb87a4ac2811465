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

from typing import Callable, TypeVar

import torch.distributed as dist

from ..formats.base import RecipeError

T = TypeVar("T")


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


def agree(what: str, fn: Callable[..., T], *args, group=None, after: str = "") -> T:
    """Run ``fn(*args)`` on this rank, then raise the same error on every rank if it failed on any.

    Call it on every rank of ``group`` at the same point (it is a collective). Without an
    initialized process group it just runs ``fn``.

    Args:
        what: what was being done, for the message (e.g. ``"load_checkpoint(ckpt/step-00000002)"``).
        fn: the step; its exceptions (``Exception``, and DCP's ``CheckpointException``) are caught.
        group: the process group (default: the default group).
        after: appended to the message when a rank failed (what the failure left behind).

    Returns:
        ``fn``'s result on this rank.

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
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        world = dist.get_world_size(group)
        reports: list = [None] * world
        try:
            dist.all_gather_object(reports, report, group=group)
        except Exception as comm:  # noqa: BLE001  (a rank died, or the group timed out)
            own = f"; this rank's own error: {report[1]}" if report else ""
            lost = CheckpointError(
                f"{what}: lost contact with the other ranks ({type(comm).__name__}: {str(comm).splitlines()[0][:200]})"
                f"{own}. A rank died or hangs (killed, out of memory?); nothing was committed by this step. "
                "Restart the job; the next save_checkpoint removes what this one left.")
            lost.ranks_lost = True
            raise lost from (error or comm)
    else:
        world, reports = 1, [report]
    failures = {rank: r for rank, r in enumerate(reports) if r is not None}
    if failures:
        raise combined_error(what, failures, world, after) from error
    return result  # type: ignore[return-value]
