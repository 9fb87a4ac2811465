"""FP8 GEMMs of ``F.linear`` with a quantized weight (dtensor_fp8/gemm.py), on the CPU.

torch 2.13's CPU ``_scaled_mm`` runs tensorwise FP8 GEMMs, so for the per-tensor recipes the whole
FP8 linear runs here for real (``fp8_gemms("on")``): every operand handed to the GEMM is compared
byte for byte with what the recipes give, the weight operands are the weight's own planes, and the
outputs and gradients with the fp32 product of the dequantized operands. Block-scaled GEMMs have no
CPU kernel: their scale layouts are checked against torch's own shape/stride rules (the meta
kernel of ``scaled_mm``), and the MXFP8 swizzle against cuBLAS' layout formula.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import dtensor_fp8 as d
from conftest import assert_bytes_equal
from dist_utils import DEVICE
from dtensor_fp8 import gemm
from dtensor_fp8._compat import TORCH_VERSION
from dtensor_fp8.formats.base import BlockShape
from dtensor_fp8.formats.scaled_mm import SCALE_LAYOUTS, swizzle_32_4_4

PER_TENSOR = {"delayed": d.DelayedScaling(), "current": d.CurrentScaling(),
              "current_pow2": d.CurrentScaling(force_pow_2_scales=True)}
M, K, TOKENS = 96, 160, 48  # multiples of 16: cuBLAS' FP8 alignment
#: torch's meta kernel of ``_scaled_mm_v2`` checks block scales' strides up to 2.13; from 2.14 it
#: infers shapes only (the stride checks run in eager, in C++).
META_CHECKS_SCALE_STRIDES = TORCH_VERSION < (2, 14)


def _inputs(seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(M, K, generator=g) * torch.logspace(-1, 1, M)[:, None]).to(dtype)
    x = (torch.randn(2, TOKENS // 2, K, generator=g) * 3).to(dtype)
    dy = torch.randn(2, TOKENS // 2, M, generator=g).to(dtype)
    return w, x, dy


def _run(recipe, w, x, dy, bias=None):
    q = d.quantize(w, recipe)
    q.requires_grad_(True)
    x = x.clone().requires_grad_(True)
    with gemm.fp8_gemms("on"), gemm.recording() as log:
        y = F.linear(x, q, bias)
        y.backward(dy)
    return q, x, y, log


def _dequant(op: gemm.Operand) -> torch.Tensor:
    """fp32 values of a tensorwise operand."""
    return op.data.float() * op.scale_inv.float().reshape(())


@pytest.mark.parametrize("name", list(PER_TENSOR))
def test_per_tensor_operands_are_the_recipes_bytes(name):
    recipe = PER_TENSOR[name]
    w, x, dy = _inputs()
    q, xg, y, log = _run(recipe, w, x, dy)
    assert [e["gemm"] for e in log] == ["fprop", "dgrad", "wgrad"]
    fprop, dgrad, wgrad = (e for e in log)
    g = recipe.gemm_recipe()
    assert g.input.fp8_dtype == torch.float8_e4m3fn and g.grad.fp8_dtype == torch.float8_e5m2  # TE's HYBRID
    x2, dy2 = x.reshape(-1, K), dy.reshape(-1, M)
    # Expected operand planes, from the recipes (a fresh delayed state: TE's initial scale 1.0).
    xq, _ = g.input.quantize_operand(x2, rowwise=True, columnwise=True, state=g.input.operand_state(x.device))
    dyq, _ = g.grad.quantize_operand(dy2, rowwise=True, columnwise=True, state=g.grad.operand_state(x.device))
    xp, dyp = xq["rowwise"], dyq["rowwise"]
    wp = q.plane("rowwise")
    # fprop: x rowwise x the weight's rowwise plane, as stored (the same storage, no copy)
    assert_bytes_equal(fprop["a"].data, xp.data, "fprop a")
    assert_bytes_equal(fprop["a"].scale_inv, xp.scale_inv, "fprop a scale")
    assert fprop["b"].data.data_ptr() == wp.data.data_ptr() and fprop["b"].scale_inv is wp.scale_inv
    # dgrad: dy rowwise (E5M2) x the transpose cache of the weight's plane
    assert dgrad["a"].data.dtype == torch.float8_e5m2
    assert_bytes_equal(dgrad["a"].data, dyp.data, "dgrad a")
    assert_bytes_equal(dgrad["b"].data, wp.data.t().contiguous(), "dgrad b = transpose cache")
    assert q.transpose_cache is None, "the transpose cache is dropped after its one use"
    # wgrad: both operands transposed bytes of the same planes (contraction over tokens)
    assert_bytes_equal(wgrad["a"].data, dyp.data.t().contiguous(), "wgrad a")
    assert_bytes_equal(wgrad["b"].data, xp.data.t().contiguous(), "wgrad b")
    # Results: the fp32 product of the dequantized operands (torch's CPU kernel accumulates in fp32).
    tol = dict(rtol=1e-2, atol=1e-2)  # one bf16 rounding of the output
    torch.testing.assert_close(y.float().reshape(-1, M), _dequant(fprop["a"]) @ _dequant(fprop["b"]).t(), **tol)
    torch.testing.assert_close(xg.grad.float().reshape(-1, K), _dequant(dgrad["a"]) @ _dequant(dgrad["b"]).t(), **tol)
    torch.testing.assert_close(q.grad.float(), _dequant(wgrad["a"]) @ _dequant(wgrad["b"]).t(), **tol)
    assert xg.grad.dtype == x.dtype and q.grad.dtype == q.dtype and q.grad.shape == q.shape


def test_fp8_linear_agrees_with_the_emulated_linear():
    """The FP8 linear (x and dy quantized too) against the emulated one (only W quantized), within
    TE's own tolerance for FP8 GEMMs against a high-precision reference (TE tests/pytorch/utils.py
    ``quantization_tols``: rtol 0.125, atol 0.0675), relative to each tensor's scale."""
    w, x, dy = _inputs(1, torch.float32)
    bias = torch.randn(M)
    for recipe in PER_TENSOR.values():
        q, xg, y, _ = _run(recipe, w, x, dy, bias)
        qe = d.quantize(w, recipe).requires_grad_(True)
        xe = x.clone().requires_grad_(True)
        be = bias.clone().requires_grad_(True)
        with gemm.fp8_gemms("off"):
            ye = F.linear(xe, qe, be)
            ye.backward(dy)
        for got, ref in ((y, ye), (xg.grad, xe.grad), (q.grad, qe.grad)):
            s = ref.abs().max()
            torch.testing.assert_close(got / s, ref / s, rtol=0.125, atol=0.0675)


