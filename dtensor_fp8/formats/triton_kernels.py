"""Triton kernels as the recipes' GPU fast path: the bytes of the pure-torch reference, in one pass.

[Note: the Triton fast path]
The reference recipes read and write a tensor several times per plane (amax, scale, cast, NaN
fix-up); MXFP8's reference runs at 37.6 GB/s on an H200. The Triton kernels
(``triton_mxfp8.py``, ``triton_blockwise.py``, ``triton_per_tensor.py``) load each tile once and
write every requested plane from it (MXFP8 and 128x128 blockwise: both planes in one pass; 1x128
blockwise: one launch a plane, each with its own tile; optionally the columnwise plane already
transposed, as the backward GEMMs read it). They implement the reference
rules bit for bit (``triton_fp8.py``: E8M0 rounding up, TE's scale rule, saturating
round-to-nearest-even casts, NaN as 0x7F) and are checked byte for byte against the reference:
``tests/test_triton_kernels.py`` under Triton's CPU interpreter, ``tests/gpu/test_triton_gpu.py``
on the GPU.

Triton ships with torch's CUDA builds; it is never required: without it (or with
``DTENSOR_FP8_TRITON=0``, or inside ``te_kernels.reference_only()``) the recipes run their
TE-kernel or pure-torch paths. Under ``TRITON_INTERPRET=1`` the kernels also take CPU tensors
(slowly: that is for tests), casting to FP8 in software because the interpreter's own FP8
conversion does not round to nearest even. The switches are read once, by ``settings.py``.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from .. import _compat, settings
# The switches the kernel modules read live in a leaf (triton_switches.py): the kernel modules,
# which this module imports on first use (kernels()), do not import this module back.
from .triton_switches import fp8_max, interpreting, software_cast  # noqa: F401  (re-exported)

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def usable(t: torch.Tensor) -> bool:
    """True when ``t`` can take the Triton path: a non-empty CUDA tensor of a high-precision dtype
    (or a CPU one under the interpreter), Triton importable, the path not switched off, and ``t``
    not one of the fake tensors torch.compile traces with (a kernel launch needs data)."""
    if not (t.is_cuda or (t.device.type == "cpu" and interpreting())):
        return False
    if t.numel() == 0 or t.dtype not in _INPUT_DTYPES or not settings.current().triton:
        return False
    return not _compat.is_traced(t) and _importable()


def fast_path(recipe, hp: torch.Tensor) -> str | None:
    """Which fast path takes ``hp`` for ``recipe``: the first of ``recipe.kernel_order``
    (``"triton"``, ``"te"``) usable here, or ``None`` (the reference)."""
    from . import te_kernels

    if _compat.is_traced(hp):
        # Under torch.compile the reference's torch ops are traced and fused by inductor; the
        # hand-written kernels (and the import probing that picks them) stay out of the graph.
        return None
    for path in recipe.kernel_order:
        if path == "triton" and usable(hp):
            return path
        if path == "te" and te_kernels.takes_input(hp):
            return path
    return None


@functools.cache  # called per quantization: importlib's lookup costs microseconds of host time
def kernels(name: str):
    """The Triton kernel module ``triton_<name>`` (imported on first use: it imports Triton)."""
    import importlib

    return importlib.import_module(f"{__package__}.triton_{name}")
