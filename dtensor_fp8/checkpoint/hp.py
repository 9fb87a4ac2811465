"""Loading a pretrained high-precision checkpoint into a sharded FP8 model, shard by shard, with
no code run and every value checked before anything is written.

[Note: a high-precision load]
``load_hp_checkpoint`` reads as ``load_checkpoint`` does (``dcp_io.py``): ``.metadata`` through
the allow-list unpickler, files checked to lie inside the directory and to hold the bytes
``.metadata`` gives them, checksums verified where ``checksums.json`` exists, values (a module's
extra state) with ``weights_only=True``. A pretrained checkpoint holds tensors: an entry stored as
a plain value (a pickle) where the model has a tensor is refused without being read. Before any
tensor is read, every entry is checked against the model from ``.metadata`` (or the safetensors
headers): present (``strict``), a floating dtype for floating parameters, the parameter's global
shape, chunks covering it. The tensors are then read into staging buffers laid out like the
parameters (this rank's shards only, FP32 for FP8 weights), their values checked (finite on every
rank) and only then written: ``hp_load.write_staged_hp_values``, the one step that writes. Any
failure raises the same :class:`CheckpointError` on every rank of the model's mesh, naming the
entry and file, with the model, its masters and scaling state as they were.
"""

from __future__ import annotations

import math
import os
from typing import Callable, NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from ..placement import like, local_tensor
from ..hp_load import HP_UNTOUCHED, HPLoadResult, stage_hp_values, value_problem, write_staged_hp_values
from ..entry import is_extra_state, is_recipe_key
from ..state_dict import hp_targets
from ..tensor import QuantizedTensor
from .dcp_io import SafeFileSystemReader, SafeLoadPlanner, checksum_policy, open_checkpoint
from .dcp_write import checkpoint_error_of
from .dirs import METADATA_FILE
from ..agreement import CheckpointError, CheckpointRecipeError, agreement_group, agree_over
from .values import check_value

_SHOWN = 8


class HPSource(NamedTuple):
    """An opened high-precision checkpoint (:func:`open_source`): the reader to load from, its
    metadata, and ``where(key)``, the " in <its files>" an error about entry ``key`` names."""

    reader: StorageReader
    metadata: Metadata
    where: Callable[[str], str]  # key -> " in <its files>"


