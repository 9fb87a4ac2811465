"""DCP reading that runs no code, verifies checksums and names the entry at fault (writing:
``dcp_write.py``).

The checkpoint package reaches DCP's internals only through ``dtensor_fp8/_compat.py`` (the
metadata globals allow-list, a stored item's byte stream, ``flatten_state_dict`` /
``set_state_dict_element``); otherwise it relies on DCP's storage API and on the fields of ``FileSystemReader.storage_data``'s
values (``relative_path``, ``offset``, ``length``), the same in torch 2.11 and 2.13, whose
``filesystem.py`` / ``metadata.py`` differ only in typing and one ``dataclasses.replace`` in
``FileSystemWriter.finish``.

[Note: what DCP unpickles]
``torch.distributed.checkpoint.load`` with the default ``FileSystemReader`` and
``DefaultLoadPlanner``:

- unpickles ``.metadata`` (and ``__<rank>.metadata``) with plain ``pickle.load``: a crafted file
  runs any code on every rank that opens it;
- reads each bytes entry (every non-tensor value: step counters, scheduler state, param groups,
  strings) with ``torch.load(weights_only=False)``: the same;
- reads tensors with ``torch.load(weights_only=True)`` (safe).

Here ``.metadata`` is read by :class:`_MetadataUnpickler`, which resolves only the globals a real
metadata file names (``_compat.DCP_METADATA_GLOBALS``: what torch 2.13 writes for tensors,
DTensors and values of every kind, and what torch 2.11's identical classes pickle) and dtypes, and
refuses anything else before it runs;
bytes entries are read with ``weights_only=True`` (:class:`SafeLoadPlanner`). A plain
``dcp.load`` user gets the metadata part with
``storage_reader=dtensor_fp8.checkpoint.SafeFileSystemReader(path)``; values still go through the
load planner, and ``DefaultLoadPlanner`` reads them with ``weights_only=False``.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from .._compat import DCP_METADATA_GLOBALS, dcp_item_stream
from .checksum import (CHECKSUMS_FILE, ChecksumFileError, bytes_checksum, copy_with_checksum, entry_key, read_checksums,
                       tensor_checksum)
from .dcp_write import done as _done
from .dirs import METADATA_FILE, check_inside
from ..agreement import CheckpointError, UnsafeCheckpointError
from .errors import os_error_text
from .values import MAX_VALUE_BYTES, scan_value_pickle

# ---- .metadata without running code -----------------------------------------------------------------------
def _torch_dtype_names() -> frozenset[str]:
    return frozenset(n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype))


class _ForbiddenGlobal(pickle.UnpicklingError):
    def __init__(self, module: str, name: str):
        super().__init__(f"{module}.{name}")
        self.qualname = f"{module}.{name}"


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the globals of DCP's metadata (see the note)."""

    _dtypes: frozenset[str] | None = None

    def find_class(self, module, name):
        if (module, name) in DCP_METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch":
            if _MetadataUnpickler._dtypes is None:
                _MetadataUnpickler._dtypes = _torch_dtype_names()
            if name in _MetadataUnpickler._dtypes:
                return getattr(torch, name)
        raise _ForbiddenGlobal(module, name)

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("persistent ids are not part of DCP metadata")


def read_metadata(checkpoint_dir: str, rank: int | None = None) -> Metadata:
    """DCP's ``.metadata`` (or ``__<rank>.metadata``) of ``checkpoint_dir``, unpickled without
    running code (see the note).

    Args:
        checkpoint_dir: a DCP checkpoint directory.
        rank: read the rank-local metadata a save with ``no_dist`` / without collectives wrote.

    Raises:
        UnsafeCheckpointError: the file names a global outside DCP's metadata classes.
        CheckpointError: the file is missing or is not DCP metadata.

    Example:
        >>> md = read_metadata("ckpt/step-00000002"); sorted(md.state_dict_metadata)[:2]
    """
    file = os.path.join(os.fspath(checkpoint_dir), METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}")
    try:
        stream = open(file, "rb")
    except FileNotFoundError:
        hint = (" It is a checkpoint root: pass latest_checkpoint(root) instead."
                if os.path.exists(os.path.join(os.fspath(checkpoint_dir), "latest")) else "")
        raise CheckpointError(f"{file} not found: {checkpoint_dir} is not a complete DCP checkpoint (an interrupted "
                              f"save, a partial copy, or the wrong directory?).{hint}") from None
    with stream:
        try:
            metadata = _MetadataUnpickler(stream).load()
        except _ForbiddenGlobal as err:
            raise UnsafeCheckpointError(
                f"{file} asks to unpickle {err.qualname}, which is not one of DCP's metadata classes: refused before "
                "running anything. DCP writes only its own dataclasses, torch.Size and dtypes there; this file was "
                "crafted or written by other software. Do not load it unless you trust its source (plain "
                "torch.distributed.checkpoint.load would unpickle it with pickle, running what it names).") from None
        except Exception as err:  # noqa: BLE001  (garbage: any unpickling error)
            raise CheckpointError(
                f"{file} is not a DCP metadata file ({type(err).__name__}: {str(err)[:200]}): truncated, overwritten "
                "or not written by DCP. A save writes it last, so this directory holds no complete checkpoint: restore "
                "the file from a copy, or load another checkpoint.") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict) \
            or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{file} holds a {type(metadata).__name__} without DCP's state_dict_metadata / storage_data: "
                              "not a DCP FileSystemWriter checkpoint")
    return metadata


