"""Turning a model's ``nn.Linear`` weights into FP8 parameters, materialized or on the meta device.

[Note: building a model larger than one rank]
torchtitan's flow builds the model on the meta device, shards it, then materializes and
initializes each rank's shard only. ``quantize_module_`` accepts meta weights: it makes FP8
parameters whose planes have a shape and no bytes, plus room for the high-precision values the
user's init will write (the tensor's values plane, ``QuantizedTensor.hp_init``; the owner record
marks the bytes pending: ``FP8ParamState.lifecycle``, ``lifecycle.py``). ``fully_shard`` cuts the FP8 planes and
the values plane alike into block-aligned shards, ``model.to_empty(device=...)`` allocates each rank's, the
user's init (``reset_parameters()``, ``nn.init.*``, ``weight.copy_(...)``) writes the values
(``ops/init.py``), and :func:`finish_init_` (called by :class:`MasterWeightOptimizer`) quantizes
them: blocks inside a shard from the shard alone, per-tensor scales from the global amax (one
all-reduce for all weights). The optimizer's masters then start from those values, not from their
FP8 rounding, and the values are dropped from the shard. No rank ever holds more than its shards
and one weight's transient.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from . import groups
from .agreement import gather_findings
from .formats.base import Recipe, RecipeError, as_matrix_shape
from .formats.experts import per_expert
from .lifecycle import BytesState
from ._compat import dtensor_local
from .placement import local_tensor
from .quantize import quantize
from .requantize import AmaxReduction
from .param_writes import CheckedToEmpty
from .state_dict import register_state_dict_hooks
from .tensor import QuantizedTensor


def quantize_module_(
    module: nn.Module,
    recipe: Recipe,
    *,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    keep_hp_init: bool = True,
    experts: Callable[[nn.Module, str], Iterable[str]] | None = None,
) -> nn.Module:
    """Replace the weights of ``nn.Linear`` layers by FP8 parameters, in place, all or nothing.

    Call it before ``fully_shard``, on a model built on the meta device (its FP8 bytes are made by
    the optimizer from your init, see the note) or on an initialized one (quantized now).

    Every selected layer is checked first — a weight shape the recipe can represent, a floating
    dtype, no NaN or Inf, not tied to another module's parameter, not already FP8 in another recipe
    — and if any fails, a :class:`RecipeError` lists every failing layer and nothing is converted;
    otherwise all are converted. Weights already FP8 in ``recipe`` are left as they are.

    Args:
        module: the model.
        recipe: ``DelayedScaling()``, ``CurrentScaling()``, ``MXFP8()`` or ``Blockwise()``.
        filter_fn: ``(linear_module, fqn) -> bool``; only layers it accepts are converted.
            Default: every ``nn.Linear`` (use a filter to keep layers the recipe cannot represent,
            or that should stay precise, e.g. an output head, in high precision).
        keep_hp_init: an initialized model: keep a CPU copy of each high-precision weight for the
            masters (sharded with the weight; the optimizer takes it). A meta model always keeps
            its values (they are what the FP8 bytes are made from).
        experts: ``(module, fqn) -> names`` of the module's own 3-D MoE expert weights
            ``[experts, out, in]`` to convert too, each quantized per expert
            (``formats/experts.py``: ``per_expert(recipe, shape)``), e.g.
            ``lambda m, fqn: ("w1", "w2", "w3") if type(m).__name__ == "GroupedExperts" else ()``.
            ``filter_fn`` selects ``nn.Linear`` layers only; ``filter_fn=lambda m, fqn: False``
            converts the experts alone.

    Returns:
        ``module``.

    Example:
        >>> with torch.device("meta"):
        ...     model = Transformer(args)
        >>> dtensor_fp8.quantize_module_(model, dtensor_fp8.MXFP8(), filter_fn=lambda m, fqn: fqn != "head")
        >>> for block in model.layers: fully_shard(block)
        >>> fully_shard(model)
        >>> model.to_empty(device="cuda"); model.init_weights()
        >>> opt = dtensor_fp8.MasterWeightOptimizer(model, torch.optim.AdamW, lr=3e-4)
    """
    places = _parameter_places(module)
    targets, problems, selected = [], [], 0
    for fqn, sub in module.named_modules():
        wanted = []
        if isinstance(sub, nn.Linear) and (filter_fn is None or filter_fn(sub, fqn)):
            wanted.append(("weight", recipe))
        for attr in (() if experts is None else experts(sub, fqn)):
            weight = getattr(sub, attr, None)
            if not isinstance(weight, nn.Parameter):
                raise RecipeError(f"quantize_module_: experts named {attr!r} of {fqn or 'the model'} "
                                  f"({type(sub).__name__}), which is not a parameter of that module; name its own "
                                  "3-D expert weights")
            try:  # each expert's matrix is a weight of its own (formats/experts.py)
                wanted.append((attr, per_expert(recipe, weight.shape)))
            except RecipeError as err:
                wanted.append((attr, err))
        for attr, target_recipe in wanted:
            name = f"{fqn}.{attr}" if fqn else attr
            selected += 1
            if isinstance(target_recipe, RecipeError):
                problems.append(f"{name}: {target_recipe}")
                continue
            weight = getattr(sub, attr)
            current = local_tensor(weight)
            if isinstance(current, QuantizedTensor):
                if current.recipe != target_recipe:
                    problems.append(
                        f"{name} is already an FP8 parameter in {current.recipe!r}: switch recipes through high "
                        "precision (hp = dtensor_fp8.export_hp_state_dict(model, torch.float32, optimizer=opt); build "
                        f"the model anew, quantize_module_(new_model, {recipe!r}); dtensor_fp8.load_hp_state_dict("
                        "new_model, hp, optimizer=new_opt))")
                continue
            problem = _why_not_quantizable(name, weight, target_recipe, places.get(id(weight), [name]))
            if problem:
                problems.append(problem)
            else:
                targets.append((sub, attr, target_recipe))
    if problems:
        raise RecipeError(
            f"quantize_module_: nothing was converted; {len(problems)} of {selected} selected weights cannot be "
            "quantized with "
            f"{recipe!r}:\n  " + "\n  ".join(problems) +
            "\nFix those weights, or leave their layers out with filter_fn=lambda module, fqn: ... (they then stay "
            "in high precision)."
        )
    converted = [(sub, attr, fp8_parameter_values(getattr(sub, attr).detach(), r, keep_hp_init))
                 for sub, attr, r in targets]
    for sub, attr, q in converted:  # nothing can fail from here on
        setattr(sub, attr, nn.Parameter(q, requires_grad=getattr(sub, attr).requires_grad))
        q.param_state.links.set_home_(sub, attr)  # where writes find its DTensor (groups.py)
    for sub in {id(sub): sub for sub, _, _ in converted}.values():  # once per module (experts: several weights)
        register_state_dict_hooks(sub)
    if converted:
        # The model's to_empty checks every FP8 weight before emptying anything (torch's empties
        # module by module; see param_writes.CheckedToEmpty).
        module.to_empty = CheckedToEmpty(module)
    return module


def fp8_parameter_values(weight: torch.Tensor, recipe: Recipe, keep_hp_init: bool = True,
                         dtype: torch.dtype | None = None) -> QuantizedTensor:
    """The FP8 parameter for a high-precision ``weight``: on the meta device, planes without bytes
    and room for the init values (see the note); elsewhere quantized now, with a CPU copy of
    ``weight`` for the masters when ``keep_hp_init``.

    Args:
        weight: the 2-D weight (meta or materialized).
        recipe: its recipe.
        keep_hp_init: keep the high-precision values for the masters (always, on meta).
        dtype: the nominal dtype on meta (default: ``weight``'s).

    Example:
        >>> q = fp8_parameter_values(torch.empty(256, 512, device="meta"), dtensor_fp8.MXFP8())
        >>> q.bytes_pending
        True
    """
    if not weight.is_meta:
        q = quantize(weight, recipe)
        return q.rebuild(hp_init=weight.to("cpu", copy=True) if keep_hp_init else None)
    shape = tuple(weight.shape)
    # the planes are the matrix of the weight (leading dims flattened: tensor.py's note)
    planes = recipe.empty_planes(as_matrix_shape(shape), ("rowwise", "columnwise"), weight.device)
    hp = torch.empty(shape, dtype=dtype or weight.dtype, device=weight.device)
    q = QuantizedTensor.from_planes(planes, recipe, shape, hp.dtype, hp_init=hp)
    q.param_state.lifecycle.mark_built_on_meta()  # its init writes hp_init; finish_init_ makes the bytes
    return q


def _parameter_places(module: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> every FQN it is reachable under (more than one: a tied parameter)."""
    places: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        places.setdefault(id(p), []).append(name)
    return places


def _why_not_quantizable(name: str, weight: torch.Tensor, recipe: Recipe, places: list[str]) -> str | None:
    """Why ``weight`` cannot become an FP8 parameter of ``recipe`` (``None``: it can)."""
    shape = tuple(weight.shape)
    if isinstance(weight, DTensor):
        return (f"{name} {shape} is already a DTensor ({tuple(weight.placements)} on {weight.device_mesh}): "
                "fully_shard or parallelize_module ran before quantize_module_, and an FP8 parameter must be in place "
                "before its weight is sharded (FSDP2 keeps its own record of each parameter). Fix: call "
                "quantize_module_ before fully_shard (and dtensor_fp8.parallelize_module after it, for tensor "
                "parallelism)")
    if len(places) > 1:
        return (f"{name} {shape} is tied: the same parameter is also {', '.join(p for p in places if p != name)}. "
                "One FP8 parameter cannot serve an embedding lookup or a second layer's own weight; leave this layer "
                "out (filter_fn) to keep the tie in high precision, or untie the weights first")
    if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"{name} {shape} has dtype {weight.dtype}; FP8 parameters are made from fp32 / bf16 / fp16 weights"
    try:
        recipe.check_shape(shape)
    except RecipeError as err:
        return f"{name}: {err}"
    if weight.is_meta:
        return None
    finite = torch.isfinite(weight.detach())
    if not bool(finite.all()):
        nan = int(torch.isnan(weight.detach()).sum())
        return (f"{name} {shape} holds {nan} NaN and {int((~finite).sum()) - nan} infinite values: FP8 cannot store "
                "them faithfully (a NaN poisons its block or tensor; an Inf saturates to the FP8 maximum); fix the init")
    return None


def _refuse_nonfinite_init(pending: list) -> None:
    """Raise on every rank of the weights' meshes if any rank's shard of a pending weight holds NaN
    or Inf (a NaN in one rank's shard: the others would otherwise wait in the amax reduction and
    see only "connection closed"); one flag all-reduced per mesh group, names gathered only then."""
    bad = [f"{name} {tuple(p.shape)}" for name, p, q in pending if not bool(torch.isfinite(q.hp_init).all())]
    mesh = groups.mesh_groups([p for _, p, _ in pending])
    device = pending[0][2].hp_init.device if pending else torch.device("cpu")
    if mesh and bool(groups.max_over_(torch.tensor([float(bool(bad))], device=device), mesh).item()):
        bad = sorted(gather_findings(bad, mesh))
    if bad:
        raise RecipeError(
            f"finish_init_: {', '.join(bad[:8])}{' ...' if len(bad) > 8 else ''} hold(s) NaN or Inf after your init (on "
            "this rank's shard or another rank's): FP8 cannot store them faithfully. Fix the init (or the pretrained "
            "values written into the weight); nothing was made: the weights still wait for their bytes")


@torch.no_grad()
def finish_init_(model: nn.Module) -> list[str]:
    """Make the FP8 bytes of every weight built on the meta device from the values your init
    wrote (see the note); a no-op for weights whose bytes are made. Call it on every rank (a
    per-tensor recipe's scale needs the amax over all shards: one all-reduce per mesh group that
    shards such weights, for all of them).
    :class:`MasterWeightOptimizer` calls it; call it yourself only to run a model without one.

    The bytes equal ``quantize(full_weight, recipe)``'s: blocks inside a shard from the shard,
    per-tensor scales from the global amax. Each weight keeps its values (``hp_init``) for the
    masters until an optimizer takes them.

    Args:
        model: the model (sharded or not), after ``to_empty`` and your init.

    Returns:
        The FQNs of the weights whose bytes were made.

    Example:
        >>> model.to_empty(device="cuda"); model.init_weights()
        >>> dtensor_fp8.finish_init_(model)      # or build the MasterWeightOptimizer
    """
    # The local tensors themselves (DTensor.to_local() would hand out aliases): their lifecycle moves.
    locals_ = [(name, p, dtensor_local(p)) for name, p in model.named_parameters()]
    pending = [(name, p, q) for name, p, q in locals_ if isinstance(q, QuantizedTensor) and q.bytes_pending]
    unwritten = [f"{name} {tuple(p.shape)} ({q.recipe.name})" for name, p, q in pending
                 if q.param_state.lifecycle.bytes_state is BytesState.ALLOCATED]
    if unwritten:
        raise RecipeError(
            f"finish_init_: {len(unwritten)} FP8 weight(s) built on the meta device were never written after "
            f"model.to_empty(...): {', '.join(unwritten[:8])}{' ...' if len(unwritten) > 8 else ''}. They would train "
            "from all-zero values. Fix: initialize them in your init (module.reset_parameters(), torch.nn.init.*, "
            "weight.copy_(values)) or load them (dtensor_fp8.load_hp_checkpoint / load_hp_state_dict) before building "
            "the optimizer or calling finish_init_")
    for name, _, q in pending:
        if q.is_meta or q.hp_init.is_meta:
            raise RecipeError(f"finish_init_: {name} is still on the meta device; call model.to_empty(device=...) "
                              "and initialize the weights first")
    _refuse_nonfinite_init(pending)
    # Per-block amaxes; those of blocks spanning a sharded dim (per-tensor scales) or split between
    # shards are reduced over the mesh dims sharding them (requantize.AmaxReduction, groups.py), one
    # all-reduce per group for all weights.
    jobs = []
    for name, p, q in pending:
        groups.bind_layout_(p)
        jobs += [(p, q, usage) for usage in q.planes]
    amaxes = AmaxReduction(jobs).amaxes([q.hp_init for _, q, _ in jobs])
    for (_, q, usage), amax in zip(jobs, amaxes, strict=True):
        plane = q.planes[usage]
        fresh = q.recipe.quantize_plane_at(q.hp_init.reshape(plane.data.shape), usage, q.phase, amax=amax)
        plane.data.copy_(fresh.data)
        plane.scale_inv.copy_(fresh.scale_inv)
    for _, _, q in pending:
        q.param_state.scaling.reset_()  # states made before the bytes (on meta) start again from them
        q.param_state.lifecycle.mark_made()
    return [name for name, _, _ in pending]
