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
    """
    jobs, spanning = [], {}
    for name, p, hp in items:
        q = local_tensor(p)
        sharded = _sharded_dims(p)
        for usage in q._planes:
            # Only blocks that span a sharded dim need their amax now (to reduce it); the codec
            # computes the others itself, fused into its quantization where it can.
            if any(q.codec.spans_dim(usage, d) for d in sharded):
                spanning.setdefault((q.codec, usage), []).append(len(jobs))
            jobs.append((name, q, hp, usage))
    amaxes = [None] * len(jobs)
    if spanning:
        for (codec, usage), idx in spanning.items():  # per recipe and plane, in one batch
            for i, amax in zip(idx, codec.block_amaxes(usage, [jobs[i][2] for i in idx]), strict=True):
                amaxes[i] = amax
        if dist.is_initialized() and dist.get_world_size() > 1:
            # One MAX all-reduce over the world group, whatever the mesh (dp, or dp x tp): ranks
            # that replicate a shard contribute identical amaxes, so reducing over them is harmless.
            order = [i for idx in spanning.values() for i in idx]
            flat = torch.cat([amaxes[i].reshape(-1) for i in order])
            dist.all_reduce(flat, op=dist.ReduceOp.MAX)
            for i, part in zip(order, flat.split([amaxes[i].numel() for i in order])):
                amaxes[i] = part.reshape(amaxes[i].shape)
    # One call per (recipe, plane) for all its tensors: per-tensor scales are computed together.
    batches: dict = {}
    for (name, q, hp, usage), amax in zip(jobs, amaxes):
        plane = q._planes[usage]
        state = None
        if scaling_states is not None:
            state = scaling_states.get((name, usage)) or q.codec.initial_scaling_state(plane)
        batches.setdefault((q.codec, usage), []).append((name, q, hp, plane, amax, state))
    for (codec, usage), batch in batches.items():
        names, qs, hps, planes, amaxes, states = zip(*batch)
        # In place: the FP8 bytes and scales keep their storage (FSDP's sharded parameters,
        # TE views and checkpoint plans all refer to it).
        new_states = codec.requantize_planes_(usage, list(hps), list(planes), list(amaxes), list(states))
        for name, q, state in zip(names, qs, new_states, strict=True):
            if state is not None:
                scaling_states[(name, usage)] = state
            q.discard_transpose_cache()


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

    Args:
        model: the (sharded) model.
        optimizer_cls: e.g. ``torch.optim.AdamW``.
        master_dtype: dtype of the masters (and so of the optimizer state): ``torch.float32``
            (default), ``torch.bfloat16`` or ``torch.float16``.
        **optimizer_kwargs: passed to ``optimizer_cls``.

    Example:
        >>> opt = dtensor_fp8.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-3)
        >>> loss.backward(); opt.step(); opt.zero_grad()
    """

    def __init__(self, model: nn.Module, optimizer_cls, *, master_dtype: torch.dtype = torch.float32,
                 **optimizer_kwargs):
        if master_dtype not in _MASTER_DTYPES:
            raise ValueError(f"MasterWeightOptimizer: master_dtype={master_dtype} is not a floating dtype for "
                             f"master weights; use one of {_MASTER_DTYPES} (torch.float32 unless memory is short)")
        self.master_dtype = master_dtype
        self.model = model
        hp_init = getattr(model, HP_INIT_ATTR, {})
        self.fp8_params: list[tuple[str, nn.Parameter, nn.Parameter]] = []
        params = []
        for name, p in model.named_parameters():
            local = local_tensor(p)
            if not isinstance(local, QuantizedTensor):
                params.append(p)
                continue
            init = hp_init.pop(name, None)
            if init is not None:
                master_local = _local_slice(init, p).to(device=local.device, dtype=master_dtype).clone()
            else:
                master_local = local.dequantize(master_dtype)
            master = nn.Parameter(like(p, master_local))
            self.fp8_params.append((name, p, master))
            params.append(master)
        self.optimizer = optimizer_cls(params, **optimizer_kwargs)
        #: per (fqn, usage) scaling state of stateful recipes (delayed scaling's amax history)
        self.scaling_states: dict[tuple[str, str], dict] = {}

    @property
    def masters(self) -> dict[str, nn.Parameter]:
        return {name: m for name, _, m in self.fp8_params}

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        for name, p, master in self.fp8_params:
            g = p.grad
            if g is None:
                master.grad = None
            elif g.dtype == master.dtype and type(g) is type(master):
                master.grad = g  # same sharding and dtype: FSDP's gradient as it is, no copy or re-wrap
            else:
                master.grad = like(master, local_tensor(g).to(master.dtype))
        self.optimizer.step()
        self.requantize_()

    @torch.no_grad()
    def requantize_(self) -> None:
        """Requantize every FP8 shard from its master (one amax all-reduce for spanning blocks)."""
        requantize_from_hp_([(name, p, local_tensor(master)) for name, p, master in self.fp8_params], self.scaling_states)

    def _names_in_order(self) -> list[str]:
        by_id = {id(m): name for name, _, m in self.fp8_params}
        by_id.update({id(p): name for name, p in self.model.named_parameters() if id(p) not in by_id})
        return [by_id[id(p)] for g in self.optimizer.param_groups for p in g["params"]]

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
                state = local_tensor(p).codec.initial_scaling_state(plane)
                if state is not None:
                    self.scaling_states.setdefault((name, usage), state)

    def state_dict(self) -> dict:
        """FQN-keyed state: the masters, the inner optimizer's state and hyper-parameters, and the
        scaling state of stateful recipes. DTensors keep their sharding, so DCP can reshard it."""
        inner = self.optimizer.state_dict()
        names = self._names_in_order()
        return {
            "masters": {name: m.detach() for name, _, m in self.fp8_params},
            "state": {names[i]: s for i, s in inner["state"].items()},
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
            "state": {index[n]: s for n, s in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]],
        })
        self.scaling_states = {tuple(k.split("|")): v for k, v in state.get("scaling", {}).items()}

    def __repr__(self) -> str:
        dtype = str(self.master_dtype).replace("torch.", "")
        return f"MasterWeightOptimizer({type(self.optimizer).__name__}, fp8_params={len(self.fp8_params)}, master_dtype={dtype})"

