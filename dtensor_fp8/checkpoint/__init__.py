"""DCP checkpoints of FP8 models: atomic per step, no code run when opened, corruption detected,
errors that name the entry, file and rank (and surface on every rank).

- :func:`save_checkpoint` / :func:`load_checkpoint` / :func:`latest_checkpoint` (``save_load.py``);
- the directory layout and the ``latest`` pointer (``dirs.py``);
- DCP reading / writing without unpickling code, with checksums (``dcp_io.py``, ``checksum.py``;
  DCP's internals only through ``dtensor_fp8/_compat.py``);
- errors, and one error on every rank (``errors.py``);
- a pretrained high-precision checkpoint loaded into a sharded FP8 model (``hp.py``).
"""

from .dcp_io import SafeFileSystemReader, read_metadata
from .errors import CheckpointError, CheckpointRecipeError, UnsafeCheckpointError
from .hp import load_hp_checkpoint
from .save_load import LoadResult, latest_checkpoint, load_checkpoint, save_checkpoint

__all__ = [
    "CheckpointError", "CheckpointRecipeError", "LoadResult", "SafeFileSystemReader", "UnsafeCheckpointError",
    "latest_checkpoint", "load_checkpoint", "load_hp_checkpoint", "read_metadata", "save_checkpoint",
]
