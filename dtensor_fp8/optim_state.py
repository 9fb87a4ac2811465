"""How ``MasterWeightOptimizer`` shows its state to torch: ``optimizer.state`` as a view of the
inner optimizer's state, and the conversions between the inner optimizer's local tensors and the
DTensors laid out like the parameters that ``state_dict()`` / ``load_state_dict()`` exchange
(see the notes in ``optim.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.distributed.tensor import DTensor

from ._compat import dtensor_local
from .entry import MASTER_KEY
from .formats.base import USAGES
from .groups import mesh_groups
from .placement import like, local_slice

#: state keys of an FP8 parameter's scaling state: ``"<usage>_<field>"`` (see the note in optim.py)
SCALING_PREFIXES = tuple(f"{u}_" for u in USAGES)


@dataclass(eq=False)
class OptimizerParts:
    """What one ``MasterWeightOptimizer`` holds per parameter, handed explicitly to the modules that
    implement parts of it (``optim_state``, ``optim_load``, ``optim_follow``), so that none of them
    reads the optimizer's private attributes (``tests/test_structure.py`` checks). ``optim.py``
    builds it; besides it only ``optim_follow.restore_groups`` writes (the groups it restores).

    Example:
        >>> parts = OptimizerParts()
        >>> parts.fqn_of(torch.zeros(1))
        '<parameter>'
    """

    #: the outer param groups: torch's ``param_groups``, holding the model's parameters
    groups: list = field(default_factory=list)
    #: FP8 parameter -> its master (an ``nn.Parameter``, a DTensor like the parameter when sharded)
    masters: dict = field(default_factory=dict)
    #: model parameter -> what the inner optimizer steps for it (see the note in optim.py)
    inner_of: dict = field(default_factory=dict)
    #: parameter -> its FQN in the model
    fqn: dict = field(default_factory=dict)
    #: the torch optimizer doing the arithmetic (None while the outer one is being built)
    inner: torch.optim.Optimizer | None = None
    #: bumped whenever the inner state may have new tensors (a step, a load): ``StateView`` re-reads it
    generation: int = 0
    #: the groups' ``params`` lists as last bound (``optim_follow.snapshot``)
    bound: list = field(default_factory=list)
    #: how to build the optimizer again over replaced parameters (``MasterWeightOptimizer.follow_model``)
    built_with: dict = field(default_factory=dict)

    #: ``(len(inner_of), groups)`` as :meth:`agreement_groups` last found them
    agreement: tuple | None = None

    def sync_hyperparameters(self) -> None:
        """The outer groups' hyper-parameters into the inner groups (schedulers write the outer ones)."""
        for outer, inner in zip(self.groups, self.inner.param_groups, strict=True):
            for key, value in outer.items():
                if key != "params" and inner.get(key) is not value:
                    inner[key] = value

    def fqn_of(self, p) -> str:
        """``p``'s FQN, or a placeholder for a tensor that is not one of the model's parameters."""
        return self.fqn.get(p, "<parameter>")

    def agreement_groups(self) -> tuple:
        """``groups.mesh_groups`` of the parameters (the groups a step's decisions agree over), found once
        per parameter set: asked every step, and ``inner_of`` only grows (``add_param_group``; a
        ``follow_model`` that replaces parameters builds new parts). A parameter's mesh never changes."""
        if self.agreement is None or self.agreement[0] != len(self.inner_of):
            self.agreement = (len(self.inner_of), mesh_groups(self.inner_of))
        return self.agreement[1]


