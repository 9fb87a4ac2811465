"""High-precision values into a model with FP8 weights: read, checked on every rank, then written.

A high-precision load (:func:`load_hp_state_dict`, and ``checkpoint/hp.py``'s
``load_hp_checkpoint`` through the same two steps) first *stages* every value
(:func:`stage_hp_values`: keys, dtypes, global shapes and finiteness agreed across the weights'
ranks) and only then *writes* (:func:`write_staged_hp_values`, the one step that writes: FP8
bytes requantized, masters, scaling state, plain parameters and buffers), so a refused load leaves
the model, its masters and scaling state untouched. The keys and layout are those of
``state_dict.export_hp_state_dict`` (``state_dict.hp_targets`` names what each key writes).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .placement import local_slice, local_tensor
from .param_writes import write_hp_values_
from .agreement import CheckpointError, CheckpointRecipeError, agreement_group, agree_over
from .entry import is_extra_state
from .state_dict import is_fp8, hp_targets
from .tensor import QuantizedTensor


class HPLoadResult(NamedTuple):
    """What :func:`load_hp_state_dict` / :func:`dtensor_fp8.load_hp_checkpoint` left out (both empty
    under ``strict=True``), as ``nn.Module.load_state_dict`` reports it."""

    missing_keys: list[str]  #: the model's entries the source lacks (kept as they were)
    unexpected_keys: list[str]  #: the source's entries the model lacks (not read)


#: what a failed high-precision load left behind (nothing is written before every check passed)
HP_UNTOUCHED = " The model, its masters and scaling state were not modified."


class StagedHP(NamedTuple):
    """A high-precision load, read and checked, not yet written (see :func:`write_staged_hp_values`)."""

    fp8: list  #: (name, FP8 parameter, FP32 local values): requantized
    pending: list  #: (FP8 parameter of a meta-built model, local values): its init values
    masters: list  #: (master, local values)
    plain: list  #: (the local tensor of a parameter or buffer, local values)
    extra: dict  #: key -> a module's extra state


def _shown(keys) -> str:
    keys = list(keys)
    return "[" + ", ".join(repr(k) for k in keys[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "") + "]"


def value_problem(key: str, src, target, where: str = "") -> str | None:
    """Why the high-precision value ``src`` cannot load into ``target`` (the model's tensor at
    ``key``), judged from what every rank sees alike (kind, dtype, global shape); None if it can.
    ``src`` may be a tensor, or the ``(dtype, shape)`` of a checkpoint entry not yet read.

    Example:
        >>> value_problem("0.weight", torch.zeros(3), model[0].weight)   # "entry '0.weight' has shape (3,), ..."
    """
    entry = f"entry {key!r}{where}"
    if is_extra_state(key) or not isinstance(target, torch.Tensor):
        return None  # a module's extra state: its module's set_extra_state judges it
    fp8 = is_fp8(target)
    kind = "FP8 weight" if fp8 else ("parameter" if isinstance(target, nn.Parameter) else "buffer")
    want_dtype = local_tensor(target).dtype
    if isinstance(src, dict) and fp8:
        return (f"{entry} holds an FP8 weight's planes ({', '.join(sorted(map(str, src))[:4])}): a state dict of an FP8 "
                "model (model.state_dict(), save_checkpoint), not high-precision weights. Fix: load it with "
                "model.load_state_dict / dtensor_fp8.load_checkpoint into a model of its recipe; load_hp_state_dict "
                "takes high-precision tensors (export_hp_state_dict makes them)")
    if isinstance(src, torch.Tensor) and src.is_meta:
        return f"{entry} is a meta tensor: it holds no values (a state dict of a model built on the meta device?)"
    if isinstance(src, torch.Tensor):
        dtype, shape = src.dtype, tuple(src.shape)
    elif isinstance(src, tuple) and len(src) == 2 and isinstance(src[0], torch.dtype):
        dtype, shape = src[0], tuple(src[1])
    else:
        return (f"{entry} holds a {type(src).__name__} where the model's {key} is a {kind} "
                f"({want_dtype} {tuple(target.shape)}); a high-precision source holds tensors there")
    floating = fp8 or want_dtype.is_floating_point
    if floating and not dtype.is_floating_point:
        return (f"{entry} is {dtype}, but the model's {key} is a{'n' if fp8 else ''} {kind} {tuple(target.shape)} of "
                f"floating-point values: {dtype} values are not weights, and nothing is converted (the wrong file or "
                "key?). Fix: store it as float32 / bfloat16 / float16")
    if not floating and dtype != want_dtype:
        return f"{entry} is {dtype}, the model's {key} a {want_dtype} {kind}; store it as {want_dtype}"
    if shape != tuple(target.shape):
        return (f"{entry} has shape {shape}, the model's {key} {tuple(target.shape)} (another model's weights? a "
                "sliced or transposed tensor?); nothing is broadcast or sliced to fit. Fix: load the weights of "
                "this model")
    return None


def _local_values(src: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """This rank's values of ``src`` (checked: the target's global shape) laid out like ``target``
    (a collective where a DTensor is redistributed or gathered: every rank calls it alike)."""
    if isinstance(src, DTensor):
        if not isinstance(target, DTensor):
            local = src.full_tensor()
        else:
            if src.device_mesh != target.device_mesh or tuple(src.placements) != tuple(target.placements):
                src = src.redistribute(target.device_mesh, target.placements)
            local = src.to_local()
    else:
        local = local_slice(src, target)
    return local.to(device=local_tensor(target).device)


def nonfinite_problem(local: torch.Tensor, dtypes: list) -> str | None:
    """What makes ``local`` not finite once written as each of ``dtypes`` (NaN / Inf, or values
    beyond a narrower dtype's range, which become Inf); None if nothing does.

    Example:
        >>> nonfinite_problem(torch.tensor([1e300], dtype=torch.float64), [torch.float32])   # "values beyond ..."
    """
    if local.numel() == 0:
        return None
    if not bool(torch.isfinite(local).all()):
        return "NaN or Inf"
    narrow = [dt for dt in dtypes if dt.is_floating_point and torch.finfo(dt).max < torch.finfo(local.dtype).max]
    if narrow:
        dt = min(narrow, key=lambda d: torch.finfo(d).max)
        if float(local.abs().amax()) > torch.finfo(dt).max:
            return f"values beyond {dt}'s range (+-{torch.finfo(dt).max:.4g}): they would become Inf there"
    return None


def _agree(what: str, fn, *args, group):
    return agree_over(what, fn, *args, group=group, after=HP_UNTOUCHED)


def stage_hp_values(model: nn.Module, state_dict: dict, optimizer=None, *, strict: bool = True,
                    allow_nonfinite: bool = False, where=None, what: str = "load_hp_state_dict",
                    targets: dict | None = None) -> tuple[StagedHP, HPLoadResult]:
    """Check every value of a high-precision load and stage this rank's part of it, writing
    nothing; any failure raises the same :class:`dtensor_fp8.CheckpointError` on every rank of the
    model's mesh (see :func:`load_hp_state_dict` for the checks).

    Args:
        model, state_dict, optimizer, strict, allow_nonfinite: as :func:`load_hp_state_dict`.
        where: ``key -> " in <file>"`` for messages (a checkpoint's files), or None.
        what: the call, for messages.
        targets: key -> the model's tensor each entry loads into (default :func:`hp_targets`); a
            framework whose state-dict hooks reshape weights (torchtitan's fused QKV) passes its
            parameters by their own names.

    Returns:
        The staged values (for :func:`write_staged_hp_values`) and the keys left out.

    Example:
        >>> staged, left_out = stage_hp_values(model, hp, optimizer=opt)
        >>> write_staged_hp_values(model, staged)
    """
    where = where or (lambda key: "")
    targets = hp_targets(model) if targets is None else targets
    while optimizer is not None and not hasattr(optimizer, "master_of") and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer  # a framework's wrapper (accelerate's, Lightning's)
    master_of = optimizer.master_of if optimizer is not None else (lambda p: None)
    group = agreement_group(t for t in targets.values() if isinstance(t, torch.Tensor))
    missing = [k for k in targets if k not in state_dict]
    unexpected = sorted(k for k in state_dict if k not in targets)

    def check() -> None:  # what every rank sees alike: keys, kinds, dtypes, global shapes
        on_meta = [k for k, t in targets.items()
                   if k in state_dict and isinstance(t, torch.Tensor) and local_tensor(t).is_meta]
        if on_meta:
            raise CheckpointError(
                f"the model's {_shown(on_meta)} {'is' if len(on_meta) == 1 else 'are'} on the meta device (not "
                "allocated yet), so there is nothing to load the values into. Fix: call model.to_empty(device=...) "
                "first, then load (the loaded weights need no init of their own)")
        problems = [p for k, src in state_dict.items() if k in targets
                    for p in [value_problem(k, src, targets[k], where(k))] if p]
        if optimizer is not None:
            # (a weight outside the optimizer, a frozen one, has no master to follow)
            problems += [f"the FP8 weight {k}'s master is held by another MasterWeightOptimizer than the one passed "
                         "(an optimizer over another model, or an older one?): pass the MasterWeightOptimizer that "
                         "trains this model" for k, t in targets.items()
                         if k in state_dict and is_fp8(t) and not local_tensor(t).bytes_pending and master_of(t) is None
                         and local_tensor(t).param_state.links.master_tensor() is not None]
        if strict and (missing or unexpected):
            problems.append(
                "the source does not match the model: "
                + "; ".join(([f"it lacks the model's {_shown(missing)}"] if missing else [])
                            + ([f"it holds {_shown(unexpected)}, which the model lacks"] if unexpected else []))
                + ". Fix: load the weights of this model; or pass strict=False to load the entries both hold "
                "(the keys left out are returned)")
        if problems:
            error = CheckpointRecipeError if all("FP8 weight's planes" in p for p in problems) else CheckpointError
            raise error("; ".join(problems[:8]) + (f"; ... ({len(problems)} problems)" if len(problems) > 8 else ""))

    _agree(what, check, group=group)
    staged = StagedHP([], [], [], [], {})
    nonfinite = []
    failed: Exception | None = None
    try:  # a failure here (on one rank) is shared below, not left for the other ranks to wait on
        for key, src in state_dict.items():
            target = targets.get(key)
            if target is None:
                continue
            if is_extra_state(key) or not isinstance(target, torch.Tensor):
                staged.extra[key] = src
                continue
            local = _local_values(src, target)
            q, master = local_tensor(target), master_of(target)
            if not isinstance(q, QuantizedTensor):
                staged.plain.append((q, local))
                into = [q.dtype]
            elif q.bytes_pending:
                staged.pending.append((target, local))
                into = [q.hp_init.dtype]
            else:
                staged.fp8.append((key, target, local.float()))
                into = [torch.float32]
                if master is not None:
                    staged.masters.append((master, local))
                    into.append(local_tensor(master).dtype)
            if not allow_nonfinite and local.is_floating_point():
                problem = nonfinite_problem(local, into)
                if problem:
                    nonfinite.append(f"entry {key!r}{where(key)} holds {problem}")
    except Exception as err:  # noqa: BLE001  (raised on every rank by the agreement below)
        failed = err

    def finite() -> None:  # this rank's shards: the finding is shared
        if failed is not None:
            raise failed
        if nonfinite:
            raise CheckpointError(
                f"{'; '.join(nonfinite[:8])}{f'; ... ({len(nonfinite)} entries)' if len(nonfinite) > 8 else ''}: as "
                "masters and FP8 bytes they would poison training (a NaN turns its block or tensor to 0x7F). Fix: "
                "repair or re-export the weights; or pass allow_nonfinite=True to load them anyway")

    _agree(what, finite, group=group)
    return staged, HPLoadResult(missing, unexpected)


@torch.no_grad()
def write_staged_hp_values(model: nn.Module, staged: StagedHP) -> None:
    """The one step of a high-precision load that writes into the model: staged (checked) values
    into its parameters, buffers, extra states and masters, and every FP8 weight requantized from
    its values (as ``quantize()`` would quantize them: a stateful recipe starts a new weight
    scaling state from these values, written into the owner records' existing tensors). Nothing
    here fails for a reason of the values: they were checked when staged."""
    if staged.extra:
        model.load_state_dict(staged.extra, strict=False)
    for target, local in staged.plain:
        target.copy_(local)
    for master, local in staged.masters:  # the optimizer passed (the weights' own masters follow below too)
        local_tensor(master).copy_(local)
    # FP8 weights, and a meta-built weight's init values: through their owners (param_writes.py).
    write_hp_values_([*staged.fp8, *((None, param, local) for param, local in staged.pending)])


@torch.no_grad()
def load_hp_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], optimizer=None, *,
                       strict: bool = True, allow_nonfinite: bool = False) -> HPLoadResult:
    """Load high-precision weights into an FP8 model: quantize on load, masters from the hp values.

    Takes what :func:`export_hp_state_dict` gives, or the state dict of the same model without FP8
    (e.g. read from a safetensors file): parameters, persistent buffers and modules' extra state.
    Entries may be full tensors (every rank the same values) or DTensors of the parameters' shapes
    (redistributed to the parameters' layout where theirs differs). Blocks that span shards
    (per-tensor scales) get the global amax. A meta-built weight whose bytes are still pending
    takes the values as its init (the optimizer, or ``finish_init_``, makes its bytes). To read a
    sharded checkpoint shard by shard, see :func:`dtensor_fp8.load_hp_checkpoint`.

    All or nothing: every entry is checked first -- a tensor where the model has one, a floating
    dtype for floating parameters (nothing is converted from integers), exactly the parameter's
    shape (nothing is broadcast), finite values on every rank's shard -- and only then is anything
    written (:func:`write_staged_hp_values`). A failure raises the same
    :class:`dtensor_fp8.CheckpointError` on every rank of the model's mesh, naming the entries,
    with every parameter, master and scaling state as it was.

    Args:
        model: the FP8 model (sharded or not).
        state_dict: name -> bf16/fp32 tensor.
        optimizer: a :class:`MasterWeightOptimizer` whose masters are set from the same values.
        strict: missing or unexpected keys are an error (naming them) unless False.
        allow_nonfinite: load NaN or Inf values (refused by default, naming the entries).

    Returns:
        :class:`HPLoadResult`: ``missing_keys`` (kept as they were) and ``unexpected_keys`` (not
        loaded), as ``nn.Module.load_state_dict`` returns them (empty under ``strict=True``).

    Example:
        >>> left_out = dtensor_fp8.load_hp_state_dict(model, safetensors.torch.load_file("model.safetensors"),
        ...                                           optimizer=opt)
    """
    staged, result = stage_hp_values(model, state_dict, optimizer, strict=strict, allow_nonfinite=allow_nonfinite)
    write_staged_hp_values(model, staged)
    return result