def load_hp_checkpoint(model: nn.Module, path: str | None = None, *, optimizer=None,
                       storage_reader: StorageReader | None = None, strict: bool = True,
                       verify: bool | str | None = "if_present", allow_nonfinite: bool = False) -> HPLoadResult:
    """Load a high-precision checkpoint (a DCP directory, or a Hugging Face safetensors directory
    through ``torch.distributed.checkpoint.HuggingFaceStorageReader``) into an FP8 model, each rank
    reading only its shards: no rank materializes the whole model.

    Each rank reads its shards into staging buffers (FP32 for FP8 weights); the FP8 weights are
    then quantized from them (global amaxes where a block spans ranks) and the masters set. A
    model built on the meta device takes the values as its init (call it after ``to_empty``,
    instead of your init). Reading runs no code and the load is all or nothing (see the note):
    a failure raises the same :class:`CheckpointError` on every rank naming the entry and file,
    with the model, its masters and scaling state as they were.

    Args:
        model: the FP8 model (sharded or not; built on meta and ``to_empty``-ed, or initialized).
        path: a DCP checkpoint directory (read with :class:`SafeFileSystemReader`: no code runs).
        optimizer: a :class:`MasterWeightOptimizer` whose masters take the same values.
        storage_reader: another reader instead of ``path`` (e.g. ``HuggingFaceStorageReader(dir)``,
            which reads only JSON headers and tensors; its keys must be the model's, as a
            ``transformers`` model's are in its safetensors). A plain ``FileSystemReader`` (or a
            :class:`SafeFileSystemReader`) is read as its path is; any other reader's own
            ``read_metadata`` decides what it runs.
        strict: every entry of the model must be in the checkpoint, and the reverse (errors name
            them); False loads the entries both hold and returns the others.
        verify: a DCP directory's ``checksums.json`` (written by ``save_checkpoint``):
            ``"if_present"`` (default) verifies it where it exists (a checkpoint of plain ``dcp.save``
            has none), True requires it, False skips it. ``None`` is this function's default,
            ``"if_present"`` (``checkpoint.dcp_io.checksum_policy``: the same values in every loader).
        allow_nonfinite: load NaN or Inf values (refused by default, naming entry and file).

    Returns:
        :class:`HPLoadResult`: ``missing_keys`` (kept as they were) and ``unexpected_keys`` (not
        read), as ``nn.Module.load_state_dict`` returns them (empty under ``strict=True``).

    Example:
        >>> from torch.distributed.checkpoint import HuggingFaceStorageReader
        >>> model.to_empty(device="cuda")
        >>> dtensor_fp8.load_hp_checkpoint(model, storage_reader=HuggingFaceStorageReader("llama-8b/"))
        >>> opt = dtensor_fp8.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-5)
    """
    if (path is None) == (storage_reader is None):
        raise ValueError("load_hp_checkpoint: pass a checkpoint path or a storage_reader (one of them)")
    if type(storage_reader) in (dcp.FileSystemReader, SafeFileSystemReader):  # read as its path is (the
        path, storage_reader = storage_reader.path, None  # plain one unpickles .metadata with pickle)
    name = os.fspath(path) if path is not None else f"{type(storage_reader).__name__}({getattr(storage_reader, 'path', '')})"
    what = f"load_hp_checkpoint({name})"
    targets = hp_targets(model)
    group = agreement_group(t for t in targets.values() if isinstance(t, torch.Tensor))
    kept = {"group": group, "after": HP_UNTOUCHED}
    source = agree_over(what, open_source, path, storage_reader, verify, **kept)
    staging, missing, unexpected = agree_over(what, _plan, targets, source, strict, **kept)
    agree_over(what, read_source, staging, source.reader, group, **kept)
    agree_over(what, _check_values, staging, targets, source.where, **kept)
    staged, _ = stage_hp_values(model, staging, optimizer, strict=False, allow_nonfinite=allow_nonfinite,
                                where=source.where, what=what)
    write_staged_hp_values(model, staged)
    return HPLoadResult(missing, unexpected)


# ---- opening the source -------------------------------------------------------------------------------------
def _files_of(metadata: Metadata, base: str) -> Callable[[str], str]:
    files: dict[str, set] = {}
    for index, info in metadata.storage_data.items():
        relative = getattr(info, "relative_path", None)
        if relative is not None:
            files.setdefault(index.fqn, set()).add(os.path.join(base, os.fspath(relative)))
    return lambda key: f" in {', '.join(sorted(files[key]))}" if key in files else ""


def _pickled_weights_only(directory: str) -> str | None:
    """The ``*.bin`` weights file of a directory holding a Hugging Face checkpoint in torch's pickle
    format only (no ``.metadata``, no ``*.safetensors``), or None."""
    try:
        names = os.listdir(directory)
    except OSError:
        return None
    if METADATA_FILE in names or any(n.endswith(".safetensors") for n in names):
        return None
    bins = sorted(n for n in names if n.endswith(".bin") and n.startswith("pytorch_model"))
    return os.path.join(directory, bins[0]) if bins else None


def _pickled_weights_error(file: str) -> CheckpointError:
    return CheckpointError(
        f"{file} is a Hugging Face checkpoint in torch's pickle format, and its directory holds no DCP checkpoint "
        "and no safetensors files: load_hp_checkpoint reads DCP directories and safetensors (storage_reader="
        "HuggingFaceStorageReader(dir)), never pickles (unpickling runs code). Fix: convert it once "
        "(safetensors.torch.save_file(torch.load(file, weights_only=True), 'model.safetensors')), or "
        "torch.load(file, weights_only=True) yourself and pass the dict to dtensor_fp8.load_hp_state_dict")


