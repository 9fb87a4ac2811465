"""An FP8 weight's master: how a ``MasterWeightOptimizer`` makes it, which optimizer owns it, and
which master dtypes train.

[Note: one owner of a master]
An FP8 weight's owner record (``FP8ParamState.links.master``) links the one master every write of the
weight keeps equal to the written values. A second optimizer built over the same weights (an
optimizer rebuilt with other groups or another class) used to start its masters from the FP8
bytes, losing what the masters held beyond their FP8 rounding (about 4 % of a block's amax),
and took the link over without a word, while the first optimizer could still step its stale
masters over the weights. Now the second one starts from the first one's masters
(:func:`first_optimizers_master`) and takes the link; the first one refuses to act
(:func:`check_masters_linked`). A deep copy of a model links to no master (``param_state.py``).

[Note: master dtypes]
float32 and bfloat16 masters train. float16 is refused at construction: its smallest normal
value is 6.1e-5, so Adam's squared gradients and its ``eps`` (1e-8) flush to zero, its update
divides 0 by 0, and every master is NaN after the first step (already at the first
``state_dict()``, whose state-creating step divides the same way).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ._compat import dtensor_local
from .groups import bind_layout_
from .placement import inner_tensor, like, local_tensor
from .tensor import QuantizedTensor

#: the dtypes masters (and so the inner optimizer's state) may have
MASTER_DTYPES = (torch.float32, torch.bfloat16)


def check_master_dtype(master_dtype: torch.dtype) -> None:
    """Refuse a ``master_dtype`` that cannot train (see the note), naming the fix.

    Args:
        master_dtype: the ``MasterWeightOptimizer``'s ``master_dtype``.

    Example:
        >>> check_master_dtype(torch.bfloat16)   # passes; torch.float16 raises ValueError
    """
    if master_dtype == torch.float16:
        raise ValueError(
            "MasterWeightOptimizer: master_dtype=torch.float16 is refused: float16's smallest normal value is 6.1e-5, "
            "so Adam's squared gradients and its eps (1e-8) flush to zero and its update divides 0 by 0: every master "
            "would be NaN after the first step (or at the first state_dict()). Fix: master_dtype=torch.bfloat16 (the "
            "same 2 bytes, float32's range) or torch.float32 (the default)")
    if master_dtype not in MASTER_DTYPES:
        raise ValueError(f"MasterWeightOptimizer: master_dtype={master_dtype} is not a floating dtype for "
                         f"master weights; use one of {MASTER_DTYPES} (torch.float32 unless memory is short)")


def first_optimizers_master(p: torch.Tensor, local: QuantizedTensor) -> torch.Tensor | None:
    """This rank's part of the master another live ``MasterWeightOptimizer`` keeps for the FP8
    parameter ``p`` (see the note), or ``None``: a master laid out like ``p`` as it is, a full one
    (built before ``fully_shard``) sliced as ``p`` is; ``None`` where there is none, or it is laid
    out otherwise (the new masters then start from the FP8 bytes).

    Args:
        p: the FP8 parameter (a DTensor after ``fully_shard``).
        local: its local :class:`QuantizedTensor`.

    Example:
        >>> first_optimizers_master(model.w1.weight, model.w1.weight.to_local())
    """
    master = local.param_state.links.master_tensor()
    if master is None:
        return None
    if (isinstance(master, DTensor) and isinstance(p, DTensor) and tuple(master.placements) == tuple(p.placements)
            and master.device_mesh == p.device_mesh):
        return dtensor_local(master).detach()
    if isinstance(master, DTensor) or tuple(master.shape) != tuple(p.shape):
        return None
    if isinstance(p, DTensor):
        return distribute_tensor(master.detach(), p.device_mesh, p.placements, src_data_rank=None).to_local()
    return master.detach()


def master_and_inner(p: torch.Tensor, master_dtype: torch.dtype) -> tuple:
    """``(master, inner)``: the master (an ``nn.Parameter``) a ``MasterWeightOptimizer`` keeps for
    the parameter ``p`` (``None`` unless ``p`` is FP8) and what its inner optimizer steps for ``p`` (``placement.inner_tensor`` of the master,
    else of ``p``), after binding ``p``'s layout to its mesh (``groups.bind_layout_``). The master starts
    from the weight's kept high-precision init values (taken from it), else from the master of an
    optimizer that owned it before (see the note), else from its FP8 values.

    Args:
        p: a parameter of the optimizer's groups.
        master_dtype: the optimizer's ``master_dtype``.

    Example:
        >>> master, inner = master_and_inner(model.w1.weight, torch.float32)
    """
    bind_layout_(p)
    local = dtensor_local(p)  # itself, not an alias: its hp_init is taken
    master = None
    if isinstance(local, QuantizedTensor):
        kept = first_optimizers_master(p, local)
        init = local.take_hp_init()
        if init is not None:
            master_local = own_tensor(init.to(device=local.device, dtype=master_dtype), init)
        elif kept is not None and kept.shape == local.shape:
            # a second optimizer: the first one's masters, not their FP8 rounding
            master_local = kept.to(dtype=master_dtype, copy=True)
        else:
            master_local = local.dequantize(master_dtype)
        master = nn.Parameter(like(p, master_local), requires_grad=p.requires_grad)
    return master, inner_tensor(p if master is None else master)


def own_tensor(master: torch.Tensor, init: torch.Tensor) -> torch.Tensor:
    """``master`` (``init`` converted) as a contiguous tensor of its own: ``init`` itself when it
    already is one (a meta-built shard's values become the master without a copy), else a copy
    (a view into a larger buffer, e.g. a CPU copy of the whole weight, would keep it alive).

    Args:
        master: ``init`` converted to the master's device and dtype (possibly ``init`` itself).
        init: the weight's kept high-precision init values.

    Example:
        >>> master_local = own_tensor(init.to(dtype=torch.float32), init)
    """
    if master.data_ptr() == init.data_ptr() and (
            not master.is_contiguous() or master.untyped_storage().nbytes() != master.numel() * master.element_size()):
        return master.clone(memory_format=torch.contiguous_format)
    return master.contiguous()


class Ownership:
    """One optimizer's claim on its masters (each master refers to it): which of its weights a
    later optimizer took over (FQNs), so a check of it costs one attribute read per step."""

    def __init__(self):
        self.taken_over: list[str] = []


#: the attribute of a master naming its optimizer's :class:`Ownership`
_OWNERSHIP = "_dtensor_fp8_ownership"


def take_masters_over(masters: dict, fqns: dict) -> Ownership:
    """Link each weight's owner record to its new master (``FP8ParamState.links.link_master_``) and mark
    the optimizer that owned the previous master as taken over (see the note). Called once the
    new optimizer is built, so a refused construction changes no link.

    Args:
        masters: ``{FP8 parameter: its new master}``.
        fqns: parameter -> FQN, for the old optimizer's message.

    Returns:
        The new optimizer's :class:`Ownership`.

    Example:
        >>> ownership = take_masters_over({weight: master}, {weight: "w1.weight"})
    """
    mine = Ownership()
    for p, master in masters.items():
        record = local_tensor(p).param_state.links
        old = record.master_tensor()
        previous = getattr(old, _OWNERSHIP, None) if old is not None else None
        if previous is not None and previous is not mine:
            previous.taken_over.append(fqns.get(p, "<parameter>"))
        setattr(master, _OWNERSHIP, mine)
        record.link_master_(master)
    return mine


def check_masters_linked(ownership: Ownership | None, what: str) -> None:
    """Refuse to act for an optimizer once a later optimizer over the same weights took over their
    masters (see the note): stepping it would requantize its stale masters over the weights the
    newer one trains. Nothing is changed.

    Args:
        ownership: the optimizer's :class:`Ownership` (None while it is being built).
        what: the call refused, for the message.

    Example:
        >>> check_masters_linked(ownership, "step")   # RuntimeError after a second optimizer
    """
    stale = ownership.taken_over if ownership is not None else []
    if stale:
        more = f" and {len(stale) - 1} more FP8 weight(s)" if len(stale) > 1 else ""
        raise RuntimeError(
            f"MasterWeightOptimizer.{what}: a later MasterWeightOptimizer was built over {stale[0]}{more} "
            "and took over their masters (it started from this one's values); this optimizer's masters are stale, "
            "and stepping them would write them over the weights the newer optimizer trains. Fix: use the newer "
            "optimizer only (del this one): one MasterWeightOptimizer per model. Nothing was changed.")


__all__ = ["MASTER_DTYPES", "Ownership", "check_master_dtype", "first_optimizers_master",
           "master_and_inner", "own_tensor", "take_masters_over", "check_masters_linked"]
