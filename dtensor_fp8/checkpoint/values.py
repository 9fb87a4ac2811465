"""Plain values in checkpoints: bounded before they are unpickled, checked against the state dict's
template before they are used, and equal on every rank when they are saved.

[Note: plain values]
DCP stores each value that is not a tensor (step counters, scheduler state, param groups, strings)
as one ``torch.save`` pickle. ``load_checkpoint`` reads it with ``weights_only=True`` (no code runs)
and, beyond that:

- before unpickling: the stored item is at most :data:`MAX_VALUE_BYTES`, and every length the
  pickle declares (a string, bytes) fits in the bytes it holds (``pickletools`` walks the opcodes
  without building anything), so a crafted 4 GiB string is named as such, not as an ``IndexError``;
- after unpickling, before anything is written into the state dict: the value has the kind of the
  template's value at that key (``check_value``): numbers for numbers (int and float alike, not
  bool), bool for bool, str, bytes, None only where the template holds None, a list / tuple /
  dict where the template has one, and so on inside it: a dict's values against the template's
  values of the same keys, a list's elements against the template's elements at the same index
  (past its end, against its last one: lists such as a param group's ``params`` grow with the
  model); at most :data:`MAX_VALUE_DEPTH` levels deep and :data:`MAX_VALUE_ITEMS` items in all
  (shared references counted each time). Lengths and keys may differ (``strict=False`` loads a
  model of another depth). A template value of None, an empty container, or a key the template
  lacks accepts any bounded value: put None in the template for a value whose kind changes.

DCP writes one copy of a plain value, and of a tensor that is not sharded, for all ranks (its
planner de-duplicates them): a value that differs between ranks would be saved as one rank's, and
every rank would load that one. So ``save_checkpoint`` compares each rank's digest of each such
entry, and of each replica of a replicated DTensor chunk, and refuses a difference naming the
entry and the ranks (``replica_digests`` / ``refuse_divergence``). The cost is one checksum pass
over those entries (``checksum.py``'s, 10-19 GB/s on the CPU) and a pickle of each plain value:
nothing for the sharded entries of FSDP2 state dicts, a pass over the replicated shards under
HSDP; none on one rank. A DTensor on a mesh smaller than the saving group (pipeline stages, each
on its own mesh; TP replicas) may be held under the same name by ranks of another mesh: two
stages holding the same block (a mistake in the stage split), each sharded by FSDP2, would each
write their rows under one name and DCP keep one copy of each chunk, so a resume would give one
stage the other's rows. Each chunk of such an entry is digested too, keyed by its offset, and a
difference refused: a pass over the entries of meshes smaller than the save, none otherwise.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import pickletools
import zipfile

import torch
from torch.distributed.tensor import DTensor

from .._compat import dtensor_chunk_offset, flatten_state_dict
from .checksum import tensor_checksum
from ..agreement import CheckpointError

#: the largest plain value a checkpoint may store, in stored (pickled) bytes
MAX_VALUE_BYTES = 256 << 20
#: the deepest nesting of lists / tuples / dicts a plain value may have
MAX_VALUE_DEPTH = 64
#: the most items (containers, keys and scalars) a plain value may hold
MAX_VALUE_ITEMS = 10_000_000

_FIX = ("Fix: load into a state dict built as the checkpoint was saved (the same model, optimizer, scheduler "
        "and values); a template value of None (or an empty container) accepts any bounded value there")


def scan_value_pickle(data: bytes, where: str) -> None:
    """Before ``torch.load``: a stored value's size is bounded and its pickle declares no length it
    does not hold (see the note).

    Args:
        data: the stored bytes of one plain value (DCP's ``torch.save`` archive of it).
        where: the entry and file, for the message.

    Example:
        >>> scan_value_pickle(stored_bytes, "entry 'step' in ckpt/step-00000002/__0_0.distcp")
    """
    if len(data) > MAX_VALUE_BYTES:
        raise CheckpointError(f"{where}: a plain value of {len(data)} stored bytes, above the {MAX_VALUE_BYTES} a value "
                              "may take (a crafted size?); store large data as tensors")
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile:
        return  # torch's legacy format: torch.load reads (and names) it
    with archive:
        pickles = [i for i in archive.infolist() if i.filename == "data.pkl" or i.filename.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise CheckpointError(f"{where}: the stored value is a zip archive with {len(pickles)} data.pkl members, "
                                  "not one torch.save'd value (crafted or damaged); restore the file from a copy")
        info = pickles[0]
        if info.file_size > MAX_VALUE_BYTES or (info.compress_type == zipfile.ZIP_STORED and info.file_size > len(data)):
            raise CheckpointError(f"{where}: the value's archive declares a {info.file_size}-byte pickle in "
                                  f"{len(data)} stored bytes (a crafted size); restore the file from a copy")
        try:
            body = archive.read(info)
        except Exception as err:  # noqa: BLE001  (zipfile raises several kinds on damaged data)
            raise CheckpointError(f"{where}: the value's archive cannot be read ({type(err).__name__}: {err}): "
                                  "damaged or crafted; restore the file from a copy") from None
    try:
        for _ in pickletools.genops(body):
            pass
    except Exception as err:  # noqa: BLE001  (ValueError for a declared length beyond the data, unknown opcodes)
        raise CheckpointError(f"{where}: the value's pickle is malformed: {err} (a crafted size, or a truncated or "
                              "damaged entry); restore the file from a copy, or load another checkpoint") from None


# ---- loaded values against the template ---------------------------------------------------------------------
def _brief(x) -> str:
    """A short description of ``x`` that never recurses (a crafted value may nest a million deep)."""
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor {tuple(x.shape)}"
    if isinstance(x, (list, tuple, dict, set, frozenset)):
        return f"a {type(x).__name__} of {len(x)} item{'' if len(x) == 1 else 's'}"
    if isinstance(x, (str, bytes)):
        return f"{type(x).__name__} {x[:40]!r}{f'... ({len(x)} long)' if len(x) > 40 else ''}"
    if x is None or isinstance(x, (bool, int, float, complex)):
        return f"{type(x).__name__} {repr(x)[:40]}"
    return f"a {type(x).__name__}"


def _same_kind(value, template) -> bool:
    if template is None:
        return True
    if value is None:
        return False
    if isinstance(template, bool):
        return isinstance(value, bool)
    if isinstance(template, (int, float)):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    for kind in (str, bytes, dict, torch.Tensor):
        if isinstance(template, kind):
            return isinstance(value, kind)
    return type(value) is type(template)  # list vs tuple, torch.Size, dtypes, devices, sets


class _Walk:
    def __init__(self, where: str):
        self.where = where
        self.items = 0

    def fail(self, path: str, problem: str) -> CheckpointError:
        at = f" at {path}" if path else ""
        return CheckpointError(f"{self.where}{at}: {problem}. {_FIX}")

    def check(self, value, template, path: str, depth: int) -> None:
        self.items += 1
        if self.items > MAX_VALUE_ITEMS:
            raise self.fail(path, f"the value holds more than {MAX_VALUE_ITEMS} items (crafted? large data belongs in "
                                  "tensors)")
        if depth > MAX_VALUE_DEPTH:
            raise self.fail(path, f"the value nests deeper than {MAX_VALUE_DEPTH} levels (crafted?)")
        if not _same_kind(value, template):
            raise self.fail(path, f"the checkpoint holds {_brief(value)} where the state dict holds {_brief(template)}")
        if isinstance(value, dict):
            shape = template if isinstance(template, dict) else {}
            for k, v in value.items():
                self.check(k, None, path, depth + 1)
                self.check(v, shape.get(k) if _hashable(k) else None, f"{path}[{k!r}]", depth + 1)
        elif isinstance(value, (list, tuple, set, frozenset)):
            shape = template if isinstance(template, (list, tuple)) and template else None
            for i, v in enumerate(value):
                # beyond the template's length, against its last element (a list of one kind grows)
                self.check(v, None if shape is None else shape[min(i, len(shape) - 1)], f"{path}[{i}]", depth + 1)
        elif isinstance(value, torch.Tensor) and isinstance(template, torch.Tensor):
            if value.dtype != template.dtype or value.shape != template.shape:
                raise self.fail(path, f"the checkpoint holds {_brief(value)} where the state dict holds {_brief(template)}")


def _hashable(key) -> bool:
    try:
        hash(key)
    except TypeError:
        return False
    return True


def check_value(value, template, where: str) -> None:
    """Raise a :class:`CheckpointError` naming ``where`` and the position inside the value unless
    ``value`` has ``template``'s kind and stays within the bounds (see the note).

    Args:
        value: a plain value read from a checkpoint.
        template: the state dict's value at the same key.
        where: the entry and file, for the message.

    Example:
        >>> check_value((0.9, 0.999), (0.9, 0.95), "entry 'optim.param_groups.0.betas'")
    """
    _Walk(where).check(value, template, "", 0)


# ---- equal on every rank at save ---------------------------------------------------------------------------
def _tensor_digest(t: torch.Tensor) -> str:
    return f"{t.dtype}{tuple(t.shape)}:{tensor_checksum(t.detach())}"


def replica_digests(state_dict: dict, ranks: int = 1) -> dict[str, str]:
    """This rank's digest of every entry DCP stores once for several ranks: plain values, tensors
    that are not DTensors, replicated DTensor chunks (keyed by their coordinates on the mesh's
    sharded dimensions), and every chunk of a DTensor whose mesh spans fewer than ``ranks`` ranks
    (keyed by its offset in the tensor: other ranks may hold the same entry on another mesh, see
    the note). Compared across ranks by :func:`refuse_divergence`.

    Args:
        state_dict: what this rank is about to save.
        ranks: how many ranks save together (the size of the save's process group).

    Example:
        >>> replica_digests({"step": 3, "rng": torch.get_rng_state()})  # {"rng": "torch.uint8(5056,):...", "step": ...}
    """
    flat, _ = flatten_state_dict(state_dict)
    out = {}
    for key, value in flat.items():
        try:
            if isinstance(value, DTensor) and value.device_mesh.size() < ranks:
                out[f"{key}@chunk[{','.join(map(str, dtensor_chunk_offset(value)))}]"] = _tensor_digest(value.to_local())
            elif isinstance(value, DTensor):
                coordinate = value.device_mesh.get_coordinate()
                if coordinate is None or not any(p.is_replicate() for p in value.placements):
                    continue
                chunk = ",".join("*" if p.is_replicate() else str(c) for c, p in zip(coordinate, value.placements))
                out[f"{key}@mesh[{chunk}]"] = _tensor_digest(value.to_local())
            elif isinstance(value, torch.Tensor):
                out[key] = _tensor_digest(value)
            else:
                out[key] = _value_digest(value)
        except Exception:  # noqa: BLE001  (not picklable / not plain bytes: DCP's own save names it)
            continue
    return out


def _canonical(value, depth: int = 0) -> bytes:
    """Bytes equal for values equal by ``==`` of the same kinds: sets and dicts in a sorted order
    (a set of strings iterates, and pickles, in another order in each process: string hashes are
    salted per process), other plain values by type and ``repr``, anything else pickled."""
    if depth > MAX_VALUE_DEPTH:
        raise RecursionError("too deep to compare by value")
    kind = type(value).__name__.encode()
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return kind + b":" + repr(value).encode() + b";"
    if isinstance(value, torch.Tensor):
        return kind + b":" + _tensor_digest(value).encode() + b";"
    if isinstance(value, dict):
        items = sorted(_canonical(k, depth + 1) + b"=" + _canonical(v, depth + 1) for k, v in value.items())
        return kind + b"{" + b"".join(items) + b"}"
    if isinstance(value, (set, frozenset)):
        return kind + b"{" + b"".join(sorted(_canonical(v, depth + 1) for v in value)) + b"}"
    if isinstance(value, (list, tuple)):
        return kind + b"[" + b"".join(_canonical(v, depth + 1) for v in value) + b"]"
    return kind + b"!" + pickle.dumps(value, protocol=4) + b";"


def _value_digest(value) -> str:
    """A digest of a plain value, equal on two ranks exactly when their values are equal (see
    :func:`_canonical`); a value nested too deep to walk is compared by its pickle."""
    try:
        data = _canonical(value)
    except RecursionError:
        data = pickle.dumps(value, protocol=4)
    return hashlib.sha256(data).hexdigest()


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def refuse_divergence(everyone: list[dict]) -> None:
    """Raise on every rank alike if an entry's digest differs between the ranks that hold it.

    Args:
        everyone: :func:`replica_digests` of each rank, in rank order.

    Example:
        >>> refuse_divergence([{"step": "a"}, {"step": "b"}])  # CheckpointError: ... rank 0 / rank 1 hold different values
    """
    bad = []
    for key in sorted(set().union(*everyone)):
        groups: dict[str, list[int]] = {}
        for rank, digests in enumerate(everyone):
            if key in digests:
                groups.setdefault(digests[key], []).append(rank)
        if len(groups) > 1:
            bad.append((key, sorted(groups.values())))
    if not bad:
        return
    parts = []
    for key, groups in bad[:6]:
        name, _, chunk = key.partition("@mesh[")
        name, _, offset = name.partition("@chunk[")
        what = f"entry {name!r}" + (f" (the replicas of its chunk at mesh coordinate [{chunk})" if chunk else "")
        if offset:  # held on meshes that do not span the save: by two pipeline stages, or by diverged replicas
            what += (f" (its chunk at offset [{offset}, held on different device meshes: two pipeline stages holding "
                     "the same block, each saving its own rows under one name? give every block to one stage)")
        parts.append(f"{what}: " + " / ".join(_ranks(g) for g in groups) + " hold different values")
    more = f"; ... ({len(bad)} entries in all)" if len(bad) > 6 else ""
    raise CheckpointError(
        f"refusing to save: {len(bad)} entr{'y differs' if len(bad) == 1 else 'ies differ'} between ranks where DCP "
        f"stores one copy for all of them (plain values, tensors that are not sharded, replicated DTensor chunks), so "
        f"all but one rank's would be lost: {'; '.join(parts)}{more}. Fix: make them equal on every rank (a missed "
        "broadcast or all-reduce?), or give each rank's value a key of its own (e.g. f'rng_state.{rank}')")