def open_source(path: str | None, reader: StorageReader | None, verify: bool | str | None = None) -> HPSource:
    """Open a high-precision checkpoint without running code: a DCP directory ``path`` (through
    ``dcp_io.open_checkpoint``), or another ``reader``'s metadata; a directory of torch pickles is
    refused with the fix. Each rank may call it (``agree_over`` shares a failure).

    Args:
        path: a DCP checkpoint directory, or None with ``reader``.
        reader: another storage reader (e.g. ``HuggingFaceStorageReader``), or None with ``path``.
        verify: ``checksums.json`` of a DCP directory: None (default) / ``"if_present"`` verifies it
            where it exists (a plain ``dcp.save`` writes none), True requires it, False skips it
            (``dcp_io.checksum_policy``).

    Example:
        >>> source = open_source("ckpt/step_100", None)
        >>> read_source(staging, source.reader, None)
    """
    if path is not None:
        path = os.fspath(path)
        pickled = _pickled_weights_only(path)
        if pickled is not None:
            raise _pickled_weights_error(pickled)
        metadata, checksums = open_checkpoint(path, checksum_policy(verify, default="if_present"), missing_hint=(
            "(verify=True). Fix: restore the file, or pass verify='if_present' / False"))
        return HPSource(SafeFileSystemReader(path, metadata=metadata, checksums=checksums), metadata,
                       _files_of(metadata, path))
    base = os.fspath(getattr(reader, "path", "") or "")
    try:
        metadata = reader.read_metadata()
    except Exception as err:  # noqa: BLE001  (a damaged file: name it)
        raise CheckpointError(_unreadable_source(reader, base, err)) from None
    pickled = _pickled_weights_only(base) if not metadata.state_dict_metadata and os.path.isdir(base) else None
    if pickled is not None:  # (a safetensors reader finds no entries in a directory of pickles)
        raise _pickled_weights_error(pickled)
    return HPSource(reader, metadata, _files_of(metadata, base))


def _unreadable_source(reader: StorageReader, base: str, err: BaseException) -> str:
    cause = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"
    pickled = _pickled_weights_only(base) if base and os.path.isdir(base) else None
    if pickled is not None:
        return str(_pickled_weights_error(pickled))
    broken = _broken_safetensors(base) if base and os.path.isdir(base) else None
    if broken is not None:
        file, why = broken
        return (f"{file} is not a readable safetensors file ({why}): damaged, cut short (an interrupted download?) "
                "or not a safetensors file. Fix: download or copy it again")
    return (f"{type(reader).__name__} could not read the checkpoint's metadata in {base or 'its source'} ({cause}): "
            "the files are damaged or not what this reader reads. Fix: restore them, or use the reader that wrote them")


def _broken_safetensors(directory: str) -> tuple[str, str] | None:
    """The first ``*.safetensors`` file of ``directory`` safetensors cannot read (header, shapes,
    sizes), with why; None if it reads them all."""
    try:
        from safetensors import safe_open
    except ImportError:
        return None
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".safetensors"):
            continue
        file = os.path.join(directory, name)
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    f.get_slice(key).get_shape()
        except Exception as err:  # noqa: BLE001  (safetensors raises its own error kinds)
            return file, f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"
    return None


# ---- before reading: every entry against the model ----------------------------------------------------------
def _listed(keys) -> str:
    keys = list(keys)
    return "[" + ", ".join(repr(k) for k in keys[:_SHOWN]) + (f", ... ({len(keys)} in all)" if len(keys) > _SHOWN else "") + "]"


