"""FP8 linears under CUDA ``torch.autocast`` (bf16 and fp16), every recipe: the cases of
tests/test_autocast.py on the GPU, where ``F.linear`` runs the FP8 GEMMs of gemm.py (see the note in
tests/autocast_cases.py for what each comparison means).

1. FP8 GEMMs under autocast equal, byte for byte, the same GEMMs on operands cast to the autocast
   dtype by hand: output (in the autocast dtype), every GEMM operand (the activation is quantized
   after the cast, as TE quantizes its input after casting it to the autocast dtype) and the
   gradients (input and bias cast back to fp32, weight gradient in fp32).
2. The FP8-GEMM path agrees with the emulated linear under the same autocast to TE's tolerance
   for FP8 GEMMs (rtol 0.125, atol 0.0675 of each tensor's largest magnitude, as
   tests/gpu/test_gemm_gpu.py): they read the same weight bytes; the FP8 path also quantizes the
   activation and the gradient.
3. The emulated linear under autocast: bit-exact forward with a plain ``nn.Linear`` holding the FP8
   values; gradients to one rounding of the autocast dtype (cuBLAS may order a transposed
   product's sums differently).
4. ``torch.compile`` (inductor, Triton) of a two-layer FP8 model under autocast: output and
   gradients bit-exact with eager under the same autocast (delayed scaling runs the emulated
   linear under compile, as tests/gpu/test_compile.py explains, and is compared with eager's).
   The FP8-GEMM path is compiled with ``torch._inductor.config.emulate_precision_casts=True``: by
   default inductor fuses autocast's cast of an fp32 activation into the operand quantization and
   skips the bf16 rounding in between (shown on the CPU: ``x.to(bf16)`` -> amax -> scale -> FP8
   gives other bytes compiled than eager, the same with the flag), so the compiled run quantizes
   the unrounded activation; the emulated path feeds the cast to a GEMM, which materializes it.

Recipes without an FP8 GEMM on this device (MXFP8 before sm_100) skip 1, 2 and the FP8 half of 4
with the reason. Not run yet at the time of writing (no GPU was lent): torch's own tests of the
blockwise scaled GEMM on sm_90 cover bf16 and fp32 outputs only, so the fp16 cases of the
blockwise recipes are the first to look at if one fails.
"""

from __future__ import annotations

import copy

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: CUDA autocast tests need a GPU", allow_module_level=True)

import dtensor_fp8 as d  # noqa: E402
from autocast_cases import (  # noqa: E402
    assert_bit_equal, check_emulated_against_unquantized, check_fp8_gemms_against_explicit_cast, fp8_layer,
    inputs, run,
)
from compile_cases import TOKENS, DIM, block  # noqa: E402
from dtensor_fp8 import gemm  # noqa: E402

RECIPES = list(d.RECIPES)
DTYPES = [torch.bfloat16, torch.float16]
DEV = "cuda"


def _fp8_gemms_here(name, dtype):
    with gemm.fp8_gemms("auto"):
        reason = gemm.unsupported_reason(torch.empty(TOKENS, 512, device=DEV, dtype=dtype),
                                         d.quantize(torch.zeros(256, 512, device=DEV), d.RECIPES[name]))
    if reason is not None:
        pytest.skip(f"{name}: no FP8 GEMMs on this device: {reason}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", RECIPES)
def test_fp8_gemms_under_autocast_equal_gemms_on_cast_operands(name, dtype):
    _fp8_gemms_here(name, dtype)
    assert check_fp8_gemms_against_explicit_cast(d.RECIPES[name], DEV, dtype, mode="auto") == ["fprop", "dgrad", "wgrad"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", RECIPES)
def test_fp8_gemms_under_autocast_agree_with_the_emulated_linear(name, dtype):
    _fp8_gemms_here(name, dtype)
    base = fp8_layer(d.RECIPES[name], DEV)
    x, dy = inputs(DEV, dtype)
    with gemm.fp8_gemms("auto"), gemm.recording() as log:
        fp8 = run(copy.deepcopy(base), x, dy, dtype)
    assert [e["gemm"] for e in log] == ["fprop", "dgrad", "wgrad"]
    with gemm.fp8_gemms("off"):
        emulated = run(copy.deepcopy(base), x, dy, dtype)
    for key in ("y", "dx", "dw", "db"):
        assert fp8[key].dtype == emulated[key].dtype, key
        scale = emulated[key].float().abs().max().item()
        torch.testing.assert_close(fp8[key].float(), emulated[key].float(), rtol=0.125, atol=0.0675 * scale,
                                   msg=f"{name}/{key}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", RECIPES)
def test_emulated_linear_under_autocast_is_autocasts_linear(name, dtype):
    check_emulated_against_unquantized(d.RECIPES[name], DEV, dtype, exact_grads=False)


@pytest.mark.parametrize("path", ["emulated", "fp8"])
@pytest.mark.parametrize("name", RECIPES)
def test_compiled_under_autocast_equals_eager(name, path):
    if path == "fp8":
        _fp8_gemms_here(name, torch.bfloat16)
    mode = "off" if path == "emulated" else "auto"
    # delayed scaling's FP8 path runs the emulated linear under compile (gemm.unsupported_reason)
    eager_mode = "off" if (name, path) == ("delayed", "fp8") else mode
    torch._dynamo.reset()
    model = block(DEV, seed=0)
    d.quantize_module_(model, d.RECIPES[name])
    g = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(TOKENS, DIM, device=DEV, generator=g)
    dy = torch.randn(TOKENS, DIM, device=DEV, generator=g, dtype=torch.bfloat16) * 1e-2

    def step(call, m):
        xi = x.clone().requires_grad_(True)
        with gemm.fp8_gemms(m), torch.autocast(DEV, dtype=torch.bfloat16):
            y = call(xi)
        y.backward(dy)
        out = {"y": y.detach(), "dx": xi.grad}
        out.update({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad()
        return out

    eager = step(model, eager_mode)
    with torch._inductor.config.patch(emulate_precision_casts=path == "fp8"):
        compiled = step(torch.compile(model, fullgraph=path == "emulated"), mode)
    assert eager["y"].dtype == torch.bfloat16
    for key in eager:
        assert_bit_equal(compiled[key], eager[key], f"{name}/{path}/{key}")
