"""torchtitan's checkpointer for FP8 runs: pretrained high-precision weights as the initial load,
and a final model-only save that writes what its config asks for.

[Note: what FP8CheckpointManager changes]
It is torchtitan 0.3's ``CheckpointManager`` (every field, folder layout, interval, async mode,
purge, resume), with two differences, both decided from what is on disk or in the config:

* **Loads.** A DCP checkpoint whose entries for the model's FP8 weights are plain tensors (a bf16
  or fp32 run of the same config without the converter, given as ``initial_load_path``, or a
  step folder written by such a run) loads through :func:`dtensor_fp8.load_hp_checkpoint`: each
  rank reads its shards; the FP8 bytes are quantized from the values and the masters take the
  values. Every model part on the rank is read and checked before any is written (all or
  nothing). Reading runs no code. A checkpoint holding the FP8 planes (a resume of this run)
  loads as torchtitan loads it. A Hugging Face initial load (``initial_load_in_hf``) reads the
  safetensors through the model's state-dict adapter into high-precision tensors, then loads
  them the same way (:func:`dtensor_fp8.load_hp_state_dict`).
* **The final model-only save** (``last_save_model_only``, torchtitan's default) writes each FP8
  weight's master in ``export_dtype`` (the values training holds; a plain weight is cast as
  torchtitan casts it), as DCP or, with ``last_save_in_hf``, as Hugging Face safetensors through
  the adapter: what the same model without FP8 writes. ``last_save_fp8=True`` keeps the FP8
  planes instead (dtensor_fp8's layout, which another dtensor_fp8 run reads). A full save
  (``last_save_model_only=False``) and every interval save keep the planes (a resume is exact).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.checkpointer.base import MODEL, OPTIMIZER
from torchtitan.components.checkpointer.dcp import AsyncMode

from ..checkpoint.dcp_io import read_metadata
from ..agreement import CheckpointError
from ..checkpoint.dcp_write import checkpoint_error_of
from ..checkpoint.hp import open_source, read_source
from ..formats.base import RecipeError
from ..hp_load import stage_hp_values, write_staged_hp_values
from ..entry import RECIPE_KEY
from ..state_dict import high_precision_state_dict, is_fp8

_SHOWN = 6


class _Masters:
    """The masters of every ``MasterWeightOptimizer`` of a torchtitan optimizers container, as one
    optimizer's ``master_of`` / ``masters`` (a part's param groups may span several optimizers)."""

    def __init__(self, optimizers) -> None:
        self._optimizers = [o for o in getattr(optimizers, "optimizers", []) if hasattr(o, "master_of")]

    def master_of(self, param: torch.Tensor):
        for optimizer in self._optimizers:
            master = optimizer.master_of(param)
            if master is not None:
                return master
        return None

    @property
    def masters(self) -> dict:
        return {k: v for o in self._optimizers for k, v in o.masters.items()}


#: the prefix torch's ``checkpoint_wrapper`` (torchtitan's activation checkpointing) puts in
#: parameter names and takes out of state-dict keys
_WRAPPED = "_checkpoint_wrapped_module."


def _refuse_plain_optimizers(model_parts: list, optimizers) -> None:
    """torchtitan's own ``OptimizersContainer`` over FP8 weights, refused as the trainer builds
    (it builds the checkpointer right after the optimizers, before any step): its optimizers would
    step the FP8 bytes in place, and no master holds the weights' values."""
    plain = [type(o).__qualname__ for o in getattr(optimizers, "optimizers", []) if not hasattr(o, "master_of")]
    fp8 = sorted(k for part in model_parts for k, t in _native_targets(part).items() if is_fp8(t))
    if plain and fp8:
        raise RecipeError(
            f"torchtitan's {type(optimizers).__qualname__} builds plain {', '.join(sorted(set(plain)))} optimizers over "
            f"the model's {len(fp8)} FP8 weights ({_listed(fp8)}): FP8 weights train through FP32 masters. Fix: "
            "config.optimizer = dtensor_fp8.integrations.torchtitan.master_weight_adamw(lr=...) (or "
            "MasterWeightOptimizersContainer.Config with your param groups)")


