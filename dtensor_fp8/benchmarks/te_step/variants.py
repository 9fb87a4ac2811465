"""The models and optimizers of te_step's variants (a)-(e), and one training step of each.

Model: ``layers`` x ``te.TransformerLayer(hidden, ffn, heads, fuse_qkv_params=True,
params_dtype=bf16, hidden_dropout=0, attention_dropout=0)`` (causal self-attention) in the
``--shape`` preset's form (benchmarks/shapes.py; :func:`transformer_layer_kwargs`: GQA groups,
RMSNorm / LayerNorm, SwiGLU / GELU, biases), input
``(seq, batch, hidden)`` bf16, loss ``output.float().pow(2).mean()``, under ``te.autocast`` with
the TE recipe matching ours (:func:`dtensor_fp8.te.te_recipe_for`).

* (a) ``bf16_fsdp``: bf16 parameters under ``fully_shard`` (each layer, then the root), FP8
  compute in ``te.autocast``; ``torch.optim.Adam`` on the (bf16) parameters.
* (b) ``te_fp8_fsdp``: TE's own FP8 parameters (``te.quantized_model_init``) under ``fully_shard``
  (TE's ``fsdp_pre/post_all_gather``); Adam over FP32 master copies of the FP8 weights (DTensors
  like the parameters) plus the high-precision parameters, FP8 local shards rewritten with TE's
  ``quantize_`` after each step (what TE's ``FusedAdam(master_weights=True)`` does). Whether the
  weights are still TE FP8 tensors after ``fully_shard`` (and in forward) is checked and reported:
  FSDP2's sharding of a TE tensor class that lacks the ops it uses silently yields bf16 shards.
* (c) ``te_fp8_nofsdp``: the same TE FP8 parameters and masters, no ``fully_shard``.
* (d) ``ours_fsdp``: :func:`dtensor_fp8.te.quantize_te_module_` on the bf16 model, ``fully_shard``,
  :class:`dtensor_fp8.MasterWeightOptimizer` around Adam (FP32 masters).
* (e) ``ours_fsdp_bf16_masters``: (d) with ``master_dtype=torch.bfloat16``.

Every variant's ``torch.optim.Adam`` is the same implementation (``adam``, default ``fused``);
masters of (b), (c), (d) start from the dequantized FP8 weights.

Example (what another benchmark reuses: variant (e), current scaling, one rank)::

    cfg = StepConfig(model_shape=ModelShape(layers=2))
    v = build_variant("e", "current", cfg, init_process_group(tmpdir))
    loss = v.step()
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ...formats import RECIPES
from ...formats import te_import
from ...placement import like
from ..shapes import PRESETS, ModelShape  # noqa: F401  (PRESETS: the docstring example)

#: key -> (name in the JSON, label in the tables)
VARIANTS = {
    "a": ("bf16_fsdp", "(a) bf16 params, FSDP2"),
    "b": ("te_fp8_fsdp", "(b) TE FP8 params, FSDP2"),
    "c": ("te_fp8_nofsdp", "(c) TE FP8 params, no FSDP"),
    "d": ("ours_fsdp", "(d) dtensor_fp8 params, FSDP2"),
    "e": ("ours_fsdp_bf16_masters", "(e) = (d), bf16 masters"),
}
OURS = ("d", "e")
RECIPE_NAMES = ("delayed", "current", "blockwise2d")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass
class StepConfig:
    """The model, data and optimizer every variant shares (te_step's command line)."""

    #: the model and its input (benchmarks/shapes.py; default: the te-default preset)
    model_shape: ModelShape = field(default_factory=ModelShape)
    lr: float = 1e-4
    seed: int = 0
    adam: str = "fused"  # torch.optim.Adam implementation: "fused" or "foreach"
    #: MasterWeightOptimizer's non-finite gradient policy for (d)/(e). "ignore" by default: the
    #: default "raise" reads a flag on the host every step (a synchronization, like torch's
    #: GradScaler), which --gpu-only cannot time around; pass --nonfinite raise to measure it.
    nonfinite: str = "ignore"




def transformer_layer_kwargs(shape: ModelShape) -> dict:
    """``te.TransformerLayer``'s keyword arguments for ``shape`` (besides sizes and devices).

    Example:
        >>> transformer_layer_kwargs(PRESETS["llama3-8b"])["num_gqa_groups"]
        8
    """
    return {"num_gqa_groups": shape.kv_heads, "normalization": "RMSNorm" if shape.norm == "rmsnorm" else "LayerNorm",
            "activation": shape.mlp, "bias": shape.bias}


def gemm_weights(cfg) -> int:
    """GEMM weights of the stack: qkv, proj, fc1, fc2 per layer."""
    return 4 * cfg.model_shape.layers


@dataclass
class Variant:
    """One variant, built and ready to train.

    Attributes:
        key: ``"a"`` ... ``"e"``.
        recipe_name: one of :data:`RECIPE_NAMES`.
        model, optimizer: as built (the model sharded where the variant uses FSDP2).
        notes: what setup observed (weight classes after init / sharding, the optimizer).
        step: ``step(mid=None) -> loss``: one training step (forward, backward, optimizer step,
            zero_grad); ``mid``: a CUDA event recorded between backward and the optimizer step.
        phase_sink: while it holds an object with ``add_phases(**seconds)``, each step reports
            its phases' host time to it (``--host-split``).
    """

    key: str
    recipe_name: str
    model: torch.nn.Module
    optimizer: object
    notes: dict
    step: Callable = None
    phase_sink: list = field(default_factory=list)


def init_process_group(tmpdir: str):
    """A one-rank NCCL process group (FileStore in ``tmpdir``) and its 1-D device mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        store = dist.FileStore(os.path.join(tmpdir, "te_step_store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    return init_device_mesh("cuda", (1,))


def build_layers(cfg: StepConfig, fp8_recipe=None) -> torch.nn.Sequential:
    """The TransformerLayer stack; with ``fp8_recipe`` (a TE recipe), inside ``te.quantized_model_init``."""
    from contextlib import nullcontext

    te = te_import.require("te_step").pytorch
    torch.manual_seed(cfg.seed)
    shape = cfg.model_shape
    ctx = te.quantized_model_init(enabled=True, recipe=fp8_recipe) if fp8_recipe is not None else nullcontext()
    with ctx:
        layers = [te.TransformerLayer(shape.hidden, shape.ffn, shape.heads, hidden_dropout=0.0, attention_dropout=0.0,
                                      fuse_qkv_params=True, params_dtype=torch.bfloat16, device="cuda",
                                      self_attn_mask_type="causal", layer_number=i + 1,
                                      **transformer_layer_kwargs(shape))
                  for i in range(shape.layers)]
    return torch.nn.Sequential(*layers)


def shard(model, mesh, *, keep_attrs: bool):
    """``fully_shard`` each layer, then the root (as TE's FSDP2 tests do; custom attributes of TE
    parameters restored on the DTensors when ``keep_attrs``)."""
    from torch.distributed.fsdp import fully_shard

    saved = {}
    if keep_attrs:
        for n, p in model.named_parameters():
            saved[n] = {k: v for k, v in vars(p).items() if not k.startswith("_")}
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for n, p in model.named_parameters():
        for k, v in saved.get(n, {}).items():
            try:
                setattr(p, k, v)
            except Exception:  # noqa: BLE001
                pass
    return model


def local(p):
    """The local tensor of a DTensor parameter, else the parameter."""
    from ..._compat import dtensor_local

    return dtensor_local(p)


def kind(t) -> str:
    """Short description of a (local) weight: TE class name, ``QuantizedTensor[fp8]`` or its dtype."""
    from ...tensor import QuantizedTensor

    if isinstance(t, QuantizedTensor):
        dts = sorted({str(pl.data.dtype).replace("torch.", "") for pl in t.planes.values()})
        return f"QuantizedTensor[{','.join(dts)}]"
    name = type(t).__name__
    return name if name not in ("Tensor", "Parameter") else str(t.dtype).replace("torch.", "")


def weight_kinds(model) -> dict[str, int]:
    """How many 2-D weights of each :func:`kind` ``model`` holds."""
    counts: dict[str, int] = {}
    for _, p in model.named_parameters():
        if p.dim() == 2:
            k = kind(local(p))
            counts[k] = counts.get(k, 0) + 1
    return counts


def record_forward_kinds(model, seen: dict) -> list:
    """Forward pre-hooks recording the :func:`kind` of the (unsharded) 2-D weights modules see,
    until ``seen["_done"]`` is set; returns the hook handles."""

    def hook(m, args):
        if seen.get("_done"):
            return
        for p in m.parameters(recurse=False):
            if p.dim() == 2:
                k = kind(local(p))
                seen[k] = seen.get(k, 0) + 1

    return [m.register_forward_pre_hook(hook) for m in model.modules()
            if any(p.dim() == 2 for p in m.parameters(recurse=False))]


def check_ours_fp8(model, expected: int) -> tuple[bool, str]:
    """(d), (e): every GEMM weight is a DTensor whose local shard is an FP8 QuantizedTensor."""
    from torch.distributed.tensor import DTensor

    from ...tensor import QuantizedTensor

    bad, good = [], 0
    for n, p in model.named_parameters():
        if p.dim() != 2:
            continue
        shard_ = p.to_local() if isinstance(p, DTensor) else None
        if isinstance(shard_, QuantizedTensor) and all(pl.data.dtype in FP8_DTYPES for pl in shard_.planes.values()):
            good += 1
        else:
            bad.append(f"{n}: {type(p).__name__}/{kind(shard_ if shard_ is not None else p)}")
    ok = not bad and good == expected
    return ok, f"{good}/{expected} GEMM weights are FP8 QuantizedTensor shards" + (f"; NOT: {bad[:4]}" if bad else "")


class TEMasterAdam:
    """``torch.optim.Adam`` over FP32 masters of TE FP8 weights (DTensors where the weights are)
    and the high-precision parameters as they are; after ``step()`` each FP8 weight (its local
    shard under FSDP) is requantized in place from its master with TE's own quantizer."""

    def __init__(self, model, lr: float, adam_kwargs: dict):
        te_qt = te_import.require("te_step").QuantizedTensor
        self.model = model
        self.fp8, others = [], []
        with torch.no_grad():
            for _, p in model.named_parameters():
                if isinstance(local(p), te_qt):
                    self.fp8.append((p, torch.nn.Parameter(like(p, local(p).dequantize(dtype=torch.float32).clone()))))
                else:
                    others.append(p)
        self.optimizer = torch.optim.Adam([m for _, m in self.fp8] + others, lr=lr, **adam_kwargs)

    @torch.no_grad()
    def step(self):
        for p, m in self.fp8:
            m.grad = None if p.grad is None else like(m, local(p.grad).float())
        self.optimizer.step()
        for p, m in self.fp8:
            local(p).quantize_(local(m))

    def zero_grad(self):
        self.model.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)


