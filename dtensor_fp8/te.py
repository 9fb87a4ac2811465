"""Transformer Engine adapter: TE tensors that share our FP8 bytes, and TE modules under FSDP2.

[Note: what is shared and what is built at the TE boundary]
:func:`to_te_tensor` wraps a :class:`QuantizedTensor` in TE's own class (``Float8Tensor`` for the
per-tensor recipes, ``Float8BlockwiseQTensor`` for blockwise, ``MXFP8Tensor``) so TE's GEMMs read
it. FP8 data whose layout agrees with TE's is shared, not copied: the rowwise plane (per-tensor
``_data``, blockwise / MXFP8 ``_rowwise_data``), MXFP8's columnwise plane (TE stores it ``(M, K)``
like we do) and the per-tensor ``_scale_inv``. What TE lays out differently is built here:
the padded (and for 1x128 blockwise, transposed) scale tensors — a few KB — and the transposed
``(K, M)`` columnwise data (per-tensor ``_transpose``, blockwise ``_columnwise_data``): for
per-tensor and 128x128 blockwise that copy *is* the transpose cache of ``tensor.py``.

:func:`from_te_tensor` is the inverse (TE tensor -> QuantizedTensor, FP8 bytes shared where the
layouts agree), and :func:`quantize_te_module_` turns the weights of TE modules (``te.Linear``,
``LayerNormLinear``, ``LayerNormMLP``, and the ones inside ``TransformerLayer``) into dtensor_fp8
parameters — from high precision, or from TE FP8 parameters made by ``te.quantized_model_init``
(masters from ``get_high_precision_init_val()`` when TE kept them).

Under ``fully_shard`` the FSDP2 extension of ``fsdp.py`` gathers our planes (rowwise for forward,
columnwise for backward) and, for parameters of modules marked by :func:`quantize_te_module_`, hands
FSDP a TE tensor built by :func:`to_te_tensor` on the gathered buffers as the unsharded parameter
(later gathers update that object's buffers in place, as TE's own ``fsdp_post_all_gather`` does).
TE's modules take an already-quantized weight as is (``quantize_weight`` skips the cast), so their
forward GEMM reads what the forward gather delivered and their dgrad GEMM what the backward gather
delivered; TE drops the columnwise buffers after the dgrad GEMM (``clear_columnwise_cache``).

Transformer Engine is optional: it is imported inside the functions of this module only.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

from .formats.base import COLUMNWISE, ROWWISE, Recipe, RecipeError, as_matrix_shape
from .formats.blockwise import Blockwise
from .formats.mxfp8 import MXFP8
from .formats.per_tensor import CurrentScaling, DelayedScaling, _PerTensor
from .tensor import QuantizedTensor

#: Module attribute set by :func:`quantize_te_module_`: the FSDP2 all-gather of this module's FP8
#: parameters returns TE tensors (see ``fsdp.py``). Its value is the function FSDP's hook calls.
TE_VIEW_ATTR = "_dtensor_fp8_te_view"

_BUFFERS = {
    "Float8Tensor": ("_data", "_transpose", "_scale_inv"),
    "Float8BlockwiseQTensor": ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv"),
    "MXFP8Tensor": ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv"),
}


def _te():
    """Lazy TE imports (TE is optional; nothing here runs at ``import dtensor_fp8``)."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer, Float8BlockwiseQTensor
    from transformer_engine.pytorch.tensor.float8_tensor import (
        Float8CurrentScalingQuantizer,
        Float8Quantizer,
        Float8Tensor,
    )
    from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer, MXFP8Tensor

    return {
        "tex": tex, "Float8Tensor": Float8Tensor, "Float8BlockwiseQTensor": Float8BlockwiseQTensor,
        "MXFP8Tensor": MXFP8Tensor, "Float8Quantizer": Float8Quantizer,
        "Float8CurrentScalingQuantizer": Float8CurrentScalingQuantizer,
        "Float8BlockQuantizer": Float8BlockQuantizer, "MXFP8Quantizer": MXFP8Quantizer,
    }


def _tex_dtype(fp8_dtype: torch.dtype):
    tex = _te()["tex"]
    return {torch.float8_e4m3fn: tex.DType.kFloat8E4M3, torch.float8_e5m2: tex.DType.kFloat8E5M2}[fp8_dtype]


