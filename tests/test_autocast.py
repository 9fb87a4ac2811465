"""FP8 linears under ``torch.autocast`` (CPU; CUDA in tests/gpu/test_autocast_gpu.py): outputs in the
autocast dtype, gradients in the parameters' and inputs' dtypes, every recipe, bf16 and fp16, eager
and compiled, without FSDP2 / TP and with them (2 gloo ranks). tests/autocast_cases.py's note says
what each comparison means; linear.py's note says how the library does it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dtensor_fp8 as d
from autocast_cases import MLP, assert_bit_equal, check_emulated_against_unquantized, check_fp8_gemms_against_explicit_cast
from dist_utils import DEVICE, WORLD_SIZES
from dtensor_fp8 import gemm
from dtensor_fp8.linear import autocast_dtype

RECIPES = list(d.RECIPES)
DTYPES = [torch.bfloat16, torch.float16]
#: torch's CPU scaled GEMM takes tensorwise scales only (gemm.py): the per-tensor recipes.
CPU_FP8_GEMM_RECIPES = ["delayed", "current"]


def test_autocast_dtype_follows_the_device_and_the_input():
    x = torch.ones(2)
    assert autocast_dtype(x) is None
    with torch.autocast("cpu", dtype=torch.float16):
        assert autocast_dtype(x) == torch.float16
        assert autocast_dtype(torch.ones(2, dtype=torch.int64)) is None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert autocast_dtype(x) is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", RECIPES)
def test_emulated_linear_under_autocast_is_autocasts_linear(name, dtype):
    """Bit-exact with a plain ``nn.Linear`` holding the FP8 values under the same autocast (the
    output and the weight / bias gradients), the input gradient read from the columnwise plane."""
    check_emulated_against_unquantized(d.RECIPES[name], "cpu", dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", CPU_FP8_GEMM_RECIPES)
def test_fp8_gemms_under_autocast_equal_gemms_on_cast_operands(name, dtype):
    """torch's CPU scaled GEMM (``DTENSOR_FP8_GEMMS=on``): under autocast the activation is cast,
    then quantized, and the output is in the autocast dtype (before the fix: fp32)."""
    assert check_fp8_gemms_against_explicit_cast(d.RECIPES[name], "cpu", dtype) == ["fprop", "dgrad", "wgrad"]


def _model(name, seed=0, quantize=True, spread=True, dim=256):
    """Two MLP blocks; with ``spread`` their weight rows span two decades (MXFP8 / 1x128 planes
    then differ), else torch's default init."""
    torch.manual_seed(seed)
    model = nn.Sequential(MLP(dim), MLP(dim))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2 and spread:
                p.mul_(torch.logspace(-1, 1, p.shape[0])[:, None])
    if quantize:
        d.quantize_module_(model, d.RECIPES[name])
    return model


def _step(model, call, x, dy, dtype=torch.bfloat16) -> dict:
    x = x.clone().requires_grad_(True)
    with torch.autocast(x.device.type, dtype=dtype):
        y = call(x)
    y.backward(dy)
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for n, p in model.named_parameters()}
    return {"y": y.detach(), "dx": x.grad, **grads}


def _batch(device="cpu"):
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 32, 256, generator=g).to(device), (torch.randn(4, 32, 256, generator=g) * 1e-2).to(
        device, torch.bfloat16)


@pytest.mark.parametrize("name", RECIPES)
def test_compiled_model_under_autocast_equals_eager(name):
    """``torch.compile(model, fullgraph=True)`` under bf16 autocast (dynamo and AOT autograd trace
    the autocast handling; backend ``aot_eager``, since inductor's cold C++ compile costs 10-50 s
    a recipe here: inductor under CUDA autocast is tests/gpu/test_autocast_gpu.py's, and on the
    CPU it was bit-exact too when measured): output, input and parameter gradients bit-exact
    with eager under the same autocast."""
    torch._dynamo.reset()
    model = _model(name)
    x, dy = _batch()
    eager = _step(model, model, x, dy)
    model.zero_grad()
    compiled = _step(model, torch.compile(model, fullgraph=True, backend="aot_eager"), x, dy)
    assert compiled.keys() == eager.keys() and eager["y"].dtype == torch.bfloat16
    for key in eager:
        assert_bit_equal(compiled[key], eager[key], key)


