"""Loading a pretrained high-precision checkpoint into a sharded FP8 model, shard by shard."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, StorageReader

from ..state_dict import export_hp_state_dict, load_hp_state_dict
from .dcp_io import SafeFileSystemReader


def load_hp_checkpoint(model: nn.Module, path: str | None = None, *, optimizer=None,
                       storage_reader: StorageReader | None = None, strict: bool = True) -> None:
    """Load a high-precision checkpoint (a DCP directory, or a Hugging Face safetensors directory
    through ``torch.distributed.checkpoint.HuggingFaceStorageReader``) into an FP8 model, each rank
    reading only its shards: no rank materializes the whole model.

    The template is the model's :func:`export_hp_state_dict` in FP32 (DTensors laid out like the
    parameters: this rank's shards), which DCP fills; :func:`load_hp_state_dict` then quantizes
    each shard (global amaxes where a block spans ranks) and sets the masters. A model built on
    the meta device takes the values as its init (call it after ``to_empty``, instead of your init).

    Args:
        model: the FP8 model (sharded or not; built on meta and ``to_empty``-ed, or initialized).
        path: a DCP checkpoint directory (read with :class:`SafeFileSystemReader`: no code runs).
        optimizer: a :class:`MasterWeightOptimizer` whose masters take the same values.
        storage_reader: another reader instead of ``path`` (e.g. ``HuggingFaceStorageReader(dir)``;
            its keys must be the model's, as a ``transformers`` model's are in its safetensors).
        strict: every entry of the model must be in the checkpoint, and the reverse.

    Example:
        >>> from torch.distributed.checkpoint import HuggingFaceStorageReader
        >>> model.to_empty(device="cuda")
        >>> dtensor_fp8.load_hp_checkpoint(model, storage_reader=HuggingFaceStorageReader("llama-8b/"))
        >>> opt = dtensor_fp8.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-5)
    """
    if (path is None) == (storage_reader is None):
        raise ValueError("load_hp_checkpoint: pass a checkpoint path or a storage_reader (one of them)")
    reader = storage_reader if storage_reader is not None else SafeFileSystemReader(path)
    template = export_hp_state_dict(model, torch.float32, optimizer=optimizer)
    # DCP fills the template in place (its shards only) and converts the stored dtype (bf16 weights).
    dcp.load(template, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=not strict))
    load_hp_state_dict(model, template, optimizer=optimizer, strict=strict)
