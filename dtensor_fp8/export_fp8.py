"""FP8 weights for serving: the Hugging Face FP8 layout, written from the trained planes as they are.

[Note: what export_fp8_hf writes]
The layout transformers (``FineGrainedFP8Config``, ``quant_method: "fp8"``) and vLLM load, which
DeepSeek-V3's and Qwen3-FP8's releases use: for each FP8 weight ``<module>.weight``, its FP8 bytes
as a ``float8_e4m3fn`` tensor, and ``<module>.weight_scale_inv``, its float32 dequantization
multipliers (value = fp8 x scale_inv): one per 128x128 block (``weight_block_size: [128, 128]``,
dtensor_fp8's ``blockwise2d``) or one per tensor, a 0-d tensor (``weight_block_size: null``,
the per-tensor recipes ``delayed`` / ``current``). They are the rowwise plane's bytes and scales,
copied, never dequantized and requantized. Every other tensor is written in high precision
(``dtype``, default bf16), as such releases hold embeddings, norms and the output head; Linear
layers left in high precision are listed in ``quantization_config.modules_to_not_convert``.

MXFP8 (E8M0 scales per 1x32 block) and 1x128 blocks (``blockwise1d``) are refused, naming the
weights: transformers' and vLLM's FP8 linear layers read float32 scales per 128x128 block or per
tensor, so those planes have no loader in this layout (export them in high precision with
``export_hp_state_dict``).

Sharded models: files are sharded safetensors (one per rank of the model's mesh, with
``model.safetensors.index.json``); each rank writes its files. safetensors holds whole tensors,
so each tensor is gathered, one at a time, and kept only by the rank whose file holds it: no rank
holds more than its own files' tensors and one more. The files are written into ``<path>.partial``
and moved to ``path`` only when every rank has written its part (all or nothing).
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .agreement import agreement_group, agree_over
from .formats.base import ROWWISE, RecipeError
from .entry import plane_key
from .placement import local_tensor
from .state_dict import is_fp8, hp_targets, plane_entries

#: the Hugging Face FP8 layout's block (transformers' default ``weight_block_size``)
HF_BLOCK = (128, 128)
_SCALE_SUFFIX = "_scale_inv"


def hf_weight_block_size(recipe) -> list[int] | None:
    """The ``weight_block_size`` of the Hugging Face FP8 layout that holds ``recipe``'s weights:
    ``[128, 128]``, or ``None`` for one scale per tensor; a :class:`RecipeError` with the reason
    for a recipe that layout cannot hold.

    Args:
        recipe: a dtensor_fp8 recipe.

    Example:
        >>> hf_weight_block_size(dtensor_fp8.RECIPES["blockwise2d"])
        [128, 128]
    """
    block = recipe.block_shape(ROWWISE)
    extents = (block.rows, block.cols)
    if recipe.fp8_dtype != torch.float8_e4m3fn:
        raise RecipeError(f"{recipe.name}: its weights are {recipe.fp8_dtype}; the Hugging Face FP8 layout holds "
                          "float8_e4m3fn weights. Fix: train the weights in E4M3 (fp8_dtype=torch.float8_e4m3fn)")
    if recipe.scale_inv_dtype == torch.float32 and extents in ((None, None), HF_BLOCK):
        return None if extents == (None, None) else list(HF_BLOCK)
    raise RecipeError(
        f"{recipe.name}: its weights hold one {recipe.scale_inv_dtype} scale per {block} block; the Hugging Face FP8 "
        "layout (transformers' FineGrainedFP8 and vLLM's FP8 linear layers) reads float32 scales per 128x128 block "
        "or per tensor, so no loader there reads these planes as trained. Fix: train with blockwise2d (128x128) or "
        "a per-tensor recipe (current, delayed) to serve FP8; or export high-precision weights with "
        "dtensor_fp8.export_hp_state_dict")


def export_fp8_hf(model: nn.Module, path: str, *, dtype: torch.dtype = torch.bfloat16, config: dict | None = None,
                  key_map=None) -> dict:
    """Write ``model`` as a Hugging Face FP8 checkpoint (see the note): its FP8 weights' trained
    bytes and scales as ``float8_e4m3fn`` ``weight`` + float32 ``weight_scale_inv``, every other
    tensor in ``dtype``, sharded safetensors, an index and ``config.json`` with the
    ``quantization_config``. Call it on every rank of the model's mesh.

    Args:
        model: a model with FP8 parameters (sharded or not), all of one Hugging Face layout
            (blockwise2d, or per-tensor recipes).
        path: the output directory (must not exist yet).
        dtype: the dtype of the high-precision tensors.
        config: the model's ``config.json`` dict (default: ``model.config.to_dict()`` of a
            transformers model); ``quantization_config`` is set in it.
        key_map: state-dict key -> the checkpoint's key (default: the same; a transformers
            model's keys are its checkpoint's).

    Returns:
        The ``quantization_config`` written (None on the other ranks of a job whose model is not
        sharded: each rank holds all of it, and rank 0 writes it).

    Example:
        >>> dtensor_fp8.export_fp8_hf(model, "out/llama-fp8")      # every rank
        >>> transformers.AutoModelForCausalLM.from_pretrained("out/llama-fp8")   # FP8 on a GPU
    """
    key_map = key_map or (lambda key: key)
    targets = hp_targets(model)
    group = agreement_group(t for t in targets.values() if isinstance(t, torch.Tensor))
    rank = dist.get_rank(group) if group is not None else 0
    world = dist.get_world_size(group) if group is not None else 1
    what = f"export_fp8_hf({path})"
    if group is None and dist.is_available() and dist.is_initialized() and dist.get_rank(dist.group.WORLD) != 0:
        return None  # an unsharded model: every rank holds all of it, rank 0 writes it
    entries, quantization = agree_over(what, _plan, model, targets, key_map, path, dtype, group=group)
    files = _assign_files(entries, world)
    mine: dict[str, torch.Tensor] = {}
    for name, (tensor, how) in entries.items():  # the same order on every rank: collectives line up
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if files[name] == rank:
            mine[name] = _as_written(full, how)
    staging = f"{os.fspath(path)}.partial"
    try:
        agree_over(what, _write, staging, mine, rank, entries, files,
                   config if config is not None else _model_config(model), quantization, dtype, group=group)
        if rank == 0:
            os.replace(staging, path)
    except BaseException:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)  # a failed export leaves nothing behind
        raise
    if group is not None:
        dist.barrier(group=group)  # the directory is in place before any rank returns
    return quantization


def _plan(model: nn.Module, targets: dict, key_map, path: str, dtype: torch.dtype) -> tuple[dict, dict]:
    """Key -> (tensor to write, how: ``("fp8", dtype)`` its bytes, ``("scalar",)`` a per-tensor
    scale, ``("cast", dtype)``, ``("as_is",)``), and the quantization config; every problem named
    at once."""
    if os.path.exists(path) or os.path.exists(f"{os.fspath(path)}.partial"):
        raise FileExistsError(f"{path} (or {path}.partial) exists: export_fp8_hf writes a new directory. Fix: "
                              "remove it or choose another path")
    entries, problems, sizes, kept_hp = {}, [], set(), []
    for key, target in targets.items():
        name = key_map(key)
        if not isinstance(target, torch.Tensor):
            problems.append(f"{key}: a module's extra state ({type(target).__name__}), which safetensors cannot hold")
            continue
        if not is_fp8(target):
            entries[name] = (target.detach(), ("cast", dtype) if target.is_floating_point() else ("as_is",))
            continue
        recipe = local_tensor(target).recipe
        try:
            sizes.add(None if (b := hf_weight_block_size(recipe)) is None else tuple(b))
        except RecipeError as err:
            problems.append(f"{key}: {err}")
            continue
        if not name.endswith("weight"):
            problems.append(f"{key} -> {name!r}: an FP8 tensor whose key does not end in 'weight' (the layout names "
                            "its scales '<module>.weight_scale_inv')")
            continue
        entry = plane_entries(target)
        entries[name] = (entry[plane_key(ROWWISE, "data")], ("fp8", recipe.fp8_dtype))
        per_tensor = recipe.block_shape(ROWWISE).rows is None
        entries[name + _SCALE_SUFFIX] = (entry[plane_key(ROWWISE, "scale_inv")], ("scalar",) if per_tensor else ("as_is",))
    if len(sizes) > 1:
        problems.append(f"the FP8 weights mix layouts (weight_block_size {sorted(map(str, sizes))}): one checkpoint "
                        "holds one. Fix: one recipe family for every FP8 weight")
    if problems:
        raise RecipeError("export_fp8_hf: nothing was written; " + "; ".join(problems[:6])
                          + (f"; ... ({len(problems)} problems)" if len(problems) > 6 else ""))
    if not sizes:
        raise RecipeError("export_fp8_hf: the model holds no FP8 weight; export it with save_pretrained / "
                          "export_hp_state_dict")
    for fqn, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, nn.Linear) and isinstance(weight, torch.Tensor) and not is_fp8(weight):
            kept_hp.append(key_map(f"{fqn}.weight").removesuffix(".weight"))
    block = sizes.pop()
    quantization = {"quant_method": "fp8", "activation_scheme": "dynamic",
                    "weight_block_size": None if block is None else list(block), "modules_to_not_convert": kept_hp}
    return entries, quantization


def _as_written(full: torch.Tensor, how: tuple) -> torch.Tensor:
    full = full.detach().cpu().contiguous()
    if how[0] == "scalar":  # one scale per tensor: the layout's 0-d weight_scale_inv
        return full.reshape(())
    if how[0] == "fp8":  # the FP8 bytes, as their float8 dtype
        return full.view(torch.uint8).view(how[1])
    if how[0] == "cast":
        return full.to(how[1])
    return full


def _nbytes(tensor: torch.Tensor, how: tuple) -> int:
    itemsize = how[1].itemsize if how[0] in ("fp8", "cast") else tensor.element_size()
    return tensor.numel() * itemsize


def _assign_files(entries: dict, world: int) -> dict[str, int]:
    """Key -> the rank whose file holds it: consecutive keys (a layer's tensors together), about
    equal bytes a file; the same on every rank (global shapes)."""
    total = sum(_nbytes(t, how) for t, how in entries.values()) or 1
    files, before = {}, 0
    for name, (tensor, how) in entries.items():
        files[name] = min(world - 1, before * world // total)
        before += _nbytes(tensor, how)
    return files


def _file_name(index: int, world: int) -> str:
    return f"model-{index + 1:05d}-of-{world:05d}.safetensors"


def _model_config(model: nn.Module) -> dict:
    config = getattr(model, "config", None)
    return config.to_dict() if hasattr(config, "to_dict") else {}


def _write(staging: str, mine: dict, rank: int, entries: dict, files: dict, config: dict, quantization: dict,
           dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    os.makedirs(staging, exist_ok=True)
    used = sorted(set(files.values()))
    if mine:
        name = os.path.join(staging, _file_name(used.index(rank), len(used)))
        save_file(mine, name + ".tmp", metadata={"format": "pt"})
        os.replace(name + ".tmp", name)
    if rank != 0:
        return
    weight_map = {key: _file_name(used.index(r), len(used)) for key, r in files.items()}
    total = sum(_nbytes(t, how) for t, how in entries.values())
    with open(os.path.join(staging, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config = {**config, "quantization_config": quantization, "torch_dtype": str(dtype).removeprefix("torch.")}
    with open(os.path.join(staging, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