def _first_scale_inv(amax: float, fp8_max: float) -> float:
    """The first cast's scale_inv: a power of two from the tensor's own amax (TE: 1.0; see "the
    first operand scale" in formats/per_tensor.py)."""
    return 1.0 / 2.0 ** math.floor(math.log2(fp8_max / amax))


def test_delayed_scaling_keeps_te_amax_history_per_weight():
    """Step 1 casts x with a power of two from its own amax (TE's initial scale is 1.0, which puts
    small gradients into E5M2's subnormals) and records its amax; the next step's scale is
    fp8_max / max(history) (TE's update, here once per step: update_operand_scaling_). A second
    forward before the update (a recompute, a micro-batch) casts with the same scale."""
    recipe = d.DelayedScaling(amax_history_len=4)
    w, x, dy = _inputs(2)
    q = d.quantize(w, recipe).requires_grad_(True)
    scales = []
    with gemm.fp8_gemms("on"), gemm.recording() as log:
        for step in range(3):
            xs = (x * (step + 1)).requires_grad_(True)
            F.linear(xs, q).backward(dy)
            if step == 0:  # the same step again: recorded, not yet updated
                F.linear(xs, q).backward(dy)
            assert d.update_operand_scaling_([q]) == 2
    amax = [float((x * (s + 1)).float().abs().max()) for s in range(3)]
    before = [e["a"].scale_inv.item() for e in log if e["gemm"] == "fprop"]
    assert before[0] == before[1] == _first_scale_inv(amax[0], 448.0)
    del log[0:3]  # the repeated forward's fprop, dgrad and wgrad
    scales = [e["a"].scale_inv.item() for e in log if e["gemm"] == "fprop"]
    assert scales[0] == _first_scale_inv(amax[0], 448.0)
    assert scales[1] == pytest.approx(max(amax[:1]) / 448.0, rel=1e-6)
    assert scales[2] == pytest.approx(max(amax[:2]) / 448.0, rel=1e-6)
    states = gemm.operand_states(q)
    assert states["input"]["amax_history"].shape == (4,) and states["grad"]["amax_history"].shape == (4,)
    grad_scales = [e["a"].scale_inv.item() for e in log if e["gemm"] == "dgrad"]
    assert grad_scales[0] == _first_scale_inv(float(dy.float().abs().max()), 57344.0) and grad_scales[1] == pytest.approx(float(dy.float().abs().max()) / 57344.0, rel=1e-6)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_delayed_scaling_recompute_records_nothing_twice(use_reentrant):
    """Activation checkpointing around part of a forward recomputes the FP8 GEMM inside backward: the
    recompute casts with the same scale (updates run once per step, not per call) and records the
    same amax, so outputs, gradients and the operand histories equal the run without recompute,
    byte for byte, over three steps."""
    recipe = d.DelayedScaling(amax_history_len=4)
    w, x, dy = _inputs(4)

    def run(checkpointed):
        q = d.quantize(w, recipe).requires_grad_(True)
        out = []
        with gemm.fp8_gemms("on"):
            for step in range(3):
                xs = (x * (step + 1)).requires_grad_(True)
                f = lambda t: torch.nn.functional.gelu(F.linear(t, q))  # noqa: E731
                y = torch.utils.checkpoint.checkpoint(f, xs, use_reentrant=use_reentrant) if checkpointed else f(xs)
                y.backward(dy)
                d.update_operand_scaling_([q])
                out += [y.detach(), xs.grad, q.grad.clone()]
                q.grad = None
        return out + [t.clone() for t in q.param_state.scaling.operand_entries().values()]

    plain, recomputed = run(False), run(True)
    assert len(plain) == 9 + 4
    for i, (a, b) in enumerate(zip(plain, recomputed, strict=True)):
        assert_bytes_equal(a, b, f"tensor {i}")


