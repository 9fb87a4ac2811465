"""Grouped GEMMs of MoE experts on FP8 expert weights: ``torch._grouped_mm`` read from the planes.

[Note: the grouped GEMM of FP8 experts]
A routed-experts layer multiplies each expert's slice of the routed tokens by that expert's matrix:
``y[rows of e] = x[rows of e] @ W[e]^T`` with ``W`` a 3-D weight ``[E, out, in]`` and the row ranges
given by cumulative offsets (``torch._grouped_mm(x, W.transpose(-2, -1), offs=offs)``). With ``W`` an
FP8 expert weight (quantized per expert, ``formats/experts.py``) the three GEMMs of a step read:

* forward ``y = x W[e]^T``: the rowwise plane (what FSDP2's forward gather delivers);
* input gradient ``dx = dy W[e]``: the columnwise plane (the backward gather; for per-tensor and
  128x128 recipes the same bytes, or the transpose cache), dropped after use as ``linear.py`` does;
* weight gradient ``dW[e] = dy[rows of e]^T x[rows of e]``: no FP8 operand, a high-precision
  grouped GEMM whose ``[E, out, in]`` result FSDP2 reduce-scatters like any gradient.

Where torch has a scaled grouped GEMM for the weight's recipe on this device
(``grouped_fp8.unsupported_reason``: per-tensor recipes on sm_90 / sm_100), the forward and
input-gradient GEMMs run in FP8 on the planes (``grouped_fp8.py``). Elsewhere this module's
emulated path runs, on any device: each plane is dequantized to the activation's dtype and
``torch._grouped_mm`` runs on that, as the emulated linear does for dense weights. It is the
reference the FP8 grouped GEMM must match, and on the CPU it lets a test tell which plane a gather
delivered. Where FP8 GEMMs are expected (CUDA, or ``fp8_gemms("on")``) it says once per process
and reason that it runs (``gemm.note_fallback``), as the dense GEMMs do when they fall back.

torchtitan's ``GroupedExperts`` calls ``self._grouped_mm(A=x, B_t=w.bfloat16().transpose(-2, -1),
offs=offs)``: ``w.bfloat16()`` of an FP8 weight is the same bytes with a bf16 nominal dtype
(``ops/copies.py``) and ``transpose(-2, -1)`` a :class:`QuantizedTransposeView` of it, so
:func:`grouped_mm` has the signature of that seam and takes either a plain ``B_t`` (then it is
``torch._grouped_mm``) or such a view.
"""

from __future__ import annotations

import torch

from . import gemm, grouped_fp8
from .formats.base import ROWWISE, RecipeError
from .ops.copies import reads_from
from .ops.gemm import QuantizedTransposeView
from .tensor import QuantizedTensor


def _expert_matrices(q: QuantizedTensor, usage: str, dtype: torch.dtype) -> torch.Tensor:
    """``[E, out, in]`` values of the plane serving ``usage``, in ``dtype``."""
    if usage == ROWWISE:
        return q.dequantize(dtype, ROWWISE)
    return q.columnwise_matrix(dtype).reshape(q.shape)


class _QuantizedGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight_t, offs):
        q = reads_from(weight_t.base)
        w = _expert_matrices(q, ROWWISE, x.dtype)
        ctx.save_for_backward(x, offs)
        ctx.weight_t = weight_t  # read again in backward: FSDP2's backward gather re-points it
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

    @staticmethod
    def backward(ctx, grad_out):
        x, offs = ctx.saved_tensors
        weight_t = ctx.weight_t
        grad_x = grad_w_t = None
        if ctx.needs_input_grad[0]:
            q = reads_from(weight_t.base)
            w = _expert_matrices(q, "columnwise", grad_out.dtype)
            q.discard_transpose_cache()  # built for this one use (see fsdp.py)
            grad_x = torch._grouped_mm(grad_out, w, offs=offs)
        if ctx.needs_input_grad[1]:
            # [E, in, out]: the gradient of W^T (autograd's transpose backward turns it into W's)
            grad_w_t = torch._grouped_mm(x.t(), grad_out.to(x.dtype), offs=offs).to(weight_t.dtype)
        return grad_x, grad_w_t, None


def grouped_mm(A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(A, B_t, offs=offs)`` where ``B_t`` may be the transpose of an FP8 expert
    weight: forward reads its rowwise plane, the input gradient its columnwise plane (see the note).

    Args:
        A: routed tokens ``[tokens, in]`` (rows of expert ``e`` are ``offs[e-1]:offs[e]``).
        B_t: ``W.transpose(-2, -1)`` of an expert weight ``W`` ``[E, out, in]`` (a plain tensor, or a
            :class:`QuantizedTransposeView` of a per-expert :class:`QuantizedTensor`).
        offs: int32 cumulative token counts per expert, ``[E]``.

    Returns:
        ``[tokens, out]`` in ``A``'s dtype.

    Example:
        >>> q = dtensor_fp8.quantize(w, dtensor_fp8.per_expert(dtensor_fp8.MXFP8(), w.shape))  # w: [4, 256, 128]
        >>> y = grouped_mm(x, q.transpose(-2, -1), offs=torch.tensor([5, 9, 9, 16], dtype=torch.int32))
    """
    if isinstance(B_t, QuantizedTensor):
        raise RecipeError(f"grouped_mm: B_t is an FP8 weight of shape {tuple(B_t.shape)} itself; pass its transpose "
                          "w.transpose(-2, -1) ([experts, in, out]), as torch._grouped_mm takes it")
    if not isinstance(B_t, QuantizedTransposeView):
        return torch._grouped_mm(A, B_t, offs=offs)
    q = B_t.base
    if q.dim() != 3 or A.dim() != 2 or A.shape[-1] != q.shape[-1] or offs.shape != q.shape[:1]:
        raise RecipeError(f"{q.recipe.name}: grouped_mm of A {tuple(A.shape)} with an expert weight {tuple(q.shape)} "
                          f"and offs {tuple(offs.shape)}: expected A [tokens, {q.shape[-1]}] and offs [{q.shape[0]}]")
    why = grouped_fp8.unsupported_reason(A, q)
    if why is None:
        return grouped_fp8.ScaledGroupedMM.apply(A, B_t, offs)
    gemm.note_fallback(why, A, q, stacklevel=3,
                       subject=f"the grouped GEMM of a {q.recipe.name} expert weight of shape {tuple(q.shape)} runs "
                               "the emulated path (torch._grouped_mm)")
    return _QuantizedGroupedMM.apply(A, B_t, offs)


def experts_grouped_mm(self, *, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """A drop-in for torchtitan's ``GroupedExperts._grouped_mm`` seam (a method): :func:`grouped_mm`.

    Example:
        >>> experts._grouped_mm = types.MethodType(experts_grouped_mm, experts)
    """
    return grouped_mm(A, B_t, offs)