def _torch_fp8_dtype(te_dtype) -> torch.dtype:
    tex = _te()["tex"]
    table = {int(tex.DType.kFloat8E4M3): torch.float8_e4m3fn, int(tex.DType.kFloat8E5M2): torch.float8_e5m2}
    try:
        return table[int(te_dtype)]
    except (KeyError, TypeError, ValueError):
        raise RecipeError(f"TE dtype {te_dtype!r} is not an FP8 dtype dtensor_fp8 stores") from None


# ---- quantizers --------------------------------------------------------------------------------------
def te_quantizer(recipe: Recipe, *, rowwise: bool = True, columnwise: bool = True, device=None,
                 scale_inv: torch.Tensor | None = None):
    """The TE quantizer that makes what ``recipe`` makes (bit-exact; see tests/gpu/test_te_parity.py).

    Args:
        recipe: our recipe object.
        rowwise, columnwise: the quantizer's usages.
        device: device of the quantizer's state (per-tensor recipes).
        scale_inv: delayed scaling: the scale_inv of the tensor (the quantizer holds ``1/scale_inv``).
    """
    m = _te()
    if isinstance(recipe, DelayedScaling):
        dev = device if device is not None else (scale_inv.device if scale_inv is not None else "cuda")
        scale = (torch.reciprocal(scale_inv.float().reshape(1)) if scale_inv is not None
                 else torch.ones(1, dtype=torch.float32, device=dev))
        return m["Float8Quantizer"](scale, torch.zeros(1, dtype=torch.float32, device=scale.device),
                                    _tex_dtype(recipe.fp8_dtype), rowwise=rowwise, columnwise=columnwise)
    if isinstance(recipe, CurrentScaling):
        return m["Float8CurrentScalingQuantizer"](
            _tex_dtype(recipe.fp8_dtype), device if device is not None else "cuda", rowwise=rowwise, columnwise=columnwise,
            force_pow_2_scales=recipe.force_pow_2_scales, amax_epsilon=recipe.amax_epsilon,
        )
    if isinstance(recipe, Blockwise):
        return m["Float8BlockQuantizer"](
            _tex_dtype(recipe.fp8_dtype), rowwise=rowwise, columnwise=columnwise, amax_epsilon=recipe.amax_epsilon,
            force_pow_2_scales=recipe.force_pow_2_scales, block_scaling_dim=recipe.block_dims,
        )
    if isinstance(recipe, MXFP8):
        return m["MXFP8Quantizer"](_tex_dtype(recipe.fp8_dtype), rowwise=rowwise, columnwise=columnwise)
    raise RecipeError(f"no TE quantizer for recipe {recipe!r}")


def recipe_from_te(t) -> Recipe:
    """Our recipe for a TE tensor (from its quantizer where it has one, else from its class)."""
    m = _te()
    quantizer = getattr(t, "_quantizer", None)
    fp8 = _torch_fp8_dtype(t._fp8_dtype)
    if isinstance(quantizer, m["Float8CurrentScalingQuantizer"]):
        return CurrentScaling(fp8_dtype=fp8, force_pow_2_scales=bool(quantizer.force_pow_2_scales),
                              amax_epsilon=float(quantizer.amax_epsilon))
    if isinstance(t, m["Float8Tensor"]):
        return DelayedScaling(fp8_dtype=fp8)
    if isinstance(t, m["Float8BlockwiseQTensor"]):
        dims = 2 if t._is_2D_scaled else 1
        if quantizer is not None:
            return Blockwise(block_dims=dims, fp8_dtype=fp8, force_pow_2_scales=bool(quantizer.force_pow_2_scales),
                             amax_epsilon=float(quantizer.amax_epsilon))
        return Blockwise(block_dims=dims, fp8_dtype=fp8)
    if isinstance(t, m["MXFP8Tensor"]):
        if getattr(t, "_with_gemm_swizzled_scales", False):
            raise RecipeError("MXFP8Tensor with GEMM-swizzled scales: convert before TE swizzles them")
        return MXFP8(fp8_dtype=fp8)
    raise RecipeError(f"from_te_tensor: unsupported TE tensor class {type(t).__name__}")