@pytest.mark.parametrize("recipe", [d.Blockwise(block_dims=2), d.Blockwise(block_dims=1)], ids=lambda r: r.name)
def test_blockwise_scale_layouts_pass_torch_checks(recipe):
    """Each GEMM's operands, laid out as gemm.scaled_mm hands them to F.scaled_mm, satisfy torch's
    shape and stride rules for block scaling: its meta kernel (no CPU kernel exists), which checks
    strides up to torch 2.13 and shapes only from 2.14, and the strides those rules name."""
    t, m, k = 256, 384, 512
    g = torch.Generator().manual_seed(3)
    w = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]
    x, dy = torch.randn(t, k, generator=g), torch.randn(t, m, generator=g)
    q = d.quantize(w, recipe)
    gr = recipe.gemm_recipe()
    xq, _ = gr.input.quantize_operand(x, rowwise=True, columnwise=True)
    dyq, _ = gr.grad.quantize_operand(dy, rowwise=True, columnwise=True)
    col = recipe.stored_usage("columnwise")
    ops = {
        "fprop": (gemm.operand(xq["rowwise"], gr.input.block_shape("rowwise"), 1),
                  gemm.operand(q.plane("rowwise"), recipe.block_shape("rowwise"), 1)),
        "dgrad": (gemm.operand(dyq["rowwise"], gr.grad.block_shape("rowwise"), 1),
                  gemm.operand(q.planes[col], recipe.block_shape("columnwise"), 0)),
        "wgrad": (gemm.operand(dyq["columnwise"], gr.grad.block_shape("columnwise"), 0),
                  gemm.operand(xq["columnwise"], gr.input.block_shape("columnwise"), 0)),
    }
    expected_kinds = {"fprop": ("BlockWise1x128", "BlockWise128x128" if recipe.block_dims == 2 else "BlockWise1x128"),
                      "dgrad": ("BlockWise1x128", "BlockWise128x128" if recipe.block_dims == 2 else "BlockWise1x128"),
                      "wgrad": ("BlockWise1x128", "BlockWise1x128")}
    S = F.ScalingType
    for name, (a, b) in ops.items():
        la, lb = SCALE_LAYOUTS[a.block], SCALE_LAYOUTS[b.block]
        assert (la.kind, lb.kind) == expected_kinds[name], name
        sa = la.scale(a.scale_inv, *a.data.shape, operand="a")
        sb = lb.scale(b.scale_inv, *b.data.shape, operand="b")
        meta = lambda t: t.to("meta")  # noqa: E731  (.to keeps the strides of a dense tensor)
        assert meta(sa).stride() == sa.stride() and meta(sb).stride() == sb.stride()
        out = F.scaled_mm(meta(a.data), meta(b.data).t(), meta(sa), getattr(S, la.kind), meta(sb), getattr(S, lb.kind),
                          output_dtype=torch.bfloat16)
        assert out.shape == (a.data.shape[0], b.data.shape[0]), name
        # The scales hold the recipe's values at the block positions torch reads them from, with
        # the strides torch's rules name (formats/scaled_mm.py): 1x128 (rows, K/128) rows-major
        # (1, rows); 128x128 as B (L4, N/128) with (1, L4).
        for s, layout in ((sa, la), (sb, lb)):
            assert s.stride() == (1, s.shape[0]), (name, layout.kind, s.shape, s.stride())
        if la.kind == "BlockWise1x128":
            assert torch.equal(sa, a.scale_inv)
        if lb.kind == "BlockWise128x128":
            assert sb.shape[0] % 4 == 0
            assert torch.equal(sb[: b.scale_inv.shape[1]].t(), b.scale_inv)
    # A row-major 1x128 scale (the recipe's own layout, not SCALE_LAYOUTS') is refused by torch's
    # stride check: the layout above is not a formality. Up to torch 2.13 the meta kernel checks
    # strides; from 2.14 only the C++ check that runs in eager does (on CUDA, asserted in
    # tests/gpu/test_gemm_gpu.py) and the meta kernel checks shapes alone.
    a, b = ops["fprop"]
    la, lb = SCALE_LAYOUTS[a.block], SCALE_LAYOUTS[b.block]
    sa, sb = la.scale(a.scale_inv, *a.data.shape, operand="a"), lb.scale(b.scale_inv, *b.data.shape, operand="b")
    row_major = a.scale_inv.contiguous()
    assert row_major.shape == sa.shape and row_major.stride() != sa.stride()
    refused = (a.data.to("meta"), b.data.to("meta").t(), row_major.to("meta"), S.BlockWise1x128, sb.to("meta"),
               getattr(S, lb.kind))
    if META_CHECKS_SCALE_STRIDES:
        with pytest.raises(RuntimeError, match="stride"):
            F.scaled_mm(*refused, output_dtype=torch.bfloat16)
    else:
        assert F.scaled_mm(*refused, output_dtype=torch.bfloat16).shape == (a.data.shape[0], b.data.shape[0])
    _eager_block_gemm(recipe, a, b, sa, sb, lb, row_major)


