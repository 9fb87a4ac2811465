"""``MasterWeightOptimizer`` following parameters replaced after its construction.

[Note: parameters replaced after construction]
accelerate's ``prepare`` with its FSDP2 plugin rebuilds an optimizer's groups: it puts placeholders
into each ``params`` list, shards the model (``fully_shard`` replaces every parameter by a DTensor),
then points each group at a new list of the parameters it matched by ``data_ptr()``. In
accelerate's own order (optimizer built before ``prepare``) the masters of a
``MasterWeightOptimizer`` then belong to parameters the model no longer has, which get no
gradients: nothing would train. So ``MasterWeightOptimizer.follow_model()`` (called by hand right after
``prepare``, and by the actions ``step``, ``zero_grad``, ``add_param_group`` and ``load_state_dict``)
checks, one identity test per group, that its groups are the lists it holds (:func:`unchanged`); if
one was replaced, :func:`restore_groups` re-derives every group from the parameters the optimizer was
built with, by FQN in its model (never from what was put in the lists, which a collapsed
``data_ptr()`` match could have filled with one parameter many times):

* the same parameters: the groups are restored (each parameter once, in the user's order);
* replaced parameters: the optimizer builds a second optimizer over them, which loads its state
  dict, taken from the replaced ones (masters, inner moments, scaling state and hyper-parameters;
  DTensor or full values, so each rank keeps its shard: exact), and takes that one's parts, keeping
  its identity (accelerate's wrapper and LR schedulers hold it) and its registered hooks.

A ``params`` list changed in place, with no new list object, is not noticed: replace the list.
Reads (``param_groups``, ``state``, ``state_dict()``, ``masters``, ``master_of``) follow nothing:
a read that every LR scheduler makes each step must not rebuild an optimizer. Between ``prepare`` and
``follow_model()`` ``param_groups`` shows accelerate's lists, and the other reads refuse, naming the fix.

Why the optimizer adapts rather than each FP8 parameter reporting a distinct ``data_ptr()`` (a
plane's address) for accelerate's match: torch takes ``data_ptr() == 0`` to mean "a wrapper
subclass without storage" (``Tensor.__deepcopy__`` then clones, pickling rebuilds through the
subclass, DCP's state-dict utilities skip the storage); a non-zero address sends those into the
storage the wrapper does not have ("invalid python storage"). And accelerate's own order needs
the masters moved to the sharded parameters whatever the match gives.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from .optim_state import OptimizerParts


def snapshot(groups: list[dict]) -> list[tuple[list, list]]:
    """What ``groups`` hold now: per group, the ``params`` list object and a copy of it.

    Args:
        groups: a ``MasterWeightOptimizer``'s param groups.

    Example:
        >>> parts.bound = snapshot(parts.groups)
    """
    return [(g["params"], list(g["params"])) for g in groups]


def unchanged(parts: OptimizerParts) -> bool:
    """Whether ``parts.groups`` still hold the ``params`` lists of the last :func:`snapshot`.

    Args:
        parts: a ``MasterWeightOptimizer``'s parts.

    Example:
        >>> unchanged(parts)   # False after accelerate's prepare assigned new lists
    """
    groups, bound = parts.groups, parts.bound
    return len(groups) == len(bound) and all(g["params"] is b[0] for g, b in zip(groups, bound))


def restore_groups(parts: OptimizerParts, model: nn.Module, canonical_fqn: Callable[[str], str]) -> list[list] | None:
    """Put back the parameter lists the groups were bound to (see the note), and return the
    model's current parameters for them where ``model`` replaced any (None where it replaced none).

    Args:
        parts: the parts of a ``MasterWeightOptimizer`` whose groups were replaced.
        model: the model it trains.
        canonical_fqn: the FQN normalization ``parts.fqn`` is keyed by.

    Returns:
        Per group, the parameters now named by the FQNs of those it was bound to; or None.

    Example:
        >>> replaced = restore_groups(parts, model, canonical_fqn)   # groups as built again
    """
    if len(parts.groups) != len(parts.bound):
        raise ValueError(f"MasterWeightOptimizer: param_groups went from {len(parts.bound)} to {len(parts.groups)} "
                         "groups other than through add_param_group; add groups with add_param_group")
    current = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        current.setdefault(canonical_fqn(name), p)
    olds = [copy for _, copy in parts.bound]
    missing = [parts.fqn[p] for old in olds for p in old if parts.fqn[p] not in current]
    if missing:
        raise ValueError(f"MasterWeightOptimizer: {', '.join(missing[:6])} no longer name parameters of its model; "
                         "build the optimizer over the model it trains (after fully_shard / prepare)")
    news = [[current[parts.fqn[p]] for p in old] for old in olds]
    for g, old in zip(parts.groups, olds):
        g["params"] = old
    parts.bound = snapshot(parts.groups)
    if all(n is o for new, old in zip(news, olds) for n, o in zip(new, old)):
        return None
    return news
