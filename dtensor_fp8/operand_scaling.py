"""Delayed scaling's GEMM operand update: once per step, reduced over each weight's own groups.

[Note: when operand amaxes are reduced and scales updated]
A delayed-scaling FP8 GEMM casts its activation (or output gradient) with the scale its history
gave so far (before the first update: a power of two from the tensor's own amax, see
``formats/per_tensor.py``) and records the local amax in ``history[0]`` (a running max). Transformer Engine then
reduces the recorded amaxes over its amax reduction group and rolls the histories once per
autocast region. Here that happens once per optimizer step (``MasterWeightOptimizer.step`` calls
:func:`update_operand_scaling_` before requantizing), or whenever the caller asks:

* no collective runs inside a forward or backward: under pipeline parallelism a stage's forward
  cannot wait on ranks of another stage, and a blocking all-reduce per GEMM costs latency;
* the reduction is over the weight's mesh (``groups.mesh_groups``), one all-reduce per group for
  all weights, so every rank holding a weight keeps the same history (a checkpoint saves one
  copy; a resume at another world size continues bit-identically);
* a recompute under activation checkpointing casts with the same scale (nothing was updated in
  between) and records the same amax again, which the running max leaves unchanged;
* micro-batches of one step (gradient accumulation) share one scale and record their max.

The arithmetic (which tensor is the recorded amax, TE's update rule) is the recipe's
(``Recipe.recorded_operand_amax`` / ``update_operand_states_``); this module only collects,
reduces and dispatches.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import nn

from . import groups
from ._compat import dtensor_local
from .entry import OPERANDS
from .tensor import QuantizedTensor


@functools.lru_cache(maxsize=256)
def operands_keep_state(recipe) -> bool:
    """Whether the FP8 GEMMs of a weight of ``recipe`` keep operand scaling state (asked of its
    GEMM recipe's operand recipes, ``Recipe.keeps_operand_state``). A recipe is a frozen value, so
    the answer is kept: the update below asks it of every weight at every step, and building the
    GEMM recipe to ask costs more than the rest of the walk.

    Example:
        >>> operands_keep_state(dtensor_fp8.CurrentScaling()), operands_keep_state(dtensor_fp8.DelayedScaling())
        (False, True)
    """
    gemm = recipe.gemm_recipe()
    return gemm is not None and (gemm.input.keeps_operand_state or gemm.grad.keeps_operand_state)


@torch.no_grad()
def update_operand_scaling_(params: nn.Module | Iterable[torch.Tensor]) -> int:
    """Reduce the GEMM operand amaxes recorded since the last update over each weight's mesh groups
    and update delayed scaling's histories and scales (see the note). Call it on every rank that
    holds the parameters, once per step; :class:`MasterWeightOptimizer` does.

    Args:
        params: a model, or its parameters (DTensors under FSDP2 / TP, or plain tensors).

    Returns:
        How many operand states were updated (0 for recipes without operand state).

    Example:
        >>> loss = model(x).sum(); loss.backward()     # FP8 GEMMs record their amaxes
        >>> dtensor_fp8.update_operand_scaling_(model)  # without a MasterWeightOptimizer
    """
    if isinstance(params, nn.Module):
        params = params.parameters()
    entries = []  # (recipe, state, groups)
    for p in params:
        # The local shard itself (not ``to_local()``, which on torch >= 2.13 makes a new view of a
        # parameter each call); a weight whose recipe keeps no operand state has nothing to update.
        q = dtensor_local(p)
        if not isinstance(q, QuantizedTensor) or not operands_keep_state(q.recipe):
            continue
        groups.bind_layout_(p)
        # Created if absent, so that every rank updates the same set (a rank's GEMMs may not have run).
        states = q.param_state.scaling.ensure_operand_states(q.recipe, q.device)
        gemm = q.recipe.gemm_recipe()
        over = groups.mesh_groups([p])
        for name, operand in zip(OPERANDS, (gemm.input, gemm.grad)):
            if name in states:
                entries.append((operand, states[name], over))
    recorded = [(i, amax) for i, (operand, state, _) in enumerate(entries)
                if (amax := operand.recorded_operand_amax(state)) is not None]
    if not recorded:
        return 0
    reduced = groups.max_by_groups_([amax for _, amax in recorded], [entries[i][2] for i, _ in recorded])
    torch._foreach_copy_([amax for _, amax in recorded], reduced)
    by_recipe: dict = {}
    for i, _ in recorded:
        operand, state, _ = entries[i]
        by_recipe.setdefault(operand, []).append(state)
    for operand, states in by_recipe.items():
        operand.update_operand_states_(states)
    return len(recorded)