#: How the CPU refuses a block-scaled GEMM: torch's CPU kernel of ``_scaled_mm_v2`` (2.13 here)
#: refuses the scaling types (ValueError); a torch without that kernel (2.11: the GPU machine's
#: NCCL run of issue 41 found none) has nothing to dispatch a CPU call to (NotImplementedError).
CPU_BLOCK_REFUSAL = (ValueError, NotImplementedError)
CPU_BLOCK_REFUSAL_MESSAGE = r"Invalid scaling configuration|Could not run 'aten::_scaled_mm_v2' with arguments from the 'CPU' backend"


def _eager_block_gemm(recipe, a, b, sa, sb, lb, row_major):
    """Eager ``scaled_mm`` on the operands, on the suite's device (``DTENSOR_FP8_TEST_BACKEND``):
    the CPU has no block-scaled GEMM and refuses even the right layout, before any stride check;
    on CUDA (where the device runs block-scaled GEMMs) the right layout runs and the row-major
    1x128 scale is refused by its strides, as tests/gpu/test_gemm_gpu.py asserts too."""
    S = F.ScalingType
    args = lambda scale_a: [t.to(DEVICE) for t in (a.data, b.data.t(), scale_a)]  # noqa: E731
    right = (*args(sa), S.BlockWise1x128, sb.to(DEVICE), getattr(S, lb.kind))
    if DEVICE == "cpu":
        with pytest.raises(CPU_BLOCK_REFUSAL, match=CPU_BLOCK_REFUSAL_MESSAGE):
            F.scaled_mm(*right, output_dtype=torch.bfloat16)
        return
    with gemm.fp8_gemms("auto"):
        reason = gemm.unsupported_reason(torch.empty(a.data.shape, device=DEVICE, dtype=torch.bfloat16),
                                         d.quantize(torch.zeros(b.data.shape, device=DEVICE), recipe))
    if reason is not None:
        pytest.skip(f"{recipe.name}: no block-scaled GEMMs on this {DEVICE} device: {reason}")
    assert F.scaled_mm(*right, output_dtype=torch.bfloat16).shape == (a.data.shape[0], b.data.shape[0])
    with pytest.raises((ValueError, RuntimeError), match=r"scale_a (must have strides|strides must be)"):
        F.scaled_mm(*args(row_major), S.BlockWise1x128, sb.to(DEVICE), getattr(S, lb.kind), output_dtype=torch.bfloat16)


