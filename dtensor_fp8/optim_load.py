"""``MasterWeightOptimizer.load_state_dict`` as a transaction: every master, moment and scaling
state of a state dict is checked, and this rank's part of it staged, before any is written; every
rank of the parameters' mesh takes the same decision.

[Note: what a load checks]
A value loaded into a master or a moment used to be copied as it came: a wrong shape failed
midway, after other masters were overwritten; a ``(256,)`` master broadcast into a ``(256, 256)``
one; a plain tensor of the local shard's shape (a full master of half the size, at world 2) was
taken as every rank's shard; a NaN moment loaded, and the next step wrote NaN FP8 bytes and blamed
the gradients. So, in two rounds, each ending in one gather of every rank's findings over the
parameters' group (``agreement.py``), so that every rank raises or none does:

1. from what every rank sees alike: the param groups match; every trainable FP8 parameter has a
   master; a parameter's saved state holds every key this optimizer's state holds for it (or no
   state at all: it starts afresh, as in torch); every master, moment and scaling state is a tensor of a floating dtype where this
   optimizer holds a floating tensor, of the parameter's global shape (a DTensor, or a full
   tensor each rank slices; never a tensor of the local shard's shape, which cannot be told from
   a smaller full tensor) where the state is shaped like the parameter, of this optimizer's own
   shape where it is not (a scaling state, a factored moment), a scalar where it holds a scalar;
2. this rank's part of each value (a DTensor redistributed to the parameter's layout where it
   differs: a collective every rank runs alike, after round 1 passed everywhere) is finite,
   unless the optimizer was built with ``nonfinite="ignore"``.

Only then does ``MasterWeightOptimizer`` write: the inner optimizer's state first (torch's own
``load_state_dict``, which builds the new state before it replaces the old), then the masters and
scaling states, which are copies that cannot fail.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ._compat import dtensor_local
from .agreement import gather_findings
from .groups import mesh_groups
from .entry import MASTER_KEY
from .optim_state import SCALING_PREFIXES, OptimizerParts, localize
from .placement import local_tensor
from .hp_load import nonfinite_problem

#: the error class of each kind of finding (several kinds: ``ValueError``)
_ERRORS = {"missing": KeyError, "nonfinite": FloatingPointError, "layout": ValueError}
_SHOWN = 6


class StagedLoad(NamedTuple):
    """A checked state dict, this rank's part of it, ready to be written."""

    inner_state: dict  #: the inner optimizer's state dict entries (index -> state)
    inner_groups: list  #: the inner optimizer's param groups
    hyperparameters: list  #: (outer group, its saved hyper-parameters)
    masters: list  #: (master's local tensor, local value)
    scaling: list  #: (scaling state tensor, value)
    values: list  #: (what, local value, the dtype it is written as) of every staged tensor, for round 2


def _shape(t) -> tuple:
    return tuple(t.shape)


def _layout_problem(what: str, value, ref: torch.Tensor, current) -> str | None:
    """Why ``value`` cannot be the state ``what`` of the parameter (or master) ``ref``, whose own
    state there is ``current`` (None where this optimizer has none); None if it can (round 1)."""
    current = current if isinstance(current, torch.Tensor) else None  # a Python number (``step``): any scalar
    if not isinstance(value, torch.Tensor):
        if current is not None and current.dim() > 0:
            return f"{what} is a {type(value).__name__}; this optimizer holds a {current.dtype} tensor {_shape(current)}"
        return None
    if value.dim() == 0 and (current is None or current.dim() == 0):
        return None
    if current is not None and current.dim() == 0:
        return f"{what} has shape {_shape(value)}; this optimizer holds a scalar"
    floating = current.is_floating_point() if current is not None else True
    if floating and not value.is_floating_point():
        return (f"{what} is {value.dtype}; this optimizer holds floating-point values there (nothing is converted "
                "from integers: the state dict of another optimizer, or damaged?)")
    local = dtensor_local(ref) if isinstance(ref, DTensor) else ref
    if current is None or _shape(current) == _shape(local):  # shaped like the parameter
        if _shape(value) == _shape(ref):
            return None
        sharded = isinstance(ref, DTensor) and _shape(ref) != _shape(local)
        shard = f" (its shard on this rank {_shape(local)})" if sharded else ""
        return (f"{what} has shape {_shape(value)}; the parameter's is {_shape(ref)}{shard}: nothing is broadcast or "
                f"sliced to fit{'; pass the DTensor, or the full tensor, which each rank slices' if sharded else ''}")
    if isinstance(value, DTensor) or _shape(value) != _shape(current):
        return f"{what} has shape {_shape(value)}; this optimizer's is {_shape(current)}"
    return None


