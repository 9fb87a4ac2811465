"""Which ranks must ask for a checkpoint's entries: each rank all of them, or the ranks together.

[Note: partial loads]
A checkpoint saved by a data-parallel job is loaded by ranks that each ask for every entry (their
shards of it): an entry the state dict does not ask for would be dropped silently, so by default
``load_checkpoint`` refuses it (``coverage="rank"``). Under pipeline parallelism every stage saves
its own entries into one checkpoint (their names are the whole model's: torchtitan builds each stage
as the whole model with the other stages' layers deleted) and, on resume, asks for its own entries
only: every rank's state dict lacks the other stages'. With ``coverage="group"`` an entry is
unexpected only when *no* rank of the process group asks for it (a deeper model than the one
built, a state dict without its optimizer), which still catches what the default catches for one
stage. Entries a rank asks for and the checkpoint lacks are missing in either mode.

Whether some rank asks for an entry is one ``all_gather_object`` of a bit mask over the
checkpoint's entries (sorted, the same ``.metadata`` on every rank): ``len(entries) / 8`` bytes a
rank, over the load's process group (any backend).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch.distributed as dist

#: ``load_checkpoint(coverage=...)``: who must ask for every entry of the checkpoint
COVERAGES = ("rank", "group")


def check_coverage_mode(coverage: str) -> None:
    if coverage not in COVERAGES:
        raise ValueError(f"load_checkpoint: coverage={coverage!r}; use 'rank' (every rank asks for every entry of the "
                         "checkpoint: one model, data-parallel ranks) or 'group' (the ranks together ask for every "
                         "entry, each for its own part: pipeline stages)")


def asked_by_no_rank(saved: Mapping, asked: Collection[str], group) -> list[str]:
    """The checkpoint's entries that no rank of ``group`` asks for (sorted). A collective: call it on
    every rank of ``group``.

    Args:
        saved: the checkpoint's entries (``Metadata.state_dict_metadata``; the same on every rank).
        asked: the entries this rank's state dict asks for.
        group: the load's process group (``None``: the default group).

    Example:
        >>> asked_by_no_rank(metadata.state_dict_metadata, flat.keys(), None)   # stage 0 and stage 1 together
        []
    """
    order = sorted(saved)
    mask = 0
    for i, key in enumerate(order):
        if key in asked:
            mask |= 1 << i
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        masks: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(masks, mask, group=group)
        for other in masks:
            mask |= other
    return [key for i, key in enumerate(order) if not mask >> i & 1]