def test_blockwise_dgrad_uses_the_transpose_and_columnwise_planes():
    """dgrad's B operand: 128x128 -> the shared plane transposed, same grid transposed; 1x128 ->
    the columnwise (128x1) plane transposed, so 1x128 blocks along M."""
    w = torch.randn(256, 384)
    for recipe in (d.Blockwise(block_dims=2), d.Blockwise(block_dims=1)):
        q = d.quantize(w, recipe)
        plane = q.plane("columnwise")
        op = gemm.operand(plane, recipe.block_shape("columnwise"), 0)
        assert_bytes_equal(op.data, plane.data.t().contiguous(), recipe.name)
        assert torch.equal(op.scale_inv, plane.scale_inv.t())
        assert op.block == (BlockShape(128, 128) if recipe.block_dims == 2 else BlockShape(1, 128))


def test_mxfp8_scale_swizzle_matches_cublas_layout():
    """swizzle_32_4_4 against cuBLAS' documented index formula for 1-D block scaling factors:
    tiles of 128 rows x 4 columns, row tiles outer; inside a tile (r, c) at (r%32)*16 + (r//32)*4 + c."""
    rows, cols = 200, 7
    grid = torch.randint(1, 255, (rows, cols), dtype=torch.uint8)
    out = swizzle_32_4_4(grid.view(torch.float8_e8m0fnu)).view(torch.uint8)
    pr, pc = 256, 8
    assert out.numel() == pr * pc
    expected = torch.zeros(pr * pc, dtype=torch.uint8)
    for r in range(rows):
        for c in range(cols):
            tile = (r // 128) * (pc // 4) + c // 4
            expected[tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4] = grid[r, c]
    assert torch.equal(out, expected)


def test_mxfp8_and_blockwise_fall_back_with_one_warning_each():
    """Where torch has no kernel (here: block scaling on the CPU) the emulated linear runs, and says
    so once per process and reason; ``off`` and the CPU default are silent."""
    gemm._warned.clear()
    w, x, dy = _inputs(4)
    for recipe in (d.MXFP8(), d.Blockwise(block_dims=2)):
        q = d.quantize(w, recipe)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with gemm.fp8_gemms("on"):
                y1 = F.linear(x, q)
                F.linear(x, q)
            with gemm.fp8_gemms("auto"):
                F.linear(x, q)  # the CPU default
            with gemm.fp8_gemms("off"):
                y2 = F.linear(x, q)
        ours = [str(s.message) for s in seen if "dtensor_fp8" in str(s.message)]
        assert len(ours) == 1 and "emulated linear" in ours[0] and "no cpu kernel" in ours[0], ours
        assert torch.equal(y1, y2)


def test_unsupported_shapes_run_the_emulated_linear():
    w = torch.randn(40, 72)  # not multiples of 16
    q = d.quantize(w, d.CurrentScaling()).requires_grad_(True)
    x = torch.randn(8, 72, requires_grad=True)
    with gemm.fp8_gemms("on"):
        assert "divisible by 16" in gemm.unsupported_reason(x, q)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with gemm.recording() as log:
                F.linear(x, q).sum().backward()
    assert log == [] and x.grad is not None and q.grad.shape == q.shape


def test_mode_switch_is_checked():
    with pytest.raises(ValueError, match="mode must be one of"):
        with gemm.fp8_gemms("yes"):
            pass


def test_scaled_mm_v2_is_torch_functional_scaled_mm_and_compiles_whole():
    """``gemm.scaled_mm_v2`` (the aten op ``F.scaled_mm`` wraps, called directly so that torch
    2.11's dynamo sees it) gives ``F.scaled_mm``'s bytes, eager and under ``fullgraph=True``
    (torch's CPU kernel takes tensorwise scales; the block-scaled layouts run in tests/gpu)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(32, 64, generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(16, 64, generator=g).to(torch.float8_e4m3fn)
    sa, sb = torch.tensor(0.5), torch.tensor(2.0)
    try:
        want = F.scaled_mm(a, b.t(), sa, F.ScalingType.TensorWise, sb, F.ScalingType.TensorWise, output_dtype=torch.bfloat16)
    except NotImplementedError:  # torch 2.11 / 2.12 (the GPU machine's): _scaled_mm_v2 has CUDA kernels only
        pytest.skip(f"torch {torch.__version__} has no CPU kernel for _scaled_mm_v2 (2.13 and later do)")

    def ours(a, b):
        return gemm.scaled_mm_v2(a, b.t(), sa, "TensorWise", "NO_SWIZZLE", sb, "TensorWise", "NO_SWIZZLE",
                                 torch.bfloat16, False)

    assert torch.equal(ours(a, b).view(torch.int16), want.view(torch.int16))
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(a, b).view(torch.int16), want.view(torch.int16))