class StateView(dict):
    """``optimizer.state``: model parameter -> its state (see the note). A ``dict`` (what torch's
    code expects), read from the inner optimizer after creating any state still missing, so a
    fresh optimizer already shows the entries a checkpoint holds; re-read only when the inner state
    may hold new tensors (after a step or a load). A parameter without state reads as ``{}``, as
    torch's ``defaultdict`` does."""

    def __init__(self, parts: OptimizerParts, materialize: Callable[[], None]):
        """Args:
            parts: the optimizer's :class:`OptimizerParts`.
            materialize: creates the inner state still missing (``MasterWeightOptimizer._materialize_state``).
        """
        super().__init__()
        self._parts = parts
        self._materialize = materialize
        self._seen = None
        self._views: dict = {}  # (id(param), key) -> (inner value, its DTensor view); see _state_of

    def follow(self, parts: OptimizerParts) -> None:
        """Show ``parts`` from now on (``MasterWeightOptimizer.follow_model`` rebuilt them): the object
        stays, since torch's utilities may hold it while it is read."""
        self._parts, self._seen = parts, None
        self._views.clear()

    def forget_views(self) -> None:
        """Drop the DTensor views kept of the inner state (after a load replaced its tensors)."""
        self._views.clear()

    def _refresh(self) -> None:
        self._materialize()  # follows the model first (may call follow() above)
        parts = self._parts
        if self._seen == parts.generation:
            return
        dict.clear(self)
        for g in parts.groups:
            for p in g["params"]:
                state = self._state_of(p)
                if state:
                    dict.__setitem__(self, p, state)
        self._seen = parts.generation

    def _state_of(self, p) -> dict:
        """``state[p]`` as torch's utilities see it (see the note in optim.py): DTensor views of the
        inner state's local tensors, made once per inner tensor and kept."""
        parts = self._parts
        out = {}
        ref = parts.masters.get(p, p)
        if p in parts.masters:
            out[MASTER_KEY] = ref.detach()
        for key, value in parts.inner.state.get(parts.inner_of[p], {}).items():
            cached = self._views.get((id(p), key))
            if cached is None or cached[0] is not value:
                cached = self._views[(id(p), key)] = (value, as_global(ref, value))
            out[key] = cached[1]
        return out

    def __getitem__(self, p):
        self._refresh()
        if dict.__contains__(self, p):
            return dict.__getitem__(self, p)
        if any(p is q for g in self._parts.groups for q in g["params"]):
            return {}
        raise KeyError("not a parameter of this optimizer")

    def get(self, p, default=None):
        self._refresh()
        return dict.get(self, p, default)

    def __iter__(self):
        self._refresh()
        return iter(list(dict.keys(self)))

    def __len__(self):
        self._refresh()
        return dict.__len__(self)

    def __contains__(self, p):
        self._refresh()
        return dict.__contains__(self, p)

    def keys(self):
        self._refresh()
        return dict.keys(self)

    def values(self):
        self._refresh()
        return dict.values(self)

    def items(self):
        self._refresh()
        return dict.items(self)

    def __bool__(self):
        return len(self) > 0

    def __setitem__(self, p, value):
        raise TypeError("MasterWeightOptimizer.state is read-only: load state with load_state_dict()")


def as_global(ref: torch.Tensor, value):
    """An inner-optimizer state tensor of ``ref``'s local shard as a DTensor laid out like ``ref``
    (scalars such as Adam's ``step`` as they are)."""
    if isinstance(ref, DTensor) and isinstance(value, torch.Tensor) and value.dim() > 0 \
            and value.shape == dtensor_local(ref).shape:
        return like(ref, value)
    return value


def localize(value: torch.Tensor, ref: torch.Tensor, what: str) -> torch.Tensor:
    """This rank's part of a saved state tensor for parameter (or master) ``ref``: a DTensor's local
    shard (redistributed to ``ref``'s layout if it differs), a full tensor sliced, a scalar as is."""
    if not isinstance(ref, DTensor) or value.dim() == 0:
        return value.to_local() if isinstance(value, DTensor) and value.dim() == 0 else value
    if isinstance(value, DTensor):
        if value.placements != ref.placements or value.device_mesh != ref.device_mesh:
            value = value.redistribute(ref.device_mesh, ref.placements)
        return value.to_local()
    if tuple(value.shape) == tuple(ref.shape):
        return local_slice(value, ref)
    if tuple(value.shape) == tuple(dtensor_local(ref).shape):
        return value
    raise ValueError(f"MasterWeightOptimizer.load_state_dict: {what} has shape {tuple(value.shape)}; expected the "
                     f"parameter's {tuple(ref.shape)} (full) or its local shard {tuple(dtensor_local(ref).shape)}")
