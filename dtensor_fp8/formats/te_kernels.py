"""Transformer Engine's CUDA kernels as the recipes' fast path: the same bytes, several times faster.

[Note: one set of bytes, two implementations]
Every recipe is written in plain torch: that reference runs everywhere (the CPU CI included) and is
checked byte for byte against TE's outputs in ``shared/golden``. On a CUDA tensor, where
``transformer_engine`` imports, the hot steps of requantizing weights after each optimizer step
call the kernels TE makes its own FP8 weights with (the pure-torch path reads and writes the
tensor five or six times; one TE kernel does it in one pass — ``python -m dtensor_fp8.benchmarks
recipe`` shows both):

* per-tensor amax: ``tex.compute_amax`` (an ``fmaxf`` reduction: NaN ignored, as the reference);
* the scaled, saturating per-tensor cast with a given scale: TE's ``Float8Quantizer`` — the scale
  is still ours (it may come from an amax reduced across shards, or a delayed-scaling history),
  which is also how TE casts sharded master weights (``transformer_engine.pytorch.tensor.utils``);
  an optimizer step has it write straight into the weight's existing FP8 bytes;
* blockwise quantization of a local shard (its blocks never straddle shards):
  ``Float8BlockQuantizer``, its output read back with the recipe's ``from_te_layout``;
* the FP8 byte transpose TE's Hopper GEMMs read for the backward pass: ``tex.fp8_transpose``
  (torch's generic strided copy of a 1-byte tensor is several times slower).

``tests/gpu/test_te_kernels.py`` compares each fast path with the reference byte for byte on the
GPU. MXFP8 has no fast path: TE's MXFP8 kernels need sm_100+ and cannot be checked on the H200
(where TE's MXFP8 quantize writes nothing); the Triton kernels (``triton_kernels.py``) cover it.
``DTENSOR_FP8_TE_KERNELS=0`` turns TE's kernels off (read once, by ``settings.py``);
``kernel_paths()`` / ``reference_only()`` choose the paths within a block through
``settings.override``, never through the environment.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from .. import _compat, settings
from . import te_import


@functools.cache
def _te():
    """TE's namespace (``formats/te_import.py``), or ``None`` when TE does not import or lacks
    the kernels used here (imported on the first CUDA tensor only: CPU runs never load TE)."""
    te = te_import.load()
    if te is None or not all(hasattr(te.tex, f) for f in ("compute_amax", "fp8_transpose")):  # another TE version
        return None
    return te


def usable(hp: torch.Tensor) -> bool:
    """True when ``hp`` can take the TE fast path: a non-empty CUDA tensor, TE importable, the
    fast path not switched off (``settings.current().te_kernels``), and not inside torch.compile
    (dynamo cannot trace TE's extension calls, and AOT autograd's fake tensors have no data; the
    compiled reference makes the same bytes)."""
    return (hp.is_cuda and hp.numel() > 0 and not _compat.is_traced(hp)
            and settings.current().te_kernels and _te() is not None)


# What TE's quantizers read and tests/gpu/test_te_kernels.py checks (fp16 goes the reference way).
_INPUT_DTYPES = (torch.float32, torch.bfloat16)


def takes_input(hp: torch.Tensor) -> bool:
    """:func:`usable`, for a high-precision input of a checked dtype (fp32 / bf16)."""
    return hp.dtype in _INPUT_DTYPES and usable(hp)


@contextlib.contextmanager
def kernel_paths(*, te: bool, triton: bool):
    """Within the block, the recipes' TE-kernel and Triton fast paths are on or off as given (tests
    comparing paths, benchmarks timing each): ``settings.override(te_kernels=te, triton=triton)``.
    Process-wide, like the settings, so it is not meant for threads running other FP8 work
    meanwhile.

    Args:
        te: TE's kernels may run.
        triton: the Triton kernels may run.

    Example:
        >>> with kernel_paths(te=False, triton=True):
        ...     q = dtensor_fp8.quantize(w.cuda(), dtensor_fp8.MXFP8())  # the Triton kernel
    """
    with settings.override(te_kernels=te, triton=triton):
        yield


@contextlib.contextmanager
def reference_only():
    """Within the block every recipe runs its pure-torch reference, also on CUDA (neither TE's nor
    the Triton kernels): :func:`kernel_paths` with both off.

    Example:
        >>> with reference_only():
        ...     ref = dtensor_fp8.quantize(w.cuda(), dtensor_fp8.CurrentScaling())
    """
    with kernel_paths(te=False, triton=False):
        yield


def transpose_bytes(u8: torch.Tensor) -> torch.Tensor:
    """``u8.t().contiguous()`` of a 2-D uint8 tensor (FP8 bytes; a transpose moves bytes, so the
    FP8 format given to TE's kernel does not matter)."""
    te = _te()
    return te.tex.fp8_transpose(u8.contiguous(), te.dtypes[torch.float8_e4m3fn], out=None)


def transposer(u8: torch.Tensor):
    """``fn() -> u8.t().contiguous()`` for this very contiguous 2-D uint8 CUDA tensor, with TE's
    kernel and format looked up once: an FSDP hook transposes the same gathered plane at every
    backward gather, where the per-call checks of :func:`usable` cost more than the launch. Under
    torch.compile it returns the reference (dynamo cannot trace TE's extension).

    Example:
        >>> transpose = transposer(plane.data.view(torch.uint8))  # once
        >>> transpose()  # per gather: (K, M) bytes
    """
    te = _te()
    fp8_transpose, fmt = te.tex.fp8_transpose, te.dtypes[torch.float8_e4m3fn]
    is_compiling = torch.compiler.is_compiling

    def transpose() -> torch.Tensor:
        if is_compiling():
            return u8.t().contiguous()
        return fp8_transpose(u8, fmt, out=None)
    return transpose


def tensor_amax(hp: torch.Tensor) -> torch.Tensor:
    """``max(|hp|)`` over the whole tensor, NaN ignored, fp32 of shape ``(1, 1)``."""
    amax = torch.zeros(1, dtype=torch.float32, device=hp.device)
    _te().tex.compute_amax(hp.contiguous(), amax)
    return amax.reshape(1, 1)


def tensor_amaxes(hps: list[torch.Tensor]) -> torch.Tensor:
    """``max(|hp|)`` of each tensor, NaN ignored, into one fp32 ``(n,)`` tensor: one kernel per
    tensor writing its slot (as TE packs the amaxes of its own master-weight casts).

    Args:
        hps: non-empty CUDA tensors of a :func:`takes_input` dtype.

    Example:
        >>> tensor_amaxes([w1, w2])  # tensor([max|w1|, max|w2|])
    """
    tex = _te().tex
    out = torch.zeros(len(hps), dtype=torch.float32, device=hps[0].device)
    for i, hp in enumerate(hps):
        tex.compute_amax(hp.contiguous(), out[i : i + 1])
    return out


def cast_with_scale(hp: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``saturate(hp * scale)`` in ``fp8_dtype`` (round to nearest even), one per-tensor ``scale``."""
    scratch_amax = torch.empty(1, dtype=torch.float32, device=hp.device)  # the cast also records its amax
    quantizer = te_import.new_quantizer("Float8Quantizer", fp8_dtype, scale=scale.float().reshape(1).to(hp.device),
                                        amax=scratch_amax, rowwise=True, columnwise=False)
    return quantizer(hp.contiguous())._data.view(fp8_dtype).reshape(hp.shape)


def cast_with_scales_into(hps: list[torch.Tensor], scales: torch.Tensor, outs: list[torch.Tensor],
                          fp8_dtype: torch.dtype) -> None:
    """:func:`cast_with_scale` of each ``hps[i]`` with ``scales[i]``, written into the existing FP8
    tensor ``outs[i]`` (an optimizer step rewriting weights in place: no new tensor, no copy).
    Only the FP8 bytes are written; the caller stores the scale_invs.

    Args:
        hps: high-precision CUDA tensors of a :func:`takes_input` dtype.
        scales: fp32 ``(n,)``, one scale per tensor, on the same device.
        outs: contiguous ``fp8_dtype`` tensors of the shapes of ``hps``.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.

    Example:
        >>> cast_with_scales_into([w], torch.tensor([2.0], device="cuda"), [plane.data], torch.float8_e4m3fn)
    """
    te = _te()
    scratch = torch.empty(2, dtype=torch.float32, device=scales.device)  # amax the cast records, scale_inv slot
    quantizer = te_import.new_quantizer("Float8Quantizer", fp8_dtype, scale=scales[0].reshape(1), amax=scratch[0:1],
                                        rowwise=True, columnwise=False)
    # TE's storage class over our bytes: the cast kernel writes them directly.
    target = te.Float8TensorStorage(data=None, fp8_scale_inv=scratch[1:2], fp8_dtype=te.dtypes[fp8_dtype],
                                    data_transpose=None)
    for hp, scale, out in zip(hps, scales, outs, strict=True):
        quantizer.scale = scale.reshape(1)  # TE's extension reads the quantizer's attributes at each call
        target._data = out.view(torch.uint8)
        te.tex.quantize(hp.contiguous(), quantizer, target, None)


def blockwise_quantize(hp: torch.Tensor, *, block_dims: int, fp8_dtype: torch.dtype, force_pow_2_scales: bool,
                       amax_epsilon: float, rowwise: bool, columnwise: bool) -> dict[str, torch.Tensor | None]:
    """TE's blockwise quantization of a 2-D tensor: TE's buffers (``_rowwise_data``, padded
    ``_rowwise_scale_inv``, ...) for the recipe's ``from_te_layout``."""
    quantizer = te_import.new_quantizer("Float8BlockQuantizer", fp8_dtype, rowwise=rowwise, columnwise=columnwise,
                                        amax_epsilon=amax_epsilon, force_pow_2_scales=force_pow_2_scales,
                                        block_scaling_dim=block_dims)
    out = quantizer(hp.contiguous())
    return {name: getattr(out, name, None) for name in
            ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv")}
