"""High-precision master weights for FP8 parameters, wrapped around any torch optimizer.

[Note: requantizing sharded FP8 weights]
After ``step()`` every FP8 parameter's local shard is requantized in place from its master
shard, into every plane it stores. A scaling block that lies inside one shard needs nothing from
other ranks. A block that spans a sharded dim (per-tensor scaling: the block is the whole tensor)
needs the max over all shards: those amaxes of *all* weights are packed into one tensor and
reduced with a single all-reduce, not one per weight. Delayed scaling records that global amax in
its per-weight amax history and takes the next scale from TE's update rule.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .module import HP_INIT_ATTR
from .placement import like, local_tensor, shard_dim
from .tensor import QuantizedTensor


def _sharded_dims(p: torch.Tensor) -> set[int]:
    """Tensor dims sharded over any mesh dim."""
    if not isinstance(p, DTensor):
        return set()
    return {d for d in map(shard_dim, p.placements) if d is not None}


def _local_slice(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a full tensor laid out like the (possibly DTensor) parameter ``p``.

    torch's own ``distribute_tensor`` with ``p``'s placements, each rank slicing its own copy
    (``src_data_rank=None``: no communication). One (offset, length) window per dim cannot
    describe FSDP's ``_StridedShard`` on a (dp, tp) mesh: a dp shard of a tp shard is a set of
    interleaved row ranges of the full tensor, not one contiguous slice.
    """
    if not isinstance(p, DTensor):
        return full
    full = full.to(p.device_mesh.device_type)
    return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()


@torch.no_grad()
def requantize_from_hp_(items, scaling_states: dict | None = None) -> None:
    """Requantize FP8 parameters in place from high-precision local shards.

    Args:
        items: ``(name, param, hp_local)``; ``param`` is a QuantizedTensor or a DTensor of one,
            ``hp_local`` the high-precision values of this rank's shard.
        scaling_states: per ``(name, usage)`` scaling state of stateful recipes (delayed
            scaling's amax history), updated in place; ``None`` keeps their current scales.

    Example:
        >>> requantize_from_hp_([("w", model.w, master_shard)], opt.scaling_states)
    """
    plan = _RequantizePlan(items, scaling_states)
    plan.run()
    plan.finish()


class _RequantizePlan:
    """One requantization of a set of FP8 parameters, split into what it decides (here, Python
    only), the device work (:meth:`run`: the only part a CUDA graph captures) and the Python-side
    bookkeeping after it (:meth:`finish`)."""

    def __init__(self, items, scaling_states: dict | None):
        jobs, spanning = [], {}
        for name, p, hp in items:
            q = local_tensor(p)
            sharded = _sharded_dims(p)
            for usage in q._planes:
                # Only blocks that span a sharded dim need their amax now (to reduce it); the recipe
                # computes the others itself, fused into its quantization where it can.
                if any(q.recipe.spans_dim(usage, d) for d in sharded):
                    spanning.setdefault((q.recipe, usage), []).append(len(jobs))
                jobs.append((name, q, hp, usage))
        self.jobs, self.spanning = jobs, spanning
        #: whether run() all-reduces amaxes (blocks spanning shards, more than one rank)
        self.reduces = bool(spanning) and dist.is_initialized() and dist.get_world_size() > 1
        # One batch per (recipe, plane) for all its tensors: per-tensor scales are computed together.
        self.batches: dict = {}
        for i, (name, q, hp, usage) in enumerate(jobs):
            plane = q._planes[usage]
            state = None
            if scaling_states is not None:
                state = scaling_states.get((name, usage))
                if state is None:
                    state = q.recipe.initial_scaling_state(plane)
                    if state is not None:  # kept from now on and updated in place by run()
                        scaling_states[(name, usage)] = state
            self.batches.setdefault((q.recipe, usage), []).append((i, hp, plane, state))
        self.tensors = list(dict.fromkeys(q for _, q, _, _ in jobs))

    def run(self) -> None:
        """The device work: amaxes (all-reduced where blocks span shards), new FP8 bytes and scales
        into the existing planes, new scaling states into the existing states."""
        jobs, amaxes = self.jobs, [None] * len(self.jobs)
        if self.spanning:
            for (recipe, usage), idx in self.spanning.items():  # per recipe and plane, in one batch
                for i, amax in zip(idx, recipe.block_amaxes(usage, [jobs[i][2] for i in idx]), strict=True):
                    amaxes[i] = amax
            if self.reduces:
                # One MAX all-reduce over the world group, whatever the mesh (dp, or dp x tp): ranks
                # that replicate a shard contribute identical amaxes, so reducing over them is harmless.
                order = [i for idx in self.spanning.values() for i in idx]
                flat = torch.cat([amaxes[i].reshape(-1) for i in order])
                dist.all_reduce(flat, op=dist.ReduceOp.MAX)
                for i, part in zip(order, flat.split([amaxes[i].numel() for i in order])):
                    amaxes[i] = part.reshape(amaxes[i].shape)
        kept, fresh = [], []
        for (recipe, usage), batch in self.batches.items():
            idx, hps, planes, states = zip(*batch)
            # In place: the FP8 bytes and scales keep their storage (FSDP's sharded parameters,
            # TE views and checkpoint plans all refer to it).
            new_states = recipe.requantize_planes_(usage, list(hps), list(planes), [amaxes[i] for i in idx], list(states))
            for old, new in zip(states, new_states, strict=True):
                if old is not None and new is not None and new is not old:
                    kept += [old[k] for k in old]
                    fresh += [new[k] for k in old]
        if kept:  # the states keep their storage too (one batched copy)
            torch._foreach_copy_(kept, fresh)

    def finish(self) -> None:
        for q in self.tensors:
            q.discard_transpose_cache()