def adam_kwargs(cfg: StepConfig) -> dict:
    """The same ``torch.optim.Adam`` implementation for every variant."""
    return {"fused": True} if cfg.adam == "fused" else {"foreach": True}


def _setup_bf16(cfg, recipe, mesh, notes):
    model = shard(build_layers(cfg), mesh, keep_attrs=True)
    notes["weights_after_shard"] = weight_kinds(model)
    return model, torch.optim.Adam(model.parameters(), lr=cfg.lr, **adam_kwargs(cfg))


def _setup_te(cfg, recipe, mesh, notes, *, fsdp: bool):
    from ...te import te_recipe_for

    te_qt = te_import.require("te_step").QuantizedTensor
    model = build_layers(cfg, te_recipe_for(recipe))
    notes["weights_after_init"] = weight_kinds(model)
    if fsdp:
        model = shard(model, mesh, keep_attrs=True)
        notes["weights_after_shard"] = weight_kinds(model)
    n_fp8 = sum(1 for p in model.parameters() if p.dim() == 2 and isinstance(local(p), te_qt))
    notes["fp8_weights"] = f"{n_fp8}/{gemm_weights(cfg)}"
    if n_fp8 != gemm_weights(cfg):
        where = "after fully_shard" if fsdp else "after quantized_model_init"
        notes["warning"] = (f"TE weights are NOT all FP8 {where}: {n_fp8}/{gemm_weights(cfg)} are TE quantized "
                            f"tensors ({notes.get('weights_after_shard', notes['weights_after_init'])}); the others "
                            "are trained as high-precision parameters")
    opt = TEMasterAdam(model, cfg.lr, adam_kwargs(cfg))
    notes["optimizer"] = f"torch.optim.Adam over {len(opt.fp8)} FP32 masters + high-precision params; TE quantize_"
    return model, opt


