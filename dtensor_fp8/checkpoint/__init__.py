"""DCP checkpoints of FP8 models: atomic per step, one job per root, no code run when opened,
corruption detected, loads that change nothing unless they succeed, errors that name the entry,
file and rank (and surface on every rank).

- :func:`save_checkpoint` / :func:`load_checkpoint` / :func:`latest_checkpoint` (``save_load.py``);
- the directory layout, the ``latest`` pointer, no symlink escapes (``dirs.py``); one job per
  root (``owner.py``);
- DCP reading without unpickling code, with checksums (``dcp_io.py``, ``checksum.py``; DCP's
  internals only through ``dtensor_fp8/_compat.py``); writing, failures named (``dcp_write.py``);
- plain values bounded, checked against the template, equal on every rank (``values.py``);
- errors, and one error on every rank (``dtensor_fp8/agreement.py``; ``errors.py``: OS errors' text);
- a pretrained high-precision checkpoint loaded into a sharded FP8 model (``hp.py``).
"""

from .dcp_io import SafeFileSystemReader, read_metadata
from ..agreement import CheckpointError, CheckpointRecipeError, UnsafeCheckpointError
from .hp import load_hp_checkpoint
from .save_load import LoadResult, latest_checkpoint, load_checkpoint, save_checkpoint

__all__ = [
    "CheckpointError", "CheckpointRecipeError", "LoadResult", "SafeFileSystemReader", "UnsafeCheckpointError",
    "latest_checkpoint", "load_checkpoint", "load_hp_checkpoint", "read_metadata", "save_checkpoint",
]