# ---- reading: checksums verified, the entry and file named -----------------------------------------------------
_RANK_FILE = re.compile(r"^__(\d+)_")


def file_rank_note(relative_path: str) -> str:
    m = _RANK_FILE.match(os.path.basename(relative_path))
    return f" (written by rank {m.group(1)} of the saving job)" if m else ""


def _entries_of_files(metadata: Metadata) -> dict[str, list]:
    files: dict[str, list] = {}
    for index, info in metadata.storage_data.items():
        files.setdefault(info.relative_path, []).append((index, info))
    return files


def check_files(checkpoint_dir: str, metadata: Metadata) -> None:
    """Every file ``.metadata`` refers to is a plain name inside ``checkpoint_dir`` (no symlink
    leading out), exists and holds the bytes its entries need, and no plain value claims more than
    a value may take: a missing, truncated or crafted file is named (with its entries) before any
    collective starts reading."""
    for relative, items in sorted(_entries_of_files(metadata).items()):
        file = os.path.join(checkpoint_dir, relative)
        names = sorted({index.fqn for index, _ in items})
        shown = ", ".join(names[:6]) + (f", ... ({len(names)} entries)" if len(names) > 6 else "")
        if not isinstance(relative, str) or relative in ("", ".", "..") or os.path.basename(relative) != relative \
                or "\0" in relative or (os.altsep and os.altsep in relative):
            raise CheckpointError(f"{os.path.join(checkpoint_dir, METADATA_FILE)} places {shown} in {relative!r}, which is "
                                  "not a file name inside the checkpoint directory (DCP writes only such names): the "
                                  "metadata is crafted or damaged; restore it from a copy")
        check_inside(checkpoint_dir, file, "a checkpoint's file")
        for index, info in items:
            if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata) \
                    and info.length > MAX_VALUE_BYTES:
                raise CheckpointError(
                    f"entry {index.fqn!r} in {file}: .metadata gives this plain value {info.length} stored bytes, above "
                    f"the {MAX_VALUE_BYTES} a value may take (a crafted size?); restore .metadata from a copy")
        try:
            size = os.path.getsize(file)
        except OSError:
            raise CheckpointError(
                f"{file} is missing{file_rank_note(relative)}; it holds {shown}. Copy it from where the checkpoint was "
                "written (every rank's files belong to one checkpoint), or load another checkpoint.") from None
        needed = max(info.offset + info.length for _, info in items)
        if size < needed:
            raise CheckpointError(
                f"{file}{file_rank_note(relative)} is {size} bytes, its entries ({shown}) need {needed}: truncated (an "
                "interrupted copy, a full disk?), or .metadata claims more than was written (crafted?). Restore it "
                "from a copy, or load another checkpoint.")


