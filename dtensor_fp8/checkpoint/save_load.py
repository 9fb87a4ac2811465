"""``save_checkpoint`` / ``load_checkpoint`` / ``latest_checkpoint``: DCP checkpoints that are atomic
per step, saved by one job per root, run no code when opened, detect corruption, load all or
nothing, and fail alike on every rank with errors that name the entry, file and rank at fault.

The state dicts are torch's own (``torch.distributed.checkpoint.state_dict.get_state_dict``, or
``model.state_dict()`` / ``optimizer.state_dict()``, plus any plain values); how an FP8 weight
appears in them is ``dtensor_fp8/state_dict.py``'s note. The directories are ``dirs.py``'s note,
the claim on a root ``owner.py``'s, the reading ``dcp_io.py``'s, the writing ``dcp_write.py``'s,
the checksums ``checksum.py``'s, plain values ``values.py``'s, and errors on every rank
``dtensor_fp8/agreement.py``'s.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from .._compat import flatten_state_dict, set_state_dict_element
from ..formats.config import recipe_from_config
from ..entry import (MASTER_KEY, RECIPE_KEY, is_extra_state, is_master_key, is_recipe_key, is_scaling_state_entry,
                     is_weight_state_entry, weight_key)
from ..placement import like, local_tensor
from ..expert_entries import older_layout_problem
from ..state_dict import check_saved_recipe
from .dcp_io import OpenedCheckpoint, SafeFileSystemReader, SafeLoadPlanner, checksum_policy, open_checkpoint
from .dcp_write import ChecksumFileSystemWriter, ChecksumSavePlanner, checkpoint_error_of
from .dirs import (
    commit_outcome,
    commit_save,
    discard_save,
    partial_dir,
    prepare_save,
    resolve_latest,
    step_dir_name,
)
from ..agreement import CheckpointError, CheckpointRecipeError, agree
from .errors import os_error_text
from .coverage import asked_by_no_rank, check_coverage_mode
from .param_groups import open_param_group_keys, param_lists
from .values import check_value, refuse_divergence, replica_digests

_SHOWN = 8  # keys listed in a message


class LoadResult(NamedTuple):
    """What :func:`load_checkpoint` left out (both empty unless ``strict=False``), as torch's
    ``load_state_dict`` reports it."""

    missing_keys: list[str]  #: asked for by the state dict, absent from the checkpoint (kept as they were)
    unexpected_keys: list[str]  #: in the checkpoint, not asked for (not loaded)


def _rank(group) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


# ---- save ------------------------------------------------------------------------------------------------------
def save_checkpoint(state_dict: dict, root: str, step: int, *, process_group=None,
                    allow_nonfinite: bool = False) -> str:
    """``dcp.save`` into ``root/step-<step>``, atomically: written aside, swapped in once every rank
    has finished, then ``root/latest`` pointed at it.

    A save that fails on any rank raises the same :class:`CheckpointError` on every rank, removes
    its partial directory and leaves ``latest`` and every step directory as they were; one killed
    mid-save leaves them as they were too (the next save removes what it left). A re-save of an
    existing step replaces it only once the new one is complete; a failure after the swap says
    what it committed. Each stored item gets a checksum (``checksums.json`` beside DCP's
    ``.metadata``), verified by :func:`load_checkpoint`.

    Refused on every rank before anything is written: masters holding NaN or Inf (below), a plain
    value, a tensor that is not sharded or a replicated DTensor chunk that differs between ranks
    (DCP would store one rank's copy for all; ``checkpoint/values.py``; a param group's parameter
    list excepted, which pipeline stages hold each their own: ``param_groups.py``), and a root
    another live job saves into (``checkpoint/owner.py``: the first save claims the root for this job).

    Under pipeline parallelism every stage saves its own entries into the same ``root`` and
    ``step`` (one collective save; load each stage's part with ``coverage="group"``).

    Args:
        state_dict: e.g. ``{"model": model_sd, "optim": optim_sd, "step": step}`` (tensors, DTensors
            and plain values).
        root: checkpoint root directory (shared by all ranks; claimed by one job at a time).
        step: training step, names the sub-directory (``step-00000042``).
        process_group: the ranks that save (default: all).
        allow_nonfinite: save even if an optimizer master (a ``...master`` entry, see
            ``MasterWeightOptimizer``) holds NaN or Inf; by default such a save is refused on every
            rank before anything is written (a diverged run would otherwise overwrite good steps).

    Returns:
        The checkpoint directory written.

    Example:
        >>> model_sd, optim_sd = get_state_dict(model, opt)
        >>> dtensor_fp8.save_checkpoint({"model": model_sd, "optim": optim_sd, "step": step}, "ckpt", step)
    """
    root = os.fspath(root)
    name = step_dir_name(step)
    what = f"save_checkpoint(step {step} into {root})"
    first = _rank(process_group) == 0
    nothing = " Nothing was written."
    digests = agree(what, _check_before_save, state_dict, allow_nonfinite, process_group, group=process_group,
                    after=nothing, everyone=True)
    agree(what, refuse_divergence, digests, group=process_group, after=nothing)
    partial = agree(what, lambda: _named(prepare_save, root, name) if first else partial_dir(root, name),
                    group=process_group, after=" This save wrote nothing: `latest` and every complete step directory "
                                               "are as before.")
    try:
        agree(what, _dcp_save, state_dict, partial, process_group, group=process_group,
              after=" Nothing was committed: `latest` and every step directory are as before this save, and its "
                    "partial directory is removed.")
    except CheckpointError as err:
        if first and not getattr(err, "ranks_lost", False):  # every rank has stopped writing
            discard_save(root, name)
        raise
    # a fault or a kill here may come after the swap: every surviving rank reads what is on disk
    return agree(what, lambda: _named(commit_save, root, name) if first else os.path.join(root, name),
                 group=process_group, outcome=lambda: commit_outcome(root, name))


def _named(fn, *args):
    """``fn(*args)``, an ``OSError`` named by its errno and file (ENOSPC with the free space)."""
    try:
        return fn(*args)
    except OSError as err:
        raise CheckpointError(os_error_text(err)) from err


def _check_before_save(state_dict: dict, allow_nonfinite: bool, group) -> dict:
    """This rank's part of the checks before a save; returns its digests of the entries DCP stores
    once for several ranks (none on one rank: nothing to compare)."""
    if not allow_nonfinite:
        _refuse_nonfinite_masters(state_dict)
    several = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    if not several:
        return {}
    digests = replica_digests(state_dict, dist.get_world_size(group))
    for key in param_lists(state_dict):  # each optimizer's own (pipeline stages): see param_groups.py's note
        digests.pop(key, None)
    return digests




def _refuse_nonfinite_masters(state_dict: dict) -> None:
    flat, _ = flatten_state_dict(state_dict)
    bad = [key for key, value in flat.items()
           if is_master_key(key) and isinstance(value, torch.Tensor) and value.is_floating_point()
           and not bool(torch.isfinite(local_tensor(value)).all())]
    if bad:
        raise CheckpointError(
            f"refusing to save: {len(bad)} optimizer master(s) hold NaN or Inf ({', '.join(bad[:_SHOWN])}"
            f"{' ...' if len(bad) > _SHOWN else ''}); the run has diverged and this checkpoint would not resume. "
            "Resume from an earlier step, or pass allow_nonfinite=True to save it anyway.")


def _dcp_save(state_dict: dict, path: str, group) -> None:
    try:
        dcp.save(state_dict, storage_writer=ChecksumFileSystemWriter(path), planner=ChecksumSavePlanner(),
                 process_group=group)
    except CheckpointException as err:  # the same on every rank
        raise checkpoint_error_of(err) from None


def latest_checkpoint(root: str) -> str:
    """The directory ``root/latest`` names: the last save that completed on every rank.

    Raises:
        CheckpointError: no pointer, an empty one, one naming something outside ``root`` (``../x``,
            an absolute path, a separator) or a directory that is missing or incomplete; the message
            lists the complete checkpoints there.

    Example:
        >>> dtensor_fp8.load_checkpoint(state, dtensor_fp8.latest_checkpoint("ckpt"))
    """
    return resolve_latest(root)


# ---- load ------------------------------------------------------------------------------------------------------
def load_checkpoint(state_dict: dict, path: str, *, strict: bool = True, coverage: str = "rank", verify: bool | str = True,
                    allow_nonfinite: bool = False, process_group=None) -> LoadResult:
    """``dcp.load`` into ``state_dict`` (in place), safely and all-or-nothing.

    Load into the state dicts of a fresh model and optimizer (``get_state_dict(model, opt)``), then
    ``set_state_dict``. Tensors and plain values (step counters, scheduler state, param groups) are
    restored; nothing is unpickled except DCP's metadata classes and ``weights_only`` values; each
    stored item's checksum is verified as it is read.

    The load is a transaction over everything ``state_dict`` aliases (the model's FP8 planes, the
    optimizer's masters, moments and scaling state through torch's ``get_state_dict``): every
    entry is read into private copies and checked first -- files inside the checkpoint directory,
    checksums covering every stored item, recipes, entries, shapes and dtypes, plain values of the
    template's kind and bounded in size and depth (``checkpoint/values.py``), masters finite -- and
    only then written back. A failure on any rank raises the same :class:`CheckpointError` on every
    rank naming the entry, file and rank, with every tensor and value of ``state_dict`` as it was.

    Args:
        state_dict: the state dict to fill (its tensors give the target sharding, its plain values
            the kinds the loaded ones must have).
        path: a checkpoint directory (e.g. :func:`latest_checkpoint`).
        strict: every entry of the checkpoint must be asked for (see ``coverage``) and every entry
            ``state_dict`` asks for must be in the checkpoint (errors name the extra / missing
            entries), except a param group's plain values, which load into the group as torch's
            optimizers take them, and its parameter list, which stays the state dict's own
            (``param_groups.py``). False loads the entries both hold and returns the others; an FP8
            weight still loads whole or not at all.
        coverage: who must ask for every entry of the checkpoint (``checkpoint/coverage.py``):
            ``"rank"`` (default) each rank's ``state_dict`` (one model on data-parallel ranks);
            ``"group"`` the ranks of ``process_group`` together, each asking for its own part (pipeline
            stages: each loads its stage's entries of the checkpoint all stages saved; an entry no
            rank asks for is still refused, or returned as unexpected with ``strict=False``).
        verify: check the checksums ``save_checkpoint`` stored: ``True`` (default) refuses a
            checkpoint without ``checksums.json``, or with one that does not cover every stored
            item; ``"if_present"`` verifies them where the file exists; ``False`` loads without
            verification, knowingly (checkpoints of plain ``dcp.save`` or ``dcp.async_save``, which
            write no checksums). ``None`` is this function's default, ``True``
            (``checkpoint.dcp_io.checksum_policy``: the same values in every loader).
        allow_nonfinite: load optimizer masters (``...master`` entries) holding NaN or Inf; by
            default such a checkpoint (saved with ``allow_nonfinite=True``) is refused before
            anything is written (``MasterWeightOptimizer.load_state_dict`` refuses them too, unless
            built with ``nonfinite="ignore"``).
        process_group: the ranks that load (default: all).

    Returns:
        :class:`LoadResult` (empty lists unless ``strict=False``).

    Example:
        >>> model_sd, optim_sd = get_state_dict(model, opt)
        >>> state = {"model": model_sd, "optim": optim_sd, "step": 0}
        >>> dtensor_fp8.load_checkpoint(state, dtensor_fp8.latest_checkpoint("ckpt"))
        >>> set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        >>> # pipeline parallelism: each stage's own state dict, its part of the one checkpoint
        >>> dtensor_fp8.load_checkpoint(stage_state, dtensor_fp8.latest_checkpoint("ckpt"), coverage="group")
    """
    check_coverage_mode(coverage)
    path = os.fspath(path)
    what = f"load_checkpoint({path})"
    untouched = " The state dict was not modified."
    kept = {"group": process_group, "after": untouched, "outcome": lambda: untouched.strip()}
    opened = agree(what, _open, path, verify, **kept)
    flat, mappings = flatten_state_dict(state_dict)
    recipes = {k: v for k, v in flat.items() if is_recipe_key(k)}
    read_weight_states_of_older_layout(flat, recipes, opened.metadata)
    taken = open_param_group_keys(state_dict, flat, opened.metadata.state_dict_metadata)  # plain param-group values
    flat.update(dict.fromkeys(taken))  # asked for from here on (None: DCP reads what was saved)
    mappings.update(taken)
    kept_lists = param_lists(state_dict) & flat.keys()  # the live optimizers' own (param_groups.py)
    agree(what, _check_fp8_layout, flat, recipes, opened.metadata, path, **kept)
    nobody = (agree(what, asked_by_no_rank, opened.metadata.state_dict_metadata, flat.keys(), process_group, **kept)
              if coverage == "group" else None)
    plan = agree(what, _check_entries, flat, recipes, opened, path, strict, nobody, process_group, **kept)
    agree(what, _dcp_load, plan.copies, path, opened, process_group, **kept)
    agree(what, _check_loaded, flat, plan, opened, path, allow_nonfinite, **kept)
    # Everything is read, verified and checked: only now is the live state written (no step below
    # can fail for a reason of the checkpoint's: same shapes, dtypes and placements, checked kinds).
    with torch.no_grad():
        for key, value in plan.copies.items():
            if key in kept_lists:  # read and checked like any value, but the live optimizer's list stays
                continue
            if key in plan.blobs or not isinstance(value, torch.Tensor):
                # a module's opaque extra state (replaced, whatever its length was), or a plain value
                set_state_dict_element(state_dict, mappings[key], value)
            else:
                flat[key].copy_(value)
    return LoadResult(plan.missing, plan.unexpected)


def read_weight_states_of_older_layout(flat: dict, recipes: dict, metadata: Metadata) -> None:
    """Ask for a weight scaling state under the key a checkpoint written before the weight's owner
    saved it holds it at (the optimizer's state: ``optim.state.<fqn>.rowwise_amax_history``), where the
    model's entry asks for it (``model.<fqn>.rowwise_amax_history``) and the checkpoint lacks that.
    In place: ``flat``'s tensor moves to the old key, so the load reads it from there into the
    model's entry (and the optimizer's old entry is not left over as unexpected).

    Args:
        flat: the flattened state dict to load into.
        recipes: its FP8 weights' recipe entries (``"<weight key>.recipe"``).
        metadata: the checkpoint's.

    Example:
        >>> read_weight_states_of_older_layout(flat, recipes, metadata)   # "optim.state.w.rowwise_scale" now asked for
    """
    saved = metadata.state_dict_metadata
    old = {k.split(".state.", 1)[1]: k for k in saved if ".state." in k and is_weight_state_entry(k)}
    if not old:
        return
    weights = {weight_key(k) for k in recipes}
    for key in [k for k in flat if k not in saved and is_weight_state_entry(k) and weight_key(k) in weights]:
        parts = key.split(".")
        for i in range(len(parts) - 1):  # the longest suffix that names the weight's old entry
            tail = ".".join(parts[i:])
            if tail in old and old[tail] not in flat:
                flat[old[tail]] = flat.pop(key)
                break


def _open(path: str, verify: bool | str | None) -> OpenedCheckpoint:
    # checksums required by default: this module's saves always write checksums.json, so a
    # directory without one is damaged or not ours
    return open_checkpoint(path, checksum_policy(verify, default=True), missing_hint=(
        "(deleted? or written by plain dcp.save / dcp.async_save, or before dtensor_fp8 stored checksums). Fix: "
        "restore the file from a copy of the checkpoint; or pass verify=False to load it unverified, knowingly"))


def _stored_file(opened: OpenedCheckpoint, path: str, key: str) -> str:
    info = opened.metadata.storage_data.get(MetadataIndex(key))
    return os.path.join(path, info.relative_path) if info is not None else path


def _check_loaded(flat: dict, plan: _Plan, opened: OpenedCheckpoint, path: str, allow_nonfinite: bool) -> None:
    """What was read, before it is written back: plain values against the template, masters finite."""
    for key, value in plan.copies.items():
        if not isinstance(value, torch.Tensor):
            check_value(value, flat[key], f"entry {key!r} in {_stored_file(opened, path, key)}")
    if allow_nonfinite:
        return
    bad = [key for key, value in plan.copies.items()
           if is_master_key(key) and isinstance(value, torch.Tensor) and value.is_floating_point()
           and not bool(torch.isfinite(local_tensor(value)).all())]
    if bad:
        params = [k.split(".state.", 1)[-1][:-len(MASTER_KEY) - 1] for k in bad]
        raise CheckpointError(
            f"{path}: the master of {', '.join(params[:_SHOWN])} holds NaN or Inf (entr{'y' if len(bad) == 1 else 'ies'} "
            f"{_listed(bad)}; saved with allow_nonfinite=True from a run that had diverged?): resuming from it would "
            "train on NaN. Fix: load an earlier checkpoint, or pass allow_nonfinite=True to load it anyway")


def _check_fp8_layout(flat: dict, recipes: dict, metadata: Metadata, path: str) -> None:
    """An FP8 model and a checkpoint of its weights in high precision (or the reverse) are told so."""
    saved = metadata.state_dict_metadata
    hp = [weight_key(k) for k in recipes if k not in saved and isinstance(saved.get(weight_key(k)),
                                                                               TensorStorageMetadata)]
    if hp:
        md = saved[hp[0]]
        raise CheckpointRecipeError(
            f"{path} holds {_listed(hp)} in high precision ({md.properties.dtype} tensors, e.g. {tuple(md.size)}), the "
            "model as FP8 weights. Fix: dtensor_fp8.load_hp_checkpoint(model, path, optimizer=opt) reads it (no code "
            "run, every value checked) and quantizes on load, where its keys are the model's FQNs; for keys under a "
            "prefix (saved as {'model': ...}), load_checkpoint it into {'model': dtensor_fp8.export_hp_state_dict(model, "
            "<its dtype>)} and pass that to dtensor_fp8.load_hp_state_dict(model, state['model'], optimizer=opt)")
    fp8_in_ckpt = [k for k, v in flat.items() if isinstance(v, torch.Tensor) and f"{k}.{RECIPE_KEY}" in saved]
    if fp8_in_ckpt:
        raise CheckpointRecipeError(
            f"{path} holds {_listed(fp8_in_ckpt)} as FP8 weights (planes + recipe), the model in high precision. Fix: "
            "quantize the model with the checkpoint's recipe first (dtensor_fp8.quantize_module_), or export the "
            "checkpoint to high precision from an FP8 model (dtensor_fp8.export_hp_state_dict)")


class _Plan(NamedTuple):
    copies: dict  # key -> what DCP fills: a clone of the tensor, a buffer of the saved size, or the value
    blobs: set  # keys of extra states read at their saved length
    missing: list
    unexpected: list


def _check_entries(flat: dict, recipes: dict, opened: OpenedCheckpoint, path: str, strict: bool, nobody: list | None,
                   group) -> _Plan:
    """Recipes first (a small collective read on every rank), then presence, kind, shape and dtype of
    every entry, before any tensor is read. ``nobody``: the entries no rank asks for
    (``coverage="group"``), else None (each rank must ask for all)."""
    saved = opened.metadata.state_dict_metadata
    present_recipes = {k: None for k in recipes if k in saved}
    # on every rank, even with no recipes: this is a collective
    _dcp_load(present_recipes, path, opened, group)
    for key, theirs in present_recipes.items():
        try:
            check_saved_recipe(weight_key(key), theirs, recipe_from_config(recipes[key]))
        except CheckpointError:
            raise
        except ValueError as err:  # RecipeError: both recipes named, and the fix
            raise CheckpointRecipeError(str(err)) from None

    missing = [k for k in flat if k not in saved]
    unexpected = sorted(k for k in saved if k not in flat) if nobody is None else nobody
    groups = {weight_key(k) for k in recipes}
    # weights whose recipe entry is saved but some plane is not (a weight missing whole is just missing)
    # (an operand scaling state is not a plane: checkpoints written before it was saved lack it, see
    # state_dict.py; strict=False loads them, naming it missing)
    torn = sorted({weight_key(k) for k in missing if not is_scaling_state_entry(k)}
                  & {g for g in groups if f"{g}.{RECIPE_KEY}" in saved})
    if torn:
        lacking = [k for k in missing if weight_key(k) in torn and not is_scaling_state_entry(k)]
        raise CheckpointRecipeError(
            f"{path}: the FP8 weight{'s' if len(torn) > 1 else ''} {_listed(torn)} lack{'' if len(torn) > 1 else 's'} "
            f"{_listed(lacking)} in the checkpoint (another recipe's planes? a checkpoint edited by hand?). An FP8 "
            "weight loads whole or not at all. Fix: build the model with the recipe and usages it was saved with")
    if strict and (missing or unexpected):
        raise CheckpointError(_mismatch_message(path, missing, unexpected, saved, len(flat), nobody is not None))

    copies, blobs = {}, set()
    for key, value in flat.items():
        meta = saved.get(key)
        if meta is None:
            continue
        is_tensor = isinstance(meta, TensorStorageMetadata)
        if isinstance(value, torch.Tensor) != is_tensor:
            raise CheckpointError(
                f"{path}: entry {key!r} is {'a tensor' if is_tensor else 'a plain value'} in the checkpoint, "
                f"{'a tensor' if isinstance(value, torch.Tensor) else type(value).__name__} in the state dict. Fix: "
                "build the state dict the checkpoint was saved from (the same model, optimizer and values)")
        if not is_tensor:
            copies[key] = value
        elif is_extra_state(key) and not isinstance(value, DTensor):
            # read at its saved size: bounded by the bytes stored for it (a crafted size allocates nothing)
            nbytes = math.prod(meta.size) * meta.properties.dtype.itemsize
            stored = sum(info.length for index, info in opened.metadata.storage_data.items() if index.fqn == key)
            if nbytes > stored:
                raise CheckpointError(
                    f"{path}: .metadata gives entry {key!r} {tuple(meta.size)} {meta.properties.dtype} ({nbytes} bytes), "
                    f"but only {stored} bytes are stored for it (a crafted size?); restore .metadata from a copy")
            copies[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype, device=value.device)
            blobs.add(key)
        elif (older := older_layout_problem(key, tuple(meta.size), tuple(value.shape))) is not None:
            raise CheckpointError(f"{path}: {older}")
        elif tuple(meta.size) != tuple(value.shape) or meta.properties.dtype != value.dtype:
            raise CheckpointError(
                f"{path}: entry {key!r} is {meta.properties.dtype} {tuple(meta.size)} in the checkpoint, "
                f"{value.dtype} {tuple(value.shape)} in the state dict (a model of other dimensions, or another "
                "master / state dtype?). Fix: build the model and optimizer as they were saved")
        else:
            covered = sum(math.prod(c.sizes) for c in meta.chunks)
            if covered != math.prod(meta.size):
                raise CheckpointError(
                    f"{path}: the chunks of entry {key!r} in .metadata cover {covered} of its {math.prod(meta.size)} "
                    "elements: the metadata is damaged or not this checkpoint's; restore it from a copy")
            # every element is read (the chunks cover the entry), so no need to copy the old values
            copies[key] = like(value, torch.empty_like(local_tensor(value)))
    return _Plan(copies, blobs, missing, unexpected)


def _mismatch_message(path: str, missing: list, unexpected: list, saved: dict, asked: int, by_group: bool) -> str:
    parts = [f"{path} does not match the state dict ({len(saved)} entries saved, {asked} asked for"
             f"{' by this rank' if by_group else ''})"]
    if unexpected and by_group:
        parts.append(f"the checkpoint holds {len(unexpected)} entr{'ies' if len(unexpected) > 1 else 'y'} no rank's "
                     f"state dict asks for: {_listed(unexpected)}; loading would drop them silently (a model "
                     "shallower than the one saved? a state dict without the optimizer or a value?)")
    elif unexpected:
        parts.append(f"the checkpoint holds {len(unexpected)} entr{'ies' if len(unexpected) > 1 else 'y'} the state "
                     f"dict does not ask for: {_listed(unexpected)}; loading would drop them silently (a model "
                     "shallower than the one saved? a state dict without the optimizer or a value? a pipeline "
                     "stage loading its part of a checkpoint every stage saved: pass coverage=\"group\", which "
                     "refuses only entries no rank asks for)")
    if missing:
        parts.append(f"the state dict asks for {len(missing)} entr{'ies' if len(missing) > 1 else 'y'} the "
                     f"checkpoint lacks: {_listed(missing)} (a model deeper than the one saved? other names?)")
    hint = _prefix_hint(missing, unexpected)
    if hint:
        parts.append(hint)
    parts.append("Fix: build the model and optimizer the checkpoint was saved from; or pass strict=False to load the "
                 "entries both hold (load_checkpoint returns the keys it left out)")
    return "; ".join(parts[:-1]) + ". " + parts[-1]


def _prefix_hint(missing: list, unexpected: list) -> str | None:
    if not missing or not unexpected:
        return None
    extra = set(unexpected)
    key = missing[0]
    if "." in key and key.split(".", 1)[1] in extra:
        return f"the checkpoint's keys lack the prefix {key.split('.', 1)[0] + '.'!r} (saved from a state dict without that level?)"
    for u in unexpected:
        if "." in u and u.split(".", 1)[1] == key:
            return f"the checkpoint's keys carry a prefix {u.split('.', 1)[0] + '.'!r} the state dict lacks (saved as {{{u.split('.', 1)[0]!r}: ...}}?)"
    return None


def _listed(keys: list) -> str:
    keys = list(keys)
    shown = ", ".join(repr(k) for k in keys[:_SHOWN])
    return f"[{shown}{f', ... ({len(keys)} in all)' if len(keys) > _SHOWN else ''}]"



def _dcp_load(flat: dict, path: str, opened: OpenedCheckpoint, group) -> None:
    reader = SafeFileSystemReader(path, metadata=opened.metadata, checksums=opened.checksums)
    try:
        dcp.load(flat, storage_reader=reader, planner=SafeLoadPlanner(), process_group=group)
    except CheckpointException as err:  # the same on every rank
        raise checkpoint_error_of(err) from None
