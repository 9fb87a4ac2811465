"""Byte-for-byte parity with real Transformer Engine kernels on a CUDA device.

Runs only where ``transformer_engine.pytorch`` imports and a GPU is visible (the H200 machine:
``.gpu/wheels`` hold TE 2.20.2, see ``shared/gpu/README.md``); everywhere else the module is
skipped. For every recipe TE runs on the device, random bf16 and fp32 inputs (with outliers and
an all-zero block) are quantized by TE's quantizer and by :func:`dtensor_fp8.quantize`, and

* every buffer of :func:`dtensor_fp8.te_layout` is compared with TE's attribute of the same name
  as raw bytes (padded blockwise scale tensors: the valid region only, TE leaves padding
  uninitialized);
* ``q.dequantize(torch.float32)`` is compared with TE's ``dequantize(dtype=torch.float32)`` as
  bits.

The recipes run their pure-torch reference here (``te_kernels.reference_only``): on CUDA their
fast path *is* TE's kernels, compared with the reference in ``test_te_kernels.py``.

NaN / Inf / zero / tiny / huge inputs are checked separately (``test_special_values``), FP8 bytes
exactly, NaN included (see the note there); only the dequantized fp32 NaNs are compared by position.

MXFP8: TE's MXFP8 kernels exist only for sm_100+; on an H200 (sm_90) only our recipe runs, and
its buffers are checked against TE's allocation shapes.
"""

from __future__ import annotations

import math
import os
import warnings
import zlib

import pytest
import torch

with warnings.catch_warnings():
    # TE's import may warn (deprecations, torch.distributed.fsdp); pyproject turns some
    # UserWarnings into errors, which must not turn "TE present" into a collection error.
    warnings.simplefilter("ignore")
    te = pytest.importorskip("transformer_engine.pytorch")
    import transformer_engine

TE_VERSION = getattr(transformer_engine, "__version__", "?")

# DTENSOR_FP8_PARITY_DEVICE=cpu is only for exercising this file against a stand-in TE.
DEVICE = torch.device(os.environ.get("DTENSOR_FP8_PARITY_DEVICE", "cuda"))
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("no CUDA device: TE parity tests need a GPU (run them on the H200 machine)", allow_module_level=True)

import transformer_engine_torch as tex  # noqa: E402
from conftest import valid_region  # noqa: E402
from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer  # noqa: E402
from transformer_engine.pytorch.tensor.float8_tensor import (  # noqa: E402
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
)
from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer  # noqa: E402

import dtensor_fp8 as d  # noqa: E402

CC = torch.cuda.get_device_capability(DEVICE) if DEVICE.type == "cuda" else (0, 0)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TE_DTYPE = {E4M3: tex.DType.kFloat8E4M3, E5M2: tex.DType.kFloat8E5M2}
HP_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

SHAPES = [
    (128, 128),
    (256, 512),
    (1024, 4096),
    (4096, 1024),
    (384, 640),
    (200, 300),  # no dimension a multiple of 128 (nor of 16)
    (72, 160),  # not multiples of 128, but GEMM-aligned (8 / 16)
    (4, 64, 256),  # 3-D: leading dims flattened into rows
]


@pytest.fixture(autouse=True)
def _reference_recipes():
    """Compare TE with the recipes' pure-torch reference: on CUDA the recipes would otherwise call
    these very TE kernels (their fast path, checked against the reference in test_te_kernels.py)."""
    from dtensor_fp8.formats import te_kernels

    with te_kernels.reference_only():
        yield


# ---- recipes: (ours, TE quantizer factory) --------------------------------------------------------
def _delayed(fp8):
    return d.DelayedScaling(fp8_dtype=fp8), lambda scale: Float8Quantizer(
        scale.clone(), torch.zeros(1, dtype=torch.float32, device=DEVICE), fp8_dtype=TE_DTYPE[fp8],
        rowwise=True, columnwise=True,
    )


