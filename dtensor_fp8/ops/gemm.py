"""The GEMMs of a quantized weight: ``F.linear`` (``linear.py``) and, under tensor parallelism, the
local ``mm`` / ``addmm`` DTensor runs on the local tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..formats.base import ROWWISE, RecipeError
from ..linear import quantized_linear
from ..op_table import QUANTIZED_FUNCTIONS, QUANTIZED_OPS, TRANSPOSE_VIEW_OPS
from ..tensor import QuantizedTensor
from .copies import never_repointed, reads_from

aten = torch.ops.aten

# ``F.linear(x, W)`` with a quantized ``W`` (not under TP): the emulated FP8 linear of linear.py.
QUANTIZED_FUNCTIONS.implements([F.linear])(quantized_linear)

# [Note: which plane a local GEMM reads]
# Under ColwiseParallel / RowwiseParallel the weight is a DTensor, so ``F.linear(x, w)`` never reaches
# ``QuantizedTensor.__torch_function__``: autograd decomposes it into ``aten.t`` + ``aten.mm`` /
# ``aten.addmm`` (``matmul`` folds leading dims into ``mm``) and DTensor runs those on the local
# tensors. ``aten.t`` of a QuantizedTensor ``W`` (logical ``(M, K)``) returns a
# :class:`QuantizedTransposeView`, a ``(K, M)`` tensor that only remembers ``W`` (no copy, and it
# sees the planes FSDP's backward gather later writes into ``W``). A GEMM with a quantized operand
# then picks the plane from the logical dim of ``W`` it contracts over:
#
# * over K (forward ``y = x W^T``: ``mm(x, W^T)``; or ``mm(W, x^T)``) -> the rowwise plane;
# * over M (input gradient ``dx = dy W``: ``mm(dy, W)``; or ``mm(W^T, dy^T)``) -> the columnwise
#   plane (for per-tensor / 128x128 recipes, the transpose cache, dropped after use).
#
# The plane is dequantized to the other operand's dtype and the GEMM runs in high precision, as in
# ``linear.py``. A plane the tensor does not hold raises (``QuantizedTensor.plane``); nothing is
# recomputed from high precision. The weight gradient ``x^T dy`` involves no quantized operand, so it
# is a plain high-precision tensor, and FSDP reduce-scatters it as usual.
class QuantizedTransposeView(torch.Tensor):
    """``W.t()`` of a :class:`QuantizedTensor` ``W``: shape ``(K, M)``, holds only ``W``.

    Supports ``t`` / ``transpose(0, 1)`` (back to ``W``), ``detach`` / ``alias`` / same-shape views,
    and the GEMMs ``mm`` / ``addmm``; anything else raises.
    """

    _base_q: QuantizedTensor

    @staticmethod
    def __new__(cls, base: QuantizedTensor):
        # 3-D: the transpose of each expert's matrix of an expert weight [E, M, K] (formats/experts.py),
        # as torchtitan's GroupedExperts hands w.transpose(-2, -1) to its grouped GEMM (grouped_mm.py).
        *lead, m, k = base.shape
        strides = (*(m * k for _ in lead), 1, k)
        return torch.Tensor._make_wrapper_subclass(
            cls, torch.Size((*lead, k, m)), strides=strides, dtype=base.dtype, device=base.device,
            requires_grad=False,
        )

    def __init__(self, base: QuantizedTensor):
        self._base_q = base

    @property
    def base(self) -> QuantizedTensor:
        return self._base_q

    def __repr__(self) -> str:
        return f"QuantizedTransposeView(shape={tuple(self.shape)}, of={self._base_q!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        impl = TRANSPOSE_VIEW_OPS.lookup(func)
        if impl is None:
            raise NotImplementedError(
                f"dtensor_fp8: {func} is not supported on the transpose of a quantized weight (shape "
                f"{tuple(args[0].shape) if args else '?'}); FP8 weights are never silently dequantized. "
                "Only t/transpose and the GEMMs mm/addmm run on it."
            )
        return impl(func, args, kwargs)


def _is_01_transpose(func, args) -> bool:
    """Whether ``func(*args)`` swaps the last two dims of a 2-D or 3-D tensor (``t``, ``transpose(0, 1)``,
    and for a 3-D expert weight ``transpose(-2, -1)`` / ``transpose(1, 2)``)."""
    ndim = args[0].dim()
    if func is aten.t.default:
        return ndim == 2
    if ndim not in (2, 3):
        return False
    return sorted(int(x) % ndim for x in args[1:3]) == [ndim - 2, ndim - 1]


@QUANTIZED_OPS.implements([aten.t.default, aten.transpose.int])
def _transpose_quantized(func, args, kwargs):
    q = args[0]
    if not _is_01_transpose(func, args):
        raise RecipeError(f"{q.recipe.name}: only the transpose of the last two dims of a 2-D weight or a 3-D expert "
                          f"weight is supported, got {func}{tuple(args[1:])} on shape {tuple(q.shape)}")
    return QuantizedTransposeView(q)


@TRANSPOSE_VIEW_OPS.implements([aten.t.default, aten.transpose.int])
def _transpose_back(func, args, kwargs):
    if not _is_01_transpose(func, args):
        raise RecipeError(f"only the transpose of the last two dims of a quantized weight is supported, got "
                          f"{func}{tuple(args[1:])}")
    base = args[0]._base_q
    # A new object (autograd's view tracking forbids returning the base itself) that reads through
    # to ``base`` (through its owner record, see ops/copies.reads_from): when this runs in
    # backward, ``base`` holds what FSDP's backward gather put in it.
    out = base.rebuild()
    if not never_repointed(base):
        base.param_state.read_through_(out.plane_tensors(), reads_from(base))
    return out


@TRANSPOSE_VIEW_OPS.implements([aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default])
def _view_alias(func, args, kwargs):
    v = args[0]
    if func in (aten.view.default, aten._unsafe_view.default, aten.reshape.default) and torch.Size(args[1]) != v.shape:
        raise RecipeError(f"cannot view the transpose of a quantized weight {tuple(v.shape)} as {tuple(args[1])}")
    return QuantizedTransposeView(v._base_q)


def _gemm_operand(t, position: str, dtype: torch.dtype):
    """High-precision matrix for a GEMM operand: plain tensors as they are, quantized ones from the
    plane their contraction dim selects (see the note above). ``position``: ``"left"`` contracts
    dim 1, ``"right"`` dim 0."""
    if isinstance(t, QuantizedTransposeView):
        q, transposed = t._base_q, True
    elif isinstance(t, QuantizedTensor):
        q, transposed = t, False
    else:
        return t, None
    q = reads_from(q)
    if q.dim() != 2:
        raise RecipeError(f"{q.recipe.name}: GEMM on a quantized tensor of shape {tuple(q.shape)}; expected 2-D")
    contracted = 1 if position == "left" else 0  # in the operand's own (possibly transposed) dims
    base_dim = 1 - contracted if transposed else contracted
    if base_dim == 1:  # contracts K: forward
        w = q.dequantize(dtype, ROWWISE)
    else:  # contracts M: input gradient
        w = q.columnwise_matrix(dtype)
        q.discard_transpose_cache()  # built for this one use (see fsdp.py)
    return (w.t() if transposed else w), q


def _other_dtype(a, b):
    for t in (a, b):
        if not isinstance(t, (QuantizedTensor, QuantizedTransposeView)):
            return t.dtype
    raise RecipeError("GEMM of two quantized operands is not supported: dequantize one explicitly")


@QUANTIZED_OPS.implements([aten.mm.default, aten.addmm.default])
@TRANSPOSE_VIEW_OPS.implements([aten.mm.default, aten.addmm.default])
def _quantized_gemm(func, args, kwargs):
    if func is aten.mm.default:
        a, b = args[0], args[1]
    else:  # addmm(bias, a, b, *, beta, alpha)
        a, b = args[1], args[2]
    dtype = _other_dtype(a, b)
    a_hp, _ = _gemm_operand(a, "left", dtype)
    b_hp, _ = _gemm_operand(b, "right", dtype)
    if func is aten.mm.default:
        return torch.mm(a_hp, b_hp)
    bias = args[0]
    if isinstance(bias, (QuantizedTensor, QuantizedTransposeView)):
        raise RecipeError("addmm: a quantized bias is not supported")
    return torch.addmm(bias, a_hp, b_hp, beta=kwargs.get("beta", 1), alpha=kwargs.get("alpha", 1))