def _fingerprint(items, scaling_states: dict | None) -> tuple:
    """Identity and address of every tensor a requantization of ``items`` reads or writes: equal
    fingerprints mean a graph captured for one is valid for the other."""
    out = []
    for name, p, hp in items:
        q = local_tensor(p)
        out += [name, id(p), id(hp), hp.data_ptr(), id(q)]
        for usage, plane in q._planes.items():
            out += [usage, plane.data.data_ptr(), plane.scale_inv.data_ptr()]
            state = scaling_states.get((name, usage)) if scaling_states is not None else None
            if state is not None:
                out += [t.data_ptr() for t in state.values()]
    return tuple(out)


class _GraphedRequantize:
    """Runs an optimizer step's requantization as a CUDA graph where it can.

    [Note: the requantization as one CUDA graph]
    After every optimizer step each FP8 weight is rewritten from its master: per weight an amax, a
    scale update (a delayed-scaling history), a cast, scale stores. On the GPU these take little
    time; issuing them from Python takes milliseconds per step, and a training step of FP8
    weights under FSDP2 is bound by the host (docs/benchmarks.md). The work reads and writes the
    same tensors every step (the masters, the planes and the scaling states are all updated in
    place), so it is captured once into a CUDA graph and replayed: one launch per step.

    The graph is valid while those tensors are: their identities and addresses
    (:func:`_fingerprint`, checked every step) change when a weight, master, plane or state is
    replaced (a checkpoint loaded with ``assign=True``, loaded scaling states), and the step then
    runs eagerly once and captures again. Not captured: requantizations that all-reduce amaxes
    (per-tensor recipes on more than one rank: a collective inside a graph is not what every
    process group supports), CPU tensors, and the first step with new tensors (it creates the
    scaling states and warms up the kernels). A capture that fails turns graphs off for this
    optimizer, with the reason in :attr:`disabled_reason`; the step then runs eagerly.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.disabled_reason: str | None = None if enabled else "cuda_graph=False"
        #: steps whose requantization was a graph replay
        self.replays = 0
        self._graph = self._plan = self._key = self._eager_key = None

    def __call__(self, items, scaling_states: dict | None) -> None:
        if self._graph is not None and _fingerprint(items, scaling_states) == self._key:
            self._graph.replay()
            self.replays += 1
            self._plan.finish()
            return
        self._graph = self._plan = self._key = None
        plan = _RequantizePlan(items, scaling_states)
        key = _fingerprint(items, scaling_states) if self._capturable(plan) else None
        if key is None or key != self._eager_key:  # not capturable, or new tensors: eagerly
            self._eager_key = key
            plan.run()
            plan.finish()
            return
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                plan.run()
        except Exception as e:  # noqa: BLE001  (whatever failed to capture: eager from now on)
            self.enabled = False
            self.disabled_reason = f"capture failed: {type(e).__name__}: {e}".splitlines()[0][:300]
            plan.run()
            plan.finish()
            return
        self._graph, self._plan, self._key = graph, plan, key
        graph.replay()  # capturing ran nothing: this is the step's requantization
        self.replays += 1
        plan.finish()

    def _capturable(self, plan: _RequantizePlan) -> bool:
        if not self.enabled or plan.reduces or not plan.jobs:
            return False
        return all(hp.is_cuda for _, _, hp, _ in plan.jobs) and not torch.cuda.is_current_stream_capturing()


_MASTER_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class MasterWeightOptimizer:
    """Any torch optimizer over high-precision masters of a model's FP8 parameters.

    High-precision parameters are optimized as they are. For each FP8 parameter (a
    :class:`QuantizedTensor`, or a DTensor of them after ``fully_shard``) a master with the
    same sharding is created (from the high-precision init values kept by ``quantize_module_``,
    else from the dequantized FP8 values); its gradient is the parameter's (FSDP has already
    reduce-scattered it in high precision); after ``step()`` the FP8 shard is requantized in place.

    [Note: master dtype and memory]
    FP32 masters (the default) cost 4 bytes per weight, and a torch optimizer keeps its state in
    the master's dtype (Adam: 8 more bytes), on top of the 1-byte FP8 weight and the gradient; a
    bf16 gradient is also copied to FP32 for the step. ``master_dtype=torch.bfloat16`` keeps masters
    and optimizer state at 2 + 4 bytes, the precision a model trained with bf16 parameters has,
    and hands FSDP's bf16 gradient to the optimizer without a copy.

    [Note: the inner optimizer steps local shards]
    The wrapped torch optimizer is given plain tensors: each master's local shard, and for the
    model's own DTensor parameters a parameter sharing their local shard's storage. An
    element-wise optimizer step is the same on a shard as on the DTensor, and DTensor's dispatch
    of a multi-tensor (``foreach`` / ``fused``) step costs several times the host time of the step
    itself (``python -m dtensor_fp8.benchmarks te_step --host-split``). FSDP may re-point a
    parameter's local shard at its lazy init, so the aliases are re-pointed when that happens, and
    gradients are handed over as local shards before each step. :meth:`state_dict` still returns
    DTensors laid out like the parameters, so DCP reshards the optimizer state as before.

    Args:
        model: the (sharded) model.
        optimizer_cls: e.g. ``torch.optim.AdamW``.
        master_dtype: dtype of the masters (and so of the optimizer state): ``torch.float32``
            (default), ``torch.bfloat16`` or ``torch.float16``.
        cuda_graph: replay the requantization after each step as a CUDA graph where possible
            (see ``_GraphedRequantize``); ``False`` issues it op by op every step.
        **optimizer_kwargs: passed to ``optimizer_cls``.

    Example:
        >>> opt = dtensor_fp8.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-3)
        >>> loss.backward(); opt.step(); opt.zero_grad()
    """

    def __init__(self, model: nn.Module, optimizer_cls, *, master_dtype: torch.dtype = torch.float32,
                 cuda_graph: bool = True, **optimizer_kwargs):
        if master_dtype not in _MASTER_DTYPES:
            raise ValueError(f"MasterWeightOptimizer: master_dtype={master_dtype} is not a floating dtype for "
                             f"master weights; use one of {_MASTER_DTYPES} (torch.float32 unless memory is short)")
        self.master_dtype = master_dtype
        self.model = model
        hp_init = getattr(model, HP_INIT_ATTR, {})
        self.fp8_params: list[tuple[str, nn.Parameter, nn.Parameter]] = []
        #: per inner-optimizer parameter, in order: (name, the parameter or master it stands for,
        #: the plain tensor the inner optimizer steps)
        self._inner: list[tuple[str, torch.Tensor, nn.Parameter]] = []
        self._aliased: list[tuple[DTensor, nn.Parameter]] = []  # model DTensor params, their aliases
        self._fp8_inner: list[nn.Parameter] = []  # what the inner optimizer steps for each master
        with torch.no_grad():
            for name, p in model.named_parameters():
                local = local_tensor(p)
                if not isinstance(local, QuantizedTensor):
                    inner = _local_alias(p)
                    if inner is not p:
                        self._aliased.append((p, inner))
                    self._inner.append((name, p, inner))
                    continue
                init = hp_init.pop(name, None)
                if init is not None:
                    master_local = _local_slice(init, p).to(device=local.device, dtype=master_dtype).clone()
                else:
                    master_local = local.dequantize(master_dtype)
                master = nn.Parameter(like(p, master_local))
                self.fp8_params.append((name, p, master))
                self._fp8_inner.append(_local_alias(master))
                self._inner.append((name, master, self._fp8_inner[-1]))
        self.optimizer = optimizer_cls([inner for _, _, inner in self._inner], **optimizer_kwargs)
        #: per (fqn, usage) scaling state of stateful recipes (delayed scaling's amax history)
        self.scaling_states: dict[tuple[str, str], dict] = {}
        self._requantize = _GraphedRequantize(cuda_graph)

    @property
    def masters(self) -> dict[str, nn.Parameter]:
        return {name: m for name, _, m in self.fp8_params}

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        for p, inner in self._aliased:
            local = p._local_tensor
            if inner.data_ptr() != local.data_ptr() or inner.shape != local.shape:
                inner.data = local  # FSDP re-pointed the shard (lazy init): follow it
            g = p.grad
            inner.grad = None if g is None else local_tensor(g)
        for (_, p, _), inner in zip(self.fp8_params, self._fp8_inner, strict=True):
            g = p.grad
            if g is None:
                inner.grad = None
            else:
                g = local_tensor(g)
                # Same dtype: FSDP's gradient as it is, no copy.
                inner.grad = g if g.dtype == inner.dtype else g.to(inner.dtype)
        self.optimizer.step()
        self.requantize_()

    @torch.no_grad()
    def requantize_(self) -> None:
        """Requantize every FP8 shard from its master (one amax all-reduce for spanning blocks)."""
        self._requantize([(name, p, inner) for (name, p, _), inner in zip(self.fp8_params, self._fp8_inner)],
                         self.scaling_states)

    @torch.no_grad()
    def init_state(self) -> None:
        """Create the inner optimizer's state (and delayed-scaling histories) without changing any
        value, so a state dict can be loaded in place (``dcp.load``) before the first step."""
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        saved = [p.grad for p in params]
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0
        for p in params:
            p.grad = torch.zeros_like(p)
        self.optimizer.step()
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        for p, g in zip(params, saved):
            p.grad = g
        for name, p, _ in self.fp8_params:
            for usage, plane in local_tensor(p)._planes.items():
                state = local_tensor(p).recipe.initial_scaling_state(plane)
                if state is not None:
                    self.scaling_states.setdefault((name, usage), state)

    def _names_in_order(self) -> list[str]:
        """FQN of each inner-optimizer parameter, in the inner optimizer's order."""
        by_id = {id(inner): name for name, _, inner in self._inner}
        return [by_id[id(p)] for g in self.optimizer.param_groups for p in g["params"]]

    def state_dict(self) -> dict:
        """FQN-keyed state: the masters, the inner optimizer's state and hyper-parameters, and the
        scaling state of stateful recipes. DTensors keep their sharding, so DCP can reshard it:
        the inner optimizer's per-shard state is returned as DTensors laid out like the
        parameters (views, not copies)."""
        inner = self.optimizer.state_dict()
        names = self._names_in_order()
        refs = {name: ref for name, ref, _ in self._inner}
        return {
            "masters": {name: m.detach() for name, _, m in self.fp8_params},
            "state": {names[i]: {k: _as_global(refs[names[i]], v) for k, v in s.items()}
                      for i, s in inner["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in inner["param_groups"]],
            "scaling": {f"{name}|{usage}": s for (name, usage), s in self.scaling_states.items()},
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        names = self._names_in_order()
        index = {name: i for i, name in enumerate(names)}
        for name, _, m in self.fp8_params:
            if name not in state["masters"]:
                raise KeyError(f"MasterWeightOptimizer.load_state_dict: no master for {name}")
            local_tensor(m).copy_(local_tensor(state["masters"][name]))
        self.optimizer.load_state_dict({
            "state": {index[n]: {k: local_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                      for n, s in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]],
        })
        self.scaling_states = {tuple(k.split("|")): v for k, v in state.get("scaling", {}).items()}

    def __repr__(self) -> str:
        dtype = str(self.master_dtype).replace("torch.", "")
        return f"MasterWeightOptimizer({type(self.optimizer).__name__}, fp8_params={len(self.fp8_params)}, master_dtype={dtype})"


def _local_alias(p: torch.Tensor) -> torch.Tensor:
    """What the inner optimizer steps for ``p``: ``p`` itself unless it is a DTensor, else a
    parameter sharing the storage of its local shard."""
    if not isinstance(p, DTensor):
        return p
    return nn.Parameter(p._local_tensor.detach(), requires_grad=p.requires_grad)


def _as_global(ref: torch.Tensor, value):
    """An inner-optimizer state tensor of ``ref``'s local shard as a DTensor laid out like ``ref``
    (scalars such as Adam's ``step`` as they are)."""
    if isinstance(ref, DTensor) and isinstance(value, torch.Tensor) and value.dim() > 0 \
            and value.shape == ref._local_tensor.shape:
        return like(ref, value)
    return value