def _setup_ours(cfg, recipe, mesh, notes, *, master_dtype):
    from ...optim import MasterWeightOptimizer
    from ...te import quantize_te_module_

    model = build_layers(cfg)
    quantize_te_module_(model, recipe, keep_hp_init=False)
    model = shard(model, mesh, keep_attrs=False)
    opt = MasterWeightOptimizer(model, torch.optim.Adam, lr=cfg.lr, master_dtype=master_dtype,
                                nonfinite=getattr(cfg, "nonfinite", "ignore"), **adam_kwargs(cfg))
    notes["weights_after_shard"] = weight_kinds(model)
    notes["optimizer"] = repr(opt)
    return model, opt


_SETUPS = {
    "a": _setup_bf16,
    "b": lambda cfg, recipe, mesh, notes: _setup_te(cfg, recipe, mesh, notes, fsdp=True),
    "c": lambda cfg, recipe, mesh, notes: _setup_te(cfg, recipe, mesh, notes, fsdp=False),
    "d": lambda cfg, recipe, mesh, notes: _setup_ours(cfg, recipe, mesh, notes, master_dtype=torch.float32),
    "e": lambda cfg, recipe, mesh, notes: _setup_ours(cfg, recipe, mesh, notes, master_dtype=torch.bfloat16),
}


