"""``MasterWeightOptimizer`` following parameters replaced after its construction.

[Note: parameters replaced after construction]
accelerate's ``prepare`` with its FSDP2 plugin rebuilds an optimizer's groups: it puts placeholders
into each ``params`` list, shards the model (``fully_shard`` replaces every parameter by a DTensor),
then points each group at a new list of the parameters it matched by ``data_ptr()``. In
accelerate's own order (optimizer built before ``prepare``) the masters of a
``MasterWeightOptimizer`` then belong to parameters the model no longer has, which get no
gradients: nothing would train. So before each use (reading ``param_groups``, ``step``,
``zero_grad``, ``state``, ``state_dict``, ``load_state_dict``, ``masters``) the optimizer checks,
one identity test per group, that its groups are the lists it holds (:func:`unchanged`); if one was replaced,
:func:`follow_model` re-derives every group from the parameters the optimizer was built with, by
FQN in ``opt.model`` (never from what was put in the lists, which a collapsed ``data_ptr()`` match
could have filled with one parameter many times):

* the same parameters: the groups are restored (each parameter once, in the user's order);
* replaced parameters: the optimizer is built again over them and loads its own state dict, taken
  from the replaced ones (masters, inner moments, scaling state and hyper-parameters; DTensor or
  full values, so each rank keeps its shard: exact), keeping its identity (accelerate's wrapper and
  LR schedulers hold it) and its registered hooks.

A ``params`` list changed in place, with no new list object, is not noticed: replace the list.
``param_groups`` is a property for this: read right after ``prepare``, it already holds each model
parameter once (a group dict someone kept from before ``prepare`` still shows accelerate's list).

Why the optimizer adapts rather than each FP8 parameter reporting a distinct ``data_ptr()`` (a
plane's address) for accelerate's match: torch takes ``data_ptr() == 0`` to mean "a wrapper
subclass without storage" (``Tensor.__deepcopy__`` then clones, pickling rebuilds through the
subclass, DCP's state-dict utilities skip the storage); a non-zero address sends those into the
storage the wrapper does not have ("invalid python storage"). And accelerate's own order needs
the masters moved to the sharded parameters whatever the match gives.
"""

from __future__ import annotations

from typing import Callable


def snapshot(opt) -> list[tuple[list, list]]:
    """What ``opt``'s groups hold now: per group, the ``params`` list object and a copy of it.

    Args:
        opt: a ``MasterWeightOptimizer``.
    """
    return [(g["params"], list(g["params"])) for g in opt.param_groups]


def unchanged(opt) -> bool:
    """Whether ``opt.param_groups`` still hold the ``params`` lists of its last :func:`snapshot`.

    Args:
        opt: a ``MasterWeightOptimizer``.
    """
    bound = opt._bound
    groups = opt.param_groups
    return len(groups) == len(bound) and all(g["params"] is b[0] for g, b in zip(groups, bound))


def follow_model(opt, canonical_fqn: Callable[[str], str]) -> None:
    """Re-point ``opt``'s groups at the model's current parameters (see the note).

    Args:
        opt: a ``MasterWeightOptimizer`` whose groups were replaced.
        canonical_fqn: the FQN normalization ``opt`` keys its parameters by.

    Example:
        >>> model, opt = accelerator.prepare(model, opt)   # the model is sharded here
        >>> opt.step()   # follows the sharded parameters first (masters sliced to their shards)
    """
    if len(opt.param_groups) != len(opt._bound):
        raise ValueError(f"MasterWeightOptimizer: param_groups went from {len(opt._bound)} to {len(opt.param_groups)} "
                         "groups other than through add_param_group; add groups with add_param_group")
    current = {}
    for name, p in opt.model.named_parameters(remove_duplicate=False):
        current.setdefault(canonical_fqn(name), p)
    olds = [copy for _, copy in opt._bound]
    missing = [opt._fqn[p] for old in olds for p in old if opt._fqn[p] not in current]
    if missing:
        raise ValueError(f"MasterWeightOptimizer: {', '.join(missing[:6])} no longer name parameters of its model; "
                         "build the optimizer over the model it trains (after fully_shard / prepare)")
    news = [[current[opt._fqn[p]] for p in old] for old in olds]
    for g, old in zip(opt.param_groups, olds):
        g["params"] = old
    opt._bound = snapshot(opt)
    if all(n is o for new, old in zip(news, olds) for n, o in zip(new, old)):
        return
    saved = opt.state_dict()
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": new} for g, new in zip(opt.param_groups, news)]
    args = dict(opt._built_with)
    hooks = {k: v for k, v in vars(opt).items() if k.startswith("_optimizer_") and k.endswith("_hooks")}
    fresh = type(opt)(opt.model, args.pop("optimizer_cls"), groups, **args)
    fresh.load_state_dict(saved)
    state_view = type(opt.state)
    vars(opt).update(vars(fresh))
    vars(opt).update(hooks)
    opt.state = state_view(opt)
