"""The switches the Triton kernel modules read when they are defined and launched: whether Triton's
CPU interpreter is on, whether casts to FP8 run in software, and each FP8 dtype's maximum.

A leaf of ``formats/`` (it imports ``settings`` only): ``triton_kernels.py`` imports the kernel
modules (``triton_mxfp8.py`` ...) on first use, and they read these from here, not from it, so no
formats module imports a module that imports it back (tests/test_structure.py checks it).
"""

from __future__ import annotations

import torch

from .. import settings


def interpreting() -> bool:
    """Triton's CPU interpreter is on (``TRITON_INTERPRET=1``; Triton reads it when kernels are
    defined, ``settings.py`` once, as Triton does)."""
    return settings.current().triton_interpret


def software_cast() -> bool:
    """Cast to FP8 with integer operations (exact everywhere) instead of the hardware conversion
    (under the interpreter, or ``DTENSOR_FP8_TRITON_SOFTWARE_CAST=1``)."""
    return interpreting() or settings.current().triton_software_cast


def fp8_max(fp8_dtype: torch.dtype) -> float:
    return float(torch.finfo(fp8_dtype).max)