def _current(fp8, pow2=False, eps=0.0):
    return d.CurrentScaling(fp8_dtype=fp8, force_pow_2_scales=pow2, amax_epsilon=eps), lambda scale: (
        Float8CurrentScalingQuantizer(
            TE_DTYPE[fp8], DEVICE, rowwise=True, columnwise=True, force_pow_2_scales=pow2, amax_epsilon=eps
        )
    )


def _block(dims, fp8, pow2=True, eps=0.0):
    return d.Blockwise(block_dims=dims, fp8_dtype=fp8, force_pow_2_scales=pow2, amax_epsilon=eps), lambda scale: (
        Float8BlockQuantizer(
            fp8_dtype=TE_DTYPE[fp8], rowwise=True, columnwise=True, amax_epsilon=eps,
            force_pow_2_scales=pow2, block_scaling_dim=dims,
        )
    )


RECIPES = {
    "delayed_e4m3": _delayed(E4M3),
    "delayed_e5m2": _delayed(E5M2),
    "current_e4m3": _current(E4M3),
    "current_e4m3_pow2": _current(E4M3, pow2=True),
    "current_e5m2": _current(E5M2),
    "current_e5m2_pow2": _current(E5M2, pow2=True),
    "current_e4m3_eps": _current(E4M3, eps=0.5),
    "block1d_e4m3": _block(1, E4M3),
    "block2d_e4m3": _block(2, E4M3),
    "block1d_e5m2": _block(1, E5M2),
    "block2d_e5m2": _block(2, E5M2),
    "block1d_e4m3_fp32scales": _block(1, E4M3, pow2=False),
    "block2d_e4m3_fp32scales": _block(2, E4M3, pow2=False),
    "block1d_e4m3_eps": _block(1, E4M3, eps=1e-3),
    "block2d_e4m3_eps": _block(2, E4M3, eps=1e-3),
}


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def _delayed_scale(seed: int) -> torch.Tensor:
    """A random explicit scale in [2^-4, 2^4) with a random mantissa (not a power of two)."""
    g = torch.Generator().manual_seed(seed)
    return (2.0 ** (torch.rand(1, generator=g) * 8 - 4)).float().to(DEVICE)


