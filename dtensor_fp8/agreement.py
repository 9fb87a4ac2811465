"""One decision on every rank: the process group over the ranks that hold a set of parameters, and
each rank's findings shared over it (:func:`gather_findings`: the one way findings, names of bad
parameters included, cross ranks; ``groups.py`` derives the groups and reduces numbers).

A check of sharded values (a NaN in one rank's shard, a shard of the wrong shape) finds different
things on different ranks; a load that writes on the ranks that found nothing and raises on the
others leaves the model half loaded and the next collective hanging. So the loaders gather every
rank's findings over the parameters' group and all take the same decision.

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

from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .formats.base import RecipeError


def agreement_group(params: Iterable[torch.Tensor]):
    """The process group spanning every rank that holds a shard of ``params`` (their DTensor
    meshes), or None when none is a DTensor (each rank holds its own copy: nothing to agree on).

    One 1-D mesh: its group. Several meshes, or a mesh of several dimensions (HSDP, (dp, tp)),
    whose ranks are the whole job: the default group (named explicitly). Anything else (meshes
    over part of the job) is refused, naming the meshes, rather than guessed.

    Args:
        params: parameters (or any tensors; the DTensors among them decide).

    Example:
        >>> group = agreement_group(model.parameters())   # fully_shard(model, mesh=init_device_mesh("cuda", (8,)))
    """
    meshes = []
    for p in params:
        if isinstance(p, DTensor) and not any(p.device_mesh is m for m in meshes):
            if not any(p.device_mesh == m for m in meshes):
                meshes.append(p.device_mesh)
    if not meshes:
        return None
    if len(meshes) == 1 and meshes[0].ndim == 1:
        return meshes[0].get_group()
    ranks = sorted({int(r) for m in meshes for r in m.mesh.flatten().tolist()})
    if ranks == list(range(dist.get_world_size(group=dist.group.WORLD))):
        return dist.group.WORLD
    raise NotImplementedError(
        f"dtensor_fp8: the parameters lie on {len(meshes)} device mesh(es) ({', '.join(str(m) for m in meshes)}) "
        f"spanning ranks {ranks} of {dist.get_world_size(group=dist.group.WORLD)}: no single process group of them is known here to agree "
        "on a decision. Put the model on one mesh (or meshes covering the whole job).")


def gather_findings(findings: list, group) -> list:
    """Every rank's ``findings`` (plain picklable values), duplicates of an earlier one dropped; this
    rank's own where ``group`` is None. ``group`` may also be a sequence of groups (the mesh dims'
    groups of ``groups.mesh_groups``), gathered over in turn: every rank of their product ends with
    every finding. A collective over those groups: call it on every rank of them at the same point.

    Args:
        findings: this rank's (e.g. ``(kind, message)`` tuples).
        group: from :func:`agreement_group`, or a tuple of groups from ``groups.mesh_groups``.

    Example:
        >>> problems = gather_findings(local_problems, mesh_groups(model.parameters()))
    """
    out = list(findings)
    if group is None or not dist.is_initialized():
        return out
    for g in (group if isinstance(group, (tuple, list)) else (group,)):
        if dist.get_world_size(g) == 1:
            continue
        everyone: list = [None] * dist.get_world_size(g)
        dist.all_gather_object(everyone, out, group=g)
        out = []
        for rank_findings in everyone:
            out += [f for f in rank_findings if f not in out]
    return out


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
    (``agreement.agreement_group``); None (no parameter is sharded, each rank holds its own
    copy): this rank alone, with the same message.

    Example:
        >>> agree_over("load_hp_checkpoint(ckpt)", check, group=agreement_group(model.parameters()))
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
