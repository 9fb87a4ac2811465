"""Param groups in checkpoints: keys a checkpoint holds and the state dict it loads into lacks, and
the parameter lists that stay the live optimizer's.

[Note: a param group is an open dict]
torch's ``Optimizer.load_state_dict`` takes the saved param groups whole: a group is an open dict,
and a key that something other than the optimizer added is restored with it, such as the
``initial_lr`` an LR scheduler sets in every group. A fresh optimizer whose scheduler is created
after the load (``LambdaLR(opt, fn, last_epoch=step - 1)`` reads ``initial_lr`` from the groups)
has no such key, so its state dict does not ask for it. :func:`load_checkpoint` therefore loads a
*plain value* saved at ``<optimizer>.param_groups.<i>.<key>`` into group ``i`` of the state dict
when that group exists and lacks ``key``, as torch would; anything else the state dict does not
ask for (a tensor, a group it does not have, a nested value, an entry of the model or of the
optimizer's ``state``) is still refused, and missing entries are refused as before.

[Note: a param group's parameter list is the live optimizer's]
``param_groups[i]["params"]`` names the parameters of group ``i`` (ids in torch's format, FQNs in
``get_state_dict``'s). It is the structure of the optimizer being loaded, not state: torch's loaders
use it only to match groups to parameters (by position, or ``set_optimizer_state_dict`` by FQN), so
it must be the loading optimizer's own. Under pipeline parallelism it legitimately differs between
stages (each lists its own parameters) while DCP stores one copy of a plain value for all ranks.
So :func:`save_checkpoint` does not require it to be equal on every rank, and
:func:`load_checkpoint` keeps the state dict's own list (an entry it asks for, whose stored copy,
one rank's, is read and checked like any plain value but never written into the state dict). torchtitan sidesteps the question by saving optimizers with
``StateDictOptions(flatten_optimizer_state_dict=True)`` (hyper-parameters keyed by parameter FQN,
no lists), which works here too and is what a plain ``dcp.load`` needs under pipeline parallelism.

An optimizer state dict is recognized by its structure, wherever it sits in the state dict: torch's
format (``Optimizer.state_dict()`` and ``torch.distributed.checkpoint.state_dict.get_state_dict``),
a mapping with a mapping ``state`` and a list ``param_groups`` of mappings that each hold
``params``. Its keys are DCP's flattened keys (the object path joined with dots, dict keys as
strings, list indices as numbers), the same ``flatten_state_dict`` gives.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch.distributed.checkpoint.metadata import BytesStorageMetadata

_STATE, _GROUPS, _PARAMS = "state", "param_groups", "params"


def _is_optimizer_state_dict(value) -> bool:
    groups = value.get(_GROUPS)
    return (isinstance(value.get(_STATE), Mapping) and isinstance(groups, list)
            and all(isinstance(g, Mapping) and _PARAMS in g for g in groups))


def param_groups_in(state_dict: Mapping, path: tuple = ()) -> dict[str, tuple[tuple, Mapping]]:
    """Every param group of every optimizer state dict inside ``state_dict``: the flattened key
    prefix of the group (``"optim.param_groups.0."``) -> (its object path, the group)."""
    found = {}
    if isinstance(state_dict, Mapping):
        if _is_optimizer_state_dict(state_dict):
            for i, group in enumerate(state_dict[_GROUPS]):
                group_path = (*path, _GROUPS, i)
                found[".".join(map(str, group_path)) + "."] = (group_path, group)
            return found
        items = ((str(k), v) for k, v in state_dict.items())
    elif isinstance(state_dict, list):
        items = enumerate(state_dict)
    else:
        return found
    for key, value in items:
        if isinstance(value, (Mapping, list)):
            found.update(param_groups_in(value, (*path, key)))
    return found


def param_lists(state_dict: Mapping) -> set[str]:
    """The flattened keys of every param group's parameter list in ``state_dict``
    (``"optim.param_groups.0.params"``): the live optimizer's own (see the note).

    Example:
        >>> param_lists({"optim": opt.state_dict(), "step": 3})
        {'optim.param_groups.0.params'}
    """
    return {prefix + _PARAMS for prefix in param_groups_in(state_dict)}


def open_param_group_keys(state_dict: Mapping, flat: Mapping, saved: Mapping) -> dict[str, tuple]:
    """The checkpoint's entries that :func:`load_checkpoint` takes into a param group of
    ``state_dict`` although the state dict does not ask for them (see the note): flattened key ->
    object path (where ``set_element`` writes the loaded value).

    Args:
        state_dict: the state dict to load into.
        flat: its flattened form (``flatten_state_dict``).
        saved: the checkpoint's entries (``Metadata.state_dict_metadata``).
    """
    groups = param_groups_in(state_dict)
    taken = {}
    for key, meta in saved.items():
        if key in flat or not isinstance(meta, BytesStorageMetadata):
            continue
        prefix, _, name = key.rpartition(".")
        hit = groups.get(prefix + ".")
        if hit is not None and name and name != _PARAMS and name not in hit[1]:
            taken[key] = (*hit[0], name)
    return taken