def _native_targets(part) -> dict:
    """State-dict key -> the part's own parameter or persistent buffer (no state-dict hooks run:
    torchtitan's split of the fused QKV weight cannot view an FP8 weight's planes)."""
    out = {}
    for prefix, module in part.named_modules():
        prefix = prefix.replace(_WRAPPED, "")
        for name, p in module.named_parameters(recurse=False):
            out[f"{prefix}.{name}" if prefix else name] = p
        for name, b in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = b
    return out


def _checkpoint_layout(part) -> dict:
    """Empty high-precision tensors with the keys, global shapes and placements of the part's
    state dict as torchtitan writes it (its hooks: the fused QKV weight as ``wq`` / ``wk`` /
    ``wv``): what a checkpoint of the model without FP8 holds, to read into."""
    with high_precision_state_dict(torch.float32):
        layout = {k: v for k, v in part.state_dict().items()}
    return {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v for k, v in layout.items()}


def _merged(part, values: dict) -> dict:
    """``values`` in the part's own layout: torchtitan's load hooks that reshape entries (the
    fused QKV merge) applied, as ``load_state_dict`` applies them."""
    values = dict(values)
    for prefix, module in part.named_modules():
        merge = getattr(type(module), "_merge_qkv_on_load", None)
        if merge is not None:
            prefix = prefix.replace(_WRAPPED, "")
            merge(module, values, f"{prefix}." if prefix else "")
    return values


def _check_entries(layout: dict, source, checkpoint_id: str) -> None:
    """Every entry present in the checkpoint as a tensor of its global shape, before any is read."""
    saved = source.metadata.state_dict_metadata
    problems = [f"it lacks {_listed([k for k in layout if k not in saved])}"] if any(k not in saved for k in layout) else []
    for key, value in layout.items():
        md = saved.get(key)
        if md is None or not isinstance(value, torch.Tensor):
            continue
        if not isinstance(md, TensorStorageMetadata):
            problems.append(f"{key}{source.where(key)} is not a tensor")
        elif tuple(md.size) != tuple(value.shape):
            problems.append(f"{key}{source.where(key)} is {tuple(md.size)}, the model's is {tuple(value.shape)}")
        elif value.is_floating_point() and not md.properties.dtype.is_floating_point:
            problems.append(f"{key}{source.where(key)} holds {md.properties.dtype} values for a floating weight "
                            "(nothing is converted from integers)")
    if problems:
        raise CheckpointError(f"FP8CheckpointManager: the high-precision checkpoint {checkpoint_id} is not one of this "
                              f"model config: {'; '.join(problems[:_SHOWN])}. Fix: start from a checkpoint of the same "
                              "model config. The model was not modified.")


def _hf_held(targets: dict, values: dict, what: str) -> dict:
    """The targets a Hugging Face load writes: those the model's state-dict adapter maps to a Hugging
    Face key. Qwen3's adapter maps none to the MoE load-balancing bias ``moe.expert_bias_E`` (its HF
    models have no such tensor): torchtitan's own HF load leaves such entries at their initial values,
    and so does this one, naming them in a warning (a key the adapter maps but the files lack is
    refused by DCP's reader before anything is written)."""
    kept = sorted(k for k in targets if k not in values)
    if kept:
        warnings.warn(f"{what}: the model's state-dict adapter maps no Hugging Face key to {_listed(kept)}; they keep "
                      "their initial values, as torchtitan's own Hugging Face load leaves them", stacklevel=3)
    return {k: t for k, t in targets.items() if k in values}


def _listed(keys) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:_SHOWN]) + (f", ... ({len(keys)} in all)" if len(keys) > _SHOWN else "")


