"""Writing new high-precision values into FP8 weights: the one path every value write takes.

[Note: every value write goes through the owner]
An FP8 weight's values are written by ``weight.copy_(values)`` (a user's init, a pretrained
weight copied in), by ``load_hp_state_dict`` / ``load_hp_checkpoint``, and by the init of a weight
built on the meta device. Each write must give what quantizing the full high-precision tensor
gives, and must leave the optimizer's master equal to the written values; two decisions that
belong to the weight's owner record (``FP8ParamState``, ``param_state.py``), made here and only
here (:func:`write_hp_values_`):

* **scale scope**: a scaling block that spans a sharded dim (a per-tensor scale under FSDP2 or
  TP) takes the amax over the weight's groups (``groups.weight_groups``, from the DTensor's mesh:
  the record's ``layout``, bound from the parameter itself, or from its ``home`` module when the
  write reaches the local shard only, as ``copy_`` into a DTensor does). Each shard quantizing with
  its own amax would read half the gathered weight with the wrong scale. A stateful recipe
  (delayed scaling) starts a new weight scaling state from the written values, as ``quantize()``
  of them would, written into the record's existing tensors (checkpoint plans and captured
  requantization graphs refer to them).
* **master sync**: once a :class:`~dtensor_fp8.MasterWeightOptimizer` exists, the record holds a
  weak reference to the weight's master (``FP8ParamState.links.master``); the write copies the values
  into it, so the next step continues from them instead of requantizing the old master over
  them. Before the optimizer, the values are kept for the masters to start from (``hp_init``).
* a load of FP8 bytes (``model.load_state_dict`` of a checkpoint's entry, ``ops/copies.py``) marks
  the record's lifecycle (``LoadedSinceStep.BYTES``, ``lifecycle.py``): at the next step the master
  takes the loaded bytes' values (:func:`masters_follow_loaded_bytes_`), unless the optimizer's own
  state was loaded since the last step too (``MASTER``, in either order: torch's ``set_state_dict`` loads the
  optimizer first), where the saved master, more precise than its FP8 rounding, stands.
* a meta-built weight whose bytes are still pending takes the values as its init (``hp_init``);
  ``finish_init_`` (the optimizer calls it) makes the bytes, with the same scale scope.

A write is collective where a block spans ranks (one MAX all-reduce per group, for all weights
written together): every rank of the weight's mesh writes it, as for any DTensor op.
Writes that cannot be honored are refused with the fix: a write into a part of a weight whose
master covers more (a slice), and ``to_empty`` of a model whose optimizer exists (``ops/copies.py``:
it would leave FP8 planes and masters disagreeing, or zeroed silently).
"""

from __future__ import annotations

import torch

from ._compat import dtensor_local
from .formats.base import RecipeError
from .groups import max_over_, mesh_groups
from .placement import local_tensor
from .requantize import requantize_from_hp_
from .tensor import QuantizedTensor


@torch.no_grad()
def write_hp_values_(items) -> None:
    """Write high-precision values into FP8 weights through their owner records (see the note):
    the bytes are those of quantizing the full tensor (amaxes over each weight's groups), a
    stateful recipe's weight scaling state starts from the values, and each weight's linked master
    (or, before an optimizer exists, its kept init values) takes them.

    Args:
        items: ``(name, weight, values)``: ``weight`` a DTensor FP8 parameter or its local
            :class:`QuantizedTensor`; ``values`` this rank's high-precision values of it (its
            local shape); ``name`` for messages (``None``: the weight's shape names it).

    Example:
        >>> write_hp_values_([("layers.0.w1.weight", model.layers[0].w1.weight, shard_values)])
    """
    made = []
    for name, weight, values in items:
        q = local_tensor(weight)
        values = values.reshape(q.shape)
        if q.bytes_pending:  # a meta-built weight's init: finish_init_ makes its bytes
            q.hp_init.copy_(values)
            q.param_state.lifecycle.mark_init_written()
            continue
        _check_master_covers(name, q)
        made.append((name or f"weight {tuple(q.shape)}", weight, values.to(q.device, torch.float32)))
    if not made:
        return
    # A new weight scaling state from the values (delayed scaling), into the record's own tensors.
    records = [local_tensor(w).param_state for _, w, _ in made]
    kept = {id(r): {u: dict(s) for u, s in r.scaling.weight.items()} for r in records}
    for record in records:
        record.scaling.weight.clear()
    requantize_from_hp_(made)
    for (_, w, values), record in zip(made, records, strict=True):
        q = local_tensor(w)
        for usage, old in kept[id(record)].items():
            for key, value in old.items():
                value.copy_(record.scaling.weight[usage][key])
            record.scaling.weight[usage] = old
        master = record.links.master_tensor()
        if master is not None:
            local_tensor(master).copy_(values)
            record.lifecycle.reset_loaded()
        if q.hp_init is not None:  # no optimizer yet: the masters start from the written values
            q.hp_init.copy_(values)


def to_empty_refusal(recipe_name: str, shape) -> RecipeError:
    """The refusal of ``to_empty`` of an FP8 weight whose optimizer exists (see the note)."""
    return RecipeError(
        f"{recipe_name}: to_empty (empty_like) of an FP8 weight of shape {tuple(shape)} whose MasterWeightOptimizer "
        "exists: it would replace the weight's FP8 bytes with zeros while its master kept the old values. Fix: call "
        "model.to_empty(device=...) and initialize the weights before building the MasterWeightOptimizer; to load "
        "new values into a trained model, use weight.copy_(values) or dtensor_fp8.load_hp_state_dict / "
        "load_checkpoint (the masters follow)")


