"""Transformer Engine, imported once and only when asked for: the one lazy importer and the one
FP8 dtype map between torch and TE.

TE is optional. Nothing imports it at ``import dtensor_fp8``; the first caller of :func:`load`
(the TE adapter ``te.py``, the recipes' TE-kernel fast path on a CUDA tensor, a benchmark) pays
for the import (several seconds the first time), later callers get the cached namespace.

Example:
    >>> te = load()              # None where TE does not import
    >>> te = require("to_te_tensor")   # ImportError naming the caller where it does not
    >>> te.Float8Tensor, te.tex, te_dtype(torch.float8_e4m3fn)
"""

from __future__ import annotations

import functools
import warnings
from types import SimpleNamespace

import torch

#: torch FP8 dtype -> name of TE's ``transformer_engine_torch.DType`` member.
TE_DTYPE_NAMES = {torch.float8_e4m3fn: "kFloat8E4M3", torch.float8_e5m2: "kFloat8E5M2"}

# What the namespace holds: name -> (module, attribute). Importing any TE tensor module imports
# ``transformer_engine.pytorch`` as a whole, so the rest costs nothing more.
_CLASSES = {
    "Float8Tensor": ("transformer_engine.pytorch.tensor.float8_tensor", "Float8Tensor"),
    "Float8Quantizer": ("transformer_engine.pytorch.tensor.float8_tensor", "Float8Quantizer"),
    "Float8CurrentScalingQuantizer": ("transformer_engine.pytorch.tensor.float8_tensor", "Float8CurrentScalingQuantizer"),
    "Float8BlockwiseQTensor": ("transformer_engine.pytorch.tensor.float8_blockwise_tensor", "Float8BlockwiseQTensor"),
    "Float8BlockQuantizer": ("transformer_engine.pytorch.tensor.float8_blockwise_tensor", "Float8BlockQuantizer"),
    "MXFP8Tensor": ("transformer_engine.pytorch.tensor.mxfp8_tensor", "MXFP8Tensor"),
    "MXFP8Quantizer": ("transformer_engine.pytorch.tensor.mxfp8_tensor", "MXFP8Quantizer"),
    "Float8TensorStorage": ("transformer_engine.pytorch.tensor.storage.float8_tensor_storage", "Float8TensorStorage"),
    "Float8BlockwiseQTensorStorage": ("transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage",
                                      "Float8BlockwiseQTensorStorage"),
    "MXFP8TensorStorage": ("transformer_engine.pytorch.tensor.storage.mxfp8_tensor_storage", "MXFP8TensorStorage"),
    "QuantizedTensor": ("transformer_engine.pytorch.quantized_tensor", "QuantizedTensor"),
    "TransformerEngineBaseModule": ("transformer_engine.pytorch.module.base", "TransformerEngineBaseModule"),
}


@functools.cache
def _load() -> tuple[SimpleNamespace | None, str | None]:
    import importlib

    try:
        with warnings.catch_warnings():
            # TE's import may warn (deprecations, torch.distributed.fsdp); pytest configurations
            # that turn UserWarnings into errors must not turn "TE present" into "TE missing".
            warnings.simplefilter("ignore")
            import transformer_engine
            import transformer_engine.pytorch as te_pytorch
            import transformer_engine_torch as tex
            from transformer_engine.common import recipe as te_recipe

            classes = {name: getattr(importlib.import_module(mod), attr) for name, (mod, attr) in _CLASSES.items()}
    except Exception as e:  # noqa: BLE001  (ImportError, or a native library that fails to load)
        return None, f"{type(e).__name__}: {e}".splitlines()[0][:300]
    version = getattr(transformer_engine, "__version__", None) or getattr(te_pytorch, "__version__", "unknown")
    to_te = {dt: getattr(tex.DType, name) for dt, name in TE_DTYPE_NAMES.items()}
    from_te = {int(v): dt for dt, v in to_te.items()}
    return SimpleNamespace(tex=tex, pytorch=te_pytorch, recipe=te_recipe, version=version, dtypes=to_te,
                           torch_dtypes=from_te, **classes), None


def load() -> SimpleNamespace | None:
    """TE's namespace (``tex``, ``pytorch``, ``recipe``, ``version``, the tensor / quantizer /
    module classes by name, ``dtypes``), or ``None`` where TE does not import."""
    return _load()[0]


def import_error() -> str | None:
    """Why TE does not import here (``None`` when it does)."""
    return _load()[1]


def require(what: str) -> SimpleNamespace:
    """:func:`load`, raising a clear ImportError naming ``what`` needed TE.

    Args:
        what: the caller, for the message (e.g. ``"to_te_tensor"``).
    """
    ns, why = _load()
    if ns is None:
        raise ImportError(f"{what} needs Transformer Engine (transformer_engine[pytorch] >= 2.20), which does not "
                          f"import here: {why}")
    return ns


def te_dtype(fp8_dtype: torch.dtype):
    """TE's ``DType`` for a torch FP8 dtype (``torch.float8_e4m3fn`` -> ``tex.DType.kFloat8E4M3``)."""
    try:
        return require("te_dtype").dtypes[fp8_dtype]
    except KeyError:
        raise ValueError(f"{fp8_dtype} has no TE FP8 dtype; TE stores {tuple(TE_DTYPE_NAMES)}") from None


def torch_fp8_dtype(te_fp8_dtype) -> torch.dtype | None:
    """The torch FP8 dtype for one of TE's ``DType`` values; ``None`` for a non-FP8 one."""
    try:
        return require("torch_fp8_dtype").torch_dtypes.get(int(te_fp8_dtype))
    except (TypeError, ValueError):
        return None


def new_quantizer(class_name: str, fp8_dtype: torch.dtype, **kwargs):
    """A TE quantizer of class ``class_name`` for ``fp8_dtype`` (TE's keyword arguments as given).

    Args:
        class_name: ``"Float8Quantizer"``, ``"Float8CurrentScalingQuantizer"``,
            ``"Float8BlockQuantizer"`` or ``"MXFP8Quantizer"``.
        fp8_dtype: torch FP8 dtype of the quantized data.
        kwargs: the quantizer's own arguments (``rowwise=``, ``scale=``, ``block_scaling_dim=``, ...).

    Example:
        >>> q = new_quantizer("MXFP8Quantizer", torch.float8_e4m3fn, rowwise=True, columnwise=False)
    """
    ns = require(class_name)
    return getattr(ns, class_name)(fp8_dtype=te_dtype(fp8_dtype), **kwargs)