def build_variant(key: str, recipe_name: str, cfg: StepConfig, mesh) -> Variant:
    """Build variant ``key`` for our recipe ``recipe_name`` and its training step.

    Args:
        key: ``"a"`` ... ``"e"`` (see the module docstring).
        recipe_name: ``"delayed"``, ``"current"`` or ``"blockwise2d"`` (``dtensor_fp8.RECIPES``).
        cfg: model, data and optimizer settings.
        mesh: a 1-D CUDA device mesh (:func:`init_process_group`).

    Example:
        >>> v = build_variant("e", "current", StepConfig(model_shape=ModelShape(layers=2)), mesh)
        >>> v.step()  # loss of one training step
    """
    from ...te import te_recipe_for

    if key not in VARIANTS:
        raise KeyError(f"unknown te_step variant {key!r}; choose from {list(VARIANTS)}")
    recipe = RECIPES[recipe_name]
    te = te_import.require("te_step").pytorch
    notes: dict = {}
    model, opt = _SETUPS[key](cfg, recipe, mesh, notes)
    variant = Variant(key, recipe_name, model, opt, notes)
    fp8_recipe = te_recipe_for(recipe)
    g = torch.Generator(device="cuda").manual_seed(cfg.seed + 1)
    shape = cfg.model_shape
    x = torch.randn(shape.seq, shape.batch, shape.hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    sink = variant.phase_sink
    clock = time.perf_counter

    def step(mid=None):
        t0 = clock()
        with te.autocast(enabled=True, recipe=fp8_recipe):
            out = model(x)
        loss = out.float().pow(2).mean()
        t1 = clock()
        loss.backward()
        t2 = clock()
        if mid is not None:
            mid.record()  # forward + backward | optimizer step + zero_grad
        opt.step()
        t3 = clock()
        opt.zero_grad()
        if sink:
            sink[0].add_phases(forward=t1 - t0, backward=t2 - t1, optimizer_step=t3 - t2, zero_grad=clock() - t3)
        return loss.detach()

    variant.step = step
    return variant
