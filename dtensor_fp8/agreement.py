"""One decision on every rank: the process group over the ranks that hold a set of parameters, and
each rank's findings shared over it (:func:`gather_findings`: the one way findings, names of bad
parameters included, cross ranks; ``groups.py`` derives the groups and reduces numbers).

A check of sharded values (a NaN in one rank's shard, a shard of the wrong shape) finds different
things on different ranks; a load that writes on the ranks that found nothing and raises on the
others leaves the model half loaded and the next collective hanging. So the loaders gather every
rank's findings over the parameters' group and all take the same decision.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _agreement_group(params: Iterable[torch.Tensor]):
    """The process group spanning every rank that holds a shard of ``params`` (their DTensor
    meshes), or None when none is a DTensor (each rank holds its own copy: nothing to agree on).

    One 1-D mesh: its group. Several meshes, or a mesh of several dimensions (HSDP, (dp, tp)),
    whose ranks are the whole job: the default group (named explicitly). Anything else (meshes
    over part of the job) is refused, naming the meshes, rather than guessed.

    Args:
        params: parameters (or any tensors; the DTensors among them decide).

    Example:
        >>> group = _agreement_group(model.parameters())   # fully_shard(model, mesh=init_device_mesh("cuda", (8,)))
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
        group: from :func:`_agreement_group`, or a tuple of groups from ``groups.mesh_groups``.

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