def _current_states(parts: OptimizerParts) -> dict:
    """Parameter -> what this optimizer holds per state key now (inner state, master, scaling)."""
    out = {}
    for g in parts.groups:
        for p in g["params"]:
            own = dict(parts.inner.state.get(parts.inner_of[p], {}))
            if p in parts.masters:
                own[MASTER_KEY] = local_tensor(parts.masters[p])
                own.update(local_tensor(p).param_state.scaling.weight_entries())
            out[p] = own
    return out


def stage_load(parts: OptimizerParts, state_dict: dict, *, check_finite: bool) -> StagedLoad:
    """Check every entry of ``state_dict`` and stage this rank's part of it (see the note); raise
    the same error on every rank, naming every problem, with nothing written, if any fails.

    Args:
        parts: the loading ``MasterWeightOptimizer``'s parts, its inner state already created
            (``_materialize_state``, as torch's state-dict helpers create any optimizer's state).
        state_dict: torch's optimizer state-dict format (after the load pre-hooks).
        check_finite: refuse NaN or Inf values (False for ``nonfinite="ignore"``).

    Example:
        >>> staged = stage_load(opt_parts, state_dict, check_finite=True)   # raises, or all is checked and staged
    """
    # Over the parameters' own mesh groups (never the world: other pipeline stages load other parameters).
    group = mesh_groups(p for g in parts.groups for p in g["params"])
    findings, states = _check_layout(parts, state_dict)
    _refuse(gather_findings(findings, group))
    try:
        staged = _stage(parts, state_dict, states)
        findings = _nonfinite(staged, group) if check_finite else []
    except Exception as err:  # noqa: BLE001  (this rank's failure, shared so every rank raises alike)
        rank = dist.get_rank(group=dist.group.WORLD) if dist.is_initialized() else 0
        staged, findings = None, [("layout", f"staging the values failed on rank {rank}: {type(err).__name__}: {err}")]
    _refuse(gather_findings(findings, group))
    return staged


def _check_layout(parts: OptimizerParts, state_dict: dict) -> tuple[list, dict]:
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(parts.groups):
        return [("layout", f"the state dict has {len(saved_groups)} param groups, this optimizer "
                           f"{len(parts.groups)}; build the optimizer with the groups it was saved with")], {}
    id_map = {}
    for i, (saved, group) in enumerate(zip(saved_groups, parts.groups)):
        if len(saved["params"]) != len(group["params"]):
            return [("layout", f"param group {i} has {len(saved['params'])} parameters in the state dict and "
                               f"{len(group['params'])} here; build the optimizer with the groups it was saved with")], {}
        id_map.update(zip(saved["params"], group["params"]))
    states = {id_map[k]: v for k, v in state_dict["state"].items() if k in id_map}
    findings = [("missing", f"no {MASTER_KEY!r} for FP8 parameter {parts.fqn_of(p)}; the state dict was not saved by a "
                            "MasterWeightOptimizer over this model (to start masters from high precision use "
                            "dtensor_fp8.load_hp_state_dict)")
                for p in parts.masters if p.requires_grad and MASTER_KEY not in states.get(p, {})]
    current = _current_states(parts)
    for p, saved in states.items():
        # A parameter's state is whole or absent: a step needs every key (a state missing
        # ``exp_avg_sq`` used to load, then failed the next step with a bare KeyError).
        lacking = sorted(k for k in parts.inner.state.get(parts.inner_of[p], {}) if k not in saved)
        if lacking:
            held = ", ".join(map(repr, sorted(saved))) or "nothing"
            findings.append(("missing", f"the state of {parts.fqn_of(p)} lacks {', '.join(map(repr, lacking))} (it "
                                        f"holds {held}), which this {type(parts.inner).__name__} needs at every step"))
        for key, value in saved.items():
            scaling = p in parts.masters and key.startswith(SCALING_PREFIXES)
            if scaling and key not in current[p]:
                continue  # another recipe's scaling state: dropped (a recipe switch starts afresh)
            ref = current[p][key] if scaling else parts.masters.get(p, p)
            problem = _layout_problem(f"the {key} of {parts.fqn_of(p)}", value, ref, current[p].get(key))
            if problem:
                findings.append(("layout", problem))
    return findings, states