# ---- QuantizedTensor -> TE ---------------------------------------------------------------------------
def te_buffers(q: QuantizedTensor, usages: tuple[str, ...] | None = None) -> dict[str, torch.Tensor | None]:
    """TE's attribute names -> tensors for ``q`` (``None`` for a usage not served). Rowwise data
    (and MXFP8 columnwise data, and the per-tensor scale_inv) are views of ``q``'s planes; for
    per-tensor recipes a transpose cache already built on ``q`` is reused."""
    usages = tuple(q.usages if usages is None else usages)
    return _te_buffers(q.recipe, q._planes, tuple(q.shape), usages, q._transpose)


def _te_buffers(recipe: Recipe, planes: dict, shape: tuple, usages: tuple[str, ...], transpose=None,
                reuse: dict | None = None) -> dict[str, torch.Tensor | None]:
    """:func:`te_buffers` from the parts of a QuantizedTensor (``reuse``: see ``Recipe.te_layout``)."""
    per_tensor = _is_per_tensor(type(recipe))
    if per_tensor and transpose is not None and COLUMNWISE in usages:
        layout = recipe.te_layout(planes, shape, tuple(u for u in usages if u != COLUMNWISE), reuse)
        layout["_transpose"] = transpose.view(torch.uint8).reshape(shape[-1], *shape[:-1])
    else:
        layout = recipe.te_layout(planes, shape, usages, reuse)
    names = _BUFFERS["Float8Tensor"] if per_tensor else _BUFFERS["Float8BlockwiseQTensor"]
    return {n: layout.get(n) for n in names}


@functools.cache
def _is_per_tensor(recipe_type: type) -> bool:
    """``issubclass(recipe_type, _PerTensor)``, memoized: FSDP's hook asks at every gather, and an
    ABC subclass check is not free."""
    return issubclass(recipe_type, _PerTensor)


def to_te_tensor(q: QuantizedTensor, *, usages: tuple[str, ...] | None = None, quantizer=None,
                 requires_grad: bool = False):
    """A TE tensor (``Float8Tensor`` / ``Float8BlockwiseQTensor`` / ``MXFP8Tensor``) over ``q``'s bytes.

    Args:
        q: a (local, unsharded) quantized tensor on a CUDA device.
        usages: usages the TE tensor serves (default: ``q.usages``); a columnwise usage builds the
            transposed data TE's Hopper GEMMs need (the transpose cache).
        quantizer: TE quantizer to attach (default: :func:`te_quantizer` of ``q.recipe`` with these usages).
        requires_grad: of the result.

    Example:
        >>> w_te = to_te_tensor(dtensor_fp8.quantize(w, dtensor_fp8.CurrentScaling()))
        >>> w_te._data.data_ptr() == q.plane("rowwise").data.data_ptr()
        True
    """
    from torch.distributed.tensor import DTensor

    if isinstance(q, DTensor):
        raise RecipeError("to_te_tensor takes a local QuantizedTensor; call .to_local() or full_tensor() first")
    if not isinstance(q, QuantizedTensor):
        raise RecipeError(f"to_te_tensor takes a QuantizedTensor, got {type(q).__name__}")
    usages = tuple(q.usages if usages is None else usages)
    for u in usages:
        q.plane(u)  # raises for a usage q does not hold
    m = _te()
    recipe = q.recipe
    bufs = te_buffers(q, usages)
    shape = tuple(q.shape)
    if quantizer is None:
        quantizer = te_quantizer(recipe, rowwise=ROWWISE in usages, columnwise=COLUMNWISE in usages,
                                 device=q.device, scale_inv=q._planes[ROWWISE].scale_inv if isinstance(recipe, DelayedScaling) else None)
    common = dict(shape=shape, dtype=q.dtype, requires_grad=requires_grad, device=q.device,
                  fp8_dtype=_tex_dtype(recipe.fp8_dtype), quantizer=quantizer)
    if isinstance(recipe, _PerTensor):
        return m["Float8Tensor"](data=bufs["_data"], fp8_scale_inv=bufs["_scale_inv"],
                                 data_transpose=bufs["_transpose"], **common)
    if isinstance(recipe, Blockwise):
        return m["Float8BlockwiseQTensor"](
            rowwise_data=bufs["_rowwise_data"], rowwise_scale_inv=bufs["_rowwise_scale_inv"],
            columnwise_data=bufs["_columnwise_data"], columnwise_scale_inv=bufs["_columnwise_scale_inv"],
            is_2D_scaled=recipe.block_dims == 2, **common,
        )
    if isinstance(recipe, MXFP8):
        return m["MXFP8Tensor"](
            rowwise_data=bufs["_rowwise_data"], rowwise_scale_inv=bufs["_rowwise_scale_inv"],
            columnwise_data=bufs["_columnwise_data"], columnwise_scale_inv=bufs["_columnwise_scale_inv"],
            with_gemm_swizzled_scales=False, **common,
        )
    raise RecipeError(f"to_te_tensor: no TE tensor class for recipe {recipe!r}")


