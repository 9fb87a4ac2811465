"""The Triton kernels (dtensor_fp8/formats/triton_*.py) on the GPU write the reference's bytes.

Every case of tests/kernel_checks.py (each recipe x TE's golden input, random inputs with
outliers, the special values: NaN, Inf, zeros, fp32 and FP8 subnormals, zero blocks, and ragged
shapes; fp32 / bf16 / fp16): quantize (both planes, one pass each kernel), GEMM operands (columnwise planes
written transposed) and the in-place batched requantization, byte for byte against the
pure-torch reference, with the hardware FP8 conversion; and the software conversion (the one the
CPU interpreter tests run) giving the same bytes here. Also: an optimizer step's requantization
through the Triton kernels captured into a CUDA graph replays the eager bytes.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

import kernel_checks  # noqa: E402

import dtensor_fp8 as d  # noqa: E402
from dtensor_fp8.formats import te_kernels  # noqa: E402


@pytest.mark.parametrize("name,case,dtype", kernel_checks.cases(), ids=lambda v: str(v))
def test_triton_matches_reference(name, case, dtype):
    errors = kernel_checks.check(name, case, dtype, "cuda")
    assert not errors, "\n".join(errors[:10])


@pytest.mark.parametrize("name", list(kernel_checks.RECIPES))
def test_software_cast_matches_hardware_cast(name):
    # The switch of DTENSOR_FP8_TRITON_SOFTWARE_CAST=1, in-process (the environment is read once).
    with d.settings.override(triton_software_cast=True):
        errors = kernel_checks.check(name, "specials", "bf16", "cuda")
    assert not errors, "\n".join(errors[:10])


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "block1d", "block2d", "current_e4m3"])
def test_requantize_in_a_cuda_graph(name):
    recipe = kernel_checks.RECIPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.randn(512, 1024, device="cuda", generator=g) * 10.0 ** i for i in range(3)]
    masters = [w.clone() for w in ws]
    with te_kernels.kernel_paths(te=False, triton=True):
        qs = [d.quantize(w, recipe) for w in ws]
        usages = recipe.stored_usages(True, True)

        def step():
            for usage in usages:
                recipe.requantize_planes_(usage, masters, [q.planes[usage] for q in qs], [None] * 3, [None] * 3)

        step()  # warm-up (compiles the kernels)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for m in masters:
            m.mul_(1.7).add_(0.3)
        graph.replay()
        torch.cuda.synchronize()
    with te_kernels.reference_only():
        refs = [d.quantize(m, recipe) for m in masters]
    for q, ref in zip(qs, refs):
        for usage in ref.planes:
            for field in ("data", "scale_inv"):
                a, b = getattr(q.planes[usage], field), getattr(ref.planes[usage], field)
                assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), (name, usage, field)
