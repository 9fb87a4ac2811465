"""The Triton kernels (dtensor_fp8/formats/triton_*.py) write the reference's bytes: checked under
Triton's CPU interpreter, in a subprocess with ``TRITON_INTERPRET=1`` (the interpreter is chosen
when kernels are defined, so it cannot be switched on inside this process).

The interpreter runs the kernels' code with numpy, the FP8 cast in software (the interpreter's own
FP8 conversion does not round to nearest even); the hardware cast is checked on the GPU
(tests/gpu/test_triton_gpu.py runs every case of tests/kernel_checks.py on CUDA). Here: every
recipe on the special-values input (NaN, Inf, zeros, subnormals, outliers, zero blocks) in bf16:
quantize, GEMM operands and the in-place requantization, byte for byte. The interpreter is slow
(about 5 s a case on two shared cores), hence the subset; ``TRITON_INTERPRET=1 python
tests/kernel_checks.py cpu`` runs all cases (8 per recipe: golden, random, specials, ragged; fp32 / bf16 /
fp16) in about 7 minutes.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kernel_checks import RECIPES

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
HERE = Path(__file__).resolve().parent


def test_triton_kernels_byte_equal_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-W", "ignore", str(HERE / "kernel_checks.py"), "cpu", "specials:bf16"],
                          env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "0 failed" in out and " passed" in out, out[-2000:]
    assert out.count("\nok ") + out.startswith("ok ") == len(RECIPES), out[-3000:]  # every recipe