def make_input(shape, dtype, seed) -> torch.Tensor:
    """Gaussian values with per-128-band magnitudes spanning 2^-10..2^10, ~0.2% outliers
    (x2^6..x2^14, both signs), and one all-zero scaling block."""
    g = torch.Generator().manual_seed(seed)
    m, k = math.prod(shape[:-1]), shape[-1]
    gm, gk = -(-m // 128), -(-k // 128)
    x = torch.randn(m, k, generator=g)
    row_band = 2.0 ** torch.randint(-10, 11, (gm,), generator=g).float()
    col_band = 2.0 ** torch.randint(-4, 5, (gk,), generator=g).float()
    x *= row_band.repeat_interleave(128)[:m, None] * col_band.repeat_interleave(128)[None, :k]
    outliers = torch.rand(m, k, generator=g) < 2e-3
    x = torch.where(outliers, x * 2.0 ** torch.randint(6, 15, (m, k), generator=g).float(), x)
    if gm * gk > 1:
        x[(gm - 1) * 128 :, : min(128, k)] = 0  # one whole (possibly ragged) 128x128 block
    else:
        x[:4] = 0  # zero 1x128 blocks
    return x.to(dtype).reshape(shape).to(DEVICE)


def special_input(case: str, dtype) -> torch.Tensor:
    """(256, 384) inputs with special values placed in chosen 128x128 blocks."""
    g = torch.Generator().manual_seed(_seed(case, str(dtype)))
    x = torch.randn(256, 384, generator=g)
    neg_nan = torch.tensor(-0x400000, dtype=torch.int32).view(torch.float32)  # bits 0xFFC00000
    if case == "nan_inf":
        x[3, 5] = float("nan")
        x[130, 140] = neg_nan  # -NaN: sign bit set
        x[7, 300] = float("inf")
        x[200, 9] = float("-inf")
        x[140, 260] = float("nan")
        x[141, 261] = float("inf")  # NaN and Inf in one block
    elif case == "nan_only":
        x[3, 5] = float("nan")
        x[130, 140] = neg_nan
        x[255, 383] = float("nan")
    elif case == "zeros":
        x.zero_()
    elif case == "tiny_huge":
        # one block of tiny values (fp8_max / amax overflows fp32 -> value_for_inf) and one of
        # values near the input dtype's max.
        big = torch.finfo(dtype).max
        x[:128, :128] = torch.randn(128, 128, generator=g) * 1e-39
        x[128:, 128:256] = torch.randn(128, 128, generator=g).clamp(-1, 1) * (big / 2)
    else:
        raise KeyError(case)
    return x.to(dtype).to(DEVICE)


# ---- comparison helpers -------------------------------------------------------------------------
def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _first_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    diff = (a != b).nonzero()
    i = diff[0].tolist()
    return f"{diff.shape[0]} differing bytes, first at {i}: ours {a[tuple(i)].item():#04x} TE {b[tuple(i)].item():#04x}"


def te_quantize(quantizer, x):
    with torch.no_grad():
        t = quantizer(x)
    if hasattr(t, "_transpose_invalid") and (t._transpose is None or t._transpose_invalid):
        t._create_transpose()  # TE builds the per-tensor transpose lazily where it can
    return t


def te_buffers(t, names) -> dict[str, torch.Tensor]:
    return {n: getattr(t, n) for n in names}


def compare_layout(ours: dict, theirs: dict, shape, recipe, what: str) -> None:
    """Assert ``te_layout`` buffers equal TE's byte for byte (valid regions of padded scales)."""
    m, k = math.prod(shape[:-1]), shape[-1]
    for name, got in ours.items():
        exp = theirs[name]
        assert exp is not None, f"{what}: TE has no {name}"
        assert tuple(got.shape) == tuple(exp.shape), f"{what}:{name}: shape {tuple(got.shape)} != TE {tuple(exp.shape)}"
        assert got.dtype.itemsize == exp.dtype.itemsize, f"{what}:{name}: dtype {got.dtype} vs TE {exp.dtype}"
        region = valid_region(name, m, k, recipe)
        if region is not None:
            got, exp = got[: region[0], : region[1]], exp[: region[0], : region[1]]
        a, b = _u8(got), _u8(exp)
        if not torch.equal(a, b):
            msg = f"{what}:{name}: {_first_diff(a, b)}"
            if name in ("_data", "_transpose", "_rowwise_data", "_columnwise_data"):
                nan_a = a.view(recipe.fp8_dtype).float().isnan()
                nan_b = b.view(recipe.fp8_dtype).float().isnan()
                msg += (f"; NaN bytes ours {sorted({hex(v) for v in a[nan_a].tolist()})} "
                        f"TE {sorted({hex(v) for v in b[nan_b].tolist()})}, same NaN positions: {torch.equal(nan_a, nan_b)}")
            raise AssertionError(msg)


def compare_bits(ours: torch.Tensor, theirs: torch.Tensor, what: str, *, nan_ok=False) -> None:
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, f"{what}: {ours.shape}/{ours.dtype} vs {theirs.shape}/{theirs.dtype}"
    if nan_ok:
        na, nb = ours.isnan(), theirs.isnan()
        assert torch.equal(na, nb), f"{what}: NaN positions differ"
        ours, theirs = ours.masked_fill(na, 0), theirs.masked_fill(nb, 0)
    a, b = _u8(ours), _u8(theirs)
    if not torch.equal(a, b):
        va, vb = ours.reshape(-1), theirs.reshape(-1)
        i = (va.view(torch.int32) != vb.view(torch.int32)).nonzero()[0].item()
        raise AssertionError(f"{what}: values differ, first at flat index {i}: ours {va[i].item()!r} TE {vb[i].item()!r}")


def run_parity(name: str, x: torch.Tensor, *, nan_ok=False, seed=0) -> None:
    recipe, make_quantizer = RECIPES[name]
    scale = _delayed_scale(seed) if isinstance(recipe, d.DelayedScaling) else None
    quantizer = make_quantizer(scale)
    try:
        t = te_quantize(quantizer, x)
    except (RuntimeError, ValueError, AssertionError, NotImplementedError) as e:
        # Only TE's own refusal of an input lands here (our side has not run yet).
        pytest.skip(f"TE {TE_VERSION} refuses {name} on {tuple(x.shape)} {x.dtype}: {str(e).splitlines()[0][:300]}")
    q = d.quantize(x, recipe, scale=scale) if scale is not None else d.quantize(x, recipe)
    ours = d.te_layout(q)
    what = f"{name}/{tuple(x.shape)}/{x.dtype}"
    compare_layout(ours, te_buffers(t, ours), tuple(x.shape), recipe, what)
    with torch.no_grad():
        te_dq = t.dequantize(dtype=torch.float32)
    # q.dequantize returns the flattened (M, K) matrix for >2-D inputs; TE returns x.shape.
    compare_bits(q.dequantize(torch.float32).reshape(te_dq.shape), te_dq, what + ":dequant", nan_ok=nan_ok)
    return quantizer


# ---- tests --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(HP_DTYPES), ids=list(HP_DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", list(RECIPES))
def test_parity_random(name, shape, dtype):
    seed = _seed(name, shape, dtype)
    run_parity(name, make_input(shape, HP_DTYPES[dtype], seed), seed=seed)


@pytest.mark.parametrize("dtype", list(HP_DTYPES), ids=list(HP_DTYPES))
@pytest.mark.parametrize("case", ["nan_inf", "nan_only", "zeros", "tiny_huge"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_special_values(name, case, dtype):
    # NaN bytes, seen on the H200 (TE 2.20.2, torch 2.11.0+cu130): TE writes 0x7F for every NaN
    # input, E4M3 and E5M2 alike, whatever the input NaN's sign (fp32 0x7FC00000 / 0xFFC00000, bf16
    # 0xFFFF). Our recipe on CUDA writes 0x7F too (the GPU's fp32 multiply returns the canonical
    # +NaN), so FP8 bytes are compared exactly here, NaN included. On the CPU our recipe currently
    # writes 0xFF for a negative NaN (x86 keeps the sign through the multiply). The dequantized
    # fp32 NaNs are compared by position only (NaN payloads carry no meaning).
    x = special_input(case, HP_DTYPES[dtype])
    run_parity(name, x, nan_ok=case.startswith("nan"), seed=_seed(name, case, dtype))


@pytest.mark.parametrize("dtype", list(HP_DTYPES), ids=list(HP_DTYPES))
@pytest.mark.parametrize("case", ["random", "nan_inf"])
def test_delayed_amax_recorded(case, dtype):
    """TE's delayed-scaling cast also records amax(|x|) (NaN ignored) into the quantizer's amax:
    the value our ``record_amax`` / ``block_amax`` produce."""
    x = make_input((384, 640), HP_DTYPES[dtype], 11) if case == "random" else special_input(case, HP_DTYPES[dtype])
    quantizer = run_parity("delayed_e4m3", x, nan_ok=case != "random", seed=_seed("amax", case, dtype))
    recipe = RECIPES["delayed_e4m3"][0]
    ours = recipe.record_amax(torch.zeros(4, device=DEVICE), recipe.block_amax(x.reshape(-1, x.shape[-1]), d.ROWWISE))[:1]
    compare_bits(ours, quantizer.amax.float().reshape(1), f"amax/{case}/{dtype}")


def test_every_te_recipe_covered():
    """Every quantizer family TE runs on this device is in RECIPES."""
    families = {type(RECIPES[n][0]).__name__ for n in RECIPES}
    assert families == {"DelayedScaling", "CurrentScaling", "Blockwise"}
    assert {r.block_dims for r, _ in RECIPES.values() if isinstance(r, d.Blockwise)} == {1, 2}


@pytest.mark.parametrize("dtype", list(HP_DTYPES), ids=list(HP_DTYPES))
@pytest.mark.parametrize("shape", [(256, 512), (4, 64, 256), (1024, 4096)], ids=lambda s: "x".join(map(str, s)))
def test_mxfp8_reference_on_cuda(shape, dtype):
    """Our MXFP8 recipe runs on CUDA: TE's buffer shapes, and the same bytes as on the CPU."""
    x = make_input(shape, HP_DTYPES[dtype], _seed("mxfp8", shape, dtype))
    recipe = d.MXFP8()
    q = d.quantize(x, recipe)
    ours = d.te_layout(q)
    m, k = math.prod(shape[:-1]), shape[-1]
    r = lambda n, mult: -(-n // mult) * mult  # noqa: E731
    expected = {
        "_rowwise_data": (tuple(shape), torch.uint8),
        "_columnwise_data": (tuple(shape), torch.uint8),
        "_rowwise_scale_inv": ((r(m, 128), r(k // 32, 4)), torch.uint8),
        "_columnwise_scale_inv": ((r(m // 32, 4), r(k, 128)), torch.uint8),
    }
    assert {n: (tuple(t.shape), t.dtype) for n, t in ours.items()} == expected
    cpu = d.te_layout(d.quantize(x.cpu(), recipe))
    for n in ours:
        assert torch.equal(_u8(ours[n]).cpu(), _u8(cpu[n])), f"{n}: CUDA and CPU bytes differ"
    dq = q.dequantize(torch.float32)
    assert torch.equal(dq.cpu(), d.quantize(x.cpu(), recipe).dequantize(torch.float32))
    assert all(t.device.type == DEVICE.type for t in ours.values())


def test_mxfp8_layout_matches_te_allocation():
    """TE's own MXFP8 allocation (no kernel runs) has our te_layout shapes and dtypes."""
    shape = (256, 512)
    q = d.quantize(make_input(shape, torch.bfloat16, 7), d.MXFP8())
    ours = d.te_layout(q)
    try:
        t = MXFP8Quantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=True).make_empty(
            shape, dtype=torch.bfloat16, device=DEVICE
        )
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"TE {TE_VERSION} cannot allocate an MXFP8 tensor on sm_{CC[0]}{CC[1]}: {e!r}")
    for n, got in ours.items():
        exp = getattr(t, n)
        assert (tuple(got.shape), got.dtype.itemsize) == (tuple(exp.shape), exp.dtype.itemsize), n


@pytest.mark.parametrize("dtype", list(HP_DTYPES), ids=list(HP_DTYPES))
@pytest.mark.parametrize("shape", [(256, 512), (1024, 4096), (4, 64, 256)], ids=lambda s: "x".join(map(str, s)))
def test_te_mxfp8_kernels(shape, dtype):
    if CC < (10, 0):
        pytest.skip(
            f"TE's MXFP8 quantize kernels are compiled for sm_100+ only (quantize_mxfp8_kernel is "
            f"guarded by __CUDA_ARCH__ >= 1000; on this sm_{CC[0]}{CC[1]} device TE's MXFP8 quantize "
            "silently writes nothing and its dequantize raises), so there is nothing to compare with here; "
            "our MXFP8 recipe is checked by test_mxfp8_reference_on_cuda and the CPU golden/spec tests"
        )
    x = make_input(shape, HP_DTYPES[dtype], _seed("te-mxfp8", shape, dtype))
    recipe = d.MXFP8()
    with torch.no_grad():
        t = MXFP8Quantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=True)(x)
    q = d.quantize(x, recipe)
    ours = d.te_layout(q)
    compare_layout(ours, te_buffers(t, ours), shape, recipe, f"mxfp8/{shape}/{dtype}")
    with torch.no_grad():
        te_dq = t.dequantize(dtype=torch.float32)
    compare_bits(q.dequantize(torch.float32).reshape(te_dq.shape), te_dq, "mxfp8:dequant")
