"""``FP8ParamState``: the one record that owns what an FP8 parameter holds besides its planes,
one field per concern (scaling, gather, links up, layout, lifecycle, read-through).

[Note: who owns an FP8 parameter's state]
An FP8 parameter is a :class:`~dtensor_fp8.tensor.QuantizedTensor` (a DTensor of one after
``fully_shard``). What it holds, where each piece is created, freed and saved:

============================  ======================================  ===============================  ==================================
state                         held by                                 created / freed                  saved
============================  ======================================  ===============================  ==================================
recipe                        the tensor (``recipe``)                 at quantization / never          model state dict (recipe config)
FP8 bytes and scales          the tensor's planes                     at quantization, or at           model state dict (plane tensors)
                                                                      :func:`finish_init_` for a
                                                                      meta build / never
weight scaling state          ``FP8ParamState.scaling.weight``        with the bytes (stateful         model state dict, in the weight's
(delayed: amax history,                                               recipes only) / never            entry (``rowwise_amax_history``
scale, per plane)                                                                                      ...; older checkpoints: under
                                                                                                       the optimizer, still read)
GEMM operand scaling state    ``FP8ParamState.scaling.operand``       with the record (recipes whose   model state dict, in the weight's
(delayed: activation and                                              FP8 GEMMs keep state) / never    entry (``input_amax_history`` ...)
gradient amax histories)
high-precision init values    the tensor's values plane (``hp_init``) by ``quantize_module_`` (meta:   not saved: the masters start
                              sliced, padded and moved with its FP8   written by the user's init) /    from them (and are saved)
                              planes, so the shard holds its rows     when the optimizer's masters
                                                                      take them
where the FP8 bytes stand     ``FP8ParamState.lifecycle``             ``META`` by ``quantize_module_`` not saved (a state dict holds
(meta build: still to be      (``bytes_state``; changed only by its   on meta, ``ALLOCATED`` at        the values while pending)
made; whether the init wrote  transition methods, ``lifecycle.py``)   ``to_empty``, ``INIT_WRITTEN``
them after ``to_empty``)                                              by the init / ``MADE`` at
                                                                      :func:`finish_init_`
per-gather plans, the        ``FP8ParamState.gather``                at the first gather (FSDP2's     not saved (rebuilt from the mesh)
gathering FSDPParamGroup,     (a :class:`GatherState`)                group: from its registry,
the unsharded weight's                                                ``_compat``) / with the record
scale copies
the current gather, planes    ``FP8ParamState.gather.gathered``,      at a gather of one of two        not saved
completed on demand           ``.inner_tensors``                      stored planes / at the next
                                                                      gather (FSDP2 frees completed
                                                                      planes when it reshards)
the unsharded view (TE)       ``FP8ParamState.gather.unsharded_view`` by ``quantize_te_module_`` /     not saved
                                                                      with the record
mesh and placements (the      ``FP8ParamState.layout``                by the first caller that sees    not saved (the DTensor's own)
process groups of its                                                 the DTensor (``groups.bind_
scaling decisions)                                                    layout_``) / with the record
transpose cache, with the     ``FP8ParamState.gather.transpose``      after a backward-only gather     not saved
plane tensors it was built                                            or by the dgrad GEMM / after
from                                                                  its one use, a rewrite of the
                                                                      planes, or at the next gather
the tensor a GEMM on a        ``FP8ParamState.read_through`` (weak    at a ``to(dtype)`` over the      not saved
same-device cast or a         references to the source and to the     same bytes or a GEMM's
transpose view reads (its     plane tensors of its casts)             transpose view / when those
source)                                                               tensors go
the master it writes through  ``FP8ParamState.links.master`` (weak    by ``MasterWeightOptimizer`` /   the optimizer's state dict
                              reference to the optimizer's master)    with the optimizer               (``master``)
where the weight lives        ``FP8ParamState.links.home``            by ``quantize_module_`` / never  not saved
whether a load since the      ``FP8ParamState.lifecycle``             at a load of the model's         not saved
last step brought bytes /     (``loaded_since_step``)                 entry / the optimizer's state /
the master                                                            at the next step
============================  ======================================  ===============================  ==================================

One ``FP8ParamState`` per parameter per rank: :func:`dtensor_fp8.quantize` makes it, and every
tensor derived from that parameter (FSDP's shard, the unsharded weight FSDP gathers, views,
slices) refers to the same record, so the FP8 GEMMs of a gathered weight update the state its
checkpoint saves. The optimizer holds masters and its inner optimizer's state; it reads and
writes the weight scaling state through this record and does not own it. Every write of new
values into the weight (``copy_``, a high-precision load, the user's init of a meta-built weight)
goes through ``param_writes.py``, which reads this record for the groups of its scale and the
master it must keep equal to the written values.

Operand scaling state is identical on every rank that holds the weight: a GEMM records its
activation / gradient amax locally (``history[0]``, a running max), and the update that rolls
the history and gives the next scale runs once per optimizer step (``operand_scaling.py``), with
one MAX all-reduce of the recorded amaxes over the weight's own mesh groups first (``groups.py``),
as Transformer Engine reduces delayed scaling's amaxes over its amax reduction group once per
region rather than per GEMM. That is what lets a checkpoint save one copy and load it at any
world size, and a resumed run continue bit-identically.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass, field

import torch

from .layout import Layout
from .entry import OPERANDS
from .lifecycle import Lifecycle
from .owner_protocols import GatheringGroup, ParameterHome, PlaneCompletion, UnshardedView


def _same(refs: tuple, tensors: tuple) -> bool:
    """Whether the weak references ``refs`` (``None`` for an absent plane) point at ``tensors``."""
    return all((r is None) == (t is None) and (r is None or r() is t) for r, t in zip(refs, tensors, strict=True))


@dataclass(eq=False)
class GatherState:
    """What FSDP2's all-gathers of one parameter keep between gathers (``fsdp.py`` writes it).

    Attributes:
        plans: ``(id(mesh), outer size, usages, id(module))`` -> that kind of gather's plan and
            its last inputs (``fsdp_buffers.PlanEntry``), made at its first gather.
        group: a weak reference to the ``FSDPParamGroup`` gathering the parameter, read once from
            FSDP2's registry; ``None`` before the first gather.
        gathers_both: whether every gather carries both directions (compile under the group, a
            module marked ``gather_both_usages``, or a first gather that wanted both: FSDP2 sizes
            its all-gather buffers at the first gather, so that one fixes it for all); ``None``
            before.
        completes_for_recompute: whether a backward gather that brought the columnwise plane
            of a two-plane recipe completes the rowwise plane at once, for the recompute of an
            activation-checkpointed module owning the weight (see the note in
            ``fsdp_completion.py``); fixed with ``gathers_both``, ``False`` before.
        unsharded_scales: the unsharded weight's own copies of per-tensor scales, by plane
            (``fsdp_buffers._scale_copy``).
        unsharded_view: what a gather hands out as the unsharded parameter where that is not a
            QuantizedTensor (``fsdp.UnshardedView``; TE modules' weights: ``te.FSDP_TE_VIEW``).
        gathered: the current gather, where it brought one plane of a recipe that stores two
            (``fsdp_completion.GatheredWeight``): a read of the other plane completes the unsharded weight
            through it (:meth:`complete_`); ``None`` otherwise, and from the next gather on.
        inner_tensors: the list FSDP2 holds as the parameter's "inner tensors to free": the
            buffers a completion all-gathered, which FSDP2 frees when it reshards; emptied at
            each gather (see the note in ``fsdp_completion.py``).
        transpose: the transpose cache, ``(plane tensors it was built from, TE's (K, M) copy of
            the shared plane)`` (per-tensor and 128x128 recipes): built after a backward-only gather
            or by the input-gradient GEMM, read by tensors holding those plane tensors, dropped
            after that one use, when the planes are rewritten, and at the next gather (see the
            note in ``tensor.py``); ``None`` otherwise.
    """

    plans: dict = field(default_factory=dict)
    group: "weakref.ref[GatheringGroup] | None" = None
    gathers_both: bool | None = None
    completes_for_recompute: bool = False
    unsharded_scales: dict[str, torch.Tensor] = field(default_factory=dict)
    unsharded_view: UnshardedView | None = None
    gathered: PlaneCompletion | None = None
    inner_tensors: list = field(default_factory=list)
    transpose: tuple | None = None

    def gathering_group(self) -> GatheringGroup | None:
        """The ``FSDPParamGroup`` kept by the first gather, or ``None``."""
        return self.group() if self.group is not None else None

    def start_gather(self) -> None:
        """Forget the previous gather's completion and transpose cache: FSDP2 resharded (and freed
        its buffers) before gathering again."""
        self.gathered = None
        self.inner_tensors.clear()
        self.transpose = None

    def complete_(self, tensor, usage: str) -> bool:
        """Give ``tensor`` (the unsharded weight of the current gather, or an alias of it) the
        plane serving ``usage``, which its gather did not bring: ``True`` if it now holds it,
        ``False`` if ``tensor`` is no such weight (then the caller raises as for any missing plane).

        Args:
            tensor: the :class:`~dtensor_fp8.tensor.QuantizedTensor` read.
            usage: the usage read.

        Example:
            >>> w.param_state.gather.complete_(w, "rowwise")   # after a backward-only gather
            True
        """
        gathered = self.gathered
        return gathered is not None and gathered.complete_(tensor, usage)


@dataclass(eq=False)
class ScalingState:
    """The scaling state one FP8 parameter keeps across steps: its weight's and its GEMM operands'.

    Attributes:
        weight: stored plane (``"rowwise"`` / ``"columnwise"``) -> the recipe's weight scaling state
            (``Recipe.initial_scaling_state``; delayed scaling: ``amax_history``, ``scale``); empty for
            recipes whose scales are a function of the data.
        operand: ``"input"`` / ``"grad"`` -> the scaling state of the FP8 GEMMs' activations / output
            gradients (``Recipe.operand_state``); empty for recipes without.

    Example:
        >>> q = dtensor_fp8.quantize(w, dtensor_fp8.DelayedScaling())
        >>> sorted(q.param_state.scaling.weight_state(q.recipe, "rowwise", q.plane("rowwise")))
        ['amax_history', 'scale']
    """

    weight: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    operand: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    def weight_state(self, recipe, usage: str, plane) -> dict[str, torch.Tensor] | None:
        """The weight scaling state of ``usage``'s plane, created from the plane's current scale
        on first use (``None`` for recipes without one).

        Args:
            recipe: the weight's recipe.
            usage: the stored plane.
            plane: the plane (its device and current scale seed the state).
        """
        state = self.weight.get(usage)
        if state is None:
            state = recipe.initial_scaling_state(plane)
            if state is not None:
                self.weight[usage] = state
        return state

    def ensure_operand_states(self, recipe, device: torch.device) -> dict[str, dict[str, torch.Tensor]]:
        """The GEMM operand scaling states (``"input"``, ``"grad"``) of a weight of ``recipe``,
        created on ``device`` on first use and moved there if the weight moved (a state dict asks
        for them before the first GEMM, so a fresh model is a complete checkpoint template).

        Args:
            recipe: the weight's recipe.
            device: where the weight's planes are.
        """
        gemm = recipe.gemm_recipe()
        if gemm is None:
            return self.operand
        for name, operand in zip(OPERANDS, (gemm.input, gemm.grad)):
            state = self.operand.get(name)
            if state is None:
                state = operand.operand_state(device)
                if state is not None:
                    self.operand[name] = state
            elif any(t.device != device for t in state.values()):
                self.operand[name] = {k: t.to(device) for k, t in state.items()}
        return self.operand

    def reset_(self) -> None:
        """Forget every state (a meta-built weight's bytes were just made: its states start from them)."""
        self.weight.clear()
        self.operand.clear()

    def entries(self) -> dict[str, torch.Tensor]:
        """Every tensor of the state under its state-dict name: ``"<plane>_<field>"`` for the
        weight scaling state, ``"<operand>_<field>"`` for the operand state.

        Example:
            >>> sorted(q.param_state.scaling.entries())   # delayed scaling
            ['grad_amax_history', 'grad_scale', 'input_amax_history', 'input_scale', 'rowwise_amax_history', 'rowwise_scale']
        """
        return {**self.weight_entries(), **self.operand_entries()}

    def operand_entries(self) -> dict[str, torch.Tensor]:
        """The operand scaling state's tensors under their state-dict names (``"input_amax_history"``...)."""
        return {f"{op}_{name}": v for op, state in self.operand.items() for name, v in state.items()}

    def weight_entries(self) -> dict[str, torch.Tensor]:
        """The weight scaling state's tensors under their state-dict names (``"rowwise_scale"``...)."""
        return {f"{usage}_{name}": v for usage, state in self.weight.items() for name, v in state.items()}

    @torch.no_grad()
    def copy_from_(self, other: "ScalingState") -> None:
        """Copy ``other``'s values into this state's tensors, in place (their storage is kept:
        requantization graphs and checkpoint plans refer to it). Entries only one side has are
        left as they are."""
        mine, theirs = self.entries(), other.entries()
        for name, value in theirs.items():
            if name in mine and mine[name] is not value:
                mine[name].copy_(value.to(mine[name].device))


@dataclass(eq=False)
class OwnerLinks:
    """The record's weak references up to who holds the weight: the module it is a parameter of,
    and the optimizer's master of it (what each is called for: ``owner_protocols.py``).

    Attributes:
        home: ``(weak reference to the module, attribute name)`` the weight is a parameter of, set by
            ``quantize_module_`` (:meth:`set_home_`): a write into the local shard alone finds its
            DTensor (and so its groups) there before anything else bound the layout.
        master: a weak reference to the optimizer's master of this weight (:meth:`link_master_`);
            writes update it (see ``param_writes.py``), ``to_empty`` is refused while it lives.
    """

    home: "tuple[weakref.ref[ParameterHome], str] | None" = None
    master: "weakref.ref[torch.nn.Parameter] | None" = None

    def set_home_(self, module: ParameterHome, name: str) -> None:
        """Record ``module`` (weakly) and the attribute ``name`` as where the weight is a parameter.

        Example:
            >>> q.param_state.links.set_home_(linear, "weight")
        """
        self.home = (weakref.ref(module), name)

    def home_module(self) -> ParameterHome | None:
        """The module at :attr:`home`, or ``None`` (none recorded, or it is gone)."""
        return None if self.home is None else self.home[0]()

    def home_parameter(self) -> torch.Tensor | None:
        """The parameter at :attr:`home` now (after ``fully_shard``: the DTensor), or ``None``."""
        module = self.home_module()
        return None if module is None else module._parameters.get(self.home[1])

    def link_master_(self, master: torch.Tensor) -> None:
        """Record ``master`` (an ``nn.Parameter``, a DTensor like the weight when sharded) as the
        high-precision values every write of this weight keeps equal to the written ones.

        Example:
            >>> local.param_state.links.link_master_(opt.master_of(p))
        """
        self.master = weakref.ref(master)

    def master_tensor(self) -> torch.Tensor | None:
        """The linked master, or ``None`` (no optimizer, or it is gone)."""
        return None if self.master is None else self.master()


@dataclass(eq=False)
class FP8ParamState:
    """Everything one FP8 parameter holds besides its planes (see the note above), one field per
    concern.

    Args:
        scaling: its weight's and GEMM operands' scaling state (:class:`ScalingState`): saved.
        gather: FSDP2's per-gather state of the parameter (:class:`GatherState`).
        links: weak references up to its module and the optimizer's master (:class:`OwnerLinks`).
        layout: the :class:`~dtensor_fp8.layout.Layout` (mesh, placements, global shape) of the
            parameter's DTensor, bound by the first caller that sees it as one (``groups.bind_layout_``:
            the optimizer, ``finish_init_``, a requantization); the process groups its scaling
            decisions reduce over derive from it (``groups.py``). ``None`` for a weight that is not
            (yet) a DTensor.
        lifecycle: where the FP8 bytes stand (a meta-built weight's are made from the values its init
            writes into ``QuantizedTensor.hp_init``) and what a load brought since the last step (FP8
            bytes from a checkpoint's entry, the optimizer's master: with both, in either order, the
            saved master stands; with bytes alone the master follows them at the next step,
            ``param_writes.masters_follow_loaded_bytes_``); see the note in ``lifecycle.py``.
        read_through: ``(weak reference to a tensor, weak references to plane tensors)`` per
            same-device cast or GEMM transpose view made of that tensor: a GEMM on a tensor holding
            those plane tensors reads the planes that tensor holds by then (see :meth:`read_through_`
            and ``ops/copies.reads_from``).

    Example:
        >>> q = dtensor_fp8.quantize(w, dtensor_fp8.DelayedScaling())
        >>> sorted(q.param_state.scaling.weight_state(q.recipe, "rowwise", q.plane("rowwise")))
        ['amax_history', 'scale']
    """

    scaling: ScalingState = field(default_factory=ScalingState)
    gather: GatherState = field(default_factory=GatherState)
    links: OwnerLinks = field(default_factory=OwnerLinks)
    layout: Layout | None = None
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    read_through: list = field(default_factory=list)

    # [Note: a copied or pickled record]
    # ``copy.deepcopy(model)`` (an EMA or evaluation copy) deep-copies each weight's record with
    # it. A copy owns its own state: its scaling states are new tensors, and it links to no master
    # (the optimizer's masters belong to the original's optimizer: a write into the copy must not
    # move them), no FSDP2 gather and no cast of the original; its home is the copied module
    # (the original's when copied alone: ``None``). An optimizer built over the copy starts its
    # masters from the copy's FP8 bytes (or its init values, if the copy was made before any
    # optimizer). Pickling (``torch.save(model)``) keeps the same and no weak reference: the home
    # is pickled as the module itself and weakly referenced again when loaded; the pickled fields
    # keep the names of the records before the grouping (``weight_scaling``, ``operand_scaling``), so
    # pickles of either load in the other.
    def __deepcopy__(self, memo: dict) -> "FP8ParamState":
        copied = FP8ParamState(scaling=copy.deepcopy(self.scaling, memo), layout=self.layout,
                               lifecycle=self.lifecycle.copied())
        memo[id(self)] = copied
        module = self.links.home_module()
        twin = memo.get(id(module)) if module is not None else None
        if twin is not None:
            copied.links.set_home_(twin, self.links.home[1])
        return copied

    def __getstate__(self) -> dict:
        module = self.links.home_module()
        return {"weight_scaling": self.scaling.weight, "operand_scaling": self.scaling.operand,
                "layout": self.layout, "lifecycle": self.lifecycle.copied(),
                "home": None if module is None else (module, self.links.home[1])}

    def __setstate__(self, state: dict) -> None:
        home = state.pop("home")
        if "bytes_pending" in state:  # pickled before the lifecycle had its own record
            state["lifecycle"] = Lifecycle.from_flags(state.pop("bytes_pending"), state.pop("init_written"))
        scaling = ScalingState(state.pop("weight_scaling"), state.pop("operand_scaling"))
        self.__init__(scaling=scaling, **state)
        if home is not None:
            self.links.set_home_(*home)

    def read_through_(self, tensors: tuple, source: torch.Tensor) -> None:
        """Make a GEMM on any tensor holding the plane tensors ``tensors`` read the planes
        ``source`` holds at the time of the GEMM (a cast of ``source`` to another nominal dtype over
        the same bytes, or a GEMM's transpose view of it, made now). Kept by identity, without
        keeping any of them alive: an entry goes when its tensors do.

        Args:
            tensors: ``QuantizedTensor.plane_tensors()`` of the new tensor (``source``'s now).
            source: the tensor to read through to (itself no such cast: see ``reads_from``).

        Example:
            >>> q.param_state.read_through_(cast.plane_tensors(), q)
        """
        live = [e for e in self.read_through
                if e[0]() is not None and all(r is None or r() is not None for r in e[1]) and not _same(e[1], tensors)]
        live.append((weakref.ref(source), tuple(None if t is None else weakref.ref(t) for t in tensors)))
        self.read_through[:] = live

    def read_through_source(self, tensors: tuple) -> torch.Tensor | None:
        """The tensor a GEMM on a holder of the plane tensors ``tensors`` reads (see
        :meth:`read_through_`), or ``None``."""
        for source, refs in self.read_through:
            if _same(refs, tensors):
                return source()
        return None

    def current_layout(self):
        """The :class:`~dtensor_fp8.layout.Layout` of this weight's DTensor, or ``None``: the bound
        one, bound again from the parameter at its home (:class:`OwnerLinks`) when that is a DTensor
        over this record laid out otherwise (first bound, or ``fully_shard`` after
        ``parallelize_module``), so a local shard alone knows its final layout (a ``copy_`` right
        after ``fully_shard``, a shard FSDP2 cut with ``new_zeros`` + ``copy_`` placed at its first
        read).

        Example:
            >>> q.param_state.current_layout().placements   # after fully_shard
            (Shard(dim=0),)
        """
        home = self.links.home_parameter()
        local = getattr(home, "_local_tensor", None)
        if local is not None and getattr(local, "param_state", None) is self:
            layout = self.layout
            if layout is None or layout.mesh is not home.device_mesh or layout.placements != tuple(home.placements):
                self.layout = Layout(home.device_mesh, tuple(home.placements), tuple(home.shape))
        return self.layout