def update_te_tensor_(t, q: QuantizedTensor, usages: tuple[str, ...] | None = None):
    """Point an existing TE tensor at ``q``'s buffers (FSDP's ``out=`` gathers); returns ``t``."""
    usages = tuple(q.usages if usages is None else usages)
    return _point_te_tensor(t, q.recipe, q._planes, tuple(q.shape), usages, q._transpose)


#: Attribute of a TE tensor made by the FSDP hook: its padded scale tensors by TE name, kept across
#: gathers (a forward gather sets only the rowwise ones, a backward gather only the columnwise).
_SCALE_BUFFERS_ATTR = "_dtensor_fp8_scale_buffers"


def _point_te_tensor(t, recipe: Recipe, planes: dict, shape: tuple, usages: tuple[str, ...], transpose=None):
    """:func:`update_te_tensor_` from the parts of a QuantizedTensor. Padded scale tensors from
    earlier calls on ``t`` are overwritten, not reallocated."""
    kept = t.__dict__.setdefault(_SCALE_BUFFERS_ATTR, {})
    bufs = _te_buffers(recipe, planes, shape, usages, transpose, reuse=kept)
    for name, value in bufs.items():
        setattr(t, name, value)
        if value is not None and name.endswith("_scale_inv") and name != "_scale_inv":
            kept[name] = value
    if hasattr(t, "_transpose_invalid"):
        t._transpose_invalid = t._transpose is None
    if getattr(t, "_quantizer", None) is not None:
        t._quantizer.set_usage(rowwise=ROWWISE in usages, columnwise=COLUMNWISE in usages)
    return t


# ---- TE -> QuantizedTensor ---------------------------------------------------------------------------
def from_te_tensor(t, *, dtype: torch.dtype | None = None) -> QuantizedTensor:
    """A :class:`QuantizedTensor` holding a TE tensor's FP8 bytes (shared where layouts agree).

    Args:
        t: ``Float8Tensor`` / ``Float8BlockwiseQTensor`` / ``MXFP8Tensor`` (or their storage classes).
        dtype: nominal dtype (default: ``t.dtype``).
    """
    recipe = recipe_from_te(t)
    shape = tuple(t.shape)
    names = _BUFFERS["Float8Tensor"] if isinstance(recipe, _PerTensor) else _BUFFERS["MXFP8Tensor"]
    bufs = {n: getattr(t, n, None) for n in names}
    if isinstance(recipe, _PerTensor) and getattr(t, "_transpose_invalid", False):
        bufs["_transpose"] = None
    planes = recipe.from_te_layout(bufs, shape)
    usages = []
    if isinstance(recipe, _PerTensor):
        if bufs["_data"] is not None:
            usages.append(ROWWISE)
        if bufs["_transpose"] is not None or bufs["_data"] is not None:
            usages.append(COLUMNWISE)
    else:
        if bufs["_rowwise_data"] is not None:
            usages.append(ROWWISE)
        if bufs["_columnwise_data"] is not None or (recipe.columnwise_is_transpose and bufs["_rowwise_data"] is not None):
            usages.append(COLUMNWISE)
    nominal = dtype or t.dtype
    matrix = as_matrix_shape(shape)
    # TE's transpose cache is not carried over: it is rebuilt from the shared bytes when needed.
    return QuantizedTensor(planes, recipe, matrix, nominal, tuple(usages))


# ---- TE modules ---------------------------------------------------------------------------------------
def _is_te_module(m: nn.Module) -> bool:
    try:
        from transformer_engine.pytorch.module.base import TransformerEngineBaseModule
    except ImportError:  # pragma: no cover
        return False
    return isinstance(m, TransformerEngineBaseModule)


def _is_te_quantized(p) -> bool:
    try:
        from transformer_engine.pytorch.quantized_tensor import QuantizedTensor as TEQuantizedTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(p, TEQuantizedTensor)


