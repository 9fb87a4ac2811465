"""``F.linear`` with a quantized weight: FP8 GEMMs where torch has them (``gemm.py``), else the
emulated linear below.

The emulated linear runs on any device: forward reads the rowwise plane, the input gradient reads
the columnwise plane (or the transpose cache), each dequantized before a high-precision GEMM; the
weight gradient is a high-precision GEMM of ``dy`` and ``x``. It is the reference for what the
FP8 GEMMs compute from the same weight bytes, and it lets a CPU test tell which plane a gather
delivered: for MXFP8 and 1x128 blockwise the two planes hold different values, so reading the
wrong one changes the input gradient. It runs on the CPU (unless ``DTENSOR_FP8_GEMMS=on``), for
shapes and recipes torch has no scaled GEMM for on the device (MXFP8 before sm_100; dims not
multiples of 16, or of 128 for blockwise), and with ``DTENSOR_FP8_GEMMS=off``; on CUDA it says so
once per process with the reason (``gemm.fallback_reason``).

[Note: autocast]
Under ``torch.autocast(device, dtype)`` autocast casts ``F.linear``'s operands to its dtype before
the kernel runs; ``F.linear`` with a quantized weight is taken over by ``__torch_function__``
before autocast sees it, so :func:`quantized_linear` does the same casts itself: the activation
and the bias are cast to the autocast dtype with ordinary (differentiable) ``.to`` calls, the
weight is dequantized (emulated linear) or its FP8 bytes read (FP8 GEMMs) for that dtype, and
both paths run with autocast off. The output is in the autocast dtype; the gradients come back in
the input's, the bias' and the weight's own dtypes (``.to``'s backward, and the weight gradient's
explicit cast), as for an ``nn.Linear`` under autocast. The FP8 GEMMs quantize the *cast*
activation, as Transformer Engine quantizes its input after casting it to the autocast dtype.
Under tensor parallelism autocast casts the DTensor weight itself (``ops/copies.py``: a new
nominal dtype over the same FP8 bytes) and the local GEMMs (``ops/gemm.py``) read its planes.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from . import gemm
from .formats.base import ROWWISE


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would cast ``F.linear``'s floating operands to on ``x``'s device, or
    ``None`` when autocast is off there (or ``x`` is not floating).

    Args:
        x: the activation.

    Example:
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     autocast_dtype(torch.ones(2))
        torch.bfloat16
    """
    device = x.device.type
    if not x.is_floating_point() or not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)


class _QuantizedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        # Dequantize to the activation dtype, as TE's GEMM consumes FP8 and accumulates in fp32.
        w = weight.dequantize(x.dtype, ROWWISE)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, w, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            # Under FSDP this is the tensor the backward all-gather filled: columnwise planes.
            grad_x = grad_out @ weight.columnwise_matrix(grad_out.dtype)
            # The transpose cache lives from the backward gather to its one use (see fsdp.py).
            weight.discard_transpose_cache()
        if ctx.needs_input_grad[1]:
            g2 = grad_out.reshape(-1, grad_out.shape[-1])
            grad_w = (g2.t() @ x.reshape(-1, x.shape[-1])).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, grad_w, grad_b


def _linear(input: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    if gemm.fallback_reason(input, weight) is None:
        return gemm.fp8_linear(input, weight, bias)
    return _QuantizedLinear.apply(input, weight, bias)


def quantized_linear(input: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with a :class:`QuantizedTensor` weight (reached through ``__torch_function__``):
    FP8 GEMMs on the weight's planes where torch has them here, else the emulated linear. Under
    ``torch.autocast`` it computes in the autocast dtype, as ``nn.Linear`` does (see the note).

    Args:
        input: activations ``(..., K)``.
        weight: quantized weight ``(M, K)`` holding the rowwise plane (and the columnwise plane or
            transpose cache by the time backward runs).
        bias: optional ``(M,)``.

    Example:
        >>> y = torch.nn.functional.linear(x, dtensor_fp8.quantize(w, dtensor_fp8.MXFP8()))
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     y = torch.nn.functional.linear(x, q)   # y.dtype == torch.bfloat16
    """
    dtype = autocast_dtype(input)
    if dtype is None:
        autocast_off = contextlib.nullcontext()
    else:
        # What autocast does to F.linear's operands (its cast of the weight is the dequantize to the
        # activation's dtype, or the FP8 GEMM's output dtype); the paths then run with autocast off,
        # so nothing inside them (the operand quantization, a bias sum) is cast again.
        input = input.to(dtype)
        if bias is not None and bias.is_floating_point():
            bias = bias.to(dtype)
        autocast_off = torch.autocast(input.device.type, enabled=False)
    with autocast_off:
        return _linear(input, weight, bias)
