"""``MasterWeightOptimizer``: a ``torch.optim.Optimizer`` that trains FP8 parameters through
high-precision masters.

[Note: what the user holds and what steps]
The object is a real ``torch.optim.Optimizer`` whose ``param_groups`` hold the *model's*
parameters, FP8 and high-precision alike, in the groups the user chose: torch's LR schedulers,
``group["lr"] = ...``, step hooks, ``zero_grad`` and ``torch.distributed.checkpoint.state_dict``
(which maps optimizer state to FQNs through parameter identity) all see what they expect.

The arithmetic is done by an *inner* optimizer of the class the user names (``torch.optim.AdamW``,
...) over plain local tensors: for an FP8 parameter the local shard of its master (FP32 by
default), for a sharded high-precision parameter a tensor sharing its local shard's storage, for
anything else the parameter itself. An element-wise step is the same on a shard as on the
DTensor, and DTensor's dispatch of a multi-tensor (``foreach`` / ``fused``) step costs several
times the host time of the step itself (``python -m dtensor_fp8.benchmarks te_step
--host-split``). Before every step the outer groups' hyper-parameters are copied into the inner
groups (so a scheduler's or a user's change takes effect at that step) and the gradients are
handed over as local shards (FSDP's reduce-scattered gradient as it is where the dtypes agree).
After the step every FP8 shard is requantized in place from its master (``requantize.py``).

[Note: optimizer state, as torch's utilities see it]
``state[p]`` of an FP8 parameter ``p`` holds ``"master"`` (a DTensor laid out like ``p``), the
inner optimizer's state of that master (``exp_avg``, ... as DTensors laid out like ``p``;
``step`` as it is). The weight scaling state of stateful recipes (delayed scaling's
``"rowwise_amax_history"``, ``"rowwise_scale"``) is the parameter's record's
(``QuantizedTensor.param_state``, see ``param_state.py``), which this optimizer updates and which
saves it in the weight's model state-dict entry; an optimizer state dict written before that
(holding those keys) still loads them into the record. ``state[p]`` of a high-precision parameter
holds the inner state of ``p``. ``state_dict()`` / ``load_state_dict()`` use torch's format
(integer ids in ``param_groups`` order; ``torch.distributed.checkpoint.state_dict`` turns them into
FQNs and back), so DCP reshards every entry.

State exists from construction: reading ``state`` or calling ``state_dict()`` before the first step
creates the inner optimizer's state the way ``torch.distributed.checkpoint.state_dict`` does for any
torch optimizer (one inner step with zero gradients and learning rate 0, here also with weight
decay 0 and with ``step`` counters set back to 0 afterwards), so a fresh optimizer is a complete
template to load a checkpoint into and a resumed run needs no extra call. For Adam, AdamW, SGD
(without dampening), RMSprop and Adagrad that state is exactly a fresh optimizer's (tested); an
optimizer whose zero-gradient step is not a no-op on its state (e.g. NAdam's ``mu_product``) gets
the state torch's own helpers would give it.

[Note: non-finite gradients]
A NaN or Inf gradient would turn every master it touches into NaN and, after requantization,
every FP8 byte of those weights into 0x7F, for any recipe. ``step()`` therefore checks the
gradients first (``nonfinite="raise"`` by default, or ``"skip"``): one max-norm per group of
gradients, a flag all-reduced over the world so every rank decides alike, and one host read — the
same synchronization torch's ``GradScaler`` makes every step; ``nonfinite="ignore"`` removes it.
A master, moment or scaling state that is not finite cannot be loaded either (``load_state_dict``
refuses it on every rank, naming it; ``optim_load.py``).
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ._compat import dtensor_local
from .agreement import gather_findings
from .groups import max_over_
from .module import finish_init_
from .placement import inner_tensor, local_tensor
from . import optim_follow
from .operand_scaling import update_operand_scaling_
from .param_writes import master_loaded_, masters_follow_loaded_bytes_
from .optim_load import stage_load
from .optim_masters import check_master_dtype, check_masters_linked, master_and_inner, take_masters_over
from .optim_state import OptimizerParts, StateView
from .requantize import GraphedRequantize
from .tensor import QuantizedTensor

_NONFINITE = ("raise", "skip", "ignore")


class MasterWeightOptimizer(torch.optim.Optimizer):
    """Any torch optimizer over high-precision masters of a model's FP8 parameters (see the notes).

    High-precision parameters are optimized as they are. For each FP8 parameter (a
    :class:`QuantizedTensor`, or a DTensor of them after ``fully_shard``) a master with the same
    sharding is created (from the high-precision init values kept by ``quantize_module_``, else
    from the dequantized FP8 values); its gradient is the parameter's (FSDP has already
    reduce-scattered it in high precision); after ``step()`` the FP8 shard is requantized in place.

    [Note: master dtype and memory]
    FP32 masters (the default) cost 4 bytes per weight, and a torch optimizer keeps its state in
    the master's dtype (Adam: 8 more bytes), on top of the 1-byte FP8 weight and the gradient; a
    bf16 gradient is also copied to FP32 for the step. ``master_dtype=torch.bfloat16`` keeps masters
    and optimizer state at 2 + 4 bytes, the precision a model trained with bf16 parameters has,
    and hands FSDP's bf16 gradient to the optimizer without a copy.

    [Note: a second optimizer]
    One ``MasterWeightOptimizer`` owns a weight's master at a time. Building another over weights
    whose master a live optimizer holds (a rebuilt optimizer: new groups, another optimizer class)
    starts the new masters from the first one's values, in the new ``master_dtype`` (not from the
    FP8 bytes, which lose about 4 % of a block's amax), with fresh optimizer state; the first
    optimizer then refuses ``step``, ``requantize_`` and ``load_state_dict``, naming the newer one.

    Args:
        model: the (sharded) model; build the optimizer after ``fully_shard``.
        optimizer_cls: e.g. ``torch.optim.AdamW``.
        params: parameters of ``model`` or param-group dicts, as torch optimizers take them
            (default: every parameter of ``model``, one group). FP8 and high-precision
            parameters may share a group.
        master_dtype: dtype of the masters (and so of the optimizer state): ``torch.float32``
            (default) or ``torch.bfloat16``; ``torch.float16`` is refused (Adam's state underflows
            in it: NaN masters at the first step).
        cuda_graph: replay the requantization after each step as a CUDA graph where possible
            (see ``requantize.GraphedRequantize``); ``False`` issues it op by op every step.
        nonfinite: what ``step()`` does when a gradient holds NaN or Inf (on any rank; see the
            note on non-finite gradients): ``"raise"`` (default) a ``FloatingPointError`` naming the
            parameters, with nothing changed; ``"skip"`` the step (a warning names them; weights,
            masters and optimizer state unchanged; :attr:`skipped_steps` counts them); ``"ignore"``
            no check (no host synchronization; NaN then spreads into the masters and FP8 weights).
        **defaults: hyper-parameters for ``optimizer_cls`` (``lr=...``, ``betas=...``).

    Example:
        >>> decay = [p for n, p in model.named_parameters() if p.dim() == 2]
        >>> other = [p for n, p in model.named_parameters() if p.dim() != 2]
        >>> opt = dtensor_fp8.MasterWeightOptimizer(
        ...     model, torch.optim.AdamW, [{"params": decay}, {"params": other, "weight_decay": 0.0}],
        ...     lr=3e-4, weight_decay=0.1)
        >>> sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
        >>> loss.backward(); opt.step(); sched.step(); opt.zero_grad()
    """

    def __init__(self, model: nn.Module, optimizer_cls: type, params: Iterable | None = None, *,
                 master_dtype: torch.dtype = torch.float32, cuda_graph: bool = True, nonfinite: str = "raise",
                 **defaults: Any):
        check_master_dtype(master_dtype)
        if isinstance(optimizer_cls, torch.optim.Optimizer) or not (
                isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(f"MasterWeightOptimizer: optimizer_cls must be a torch.optim.Optimizer class such as "
                            f"torch.optim.AdamW, got {optimizer_cls!r}; pass its hyper-parameters as keywords")
        if optimizer_cls is torch.optim.LBFGS:
            raise TypeError("MasterWeightOptimizer: LBFGS re-evaluates the closure inside its step, which would "
                            "need the FP8 weights requantized between evaluations; use a first-order optimizer")
        if nonfinite not in _NONFINITE:
            raise ValueError(f"MasterWeightOptimizer: nonfinite={nonfinite!r}; use one of {_NONFINITE}")
        self.master_dtype = master_dtype
        self.nonfinite = nonfinite
        #: steps not taken because a gradient was not finite (``nonfinite="skip"``)
        self.skipped_steps = 0
        self.model = model
        finish_init_(model)  # a meta-built model's FP8 bytes, from the values its init wrote
        groups = _param_groups(model if params is None else params)
        #: masters, inner tensors, FQNs, groups: what the helper modules read, passed to them explicitly
        parts = self._parts = OptimizerParts(fqn=_fqns(model, groups))
        with torch.no_grad():
            for p in (p for g in groups for p in g["params"]):
                master, stepped = master_and_inner(p, master_dtype)
                parts.inner_of[p] = stepped
                if master is not None:
                    parts.masters[p] = master
        inner = optimizer_cls([{**g, "params": [parts.inner_of[p] for p in g["params"]]} for g in groups], **defaults)
        super().__init__(groups, inner.defaults)  # parts.inner is None: add_param_group leaves it alone
        parts.inner = inner
        self._parts.sync_hyperparameters()
        # The weight scaling state of stateful recipes (delayed scaling's amax history), made now in
        # each parameter's owner record from its plane's current scale: a fresh optimizer is then a
        # complete checkpoint template.
        for p in parts.masters:
            q = local_tensor(p)
            for usage, plane in q.planes.items():
                q.param_state.scaling.weight_state(q.recipe, usage, plane)
        self._requantize = GraphedRequantize(cuda_graph)
        self.state = StateView(parts, self._materialize_state)
        parts.built_with = {"optimizer_cls": optimizer_cls, "master_dtype": master_dtype, "cuda_graph": cuda_graph,
                            "nonfinite": nonfinite, **defaults}
        parts.bound = optim_follow.snapshot(parts.groups)
        # Built: this optimizer now owns its weights' masters (writes into the weights update them,
        # param_writes.py); an optimizer that owned them before stops acting (optim_masters.py).
        self._ownership = take_masters_over(parts.masters, parts.fqn)

    # ---- torch.optim.Optimizer API -------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        """torch's ``param_groups``: a plain read (LR schedulers read it every step). After a
        framework replaced their parameter lists (accelerate's ``prepare``), :meth:`follow_model`
        puts the model's current parameters back into them."""
        return self._parts.groups

    @param_groups.setter
    def param_groups(self, groups: list[dict]) -> None:
        self._parts.groups = groups

    def add_param_group(self, param_group: dict) -> None:
        """Add a group of model parameters (torch's ``add_param_group``; e.g. layers unfrozen later).

        High-precision parameters only (an FP8 parameter's master is made at construction). A
        refused group leaves the optimizer as it was.
        """
        if self._parts.inner is None:  # inside __init__: the inner optimizer is built with every group
            super().add_param_group(param_group)
            return
        self.follow_model()
        outer, inner = len(self._parts.groups), len(self._parts.inner.param_groups)
        try:  # torch's checks run inside and append the group: a refusal after that takes it out again
            super().add_param_group(param_group)
            group = self._parts.groups[-1]
            fp8 = [p for p in group["params"] if isinstance(local_tensor(p), QuantizedTensor)]
            if fp8:
                raise ValueError(
                    f"MasterWeightOptimizer.add_param_group: {self._parts.fqn_of(fp8[0])} is an FP8 parameter; its "
                    "master is made at construction. Pass every FP8 parameter when building the optimizer "
                    "(frozen ones may have requires_grad=False).")
            names = _fqns(self.model, [group])
            aliases = {p: inner_tensor(p) for p in group["params"]}
            self._parts.inner.add_param_group({**group, "params": [aliases[p] for p in group["params"]]})
            self._parts.inner_of.update(aliases)
            self._parts.fqn.update(names)
            self._parts.bound = optim_follow.snapshot(self._parts.groups)
        except BaseException:
            del self._parts.groups[outer:]
            del self._parts.inner.param_groups[inner:]
            raise

    @torch.no_grad()
    def step(self, closure=None):
        """One step of the inner optimizer on the masters, then every FP8 shard requantized.

        Args:
            closure: re-evaluates the model and returns the loss; called once, before the step
                (as SGD and Adam use it).

        Returns:
            The closure's loss, or ``None``.
        """
        self.follow_model()
        self._check_masters_linked("step")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._parts.sync_hyperparameters()
        materializing = self._hand_over_gradients()
        if not materializing:  # (not torch's state-creating step, which set_state_dict runs before its loads)
            masters_follow_loaded_bytes_(self._parts.masters)  # a model-only load since the last step: follow it
        if self.nonfinite != "ignore" and not materializing and self._gradients_not_finite():
            bad = self._nonfinite_parameters()
            self._drop_inner_gradients()
            what = (f"non-finite gradients (NaN or Inf) in {len(bad)} parameter(s): {', '.join(bad[:6])}"
                    f"{' ...' if len(bad) > 6 else ''}")
            if self.nonfinite == "raise":
                raise FloatingPointError(
                    f"MasterWeightOptimizer.step: {what}. The step was not taken: weights, masters and optimizer "
                    "state are unchanged. Find the cause (a NaN loss, an overflow; lower the learning rate), or pass "
                    "nonfinite='skip' to skip such steps.")
            self.skipped_steps += 1
            warnings.warn(f"MasterWeightOptimizer.step: {what}; step skipped ({self.skipped_steps} so far)", stacklevel=2)
            return loss
        self._parts.inner.step()
        self._drop_inner_gradients()
        self._parts.generation += 1
        if not materializing:
            update_operand_scaling_(self._parts.masters)  # delayed scaling's GEMM operands: once per step
            self.requantize_()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.follow_model()
        super().zero_grad(set_to_none=set_to_none)
        self._drop_inner_gradients()

    def follow_model(self) -> None:
        """Follow the model after a framework replaced the groups' parameter lists: accelerate's
        ``prepare`` re-maps them by ``data_ptr()`` (0 for every FP8 weight) and, in its own order,
        shards the model after the optimizer was built (``optim_follow.py``). The groups get back
        their parameters, each once, by FQN; masters, inner and scaling state and hyper-parameters
        move exactly to parameters the model replaced. One identity test per group otherwise.

        torch's optimizer API calls it, on every rank as a step or a save runs there (``step``,
        ``zero_grad``, ``add_param_group``, ``state_dict``, ``load_state_dict``, reads of ``state``),
        so ``accelerator.save_state`` / ``load_state`` work right after ``prepare``. Not ``param_groups``
        (a plain read: LR schedulers read it every step), nor ``masters`` / ``master_of``, which may
        be read on one rank: a follow may rebuild the optimizer, which agrees across ranks; they refuse.

        Example:
            >>> model, opt = accelerator.prepare(model, opt)
            >>> opt.optimizer.follow_model()   # before reading opt.optimizer.masters
        """
        parts = self._parts
        if optim_follow.unchanged(parts):
            return
        replaced = optim_follow.restore_groups(parts, self.model, canonical_fqn)
        if replaced is None:
            return
        saved = self.state_dict()
        args = dict(parts.built_with)
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": new}
                  for g, new in zip(parts.groups, replaced)]
        rebuilt = type(self)(self.model, args.pop("optimizer_cls"), groups, **args)
        rebuilt.load_state_dict(saved)
        # This object stays (accelerate's wrapper and LR schedulers hold it, with its hooks): it takes
        # the rebuilt one's parts, the masters' ownership and the requantization over the new tensors.
        self._parts, self._ownership, self._requantize = rebuilt._parts, rebuilt._ownership, rebuilt._requantize
        self.state.follow(self._parts)

    def state_dict(self) -> dict:
        """torch's optimizer state-dict format: ``state`` keyed by integer ids in ``param_groups``
        order, with DTensors laid out like the parameters (see the note), and ``param_groups``."""
        self.follow_model()  # a save is an action, as a load is: accelerate's save_state may come before any step
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        params = [p for g in self.param_groups for p in g["params"]]
        index = {p: i for i, p in enumerate(params)}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[p] for p in g["params"]]}
                  for g in self.param_groups]
        out = {"state": {index[p]: s for p, s in self.state.items()}, "param_groups": groups}
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, out)
            if result is not None:
                out = result
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a :meth:`state_dict` (ids or, as ``torch.distributed.checkpoint.state_dict`` passes
        them, FQNs: matched to this optimizer's parameters by position, as torch does).

        Masters and scaling states are copied into this optimizer's own tensors (their storage is
        kept: requantization graphs and DCP plans refer to it); values may be DTensors of the
        parameters' shapes or full tensors (each rank keeps its shard).

        All or nothing: every master, moment and scaling state is checked before any is written
        (a tensor of a floating dtype, the parameter's global shape or this optimizer's own,
        finite unless built with ``nonfinite="ignore"``; see ``optim_load.py``). Under
        torch.distributed, call it on every rank (as torch's ``set_state_dict`` does): a problem
        on any rank (a NaN in one rank's shard) is raised on all of them, naming the entries
        (``KeyError`` for a missing master, ``FloatingPointError`` for NaN or Inf, ``ValueError``
        otherwise), with nothing changed.

        Args:
            state_dict: from :meth:`state_dict` (or torch's DCP helpers).
        """
        self.follow_model()
        self._check_masters_linked("load_state_dict")
        state_dict = dict(state_dict)
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._materialize_state()  # a fresh optimizer's state, as torch's state-dict helpers create it
        staged = stage_load(self._parts, state_dict, check_finite=self.nonfinite != "ignore")
        # Everything is checked; torch's load builds the inner state before it replaces the old
        # one, and the copies below cannot fail.
        self._parts.inner.load_state_dict({"state": staged.inner_state, "param_groups": staged.inner_groups})
        for target, value in staged.masters:
            target.copy_(value)
        master_loaded_(self._parts.masters)
        for target, value in staged.scaling:
            target.copy_(value)
        for group, hyperparameters in staged.hyperparameters:
            group.update(hyperparameters)
        self._parts.sync_hyperparameters()
        self.state.forget_views()
        self._parts.generation += 1
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    # ---- FP8 specifics -------------------------------------------------------------------------------
    @property
    def masters(self) -> dict[str, nn.Parameter]:
        """FQN -> master of each FP8 parameter."""
        self._check_groups_bound("masters")
        return {self._parts.fqn[p]: m for p, m in self._parts.masters.items()}

    def master_of(self, param: torch.Tensor) -> nn.Parameter | None:
        """The master of the FP8 parameter ``param`` of the model (None for any other tensor).

        Example:
            >>> opt.master_of(model.layers[0].w1.weight)
        """
        self._check_groups_bound("master_of")
        return self._parts.masters.get(param)

    @property
    def scaling_states(self) -> dict[tuple[str, str], dict]:
        """``(fqn, plane) -> weight scaling state`` of stateful recipes (delayed scaling), as held by
        each parameter's owner record (``param_state.scaling.weight``; not this optimizer's)."""
        return {(self._parts.fqn[p], usage): state for p in self._parts.masters
                for usage, state in local_tensor(p).param_state.scaling.weight.items()}

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The torch optimizer doing the arithmetic, over local tensors (see the note)."""
        return self._parts.inner

    @torch.no_grad()
    def requantize_(self) -> None:
        """Requantize every FP8 shard from its master (one amax all-reduce for spanning blocks)."""
        self._check_masters_linked("requantize_")
        self._requantize([(self._parts.fqn[p], p, self._parts.inner_of[p]) for p in self._parts.masters])

    def __repr__(self) -> str:
        dtype = str(self.master_dtype).replace("torch.", "")
        return (f"MasterWeightOptimizer({type(self._parts.inner).__name__}, fp8_params={len(self._parts.masters)}, "
                f"master_dtype={dtype}, groups={len(self.param_groups)})")

    # ---- internals -----------------------------------------------------------------------------------
    def _check_masters_linked(self, what: str) -> None:
        """Refuse to act once a later optimizer took over these masters (optim_masters.py)."""
        check_masters_linked(self.__dict__.get("_ownership"), what)

    def _check_groups_bound(self, what: str) -> None:
        """This class's own accessors follow nothing (see :meth:`follow_model`): with groups not
        followed yet they refuse rather than show the state of parameters the model may no longer have."""
        if not optim_follow.unchanged(self._parts):
            raise RuntimeError(
                f"MasterWeightOptimizer.{what}: param_groups hold parameter lists put there after construction "
                "(accelerate's prepare does this), not followed yet. Fix: call opt.follow_model() first, on every "
                "rank (with accelerate: opt.optimizer.follow_model() right after accelerator.prepare); step(), "
                "zero_grad(), state_dict() and load_state_dict() call it themselves. Nothing was changed.")

    def _agreement_groups(self) -> tuple:
        """The process groups over which every rank stepping these parameters must decide alike: the
        mesh dims of the parameters' own meshes (``groups.py``), never the world (under pipeline
        parallelism the other stages step other parameters, at other times)."""
        return self._parts.agreement_groups()

    def _gradients_not_finite(self) -> bool:
        """Whether any rank's gradient holds NaN or Inf: one max-norm kernel per group of gradients,
        one all-reduce of a flag per mesh group, one host read (what torch's GradScaler pays per step too)."""
        grads = [t.grad for t in self._parts.inner_of.values() if t.grad is not None]
        device = next(iter(self._parts.inner_of.values())).device if self._parts.inner_of else torch.device("cpu")
        if not grads:
            flag = torch.zeros(1, device=device)
        else:
            # The inf-norm (max |g|) is NaN or Inf exactly when an element is; it cannot overflow.
            norms = torch._foreach_norm(grads, float("inf"))
            flag = (~torch.stack([n.float() for n in norms]).isfinite()).any().float().reshape(1)
        flag = max_over_(flag, self._agreement_groups())  # every rank takes the same decision
        return bool(flag.item())

    def _nonfinite_parameters(self) -> list[str]:
        """FQNs of the parameters whose gradient is not finite, on any rank (the error path only)."""
        local = sorted(self._parts.fqn[p] for p, t in self._parts.inner_of.items()
                       if t.grad is not None and not bool(torch.isfinite(t.grad).all()))
        return sorted(gather_findings(local, self._agreement_groups()))

    def _drop_inner_gradients(self) -> None:
        """Drop the inner tensors' references to this step's gradients (the model's own gradients stay
        where FSDP put them until ``zero_grad``)."""
        for p, inner in self._parts.inner_of.items():
            if inner is not p:
                inner.grad = None

    def _hand_over_gradients(self) -> bool:
        """Give the inner tensors this step's gradients (local shards). Returns True for torch's
        state-creating step (``torch.distributed.checkpoint.state_dict`` sets every gradient to
        ``zeros_like(param)``, which for an FP8 parameter is an FP8 zero tensor): its gradients are
        zeros, and the FP8 weights need no requantization after it."""
        materializing = False
        for p, inner in self._parts.inner_of.items():
            if isinstance(p, DTensor) and p not in self._parts.masters:
                local = dtensor_local(p)
                if inner.data_ptr() != local.data_ptr() or inner.shape != local.shape:
                    inner.data = local  # FSDP re-pointed the shard (lazy init): follow it
            g = p.grad
            if g is None:
                inner.grad = None
                continue
            local = dtensor_local(g)
            self._check_gradient_layout(p, g, local, inner)
            g = local
            if isinstance(g, QuantizedTensor):
                materializing = True
                inner.grad = torch.zeros_like(inner)
            else:
                # Same dtype: FSDP's gradient as it is, no copy.
                inner.grad = g if g.dtype == inner.dtype else g.to(inner.dtype)
        return materializing

    def _check_gradient_layout(self, p: torch.Tensor, g: torch.Tensor, local: torch.Tensor, inner: torch.Tensor) -> None:
        """The step works on each rank's shard: a gradient laid out unlike its parameter (a
        Replicate DTensor set by hand on a sharded one) is named, with nothing stepped."""
        wrong = None
        if isinstance(g, DTensor) and isinstance(p, DTensor) and (tuple(g.placements) != tuple(p.placements) or (
                g.device_mesh is not p.device_mesh and g.device_mesh != p.device_mesh)):
            wrong = (f"is a DTensor laid out as {tuple(g.placements)} on {g.device_mesh}, its parameter as "
                     f"{tuple(p.placements)} on {p.device_mesh}")
        elif local.shape != inner.shape and not isinstance(local, QuantizedTensor):
            wrong = f"has shape {tuple(local.shape)} on this rank, its parameter's shard {tuple(inner.shape)}"
        if wrong is not None:
            self._drop_inner_gradients()
            raise ValueError(
                f"MasterWeightOptimizer.step: the gradient of {self._parts.fqn_of(p)} {wrong}: the optimizer steps "
                "each rank's shard, so a gradient must be laid out like its parameter (as FSDP's reduce-scatter leaves "
                "it). Fix: p.grad = grad.redistribute(p.device_mesh, p.placements) (or a gradient of the "
                "parameter's shape). The step was not taken: nothing changed.")

    @torch.no_grad()
    def _materialize_state(self) -> None:
        """Create the inner optimizer's state for every trainable tensor that has none (see the
        note): one inner step with zero gradients, lr 0 and weight decay 0, then ``step`` counters
        set back to 0. Values are unchanged."""
        self.follow_model()  # torch's state-dict helpers read state first, on every rank (a save)
        inner = self._parts.inner
        missing = {id(t): t for t in self._parts.inner_of.values() if t.requires_grad and t not in inner.state}
        if not missing:
            return
        self._parts.sync_hyperparameters()
        saved = [(g, k, g[k]) for g in self._parts.inner.param_groups for k in ("lr", "weight_decay") if k in g]
        for g, k, v in saved:
            g[k] = torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0.0
        grads = {t: t.grad for t in self._parts.inner_of.values()}
        try:
            for t in self._parts.inner_of.values():
                t.grad = torch.zeros_like(t) if id(t) in missing else None
            self._parts.inner.step()
        finally:
            for g, k, v in saved:
                g[k] = v
            for t, g in grads.items():
                t.grad = g
        self._parts.generation += 1
        for t in missing.values():
            state = self._parts.inner.state.get(t, {})
            if "step" in state:
                step = state["step"]
                state["step"] = step.zero_() if isinstance(step, torch.Tensor) else type(step)(0)


def _param_groups(params) -> list[dict]:
    """torch's forms of ``params`` (a module, tensors, or group dicts) as a list of group dicts."""
    if isinstance(params, nn.Module):
        return [{"params": list(params.parameters())}]
    params = list(params)
    if not params:
        raise ValueError("MasterWeightOptimizer: got an empty parameter list")
    if isinstance(params[0], dict):
        return [{**g, "params": list(g["params"]) if not isinstance(g["params"], torch.Tensor) else [g["params"]]}
                for g in params]
    return [{"params": params}]


#: Path components that wrappers insert into parameter names and torch's state-dict helpers drop
#: (``torch.compile``'s ``_orig_mod``, ``checkpoint_wrapper``'s ``_checkpoint_wrapped_module``).
_WRAPPER_COMPONENTS = ("_orig_mod", "_checkpoint_wrapped_module")


def canonical_fqn(name: str) -> str:
    """``name`` without the components wrappers insert, so an FQN means the same parameter
    before and after ``torch.compile`` / ``checkpoint_wrapper`` (as in torch's ``get_state_dict``).

    Example:
        >>> canonical_fqn("layers.0._orig_mod.w1.weight")
        'layers.0.w1.weight'
    """
    return ".".join(c for c in name.split(".") if c not in _WRAPPER_COMPONENTS)


def _fqns(model: nn.Module, groups: list[dict]) -> dict:
    """Parameter -> its FQN in ``model``; a parameter that is not the model's is an error."""
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p, canonical_fqn(name))
    for g in groups:
        for p in g["params"]:
            if p not in names:
                raise ValueError(
                    f"MasterWeightOptimizer: a parameter of shape {tuple(p.shape)} in the param groups is not a "
                    "parameter of the model. Build the optimizer after fully_shard (which replaces the "
                    "parameters) from model.parameters() / model.named_parameters().")
    return names