class CheckedToEmpty:
    """A model's ``to_empty(device=...)`` that checks first: refused, with nothing emptied, if an
    FP8 weight of the model has an optimizer master (torch's ``to_empty`` empties module by
    module, so the refusal at the first such weight came after the modules before it were
    emptied). ``quantize_module_`` sets it as the quantized model's ``to_empty``; an object rather
    than a bound method, so a deep copy or a pickle of the model carries it, bound to the copy.

    Args:
        module: the model.

    Example:
        >>> model.to_empty(device="cuda")   # RecipeError once a MasterWeightOptimizer exists
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(self, *, device, recurse: bool = True) -> torch.nn.Module:
        module = self.module
        for p in (module.parameters() if recurse else module.parameters(recurse=False)):
            q = local_tensor(p)
            if isinstance(q, QuantizedTensor) and q.param_state.links.master_tensor() is not None:
                raise to_empty_refusal(q.recipe.name, p.shape)
        return type(module).to_empty(module, device=device, recurse=recurse)


def check_copy_source(dst: QuantizedTensor, src: torch.Tensor) -> torch.Tensor:
    """``src`` as the values of ``dst.copy_(src)``, by torch's rules for ``copy_``, and the
    library's for values: broadcast to ``dst``'s shape where torch would (a ``(256,)`` row into a
    ``(256, 256)`` weight), refused with torch's error where it would not (a ``(128, 512)`` source
    is not reshaped into a ``(256, 256)`` weight), and refused if any value is NaN or Inf on any
    rank holding the weight (a NaN would turn its block to 0x7F, and the master with it). Checked
    before anything is written; the non-finite decision is all-reduced over the weight's mesh
    groups, so every rank of a sharded weight raises alike (none waits in the write's amax
    reduction).

    Args:
        dst: the FP8 weight (this rank's local tensor).
        src: the high-precision source (this rank's part, as ``copy_`` into a DTensor passes it).

    Example:
        >>> weight.copy_(torch.randn(256))   # broadcast over the rows, as plain torch does
    """
    shape, given = tuple(dst.shape), tuple(src.shape)
    if given != shape:
        try:
            fits = torch.broadcast_shapes(given, shape) == torch.Size(shape)
        except RuntimeError:
            fits = False
        if not fits:
            raise RuntimeError(
                f"copy_: a source of shape {given} cannot be copied into an FP8 weight of shape {shape} "
                f"({dst.recipe.name}): the source must be broadcastable to the weight's shape, as torch's copy_ "
                "requires (nothing is reshaped). Fix: pass values of the weight's shape (under FSDP2 / TP: the "
                "DTensor, or distribute_tensor(full, weight.device_mesh, weight.placements)). Nothing was written.")
        src = src.expand(shape).contiguous()  # (kernels read dense rows)
    if dst.bytes_pending:  # a meta-built weight's init: finish_init_ checks its values with its bytes
        return src
    flag = (~torch.isfinite(src)).any().float().reshape(1).to(dst.device) if src.is_floating_point() \
        else torch.zeros(1, device=dst.device)
    if bool(max_over_(flag, mesh_groups([dst])).item()):
        raise FloatingPointError(
            f"copy_: the values copied into an FP8 weight of shape {shape} ({dst.recipe.name}) hold NaN or Inf (on "
            "this rank or another holding the weight): as FP8 bytes and master they would poison training (a NaN "
            "turns its block or tensor to 0x7F), so they are refused. Fix: repair the values (e.g. "
            "torch.nan_to_num); a checkpoint's weights: dtensor_fp8.load_hp_state_dict(..., allow_nonfinite=True) "
            "loads them anyway. Nothing was written.")
    return src


def _check_master_covers(name, q: QuantizedTensor) -> None:
    master = q.param_state.links.master_tensor()
    if master is not None and tuple(local_tensor(master).shape) != tuple(q.shape):
        raise RecipeError(
            f"{name or 'an FP8 weight'}: a write of {tuple(q.shape)} values into an FP8 weight whose optimizer master "
            f"holds {tuple(local_tensor(master).shape)} on this rank ({q.recipe.name}): a part of the weight (a slice, "
            "or the unsharded weight FSDP gathered) cannot be written without leaving the master behind. Fix: write "
            "the whole parameter (weight.copy_(values) on the model's parameter, values laid out like it), or "
            "dtensor_fp8.load_hp_state_dict(model, {name: values}, strict=False)")


@torch.no_grad()
def masters_follow_loaded_bytes_(masters) -> None:
    """Write each master whose weight's bytes were loaded from a checkpoint entry since
    (``Lifecycle.master_follows_loaded_bytes``: ``model.load_state_dict`` without the optimizer's state after
    it) from those bytes, dequantized: the next step then continues from the loaded weights
    instead of requantizing the old master over them.

    Args:
        masters: ``{FP8 parameter: its master}`` (``MasterWeightOptimizer``'s).

    Example:
        >>> masters_follow_loaded_bytes_(opt._masters)   # at the start of a step
    """
    for p, master in masters.items():
        # The local shard itself: this runs every step, and on torch >= 2.13 ``to_local()`` of a
        # parameter makes a new view (a QuantizedTensor rebuilt through dispatch) each call.
        local = dtensor_local(p)
        record = local.param_state
        if record.lifecycle.master_follows_loaded_bytes:
            target = dtensor_local(master)
            target.copy_(local.dequantize(target.dtype))
        record.lifecycle.reset_loaded()


def master_loaded_(masters) -> None:
    """The optimizer's own masters were just loaded (``MasterWeightOptimizer.load_state_dict``):
    bytes loaded in the same resume, before or after, came with them and do not overwrite them."""
    for p in masters:
        local_tensor(p).param_state.lifecycle.mark_master_loaded()


__all__ = ["write_hp_values_", "check_copy_source", "CheckedToEmpty", "to_empty_refusal", "masters_follow_loaded_bytes_", "master_loaded_"]
