"""Checksums of checkpoint entries, and the plain-JSON file that holds them.

[Note: why block sums and not crc32]
A checkpoint entry is verified where DCP reads it, so the checksum's cost adds to every load. On
the 2-core CPU machine of this project DCP saves 1 GiB in 0.8-5 s and loads it in 0.5-4 s from
the page cache (the host is shared: times move 5x between runs); the stdlib's fastest hashes,
``zlib.crc32`` / ``adler32`` at 2-4 GB/s on one thread, would add 10-25 % to a load. The checksum
here is a reduction numpy (CPU, one thread, GIL released) or torch (CUDA) vectorizes: the entry's
bytes in 4 KiB blocks, each block summed as 512 little-endian 64-bit words (modulo 2**64: exact
and order-independent, so CPU and CUDA, numpy and torch, torch 2.11 and 2.13 agree), and SHA-256
over the block sums, the entry's length and the bytes of a partial last block; 10-19 GB/s here.
On save it runs on a worker thread beside DCP's writing; on load it is fused with the copy into
the target (:func:`copy_with_checksum`). ``python -m dtensor_fp8.benchmarks checkpoint``
measures it against DCP's own save / load and the stdlib hashes.

What it detects: accidental damage -- flipped bits, overwritten, zeroed or stale bytes, a block
written in the wrong place, truncation -- missing random damage with a probability of about
2**-64. What it misses: 8-byte words permuted within one 4 KiB block, and deliberate edits that
keep every block's word sum; it is a guard against corruption, not against tampering.

The checksums live in a file of plain values beside DCP's ``.metadata``
(:data:`CHECKSUMS_FILE`), so ``.metadata`` keeps only DCP's own classes and plain torch reads the
checkpoint without dtensor_fp8.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys

import numpy as np
import torch

#: the file beside ``.metadata`` holding one checksum per stored item
CHECKSUMS_FILE = "checksums.json"
ALGORITHM = "sha256-of-4KiB-int64-block-sums"
FORMAT_VERSION = 1
BLOCK_BYTES = 4096


class ChecksumFileError(ValueError):
    """A checksum file that cannot be read (the message names the file and the fix)."""


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)  # logical order (a copy only for non-contiguous tensors)
    if flat.dtype.itemsize > 1 and flat.numel() == 0:
        return flat.new_empty(0, dtype=torch.uint8)
    return flat.view(torch.uint8)


def tensor_checksum(t: torch.Tensor) -> str:
    """Checksum of a tensor's bytes in logical (row-major) order, on the tensor's own device (see the note).

    Args:
        t: any dense tensor (CPU or CUDA, any dtype, contiguous or not).

    Returns:
        A hex digest; equal for equal bytes whatever the device, strides or torch version.

    Example:
        >>> tensor_checksum(torch.arange(4.0)) == tensor_checksum(torch.arange(4.0).cuda())
        True
    """
    data = _flat_bytes(t)
    whole = data.numel() - data.numel() % BLOCK_BYTES
    sums = _block_sums(data[:whole]) if whole else np.zeros(0, dtype=np.int64)
    return _digest(data.numel(), sums, data[whole:].cpu().numpy().tobytes())


def _digest(n: int, sums: np.ndarray, tail: bytes) -> str:
    digest = hashlib.sha256(n.to_bytes(8, "little"))
    digest.update(_little_endian(sums))
    digest.update(tail)
    return digest.hexdigest()


#: bytes per piece of :func:`copy_with_checksum` (a piece's second read comes from the cache)
_PIECE_BYTES = 256 * BLOCK_BYTES


def copy_with_checksum(src: torch.Tensor, dst: torch.Tensor) -> str:
    """``dst.copy_(src)`` for CPU tensors of the same dtype, contiguous, and :func:`tensor_checksum`
    of ``src``, in one pass: piece by piece (1 MiB), each piece summed while it is in the cache, so
    verifying a loaded item costs little more than the copy DCP makes anyway.

    Example:
        >>> dst = torch.empty(1000); copy_with_checksum(torch.arange(1000.0), dst) == tensor_checksum(dst)
        True
    """
    if not (src.device.type == dst.device.type == "cpu" and src.dtype == dst.dtype and src.shape == dst.shape
            and src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("copy_with_checksum needs contiguous CPU tensors of one dtype and shape")
    a, b = _flat_bytes(src).numpy(), _flat_bytes(dst).numpy()
    n = a.size
    whole = n - n % BLOCK_BYTES
    aligned = a.ctypes.data % 8 == 0
    sums = []
    # numpy: one thread, the GIL released (see _block_sums)
    for start in range(0, whole, _PIECE_BYTES):
        piece = a[start:min(start + _PIECE_BYTES, whole)]
        np.copyto(b[start:start + piece.size], piece)
        words = (piece if aligned else piece.copy()).view(np.int64)
        sums.append(np.add.reduce(words.reshape(-1, BLOCK_BYTES // 8), axis=1))
    np.copyto(b[whole:], a[whole:])
    return _digest(n, np.concatenate(sums) if sums else np.zeros(0, dtype=np.int64), a[whole:].tobytes())


def _block_sums(body: torch.Tensor) -> np.ndarray:
    """Per 4 KiB block, the sum of its 512 int64 words modulo 2**64 (numpy and torch wrap alike)."""
    if body.device.type == "cpu":
        # numpy: one thread that releases the GIL. torch's reduction would split over the intra-op
        # threads, which on a host shared by several ranks mostly wait for each other (4-10x slower
        # here with 2 ranks on 2 cores).
        flat = body.numpy()
        if flat.ctypes.data % 8:  # a view starting off an 8-byte boundary
            flat = flat.copy()
        return np.add.reduce(flat.view(np.int64).reshape(-1, BLOCK_BYTES // 8), axis=1)
    try:
        words = body.view(torch.int64)
    except RuntimeError:  # a view starting off an 8-byte boundary
        words = body.clone().view(torch.int64)
    return words.view(-1, BLOCK_BYTES // 8).sum(dim=1).cpu().numpy()


def bytes_checksum(data) -> str:
    """:func:`tensor_checksum` of a bytes-like object (a DCP bytes entry as stored).

    Example:
        >>> bytes_checksum(b"abc") == tensor_checksum(torch.tensor([97, 98, 99], dtype=torch.uint8))
        True
    """
    copy = bytearray(data)  # bytes entries are small (pickled plain values); a writable copy for torch
    if not copy:
        return tensor_checksum(torch.empty(0, dtype=torch.uint8))
    return tensor_checksum(torch.frombuffer(copy, dtype=torch.uint8))


def _little_endian(array) -> bytes:
    if sys.byteorder != "little":
        array = array.byteswap()
    return array.tobytes()


# ---- the checksum file --------------------------------------------------------------------------------------
def entry_key(fqn: str, offset) -> str:
    """The key of one stored item (a state-dict entry's chunk) in the checksum file: sharding
    independent, so a rank of any world size finds the checksum of every item it reads."""
    return fqn if offset is None else f"{fqn}@{','.join(str(int(o)) for o in offset)}"


def write_checksums(path: str, checksums: dict[str, dict], sync: bool = True) -> None:
    """Write ``{entry_key: {"checksum": hex, "nbytes": n, "file": name}}`` as :data:`CHECKSUMS_FILE`
    of the checkpoint directory ``path`` (atomically: a temporary file renamed)."""
    doc = {"format": "dtensor_fp8 checkpoint checksums", "version": FORMAT_VERSION, "algorithm": ALGORITHM,
           "entries": dict(sorted(checksums.items()))}
    final = os.path.join(path, CHECKSUMS_FILE)
    tmp = final + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=0)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, final)


#: the deepest nesting a checksum file may have (its own is 3: the document, ``entries``, an entry)
MAX_CHECKSUM_DEPTH = 8
#: bytes a checksum file may hold per stored item beyond the item's key and file name, and in all
#: beyond those (what ``write_checksums`` writes is about 110 and 150)
_BYTES_PER_ITEM, _BYTES_BESIDES = 512, 64 << 10


def checksum_file_limit(metadata) -> int:
    """The most bytes the checksum file of a checkpoint with DCP ``metadata`` may take: what
    :func:`write_checksums` writes for its stored items, with room to spare."""
    return _BYTES_BESIDES + sum(len(entry_key(index.fqn, index.offset)) + len(str(info.relative_path)) + _BYTES_PER_ITEM
                                for index, info in metadata.storage_data.items())


def _nesting(text: str) -> int:
    """How deep ``[`` / ``{`` nest in JSON ``text`` (strings skipped), without parsing it."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text).encode()
    if not bare:
        return 0
    chars = np.frombuffer(bare, dtype=np.uint8)
    step = ((chars == ord("[")) | (chars == ord("{"))).astype(np.int64) - ((chars == ord("]")) | (chars == ord("}")))
    return int(np.cumsum(step).max(initial=0))


def read_checksums(path: str, metadata=None) -> dict[str, dict] | None:
    """The entries of ``path``'s :data:`CHECKSUMS_FILE`, or None where there is none (a checkpoint
    written by plain ``dcp.save``). Bounded before it is parsed: in size by what the checkpoint's
    ``metadata`` stores (:func:`checksum_file_limit`), and in depth (:data:`MAX_CHECKSUM_DEPTH`).

    Raises:
        ChecksumFileError: the file exists but is not a checksum file this version reads.
    """
    file = os.path.join(path, CHECKSUMS_FILE)
    if not os.path.exists(file):
        return None
    fix = "restore it from a copy of the checkpoint, or load without verification (verify=False)"
    limit = checksum_file_limit(metadata) if metadata is not None else None
    try:
        size = os.path.getsize(file)
        if limit is not None and size > limit:
            raise ChecksumFileError(
                f"{file} is {size} bytes, more than the {limit} the checksums of this checkpoint's "
                f"{len(metadata.storage_data)} stored items take (entries it does not store? crafted?); {fix}")
        with open(file) as f:
            text = f.read()
        depth = _nesting(text)
        if depth > MAX_CHECKSUM_DEPTH:
            raise ChecksumFileError(f"{file} nests {depth} levels deep; a checksum file nests "
                                    f"{MAX_CHECKSUM_DEPTH} at most (crafted or damaged); {fix}")
        doc = json.loads(text)
    except ChecksumFileError:
        raise
    except (OSError, ValueError, RecursionError) as err:
        raise ChecksumFileError(f"{file} is not readable JSON ({type(err).__name__}: {str(err)[:200]}); {fix}") from None
    if not isinstance(doc, dict) or doc.get("algorithm") != ALGORITHM or not isinstance(doc.get("entries"), dict):
        raise ChecksumFileError(
            f"{file} is not a checksum file of algorithm {ALGORITHM!r} (format {FORMAT_VERSION}): "
            f"found algorithm {doc.get('algorithm') if isinstance(doc, dict) else None!r}; {fix}")
    return doc["entries"]