def check_coverage(checkpoint_dir: str, metadata: Metadata, checksums: dict) -> None:
    """``checksums.json`` holds a checksum for every stored item of ``.metadata``, in the file
    ``.metadata`` places it, and nothing else: else verification would pass over what it lacks."""
    stored = {entry_key(index.fqn, index.offset): info.relative_path for index, info in metadata.storage_data.items()}
    file = os.path.join(checkpoint_dir, CHECKSUMS_FILE)
    fix = ("restore both files from a copy of the checkpoint, or load it unverified, knowingly, with verify=False")
    lacking = sorted(k for k in stored if k not in checksums)
    extra = sorted(k for k in checksums if k not in stored)
    if lacking or extra:
        parts = ([f"lacks the checksums of {len(lacking)} stored item(s) ({', '.join(lacking[:6])})"] if lacking else []) \
            + ([f"has {len(extra)} item(s) .metadata does not store ({', '.join(extra[:6])})"] if extra else [])
        raise CheckpointError(f"{file} {' and '.join(parts)}: it does not cover this checkpoint (edited, or from "
                              f"another save), so those items could not be verified; {fix}")
    moved = sorted(k for k, rel in stored.items()
                   if not isinstance(checksums[k], dict) or checksums[k].get("file") != rel)
    if moved:
        raise CheckpointError(f"{file} places {len(moved)} item(s) in other files than .metadata does "
                              f"({', '.join(moved[:6])}): the two files are not of one save; {fix}")


# ---- opening a DCP directory: metadata, files, checksums --------------------------------------------------------
CHECKSUM_POLICIES = ("required", "if_present", "skip")


def checksum_policy(verify: bool | str | None, default: bool | str) -> str:
    """The :data:`CHECKSUM_POLICIES` entry a loader's ``verify`` argument asks for, the same in every
    loader (``load_checkpoint``, ``load_hp_checkpoint``, torchtitan's checkpointer): ``True`` requires
    ``checksums.json``, ``False`` skips it, ``"if_present"`` verifies it where it exists, and ``None``
    is the loader's own ``default`` (``load_checkpoint``: ``True``; ``load_hp_checkpoint``:
    ``"if_present"``, since it also reads directories of plain ``dcp.save``, which write none).

    Args:
        verify: the caller's argument.
        default: what ``None`` stands for in this loader (``True``, ``False`` or ``"if_present"``).

    Example:
        >>> checksum_policy(None, "if_present"), checksum_policy(True, "if_present")
        ('if_present', 'required')
    """
    chosen = default if verify is None else verify
    if chosen is True or chosen == "required":
        return "required"
    if chosen is False or chosen == "skip":
        return "skip"
    if chosen == "if_present":
        return "if_present"
    raise ValueError(f"verify={verify!r}: pass True (require checksums.json), False (skip it) or "
                     "'if_present' (verify it where it exists); None is the loader's default")


class OpenedCheckpoint(NamedTuple):
    metadata: Metadata
    checksums: dict | None  # None: not read (``"skip"``) or no checksums.json (``"if_present"``)


def open_checkpoint(path: str, checksums: str, *, missing_hint: str = "") -> OpenedCheckpoint:
    """Open the DCP checkpoint directory ``path`` without running code: ``.metadata`` through the
    allow-list (:func:`read_metadata`), every file it names inside ``path`` and long enough
    (:func:`check_files`), then ``checksums.json`` read and checked to cover every stored item
    (:func:`check_coverage`), as ``checksums`` asks. ``load_checkpoint`` and ``load_hp_checkpoint``
    both open a directory through here, each stating its policy.

    Args:
        path: the checkpoint directory.
        checksums: ``"required"`` (a missing ``checksums.json`` is refused), ``"if_present"``
            (verified where the file exists, e.g. a plain ``dcp.save`` has none) or ``"skip"``
            (not read).
        missing_hint: under ``"required"``, the text after "{file} is missing, so the checkpoint
            cannot be verified " in the error (the caller's why and fix: its switch's name).

    Returns:
        :class:`OpenedCheckpoint` ``(metadata, checksums)``; ``checksums`` is None where skipped or absent.

    Raises:
        CheckpointError: a file outside ``path``, unreadable or crafted ``.metadata``, a missing or
            short file, a ``checksums.json`` missing (``"required"``), unreadable or not covering.

    Example:
        >>> opened = open_checkpoint("ckpt/step_100", "if_present")
        >>> reader = SafeFileSystemReader("ckpt/step_100", metadata=opened.metadata, checksums=opened.checksums)
    """
    if checksums not in CHECKSUM_POLICIES:
        raise ValueError(f"open_checkpoint: checksums={checksums!r}; one of {', '.join(CHECKSUM_POLICIES)}")
    check_inside(path, os.path.join(path, METADATA_FILE), "a checkpoint's file")
    metadata = read_metadata(path)
    check_files(path, metadata)
    if checksums == "skip":
        return OpenedCheckpoint(metadata, None)
    file = os.path.join(path, CHECKSUMS_FILE)
    check_inside(path, file, "a checkpoint's file")
    try:
        stored = read_checksums(path, metadata)
    except ChecksumFileError as err:
        raise CheckpointError(str(err)) from None
    if stored is None:
        if checksums == "required":
            raise CheckpointError(f"{file} is missing, so the checkpoint cannot be verified {missing_hint}".rstrip())
        return OpenedCheckpoint(metadata, None)
    check_coverage(path, metadata, stored)
    return OpenedCheckpoint(metadata, stored)