def quantize_te_module_(
    module: nn.Module,
    recipe: Recipe | None = None,
    *,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    keep_hp_init: bool = True,
) -> nn.Module:
    """Replace the 2-D weights of TE modules by dtensor_fp8 parameters, in place (before ``fully_shard``).

    Each TE module (``te.Linear``, ``LayerNormLinear``, ``LayerNormMLP``, ... also inside
    ``TransformerLayer``) gets its 2-D weight parameters (``weight``, ``fc1_weight``, ...)
    quantized with ``recipe``; a weight that already is a TE FP8 tensor (``te.quantized_model_init``)
    is converted with :func:`from_te_tensor` (its bytes kept) and its master starts from
    ``get_high_precision_init_val()`` when TE kept it. The module is marked so FSDP2's all-gather
    returns TE tensors (see the note at the top), which TE's GEMMs read directly.

    Use ``fuse_qkv_params=True`` in ``TransformerLayer`` / ``MultiheadAttention``: with split Q/K/V
    parameters TE concatenates the weights in forward, which is not an FP8 operation.

    Args:
        module: the model.
        recipe: our recipe for high-precision weights (must match the ``te.autocast`` recipe's weight
            quantizer: ``DelayedScaling``/``CurrentScaling`` for TE's per-tensor recipes,
            ``Blockwise(block_dims=2)`` for ``Float8BlockScaling``, ``MXFP8``).
        filter_fn: ``(te_module, param_name) -> bool``; only accepted weights are converted.
        keep_hp_init: keep a CPU copy of each high-precision init value for the master weights.
    """
    from .state_dict import register_state_dict_hooks
    from .module import HP_INIT_ATTR

    hp_init = getattr(module, HP_INIT_ATTR, {})
    for fqn, sub in module.named_modules():
        if not _is_te_module(sub):
            continue
        converted = False
        for pname, p in list(sub.named_parameters(recurse=False)):
            if p.dim() != 2 or isinstance(p, QuantizedTensor):
                continue
            if filter_fn is not None and not filter_fn(sub, pname):
                continue
            full = f"{fqn}.{pname}" if fqn else pname
            if _is_te_quantized(p):
                q = from_te_tensor(p)
                init = p.get_high_precision_init_val() if hasattr(p, "get_high_precision_init_val") else None
            else:
                if recipe is None:
                    raise RecipeError(f"quantize_te_module_: {full} is high precision; pass a recipe")
                if p.is_meta:
                    raise RecipeError(f"quantize_te_module_: {full} is on the meta device; materialize and init first")
                from .quantize import quantize

                q = quantize(p.detach(), recipe)
                init = p.detach()
            setattr(sub, pname, nn.Parameter(q, requires_grad=p.requires_grad))
            if keep_hp_init and init is not None:
                hp_init[full] = init.detach().to("cpu", copy=True)
            converted = True
        if converted:
            setattr(sub, TE_VIEW_ATTR, fsdp_te_view)
            register_state_dict_hooks(sub)
    setattr(module, HP_INIT_ATTR, hp_init)
    return module


def fsdp_te_view(planes: dict, recipe: Recipe, shape: tuple[int, int], dtype: torch.dtype,
                 usages: tuple[str, ...], out, orig_rows: int):
    """Called by ``fsdp.fsdp_post_all_gather`` for parameters of marked TE modules, with the
    gathered planes (views of FSDP's buffers) of a ``shape`` weight serving ``usages``.

    First gather (``out is None``): returns ``(te_tensor, ())`` — FSDP's unsharded parameter is a
    TE tensor over the gathered buffers. Later gathers: re-point ``out``'s buffers in place
    (every gather runs this, so it builds no QuantizedTensor unless rows must be cut off).
    """
    from .ops import slice_quantized

    if out is not None and shape[0] == orig_rows:
        # te_layout builds the transposed copy a columnwise usage needs.
        _point_te_tensor(getattr(out, "_local_tensor", out), recipe, planes, shape, usages)
        return None
    gathered = QuantizedTensor(planes, recipe, shape, dtype, usages)
    if shape[0] != orig_rows:
        gathered = slice_quantized(gathered, 0, 0, orig_rows)
    if out is not None:
        update_te_tensor_(getattr(out, "_local_tensor", out), gathered)
        return None
    return to_te_tensor(gathered), ()
