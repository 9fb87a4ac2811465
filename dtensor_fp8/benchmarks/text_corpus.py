"""Real text on every machine, without a network: the Python standard library's own ``.py`` sources,
read from the running interpreter's installation, as bytes for a byte-level language model.

Which files: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]``, except installed packages
(``site-packages``, ``dist-packages``) and the standard library's test suites (``test``,
``tests``, ``idle_test`` directories: a distribution may leave them out), in sorted order of their
paths. Held out, by file: a file whose path's CRC-32 is divisible by ``held_out_every`` (default
10: about 10 % of the files), so the split does not move when another Python version adds or
drops files. Each file's bytes end with a NUL byte (a document boundary the model sees); the
train files make one stream, the held-out files another. :meth:`Corpus.describe` says what was
used: the directory, the Python version, file and byte counts and a SHA-256 of each stream, so two
runs can tell whether they trained on the same text.

Example:
    >>> corpus = load_stdlib_corpus()
    >>> corpus.train.dtype, corpus.train.numel() > 1_000_000
    (torch.uint8, True)
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import sysconfig
import zlib
from pathlib import Path

import torch

#: directories under the standard library that are not its own sources, or not on every install
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
SEPARATOR = b"\0"


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Train and held-out byte streams (``uint8`` tensors) and where they came from."""

    root: str
    train_files: tuple[str, ...]
    held_out_files: tuple[str, ...]
    train: torch.Tensor
    held_out: torch.Tensor

    def describe(self) -> dict:
        """Plain values for a report: directory, Python, counts, bytes, hashes, the held-out files."""
        digest = lambda t: hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16]  # noqa: E731
        return {"source": "the Python standard library's .py files", "root": self.root,
                "python": platform.python_version(), "excluded_dirs": sorted(EXCLUDED_DIRS),
                "train_files": len(self.train_files), "train_bytes": self.train.numel(),
                "train_sha256_16": digest(self.train),
                "held_out_files": len(self.held_out_files), "held_out_bytes": self.held_out.numel(),
                "held_out_sha256_16": digest(self.held_out), "held_out_file_list": list(self.held_out_files)}


def stdlib_files(root: str | os.PathLike) -> list[str]:
    """The ``.py`` files under ``root`` outside :data:`EXCLUDED_DIRS`, as sorted POSIX paths
    relative to ``root``."""
    root = Path(root)
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS]  # pruned, not walked (site-packages is large)
        rel = Path(folder).relative_to(root)
        out += [(rel / f).as_posix() for f in files if f.endswith(".py")]
    return sorted(out)


def is_held_out(path: str, held_out_every: int) -> bool:
    return zlib.crc32(path.encode()) % held_out_every == 0


def load_stdlib_corpus(root: str | None = None, held_out_every: int = 10) -> Corpus:
    """Read the corpus (see the module docstring).

    Args:
        root: the standard library's directory (default: this interpreter's).
        held_out_every: a file is held out when its path's CRC-32 is a multiple of this.

    Raises:
        RuntimeError: when the directory has no source files to train on or none held out.
    """
    root = root or sysconfig.get_paths()["stdlib"]
    files = stdlib_files(root)
    held = tuple(f for f in files if is_held_out(f, held_out_every))
    train = tuple(f for f in files if not is_held_out(f, held_out_every))
    if not train or not held:
        raise RuntimeError(f"{root}: {len(train)} train and {len(held)} held-out .py files; the convergence "
                           "benchmark needs both (is this the standard library's directory? pass another with --stdlib)")

    def stream(names) -> torch.Tensor:
        data = b"".join(Path(root, n).read_bytes() + SEPARATOR for n in names)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    return Corpus(str(root), train, held, stream(train), stream(held))