def _plan(targets: dict, source: HPSource, strict: bool) -> tuple[dict, list, list]:
    """The staging buffers to read into (this rank's shards), and the keys left out; refuses what
    the metadata already shows wrong, naming every entry."""
    saved = source.metadata.state_dict_metadata
    missing = [k for k in targets if k not in saved]
    unexpected = sorted(k for k in saved if k not in targets)
    fp8 = sorted(k for k in saved if is_recipe_key(k))
    if fp8 and missing:
        raise CheckpointRecipeError(
            f"the checkpoint holds FP8 weights ({_listed(fp8[:4])} and their planes): a checkpoint of save_checkpoint "
            f"or of an FP8 model's state dict, not high-precision weights, so the model's {_listed(missing)} are "
            "not there. Fix: load it with dtensor_fp8.load_checkpoint into get_state_dict(model, opt) of a model "
            "built with its recipe; to move to another recipe, export from that model with "
            "dtensor_fp8.export_hp_state_dict(model, torch.float32, optimizer=opt) and load_hp_state_dict the result")
    if not saved:
        raise CheckpointError("the checkpoint holds no entries (an empty directory, or files this reader does not "
                              "read?). Fix: point it at the directory holding the weights")
    problems = []
    staging: dict = {}
    for key, target in targets.items():
        md = saved.get(key)
        if md is None:
            continue
        where = source.where(key)
        if isinstance(md, BytesStorageMetadata):
            if isinstance(target, torch.Tensor):
                problems.append(f"entry {key!r}{where} is a plain value (a pickle) in the checkpoint where the model "
                                "has a tensor: a high-precision checkpoint holds tensors there, so it is not read "
                                "(unpickling a crafted value runs code). Fix: load the weights of this model")
            else:
                staging[key] = None  # a module's extra state: read with weights_only=True, checked against its kind
            continue
        if not isinstance(md, TensorStorageMetadata):
            problems.append(f"entry {key!r}{where} is a {type(md).__name__} in .metadata, not a tensor")
            continue
        if is_extra_state(key) or not isinstance(target, torch.Tensor):
            # opaque: read at its saved size, which the bytes stored for it bound (a crafted size allocates nothing)
            nbytes = math.prod(md.size) * md.properties.dtype.itemsize
            stored = [getattr(info, "length", None) for index, info in source.metadata.storage_data.items()
                      if index.fqn == key]
            if stored and None not in stored and nbytes > sum(stored):
                problems.append(f"entry {key!r}{where}: .metadata gives it {tuple(md.size)} {md.properties.dtype} "
                                f"({nbytes} bytes), but only {sum(stored)} bytes are stored for it (a crafted size?)")
            else:
                staging[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            continue
        problem = value_problem(key, (md.properties.dtype, tuple(md.size)), target, where)
        covered = sum(math.prod(c.sizes) for c in md.chunks)
        if problem is None and covered != math.prod(md.size):
            problem = (f"the stored chunks of entry {key!r}{where} cover {covered} of its {math.prod(md.size)} elements: "
                       "the metadata is damaged or not this checkpoint's; restore it from a copy")
        if problem:
            problems.append(problem)
        else:
            staging[key] = _staging_like(target)
    if strict and (missing or unexpected):
        parts = ([f"lacks the model's {_listed(missing)}"] if missing else []) + (
            [f"holds {_listed(unexpected)}, which the model lacks"] if unexpected else [])
        problems.append(f"the checkpoint {' and '.join(parts)}. Fix: load the checkpoint of this model (its keys "
                        "must be the model's FQNs); or pass strict=False to load the entries both hold (the keys left "
                        "out are returned)")
    if problems:
        raise CheckpointError("; ".join(problems[:_SHOWN]) + (f"; ... ({len(problems)} problems)" if len(problems) > _SHOWN else ""))
    return staging, missing, unexpected


def _staging_like(target: torch.Tensor) -> torch.Tensor:
    """A buffer laid out like ``target`` (its local shard, a DTensor like it): FP32 for an FP8
    weight (the masters' values), the target's dtype otherwise; DCP converts the stored dtype."""
    local = local_tensor(target)
    if isinstance(local, QuantizedTensor):
        buffer = torch.empty(tuple(local.shape), dtype=torch.float32, device=local.device)
    else:
        buffer = torch.empty_like(local)
    return like(target, buffer)


# ---- reading, then the values ----------------------------------------------------------------------------------
def read_source(staging: dict, reader: StorageReader, group) -> None:
    """``dcp.load`` into the buffers of ``staging`` from ``reader`` (of :func:`open_source`), with the
    safe planner; DCP's failure becomes one :class:`CheckpointError` naming each rank's.

    Args:
        staging: key -> the buffer to read into (this rank's shards) or None (a plain value).
        reader: the source's reader.
        group: the process group reading, or None for one process.

    Example:
        >>> read_source({"w": torch.empty(64, 128)}, source.reader, None)
    """
    try:
        dcp.load(staging, storage_reader=reader, planner=SafeLoadPlanner(), process_group=group, no_dist=group is None)
    except CheckpointException as err:  # the same on every rank
        raise checkpoint_error_of(err) from None


def _check_values(staging: dict, targets: dict, where: Callable[[str], str]) -> None:
    for key, value in staging.items():
        if not isinstance(value, torch.Tensor):
            check_value(value, targets[key], f"entry {key!r}{where(key)}")