class FP8CheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` for a model with FP8 parameters (see the note): a bf16 /
    fp32 checkpoint (``initial_load_path``, ``initial_load_in_hf``) starts the FP8 run, and the
    final model-only save writes high-precision weights in ``export_dtype`` (``last_save_in_hf``
    too).

    Example:
        >>> config.checkpoint = FP8CheckpointManager.Config(
        ...     enable=True, initial_load_path="/ckpt/llama3-bf16/step-1000", export_dtype="bfloat16")
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        last_save_fp8: bool = False
        """The final model-only save keeps the FP8 planes (dtensor_fp8's layout, for another
        dtensor_fp8 run) instead of the masters in ``export_dtype``."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            if self.last_save_fp8 and self.last_save_in_hf:
                raise ValueError("FP8CheckpointManager: last_save_fp8 keeps dtensor_fp8's FP8 planes, which no "
                                 "Hugging Face loader reads; last_save_in_hf writes high-precision weights. Choose one")

    def __init__(self, config: Config, *, model_parts: list, optimizers, **kwargs: Any) -> None:
        _refuse_plain_optimizers(model_parts, optimizers)
        self.last_save_fp8 = config.last_save_fp8
        super().__init__(config, model_parts=model_parts, optimizers=optimizers, **kwargs)

    # ---- loading ------------------------------------------------------------------------------------------
    def _parts(self) -> list:
        return self.states[MODEL].model

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        """torchtitan's load, except that high-precision weights load into the FP8 model through
        their owners (see the note)."""
        fp8 = {k for part in self._parts() for k, t in _native_targets(part).items() if is_fp8(t)}
        if not fp8:
            return CheckpointManager.dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized)
        if from_hf:
            if from_quantized:
                raise CheckpointError(
                    f"FP8CheckpointManager: initial_load_in_hf_quantized dequantizes a quantized Hugging Face "
                    f"checkpoint ({checkpoint_id}); an FP8 run starts from high-precision values. Fix: load the "
                    "bf16 release with initial_load_in_hf_quantized=False")
            return self._load_hp(checkpoint_id, hf=True)
        saved = read_metadata(checkpoint_id).state_dict_metadata
        if any(f"{k}.{RECIPE_KEY}" in saved for k in fp8):  # this run's own planes (a resume)
            return CheckpointManager.dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized)
        if OPTIMIZER in state_dict:
            raise CheckpointError(
                f"FP8CheckpointManager: {checkpoint_id} holds high-precision weights (a run without FP8), which "
                "load as the model's initial values only: its optimizer state is over other parameters. Fix: "
                "checkpoint.initial_load_model_only=True (torchtitan's default)")
        self._load_hp(checkpoint_id, hf=False)

    def _load_hp(self, checkpoint_id: str, *, hf: bool) -> None:
        """Every model part read (this rank's shards) and checked, then all written (see the note)."""
        masters = _Masters(self.states[OPTIMIZER])
        what = f"FP8CheckpointManager({'initial_load_in_hf ' if hf else ''}{checkpoint_id})"
        source = None if hf else open_source(checkpoint_id, None)
        staged = []
        for part in self._parts():
            layout = _checkpoint_layout(part)
            if hf:
                values = self._read_hf(layout, checkpoint_id)
            else:
                _check_entries(layout, source, checkpoint_id)
                read_source(layout, source.reader, None)
                values = layout
            targets, values = _native_targets(part), _merged(part, values)
            if hf:
                targets = _hf_held(targets, values, what)
            staged.append(stage_hp_values(part, values, masters, targets=targets,
                                          where=source.where if source else None, what=what)[0])
        for part, values in zip(self._parts(), staged):
            write_staged_hp_values(part, values)

    def _read_hf(self, layout: dict, checkpoint_id: str) -> dict:
        """Hugging Face safetensors through the model's state-dict adapter (torchtitan's HF load)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        if self.sd_adapter is None:
            raise CheckpointError("FP8CheckpointManager: initial_load_in_hf needs the model spec's state_dict_adapter")
        hf = self.sd_adapter.to_hf(layout)
        try:
            dcp.load(hf, storage_reader=self.sd_adapter.get_hf_storage_reader(checkpoint_id, False))
        except CheckpointException as err:
            raise checkpoint_error_of(err) from None
        return self.sd_adapter.from_hf(hf)

    # ---- the final save -----------------------------------------------------------------------------------------
    def _save_last_step(self, curr_step: int) -> None:
        if not self.last_save_model_only or self.last_save_fp8:
            return CheckpointManager._save_last_step(self, curr_step)
        with high_precision_state_dict(self.export_dtype, optimizer=_Masters(self.states[OPTIMIZER])):
            states = {k: v for part in self._parts() for k, v in part.state_dict().items()}
        states = {k: v.to(self.export_dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                  for k, v in states.items()}
        self.dcp_save(states, checkpoint_id=self._create_checkpoint_id(curr_step), async_mode=AsyncMode.DISABLED,
                      enable_garbage_collection=True, to_hf=self.last_save_in_hf)