def _stage(parts: OptimizerParts, state_dict: dict, states: dict) -> StagedLoad:
    inner_index = {inner: i for i, inner in enumerate(x for g in parts.inner.param_groups for x in g["params"])}
    current = _current_states(parts)
    staged = StagedLoad({}, [], [], [], [], [])
    for p, saved in states.items():
        ref = parts.masters.get(p, p)
        own = {}
        for key, value in saved.items():
            what = f"{parts.fqn_of(p)}.{key}"
            if key == MASTER_KEY and p in parts.masters:
                local, into = localize(value, ref, what), local_tensor(ref).dtype
                staged.masters.append((local_tensor(ref), local))
            elif p in parts.masters and key.startswith(SCALING_PREFIXES):
                target = current[p].get(key)
                if target is None:
                    continue
                local, into = local_tensor(value).to(target.device), target.dtype
                staged.scaling.append((target, local))
            elif not isinstance(value, torch.Tensor):
                own[key] = value
                continue
            else:
                mine = current[p].get(key)
                shaped_like_ref = not isinstance(mine, torch.Tensor) or mine.dim() == 0 or \
                    _shape(mine) == _shape(local_tensor(ref))
                local = own[key] = localize(value, ref, what) if shaped_like_ref else value
                # torch's load casts floating state (but ``step``) to its parameter's dtype
                into = mine.dtype if isinstance(mine, torch.Tensor) else parts.inner_of[p].dtype
            staged.values.append((f"the {key} of {parts.fqn_of(p)}", local, into))
        if own:
            staged.inner_state[inner_index[parts.inner_of[p]]] = own
    for saved, group in zip(state_dict["param_groups"], parts.groups):
        hyper = {k: v for k, v in saved.items() if k != "params"}
        staged.inner_groups.append({**hyper, "params": [inner_index[parts.inner_of[p]] for p in group["params"]]})
        staged.hyperparameters.append((group, hyper))
    return staged


def _nonfinite(staged: StagedLoad, group) -> list:
    """This rank's non-finite values among the staged ones (round 2)."""
    rank = f" (on rank {dist.get_rank(group=dist.group.WORLD)})" if dist.is_initialized() else ""
    found = []
    for what, value, into in staged.values:
        value = local_tensor(value)
        problem = nonfinite_problem(value, [into]) if value.is_floating_point() else None
        if problem:
            found.append(("nonfinite", f"{what} holds {problem}{rank}"))
    return found


def _refuse(findings: list) -> None:
    if not findings:
        return
    kinds = {kind for kind, _ in findings}
    error = _ERRORS[kinds.pop()] if len(kinds) == 1 else ValueError
    texts = [text for _, text in findings]
    fix = {KeyError: " Fix: load the whole state dict a MasterWeightOptimizer over this model saved (every state "
                     "key of every parameter it holds state for).",
           FloatingPointError: " Fix: load an earlier checkpoint (or build the optimizer with nonfinite='ignore' to "
                               "load it anyway).",
           ValueError: " Fix: load the state dict of a MasterWeightOptimizer over this model, saved as it is built "
                       "(the same parameters, shapes and groups)."}.get(error, "")
    raise error(f"MasterWeightOptimizer.load_state_dict: {'; '.join(texts[:_SHOWN])}"
                f"{f'; ... ({len(texts)} problems)' if len(texts) > _SHOWN else ''}.{fix} Nothing was loaded: the "
                "optimizer's state, its masters and scaling states are as they were.")
