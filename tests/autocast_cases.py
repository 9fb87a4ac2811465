"""``torch.autocast`` cases shared by tests/test_autocast.py (CPU) and tests/gpu/test_autocast_gpu.py
(CUDA): an FP8 ``nn.Linear`` under autocast against what autocast does to a plain one.

[Note: what autocast must do to an FP8 linear]
Autocast casts ``F.linear``'s floating operands to its dtype and runs the GEMM there: the output is
in the autocast dtype, and the gradients reach the input, the weight and the bias in their own
dtypes through the casts' backward. An FP8 linear must do the same (linear.py's note), so:

* **emulated linear** (:func:`check_emulated_against_unquantized`): the same layer with a plain
  fp32 weight holding the FP8 weight's dequantized rowwise plane computes, under autocast, the same
  forward (the same ``F.linear`` call on the same cast operands: bit-exact), the same weight and
  bias gradients, and an input gradient equal to ``dy`` times the *columnwise* plane cast to the
  autocast dtype (the plane the backward GEMM reads; the weights have rows of very different
  magnitudes, so MXFP8 / 1x128 row and column planes differ);
* **FP8 GEMMs** (:func:`check_fp8_gemms_against_explicit_cast`): an fp32 layer run under autocast
  equals, byte for byte, the same layer run without autocast on an input and a bias cast to the
  autocast dtype by hand: output, every GEMM operand (so the activation is quantized *after* the
  cast, as Transformer Engine does), and the gradients (the input's and the bias' cast back to
  fp32, the weight's in fp32).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import dtensor_fp8 as d
from dtensor_fp8 import gemm

BATCH, SEQ, K, M = 2, 64, 512, 256  # 128 tokens; every dim a multiple of 128 (blockwise GEMMs on CUDA)


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, for bit-exact comparison."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if not torch.equal(bits(a), bits(b)):
        err = ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
        raise AssertionError(f"{what}: not bit-exact (max error {err:.3g} of the largest element)")


def fp8_layer(recipe, device, seed: int = 0) -> nn.Linear:
    """An ``nn.Linear(K, M)`` with an FP8 weight (fp32 nominal) and an fp32 bias; weight rows span
    three decades, so block scales differ between rows and between row and column blocks."""
    g = torch.Generator().manual_seed(seed)
    layer = nn.Linear(K, M)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(M, K, generator=g) * torch.logspace(-2, 1, M)[:, None])
        layer.bias.copy_(torch.randn(M, generator=g))
    layer = layer.to(device)
    d.quantize_module_(layer, recipe)
    return layer


def inputs(device, dtype, seed: int = 1):
    """``(x, dy)``: an fp32 activation ``(BATCH, SEQ, K)`` and an upstream gradient in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, SEQ, K, generator=g) * torch.logspace(-1, 1, K)
    dy = torch.randn(BATCH, SEQ, M, generator=g) * 1e-2
    return x.to(device), dy.to(device=device, dtype=dtype)


def run(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor, dtype, autocast: bool = True) -> dict:
    """Forward under ``torch.autocast(dtype)`` (or not), backward with ``dy``: what came out."""
    x = x.detach().clone().requires_grad_(True)
    with torch.autocast(x.device.type, dtype=dtype, enabled=autocast):
        y = layer(x)
    y.backward(dy)
    return {"y": y.detach(), "dx": x.grad, "dw": layer.weight.grad, "db": layer.bias.grad}


def check_emulated_against_unquantized(recipe, device, dtype, exact_grads: bool = True) -> None:
    """The emulated FP8 linear under autocast against a plain ``nn.Linear`` holding its rowwise
    values (see the note). ``exact_grads=False``: gradients to float rounding, for devices whose
    GEMM libraries may order a transposed product's sums differently (cuBLAS)."""
    layer = fp8_layer(recipe, device)
    q = layer.weight.detach()
    plain = nn.Linear(K, M).to(device)
    with torch.no_grad():
        plain.weight.copy_(q.dequantize(torch.float32, d.ROWWISE))
        plain.bias.copy_(layer.bias)
    x, dy = inputs(device, dtype)
    with gemm.fp8_gemms("off"):
        got = run(layer, x, dy, dtype)
    ref = run(plain, x, dy, dtype)
    assert got["y"].dtype == dtype and (got["dx"].dtype, got["dw"].dtype, got["db"].dtype) == (torch.float32,) * 3
    assert isinstance(layer.weight.grad, torch.Tensor) and not isinstance(layer.weight.grad, d.QuantizedTensor)
    assert_bit_equal(got["y"], ref["y"], "output")
    dx_col = (dy.reshape(-1, M) @ q.columnwise_matrix(torch.float32).to(dtype)).float().reshape(x.shape)
    for key, expected in (("dw", ref["dw"]), ("db", ref["db"]), ("dx", dx_col)):
        if exact_grads:
            assert_bit_equal(got[key], expected, key)
        else:  # one rounding of the autocast dtype's GEMM output (bf16: 2^-8), relative to the largest element
            scale = expected.abs().max().item()
            torch.testing.assert_close(got[key], expected, rtol=2 ** -6, atol=2 ** -6 * scale, msg=key)


def check_fp8_gemms_against_explicit_cast(recipe, device, dtype, mode: str = "on") -> list[str]:
    """FP8 GEMMs under autocast against the same GEMMs on operands cast by hand (see the note);
    returns the GEMMs recorded under autocast."""
    base = fp8_layer(recipe, device)
    auto, manual = copy.deepcopy(base), copy.deepcopy(base)  # delayed scaling: fresh operand state each
    x, dy = inputs(device, dtype)
    with gemm.fp8_gemms(mode):
        reason = gemm.unsupported_reason(x.to(dtype), auto.weight)
        assert reason is None, f"{recipe.name}: no FP8 GEMMs here: {reason}"
        with gemm.recording() as log_auto:
            got = run(auto, x, dy, dtype)
        xm = x.to(dtype).requires_grad_(True)
        with gemm.recording() as log_manual:
            y = F.linear(xm, manual.weight, manual.bias.to(dtype))
            y.backward(dy)
    assert [e["gemm"] for e in log_auto] == ["fprop", "dgrad", "wgrad"] == [e["gemm"] for e in log_manual]
    assert got["y"].dtype == dtype and got["dx"].dtype == torch.float32 and got["dw"].dtype == torch.float32
    assert_bit_equal(got["y"], y.detach(), "output")
    for a, b in zip(log_auto, log_manual):
        for side in ("a", "b"):
            assert_bit_equal(a[side].data, b[side].data, f"{a['gemm']}.{side} data")
            assert_bit_equal(a[side].scale_inv, b[side].scale_inv, f"{a['gemm']}.{side} scale_inv")
    assert_bit_equal(got["dx"], xm.grad.float(), "dx")
    assert_bit_equal(got["dw"], manual.weight.grad, "dw")
    assert_bit_equal(got["db"], manual.bias.grad, "db")
    return [e["gemm"] for e in log_auto]


class MLP(nn.Module):
    """Two FP8-able linears with biases and a ReLU (a bias gradient: a sum inductor may reorder)."""

    def __init__(self, dim: int = 256):
        super().__init__()
        self.w1, self.w2 = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))