def _train(name, steps=8, dtype=torch.bfloat16):
    model = _model(name, quantize=name != "fp32", spread=False, dim=128)
    if name == "fp32":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-3)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 128, generator=g)
    y = x @ (torch.randn(128, 128, generator=g) / 11)  # a linear teacher; one batch, fitted step by step
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=dtype):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", RECIPES)
def test_training_under_autocast_follows_the_unquantized_model(name):
    """8 AdamW steps under bf16 autocast from the same init (the masters start from the
    high-precision init ``quantize_module_`` kept), against the model without FP8 under the same
    autocast; the reference's loss falls by 13 %. Tolerance: every loss within 1 % of the
    reference's. The only difference is each forward's FP8 rounding of the weights (E4M3: up to
    2^-4 relative per weight), which moved the loss by at most 0.18 % (measured, every recipe)."""
    ref = _train("fp32")
    losses = _train(name)
    assert ref[-1] < 0.9 * ref[0], f"the reference did not learn: {ref}"
    for step, (a, b) in enumerate(zip(losses, ref)):
        assert abs(a - b) <= 0.01 * b, (step, losses, ref)


# ---- FSDP2 and tensor parallelism (2 gloo ranks) ------------------------------------------------------
TP_PLAN = {"w1": ColwiseParallel(), "w2": RowwiseParallel()}


def _distribute(model, name, layout):
    """``layout``: "fsdp" (dp=2), "fsdp+tp" (dp=2 x tp=1: DTensor's local GEMMs, and the backward
    all-gather that re-points the weights autocast cast in forward) or "tp" (tp=2)."""
    dp, tp = {"fsdp": (2, 1), "fsdp+tp": (2, 1), "tp": (1, 2)}[layout]
    mesh = init_device_mesh(DEVICE, (dp, tp), mesh_dim_names=("dp", "tp"))
    if "tp" in layout:
        for block in model:
            if name == "plain":
                plan = copy.deepcopy(TP_PLAN)
                for style in plan.values():
                    style.src_data_rank = None  # as dtensor_fp8.parallelize_module sets it
                parallelize_module(block, mesh["tp"], plan)
            else:
                d.parallelize_module(block, mesh["tp"], copy.deepcopy(TP_PLAN))
    if "fsdp" in layout:
        for block in model:
            fully_shard(block, mesh=mesh["dp"])  # reshards after forward: backward gathers columnwise
        fully_shard(model, mesh=mesh["dp"])
    return model


def _distributed(name):
    x, dy = _batch(DEVICE)
    one = _model(name).to(DEVICE)
    out = {"one": _step(one, one, x, dy)}
    for layout in ("fsdp", "fsdp+tp", "tp"):
        model = _distribute(_model(name).to(DEVICE), name, layout)
        out[layout] = _step(model, model, x, dy)
    # tp=2 sums partial products in bf16 where one process sums once: the reference is the same
    # TP layout with plain weights holding the FP8 weights' rowwise values.
    plain = _model(name).to(DEVICE)
    with torch.no_grad():
        deq = nn.Sequential(MLP(), MLP()).to(DEVICE)
        for (n, p), (_, q) in zip(deq.named_parameters(), plain.named_parameters()):
            p.copy_(q.dequantize(torch.float32, d.ROWWISE) if isinstance(q, d.QuantizedTensor) else q)
    deq = _distribute(deq, "plain", "tp")
    out["tp/plain"] = _step(deq, deq, x, dy)
    return out


@pytest.mark.skipif(2 not in WORLD_SIZES, reason=f"needs 2 ranks (it builds dp=2 and tp=2 meshes); "
                    f"DTENSOR_FP8_TEST_WORLD_SIZES={','.join(map(str, WORLD_SIZES))} does not include 2")
@pytest.mark.parametrize("name", RECIPES)
def test_fsdp2_and_tp_under_autocast(pools, name):
    """Under bf16 autocast on 2 ranks (each rank the same batch): FSDP2, and FSDP2 over DTensor's
    local GEMMs, are bit-exact with one process (output, input and every parameter gradient);
    tp=2 is bit-exact with the same TP layout over plain weights holding the FP8 values (the
    output and the last layer's gradients; the rest too where the columnwise plane is the rowwise
    one, else within the two planes' FP8 difference)."""
    out = pools[2].run(_distributed, name)[0]
    one = out["one"]
    assert one["y"].dtype == torch.bfloat16 and all(v.dtype == torch.float32 for k, v in one.items() if k != "y")
    for layout in ("fsdp", "fsdp+tp"):
        for key in one:
            assert_bit_equal(out[layout][key], one[key], f"{layout}/{key}")
    tp, plain = out["tp"], out["tp/plain"]
    single_plane = d.RECIPES[name].columnwise_is_transpose
    for key in plain:
        if single_plane or key == "y" or key.startswith("1.w2"):
            assert_bit_equal(tp[key], plain[key], f"tp/{key}")
        else:  # MXFP8 / 1x128: backward reads the columnwise plane, the plain model its rowwise values
            scale = plain[key].abs().max().item()
            torch.testing.assert_close(tp[key], plain[key], rtol=0.25, atol=0.1 * scale, msg=f"tp/{key}")
