"""In-place initialization of an FP8 weight built on the meta device (``reset_parameters()``,
``nn.init.trunc_normal_``, ``weight.copy_(...)`` in a user's ``init_weights``).

[Note: initializing a weight whose bytes are pending]
``quantize_module_`` on a meta model makes FP8 parameters with planes but no bytes; FSDP2 shards
them and ``to_empty`` allocates each rank's shard, with room for the high-precision values the
user's init then writes (``QuantizedTensor.hp_init``). The in-place ops of ``torch.nn.init``
(``uniform_``, ``normal_``, ``erfinv_``, ``mul_``, ``add_``, ``clamp_``, ``fill_``, ``zero_``)
land here and run on those values; so does every other op an init runs on the weight (the
comparisons and ``torch.where`` of ``trunc_normal_``'s rejection sampling): while its bytes are
pending a weight is its values, and those ops return plain tensors. DTensor's random ops on a
sharded weight reach them with its RNG offsets for the shard, exactly as for a plain parameter. ``finish_init_`` (called by
``MasterWeightOptimizer``) quantizes the values once the init is over, with the global amax where
a scaling block spans ranks. On a weight whose bytes are made these ops raise: FP8 bytes are
never rewritten by an elementwise op on values they no longer hold.
"""

from __future__ import annotations

import torch

from ..formats.base import RecipeError
from torch.utils._pytree import tree_map_only

from ..op_table import QUANTIZED_OPS
from ..tensor import QuantizedTensor

aten = torch.ops.aten

#: The in-place ops ``torch.nn.init``'s functions issue, run on the pending values.
INIT_OPS = [
    aten.uniform_.default, aten.normal_.default, aten.erfinv_.default, aten.exponential_.default,
    aten.mul_.Tensor, aten.mul_.Scalar, aten.add_.Tensor, aten.add_.Scalar, aten.sub_.Tensor, aten.sub_.Scalar,
    aten.div_.Tensor, aten.div_.Scalar, aten.clamp_.default, aten.clamp_.Tensor, aten.clamp_min_.default,
    aten.clamp_max_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default,
]


def _values(arg):
    if isinstance(arg, QuantizedTensor):
        if not arg.bytes_pending:
            raise RecipeError(f"{arg.recipe.name}: an FP8 weight whose bytes are made is an operand of an in-place init op")
        return arg.hp_init
    return arg


@QUANTIZED_OPS.implements(INIT_OPS)
def _init_in_place(func, args, kwargs):
    q = args[0]
    if not q.bytes_pending:
        raise RecipeError(
            f"{q.recipe.name}: {func} on an FP8 weight of shape {tuple(q.shape)} whose FP8 bytes are already made: "
            "an in-place op cannot rewrite FP8 bytes faithfully. Initialize weights before quantize_module_ "
            "(or build the model on the meta device, quantize_module_, fully_shard, to_empty, then init), or load "
            "new values with dtensor_fp8.load_hp_state_dict.")
    func(q.hp_init, *[_values(a) for a in args[1:]], **kwargs)
    q.param_state.lifecycle.mark_init_written()
    return q


def _pending_values(func, args, kwargs):
    """Any other op on weights whose bytes are pending: run on their values (plain results)."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, QuantizedTensor)]
    # Only after ``to_empty``: on the meta device an op without an implementation is a sharding or
    # parallelization step, whose plain result would silently replace the FP8 weight.
    if not tensors or not all(t.bytes_pending and not t.is_meta for t in tensors):
        return NotImplemented
    if func._schema.is_mutable:  # an in-place op of the init writes the values it runs on
        for t in tensors:
            t.param_state.lifecycle.mark_init_written()
    return func(*tree_map_only(QuantizedTensor, lambda t: t.hp_init, args),
                **tree_map_only(QuantizedTensor, lambda t: t.hp_init, kwargs))


QUANTIZED_OPS.set_fallback(_pending_values)