def _narrow(tensor: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        if tensor.size(dim) != length:
            tensor = tensor.narrow(dim, start, length)
    return tensor


def _unreadable(where: str, err: BaseException) -> CheckpointError:
    cause = (os_error_text(err) if isinstance(err, OSError) and err.errno
             else f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}")
    return CheckpointError(f"{where} could not be read ({cause}): the file is damaged or not this checkpoint's; "
                           "restore it from a copy, or load another checkpoint")


def _commit(future, planner) -> None:
    req, target = future.result()  # raises the item's CheckpointError
    planner.commit_tensor(req, target)


def _plain_copy(src: torch.Tensor, dst: torch.Tensor) -> bool:
    return (src.device.type == dst.device.type == "cpu" and src.dtype == dst.dtype and src.is_contiguous()
            and dst.is_contiguous() and type(dst) is torch.Tensor)


def _refused_global(err: BaseException) -> str | None:
    """The global a ``weights_only`` load refused, if that is what ``err`` is."""
    text = str(err)
    if "Weights only load failed" not in text:
        return None
    m = re.search(r"GLOBAL ([\w.]+)", text)
    return m.group(1) if m else "a global outside torch's weights_only allow-list"


class SafeFileSystemReader(dcp.FileSystemReader):
    """``FileSystemReader`` that unpickles ``.metadata`` without running code, verifies each stored
    item's checksum as it reads it, and names the entry and file of any read that fails.

    Args:
        path: the checkpoint directory.
        metadata: ``.metadata`` already read with :func:`read_metadata` (read here when None).
        checksums: the entries of the checkpoint's ``checksums.json`` (:func:`read_checksums`), or
            None to read without verification.

    Example:
        >>> dcp.load(state, storage_reader=SafeFileSystemReader("ckpt/step-00000002"), planner=SafeLoadPlanner())
    """

    def __init__(self, path, metadata: Metadata | None = None, checksums: dict | None = None):
        super().__init__(path)
        self._metadata = metadata
        self._checksums = checksums
        self._chunks: dict = {}

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._metadata is None or kwargs.get("rank") is not None:
            self._metadata = read_metadata(self.path, kwargs.get("rank"))
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._chunks = {
            (fqn, tuple(chunk.offsets)): (md.properties.dtype, tuple(chunk.sizes))
            for fqn, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)
            for chunk in md.chunks
        }

    def read_data(self, plan, planner) -> Future:
        # DCP's own loop, plus: verification, a clear error per item (which entry, which file). With
        # checksums, an item's copy + checksum runs on a worker thread (numpy releases the GIL)
        # while the next item is read, and is committed once verified.
        per_file: dict[str, list] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        pool = ThreadPoolExecutor(1, thread_name_prefix="dtensor_fp8-verify") if self._checksums is not None else None
        pending: deque = deque()
        try:
            for relative, reqs in per_file.items():
                file = self.fs.concat_path(self.path, relative)
                try:
                    stream = self.fs.create_stream(file, "rb")
                except OSError as err:
                    raise CheckpointError(f"{file} cannot be opened{file_rank_note(relative)} ({os_error_text(err)}); "
                                          "restore it from a copy, or load another checkpoint") from None
                with stream as f:
                    for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                        step = self._read_item(f, relative, req, planner)
                        if step is None:
                            continue
                        if pool is None:
                            _commit(_done(step()), planner)
                        else:
                            pending.append(pool.submit(step))
                            while len(pending) > 1:  # at most one item read ahead
                                _commit(pending.popleft(), planner)
            while pending:
                _commit(pending.popleft(), planner)
        finally:
            if pool is not None:  # no worker writes into a target after this returns or raises
                pool.shutdown(wait=True, cancel_futures=True)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_item(self, stream, relative: str, req, planner):
        """Read one item; a bytes item is loaded here (None returned), a tensor item returns
        ``finish``: ``finish()`` verifies and copies it into its target, returning (req, target)."""
        index = req.storage_index
        info = self.storage_data[index]
        chunk = "" if index.offset is None else f" (chunk at offset {tuple(index.offset)})"
        where = f"entry {index.fqn!r}{chunk} in {os.path.join(os.fspath(self.path), relative)}{file_rank_note(relative)}"
        try:
            raw = dcp_item_stream(self, stream, info, req)
            if req.type == LoadItemType.BYTE_IO:
                if info.length > MAX_VALUE_BYTES:
                    raise CheckpointError(f"{where}: a plain value of {info.length} stored bytes, above the "
                                          f"{MAX_VALUE_BYTES} a value may take (a crafted size?)")
                data = raw.read(-1)
                self._verify(index, where, lambda: bytes_checksum(data), len(data))
                scan_value_pickle(data, where)
                try:
                    planner.load_bytes(req, io.BytesIO(data))
                except pickle.UnpicklingError as err:
                    refused = _refused_global(err)
                    if refused is None:
                        raise
                    raise UnsafeCheckpointError(
                        f"{where}: this value asks to unpickle {refused}, outside torch's weights_only allow-list: "
                        "refused before running anything (dtensor_fp8 checkpoints hold only plain values: numbers, "
                        "strings, lists, dicts, tensors). Do not load it unless you trust its source.") from None
                return None
            seekable = raw if raw.seekable() else io.BytesIO(raw.read(-1))
            stored = torch.load(seekable, map_location="cpu", weights_only=True)
            expected = self._chunks.get((index.fqn, tuple(index.offset)))
            if not isinstance(stored, torch.Tensor) or (expected and (stored.dtype, tuple(stored.shape)) != expected):
                got = (stored.dtype, tuple(stored.shape)) if isinstance(stored, torch.Tensor) else type(stored).__name__
                raise CheckpointError(f"{where} holds {got}, .metadata says {expected}: the file is corrupted or "
                                      "belongs to another checkpoint; restore it from a copy")
            tensor = _narrow(stored, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise CheckpointError(f"{where}: the state dict's chunk is {tuple(target.size())}, the stored one "
                                      f"{tuple(tensor.size())}")
        except CheckpointError:
            raise
        except Exception as err:  # noqa: BLE001  (named here, re-raised on every rank by DCP and agree())
            raise _unreadable(where, err) from err
        nbytes = stored.numel() * stored.element_size()

        def finish():
            try:
                if self._checksums is not None and tensor is stored and _plain_copy(stored, target):
                    # the whole item into a CPU target: copy and checksum in one pass
                    checksum = copy_with_checksum(stored, target)
                    self._verify(index, where, lambda: checksum, nbytes)
                else:
                    self._verify(index, where, lambda: tensor_checksum(stored), nbytes)
                    target.copy_(tensor)
            except CheckpointError:
                raise
            except Exception as err:  # noqa: BLE001
                raise _unreadable(where, err) from err
            return req, target

        return finish

    def _verify(self, index, where: str, checksum, nbytes: int) -> None:
        if self._checksums is None:
            return
        key = entry_key(index.fqn, index.offset)
        saved = self._checksums.get(key)
        if saved is None:
            raise CheckpointError(f"{where}: no checksum recorded in checksums.json (the file belongs to another "
                                  "checkpoint?); restore it, or load with verify=False")
        if saved.get("nbytes") != nbytes or saved.get("checksum") != checksum():
            raise CheckpointError(
                f"{where}: checksum mismatch, the stored bytes differ from the ones saved (corrupted on disk or in a "
                "copy). Restore the file from a copy, or load an earlier checkpoint.")


class SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's load planner over a flat dict, reading bytes entries (plain values) with
    ``weights_only=True``: DCP's own reads them with ``weights_only=False``, which runs whatever a
    crafted entry pickles."""

    def __init__(self):
        super().__init__(flatten_state_dict=False)
        self._target: dict = {}

    def set_up_planner(self, state_dict, *args, **kwargs):
        # Written into the dict we were given: ``self.state_dict`` may be a copy (torch 2.11 makes
        # one when it flattens sharded tensors).
        self._target = state_dict
        super().set_up_planner(state_dict, *args, **kwargs)

    def load_bytes(self, read_item, value):
        self._target[read_item.dest_index.fqn] = torch.load(value, weights_only=True)
