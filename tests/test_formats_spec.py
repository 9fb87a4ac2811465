"""Spec-level tests of the recipes against pure-Python scalar references.

Every expected value here is derived independently of ``dtensor_fp8``: fp32 arithmetic is emulated
with ``struct`` (a Python float holds any fp32 exactly; ``f32()`` rounds a double to the nearest
fp32, ties to even, as a C ``(float)`` cast does), FP8 encodings are built from the E4M3 / E5M2 bit
layouts (OCP 8-bit FP spec), and the scale rules are transcriptions of Transformer Engine 2.20.2's
sources (paths in TE's repository):

* TE common/util/ptx_arch_spec.cuh ``float_to_e8m0`` (bit emulation of ``cvt.rp.satfinite.ue8m0``)
* TE common/util/ptx.cuh ``exp2f_rcp`` (E8M0 byte -> fp32 multiplier ``2^(127-e)``)
* TE tests/cpp/operator/test_cast_mxfp8.cu ``compute_ref`` (block amax ignores NaN; ``x * rcp``, satcast)
* TE common/recipe/recipe_common.cuh ``compute_scale_from_amax`` (current scaling and blockwise)
* TE common/recipe/delayed_scaling.cu ``amax_and_scale_update_impl::kernel_bulk`` (delayed scaling update)
* OCP Microscaling Formats (MX) v1.0: E8M0 scale = 2^(byte-127), 0xFF = NaN; 32-element blocks.

Double rounding: a product/quotient of two fp32 values computed in double and then rounded to fp32
equals the correctly rounded fp32 result (53 >= 2*24 + 2), also when the result is an fp32 subnormal.
"""

from __future__ import annotations

import bisect
import math
import random
import struct
from fractions import Fraction

import pytest
import torch

import dtensor_fp8 as d

INF, NAN = math.inf, math.nan
FLT_MAX = struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0]
BF16_MAX = float.fromhex("0x1.FEp127")  # TE common/common.h TypeExtrema<bf16>::max


# ---- scalar fp32 helpers --------------------------------------------------------------------------------
def f32(x: float) -> float:
    """Nearest fp32 of a double (RN-even, subnormals kept, overflow -> +-inf)."""
    if math.isnan(x) or math.isinf(x):
        return x
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(INF, x)


def bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def from_bits(u: int) -> float:
    return struct.unpack("<f", struct.pack("<I", u & 0xFFFFFFFF))[0]


def fmaxf(a: float, b: float) -> float:
    """C fmaxf: a NaN operand is ignored."""
    if math.isnan(a):
        return b
    if math.isnan(b):
        return a
    return max(a, b)


def bf16_round(x: float) -> float:
    """fp32 value -> nearest bf16 (RN-even) as a float, by bits."""
    u = bits(f32(x))
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return from_bits(u)


# ---- FP8 element formats from their bit layouts ---------------------------------------------------------
class Fp8Format:
    """E4M3 (bias 7, no Inf, S.1111.111 = NaN, max 448) / E5M2 (bias 15, IEEE-like, max 57344)."""

    def __init__(self, ebits: int, mbits: int, bias: int, max_code: int, torch_dtype):
        self.torch_dtype = torch_dtype
        self.values = []
        for code in range(max_code + 1):
            e, m = code >> mbits, code & ((1 << mbits) - 1)
            if e == 0:
                v = m * 2.0 ** (1 - bias - mbits)
            else:
                v = (1 + m / 2**mbits) * 2.0 ** (e - bias)
            self.values.append(v)
        assert self.values == sorted(self.values)
        self.max = self.values[-1]

    def encode(self, v: float) -> int | None:
        """RN-even, SATFINITE cast of an fp32 value; None for NaN (its byte is not pinned down)."""
        if math.isnan(v):
            return None
        sign = 0x80 if math.copysign(1.0, v) < 0 else 0
        a = abs(v)
        if a >= self.max:  # satfinite: overflow and +-Inf become +-max
            return sign | (len(self.values) - 1)
        i = bisect.bisect_left(self.values, a)
        if self.values[i] == a:
            return sign | i
        lo, hi = self.values[i - 1], self.values[i]
        if a - lo < hi - a:
            return sign | (i - 1)
        if a - lo > hi - a:
            return sign | i
        return sign | (i - 1 if (i - 1) % 2 == 0 else i)  # tie: even mantissa = even code

    def decode(self, code: int) -> float:
        v = self.values[code & 0x7F]
        return -v if code & 0x80 else v


E4M3 = Fp8Format(4, 3, 7, 0x7E, torch.float8_e4m3fn)
E5M2 = Fp8Format(5, 2, 15, 0x7B, torch.float8_e5m2)
FORMATS = {torch.float8_e4m3fn: E4M3, torch.float8_e5m2: E5M2}


def test_reference_formats_and_constants():
    """Sanity of the reference itself against constants quoted from TE (memo section 1.2)."""
    assert E4M3.max == 448.0 and E5M2.max == 57344.0
    assert E4M3.encode(448.0) == 0x7E and E4M3.encode(-1e30) == 0xFE and E4M3.encode(INF) == 0x7E
    assert E5M2.encode(57344.0) == 0x7B and E5M2.encode(INF) == 0x7B
    assert E4M3.encode(2.0**-9) == 0x01 and E4M3.encode(2.0**-10) == 0x00  # tie -> even (0)
    assert E4M3.encode(3 * 2.0**-10) == 0x02  # tie between codes 1 and 2 -> 2
    assert bits(f32(1.0 / 448)) == 0x3B124925 and bits(f32(1.0 / 57344)) == 0x37924925
    assert f32(448.0 * f32(1.0 / 448)) == 1.0
    # The reference encoder agrees with torch's RN cast on in-range values.
    vals = [random.Random(0).uniform(-500, 500) for _ in range(2000)]
    for fmt in (E4M3, E5M2):
        t = torch.tensor([f32(v) for v in vals]).clamp(-fmt.max, fmt.max).to(fmt.torch_dtype).view(torch.uint8)
        assert t.tolist() == [fmt.encode(f32(v)) for v in vals]


# ---- comparison helpers ---------------------------------------------------------------------------------
def assert_codes(got: torch.Tensor, expected: list[list[int | None]], what: str = ""):
    """FP8 tensor bytes == expected codes; a None expectation means 'NaN' (checked with isnan)."""
    assert tuple(got.shape) == (len(expected), len(expected[0])), what
    nan_mask = torch.tensor([[c is None for c in row] for row in expected])
    exp = torch.tensor([[0 if c is None else c for c in row] for row in expected], dtype=torch.uint8)
    got_u8 = got.contiguous().view(torch.uint8)
    if nan_mask.any():
        assert torch.isnan(got.float()[nan_mask]).all(), f"{what}: expected NaN"
    got_masked = torch.where(nan_mask, torch.zeros_like(got_u8), got_u8)
    if not torch.equal(got_masked, exp):
        diff = (got_masked != exp).nonzero()[0].tolist()
        raise AssertionError(f"{what}: byte mismatch at {diff}: got {got_masked[tuple(diff)].item():#x}, "
                             f"expected {exp[tuple(diff)].item():#x}")


def assert_f32_equal(got: torch.Tensor, expected: list, what: str = ""):
    """fp32 tensor bits == expected Python floats (exact, via uint8 views)."""
    exp = torch.tensor(expected, dtype=torch.float32)
    assert got.dtype == torch.float32 and got.shape == exp.shape, (what, got.dtype, got.shape, exp.shape)
    if not torch.equal(got.contiguous().view(torch.uint8), exp.view(torch.uint8)):
        raise AssertionError(f"{what}: got {got.tolist()}, expected {expected}")


def as_floats(x: torch.Tensor) -> list[list[float]]:
    return x.float().tolist()  # bf16/fp32 -> fp32 is exact


# ================================== MXFP8 ===================================================================
def float_to_e8m0(val: float) -> int:
    """TE common/util/ptx_arch_spec.cuh float_to_e8m0 (non-Blackwell bit emulation), verbatim logic."""
    if math.isnan(val):
        return 0xFF
    if math.isinf(val):
        return 0xFE
    if val == 0.0:
        return 0x00
    u = bits(val)
    exponent = (u >> 23) & 0xFF
    mantissa = u & 0x7FFFFF
    if (mantissa > 0 and exponent != 0xFE) and not (exponent == 0 and mantissa <= 0x400000):
        exponent += 1
    return exponent


def exp2f_rcp(e: int) -> float:
    """TE common/util/ptx.cuh exp2f_rcp<float>."""
    if e == 255:
        return NAN
    if e == 254:
        return from_bits(0x00400000)
    return from_bits((254 - e) << 23)


def ref_mxfp8(x: list[list[float]], fmt: Fp8Format, usage: str):
    """TE tests/cpp/operator/test_cast_mxfp8.cu compute_ref: returns (codes MxK, scale bytes grid)."""
    m, k = len(x), len(x[0])
    rcp = f32(1.0 / fmt.max)  # Quantized_Limits<OType>::max_reciprocal()
    codes = [[0] * k for _ in range(m)]
    if usage == "rowwise":
        grid = [[0] * (k // 32) for _ in range(m)]
        blocks = [((r, c), [(r, c * 32 + j) for j in range(32)]) for r in range(m) for c in range(k // 32)]
    else:
        grid = [[0] * k for _ in range(m // 32)]
        blocks = [((r, c), [(r * 32 + j, c) for j in range(32)]) for r in range(m // 32) for c in range(k)]
    for (gr, gc), idx in blocks:
        amax = 0.0
        for i, j in idx:
            amax = fmaxf(amax, abs(x[i][j]))  # std::max(block_amax, |x|): NaN never enters
        e = float_to_e8m0(f32(amax * rcp))
        grid[gr][gc] = e
        mult = exp2f_rcp(e)
        for i, j in idx:
            codes[i][j] = fmt.encode(f32(x[i][j] * mult))
    return codes, grid


def mx_check(x: torch.Tensor, recipe, usages=("rowwise", "columnwise")):
    q = d.quantize(x, recipe)
    xs = as_floats(x)
    fmt = FORMATS[recipe.fp8_dtype]
    out = {}
    for usage in usages:
        codes, grid = ref_mxfp8(xs, fmt, usage)
        plane = q.plane(usage)
        assert plane.scale_inv.dtype == torch.float8_e8m0fnu
        assert torch.equal(plane.scale_inv.view(torch.uint8), torch.tensor(grid, dtype=torch.uint8)), usage
        assert_codes(plane.data, codes, usage)
        out[usage] = (codes, grid)
    return q, out


def block_row(values: list[float], rows: int = 32) -> torch.Tensor:
    """A (rows, 32*n) fp32 matrix whose every row is ``values`` (one 1x32 rowwise block per 32)."""
    return torch.tensor([values] * rows, dtype=torch.float32)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("k", [-3, 0, 5])
def test_mxfp8_e8m0_rounds_up(fp8, k):
    fmt = FORMATS[fp8]
    exact = fmt.max * 2.0**k  # amax*R == 2^k exactly: biased exponent 127+k, block max -> fp8 max
    above = from_bits(bits(exact) + 1)  # one fp32 ulp above: rounds UP to 2^(k+1)
    below = from_bits(bits(exact) - 1)  # one ulp below: still 2^k
    vals = [0.25 * 2.0**k] * 31
    x = torch.tensor([[exact] + vals] * 32 + [[above] + vals] * 32 + [[below] + vals] * 32)  # (96, 32)
    q, ref = mx_check(x, d.MXFP8(fp8_dtype=fp8), usages=("rowwise",))
    scale = q.plane("rowwise").scale_inv.view(torch.uint8)
    # Independent of the bit rule: OCP/TE semantics "smallest power of two >= amax / fp8_max".
    assert scale[0, 0].item() == 127 + k and scale[32, 0].item() == 128 + k and scale[64, 0].item() == 127 + k
    data = q.plane("rowwise").data.view(torch.uint8)
    max_code = E4M3.encode(448.0) if fp8 == torch.float8_e4m3fn else E5M2.encode(57344.0)
    assert data[0, 0].item() == max_code  # amax == fp8_max * 2^k maps exactly to fp8_max
    assert data[32, 0].item() < max_code  # just above: half the range, never saturates
    assert data[64, 0].item() == max_code  # just below: rounds to max, not above (satfinite)


def test_mxfp8_e8m0_matches_exact_ceil_log2():
    """float_to_e8m0(f32(amax * f32(1/448))) == 127 + ceil(log2(amax / 448)) for random bf16 amax,
    computed with exact rationals (the OCP-style definition, independent of fp32 rounding)."""
    rng = random.Random(1)
    amaxes = [bf16_round(2.0 ** rng.uniform(-100, 120) * rng.uniform(1, 2)) for _ in range(64)]
    amaxes += [448.0 * 2.0**j for j in (-20, 0, 3)]
    x = torch.tensor([[a] + [0.0] * 31 for a in amaxes], dtype=torch.bfloat16)
    x = torch.cat([x, torch.zeros(96 - len(amaxes), 32, dtype=torch.bfloat16)])
    q = d.quantize(x, d.MXFP8())
    got = q.plane("rowwise").scale_inv.view(torch.uint8)[: len(amaxes), 0].tolist()
    for a, g in zip(amaxes, got):
        ratio = Fraction(a) / 448
        e = math.ceil(math.log2(ratio)) + 2
        while Fraction(2) ** (e - 1) >= ratio:
            e -= 1
        assert g == 127 + e, (a, g, 127 + e)


def test_mxfp8_zero_block_and_negative_zero():
    x = torch.zeros(32, 64)
    x[:, 32:] = torch.randn(32, 32, generator=torch.Generator().manual_seed(0))
    x[3, 5] = -0.0
    q, _ = mx_check(x, d.MXFP8())
    rs = q.plane("rowwise").scale_inv.view(torch.uint8)
    assert torch.equal(rs[:, 0], torch.zeros(32, dtype=torch.uint8))
    data = q.plane("rowwise").data.view(torch.uint8)
    assert data[3, 5].item() == 0x80 and data[:, :32].sum().item() == 0x80
    cs = q.plane("columnwise").scale_inv.view(torch.uint8)
    assert torch.equal(cs[0, :32], torch.zeros(32, dtype=torch.uint8))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("hp", [torch.float32, torch.bfloat16])
def test_mxfp8_random_wide_range_never_exceeds_max(fp8, hp):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 128, generator=g) * torch.exp2(torch.randint(-60, 60, (64, 1), generator=g).float())
    x = x * torch.exp2(torch.randint(-10, 10, (1, 128), generator=g).float())
    x = x.to(hp)
    q, _ = mx_check(x, d.MXFP8(fp8_dtype=fp8))
    for usage in ("rowwise", "columnwise"):
        v = q.plane(usage).data.float()
        assert torch.isfinite(v).all() and v.abs().max() <= torch.finfo(fp8).max


@pytest.mark.parametrize("hp", [torch.float32, torch.bfloat16])
def test_mxfp8_denormal_amax(hp):
    t = 448.0 * 2.0**-127  # amax * R == 2^-127 (fp32 subnormal, mantissa 0x400000) -> 0x00
    cases = [t, t * 1.5, 2.0**-133, 2.0**-130, 448.0 * 2.0**-126]
    # expected bytes from the spec statement "v <= 2^-127 -> 0x00, else 0x01; 2^-126 -> 0x01"
    expected = [0x00, 0x01, 0x00, 0x00, 0x01]
    x = torch.zeros(32 * len(cases), 32, dtype=hp)
    for i, a in enumerate(cases):
        x[32 * i : 32 * i + 32, 0] = a
        x[32 * i : 32 * i + 32, 1] = -a / 4
    assert x[:, 0].float().tolist()[::32] == cases  # all exactly representable in bf16
    q, _ = mx_check(x, d.MXFP8())
    got = q.plane("rowwise").scale_inv.view(torch.uint8)[::32, 0].tolist()
    assert got == expected
    assert q.plane("rowwise").data.view(torch.uint8)[0, 0].item() == 0x7E  # 448*2^-127 * 2^127 == 448


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("hp", [torch.float32, torch.bfloat16])
def test_mxfp8_inf_element(fp8, hp):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(64, 64, generator=g) * 10).to(hp)
    x[5, 7] = INF
    x[40, 33] = -INF
    q, _ = mx_check(x, d.MXFP8(fp8_dtype=fp8))
    fmt = FORMATS[fp8]
    maxc = len(fmt.values) - 1
    r = q.plane("rowwise")
    rs, rd = r.scale_inv.view(torch.uint8), r.data.view(torch.uint8)
    assert rs[5, 0].item() == 0xFE and rs[40, 1].item() == 0xFE
    assert rd[5, 7].item() == maxc and rd[40, 33].item() == 0x80 | maxc
    others = torch.cat([rd[5, :7], rd[5, 8:32], rd[40, 32:33], rd[40, 34:64]])
    assert torch.equal(others & 0x7F, torch.zeros_like(others))  # +-0
    c = q.plane("columnwise")
    assert c.scale_inv.view(torch.uint8)[0, 7].item() == 0xFE and c.scale_inv.view(torch.uint8)[1, 33].item() == 0xFE
    col = c.data.view(torch.uint8)[:32, 7]
    assert col[5].item() == maxc and (torch.cat([col[:5], col[6:]]) & 0x7F).sum().item() == 0
    assert rs[6, 0].item() != 0xFE  # neighbouring blocks untouched


@pytest.mark.parametrize("hp", [torch.float32, torch.bfloat16])
def test_mxfp8_nan_element(hp):
    x = torch.full((32, 64), 0.5, dtype=hp)
    x[:, 1] = 3.0
    x[2, 0] = NAN  # the NaN is not the block max; the block amax stays 3.0
    x[7, 40] = NAN  # a NaN in a block whose other elements are all 0.5
    q, _ = mx_check(x, d.MXFP8())
    rs = q.plane("rowwise").scale_inv.view(torch.uint8)
    # 3.0 / 448 -> ceil to 2^-7 -> 120; 0.5/448 -> 2^-9 -> 118
    assert rs[2, 0].item() == 120 and rs[7, 1].item() == 118 and rs[0, 0].item() == 120
    data = q.plane("rowwise").data
    assert torch.isnan(data[2, 0].float()) and torch.isnan(data[7, 40].float())
    assert data[2, 1].float().item() == 384.0  # 3 * 2^7
    cs = q.plane("columnwise").scale_inv.view(torch.uint8)
    assert cs[0, 0].item() == 118  # column 0: 0.5 everywhere but the NaN


def test_mxfp8_columnwise_differs_from_rowwise():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 96, generator=g) * torch.exp2(torch.arange(64).float().remainder(9) - 4)[:, None]
    q, ref = mx_check(x.to(torch.bfloat16), d.MXFP8())
    assert ref["rowwise"][0] != ref["columnwise"][0]
    assert not torch.equal(q.plane("rowwise").data.view(torch.uint8), q.plane("columnwise").data.view(torch.uint8))
    # Dequantized: code value * 2^(byte-127) (OCP MX: E8M0 = 2^(e-127)), exact in fp32.
    for usage in ("rowwise", "columnwise"):
        codes, grid = ref[usage]
        exp = [[E4M3.decode(codes[i][j]) * 2.0 ** ((grid[i][j // 32] if usage == "rowwise" else grid[i // 32][j]) - 127)
                for j in range(96)] for i in range(64)]
        assert_f32_equal(q.dequantize(torch.float32, usage), exp, usage)


@pytest.mark.parametrize("shape", [(96, 64), (64, 160), (256, 256), (2, 64, 96)])
def test_mxfp8_te_layout_padded(shape):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(*shape, generator=g, dtype=torch.float32).to(torch.bfloat16)
    q = d.quantize(x, d.MXFP8())
    m, k = math.prod(shape[:-1]), shape[-1]
    ru = lambda n, a: -(-n // a) * a  # noqa: E731
    bufs = d.te_layout(q)
    assert set(bufs) == {"_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv"}
    xs = as_floats(x.reshape(m, k))
    for usage, sshape, valid in (
        ("rowwise", (ru(m, 128), ru(k // 32, 4)), (m, k // 32)),
        ("columnwise", (ru(m // 32, 4), ru(k, 128)), (m // 32, k)),
    ):
        codes, grid = ref_mxfp8(xs, E4M3, usage)
        data, scale = bufs[f"_{usage}_data"], bufs[f"_{usage}_scale_inv"]
        assert data.dtype == torch.uint8 and tuple(data.shape) == tuple(shape)  # columnwise not transposed
        assert_codes(data.reshape(m, k), codes, usage)
        assert scale.dtype == torch.uint8 and tuple(scale.shape) == sshape, (usage, scale.shape)
        assert torch.equal(scale[: valid[0], : valid[1]], torch.tensor(grid, dtype=torch.uint8))
        pad = scale.clone()
        pad[: valid[0], : valid[1]] = 0
        assert torch.equal(pad, torch.zeros_like(pad)), f"{usage} scale padding not zero"


@pytest.mark.parametrize("shape", [(48, 64), (64, 40), (33, 32), (2, 24, 64)])
def test_mxfp8_rejects_non_multiple_of_32(shape):
    with pytest.raises(d.RecipeError) as e:
        d.quantize(torch.randn(*shape), d.MXFP8())
    m, k = math.prod(shape[:-1]), shape[-1]
    assert f"({m}, {k})" in str(e.value) or str(tuple(shape)) in str(e.value), str(e.value)
    assert "32" in str(e.value)


# ================================== current scaling / blockwise ===========================================
def compute_scale_from_amax(amax: float, max_fp8: float, pow2: bool, eps: float, value_for_inf: float) -> float:
    """TE common/recipe/recipe_common.cuh compute_scale_from_amax."""
    if amax < eps:  # NaN compares false
        amax = eps
    if math.isinf(amax) or amax == 0.0 or math.isnan(amax):
        return 1.0
    scale = f32(max_fp8 / amax)  # __fdiv_rn
    if math.isinf(scale):
        scale = value_for_inf
    if pow2:
        scale = from_bits(bits(scale) & 0xFF800000)
    return scale


def ref_blocks(x, br, bc, fmt, pow2, eps, value_for_inf):
    """Block-scaled quantization with (br x bc) blocks (None = whole dim), partial edge blocks use
    only the valid elements. Returns (codes, scale grid, scale_inv grid)."""
    m, k = len(x), len(x[0])
    br, bc = br or m, bc or k
    gm, gk = -(-m // br), -(-k // bc)
    codes = [[0] * k for _ in range(m)]
    scales = [[0.0] * gk for _ in range(gm)]
    sinv = [[0.0] * gk for _ in range(gm)]
    eps = f32(eps)  # TE takes epsilon as a C float
    for a in range(gm):
        rows = range(a * br, min(m, (a + 1) * br))
        for b in range(gk):
            cols = range(b * bc, min(k, (b + 1) * bc))
            amax = 0.0
            for i in rows:
                for j in cols:
                    amax = fmaxf(amax, abs(x[i][j]))
            s = compute_scale_from_amax(amax, fmt.max, pow2, eps, value_for_inf)
            scales[a][b], sinv[a][b] = s, f32(1.0 / s)  # __frcp_rn / (float)(1.0 / scale)
            for i in rows:
                for j in cols:
                    codes[i][j] = fmt.encode(f32(x[i][j] * s))
    return codes, scales, sinv


def check_current(x, recipe, expect_scale=None):
    q = d.quantize(x, recipe)
    fmt = FORMATS[recipe.fp8_dtype]
    codes, scales, sinv = ref_blocks(as_floats(x), None, None, fmt, recipe.force_pow_2_scales,
                                     recipe.amax_epsilon, FLT_MAX)  # current scaling: value_for_inf = FLT_MAX
    if expect_scale is not None:
        assert scales[0][0] == expect_scale, (scales, expect_scale)
    bufs = d.te_layout(q)
    assert_f32_equal(bufs["_scale_inv"], [sinv[0][0]], "_scale_inv")
    assert_codes(bufs["_data"].view(recipe.fp8_dtype), codes, "_data")
    assert_codes(bufs["_transpose"].view(recipe.fp8_dtype), [list(c) for c in zip(*codes)], "_transpose")
    return q, sinv[0][0]


def f32_of_fraction(q: Fraction) -> float:
    """The fp32 nearest a positive rational, ties to even, subnormals kept, overflow -> inf:
    rounded exactly (no double in between), as the reference for IEEE fp32 division."""
    e = q.numerator.bit_length() - q.denominator.bit_length()
    e = e - 1 if Fraction(2) ** e > q else e  # now 2^e <= q < 2^(e+1)
    quantum = Fraction(2) ** (max(e, -126) - 23)
    n, rest = divmod(q, quantum)
    n = int(n) + (rest * 2 > quantum or (rest * 2 == quantum and int(n) % 2 == 1))
    return INF if n * quantum >= Fraction(2) ** 128 else float(n * quantum)


def test_scale_quotient_is_ieee_division():
    """``scaling.quotient`` (the scale rules' division, computed through fp64 so that inductor's
    approximate fp32 division never touches it) equals the exactly rounded fp32 quotient, for
    random, subnormal and edge denominators."""
    from dtensor_fp8.formats.scaling import quotient

    rng = random.Random(7)
    patterns = [rng.randrange(1, 0x7F800000) for _ in range(3000)] + [1, 2, 0x7FFFFF, 0x800000, 0x7F7FFFFF,
                                                                      0x3F800000, 0x3F7FFFFF, 0x43E00000]
    denominators = [from_bits(u) for u in patterns]
    for numerator in (448.0, 57344.0, 1.0, 224.0):
        got = quotient(numerator, torch.tensor(denominators, dtype=torch.float32)).tolist()
        want = [f32_of_fraction(Fraction(numerator) / Fraction(x)) for x in denominators]
        bad = [(hex(u), g, w) for u, g, w in zip(patterns, got, want) if bits(g) != bits(w)]
        assert bad == [], bad[:5]


def _rand(m, k, seed, dtype=torch.float32, scale=1.0):
    return (torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("hp", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pow2", [False, True])
def test_current_random(fp8, hp, pow2):
    check_current(_rand(48, 80, 10, hp, 3.0), d.CurrentScaling(fp8_dtype=fp8, force_pow_2_scales=pow2))


def test_current_amax_zero_gives_scale_one():
    _, sinv = check_current(torch.zeros(32, 32), d.CurrentScaling(), expect_scale=1.0)
    assert sinv == 1.0


def test_current_amax_epsilon():
    x = _rand(32, 32, 11, scale=1e-4)
    _, sinv = check_current(x, d.CurrentScaling(amax_epsilon=0.1), expect_scale=f32(448 / f32(0.1)))
    check_current(x, d.CurrentScaling(amax_epsilon=0.1, force_pow_2_scales=True), expect_scale=4096.0)
    check_current(x * 1e5, d.CurrentScaling(amax_epsilon=0.1))  # eps below amax: no effect


def test_current_force_pow2():
    x = torch.full((16, 16), 1.0)
    x[0, 0] = -3.0  # 448/3 = 149.33 -> floor to 128
    check_current(x, d.CurrentScaling(force_pow_2_scales=True), expect_scale=128.0)
    check_current(x, d.CurrentScaling(), expect_scale=f32(448 / 3))


@pytest.mark.parametrize("hp", [torch.float32, torch.bfloat16])
def test_current_scale_overflow_uses_flt_max(hp):
    x = torch.full((16, 16), 1e-38).to(hp)
    x[1, 1] = -1e-39
    check_current(x, d.CurrentScaling(), expect_scale=FLT_MAX)  # FLT_MAX for any input dtype
    check_current(x, d.CurrentScaling(force_pow_2_scales=True), expect_scale=2.0**127)
    check_current(x, d.CurrentScaling(fp8_dtype=torch.float8_e5m2), expect_scale=FLT_MAX)


@pytest.mark.parametrize("hp", [torch.float32, torch.bfloat16])
def test_current_inf_and_nan(hp):
    x = _rand(32, 32, 12, hp, 100.0)
    x[3, 4] = -INF
    _, sinv = check_current(x, d.CurrentScaling(), expect_scale=1.0)  # Inf amax -> scale 1
    y = _rand(32, 32, 13, hp, 100.0)
    y[5, 6] = NAN
    amax = max(abs(v) for row in as_floats(y) for v in row if not math.isnan(v))
    q, _ = check_current(y, d.CurrentScaling(), expect_scale=f32(448 / amax))  # NaN not in amax
    assert torch.isnan(q.plane("rowwise").data[5, 6].float())


def check_blockwise(x, recipe):
    q = d.quantize(x, recipe)
    fmt = FORMATS[recipe.fp8_dtype]
    xs = as_floats(x)
    m, k = len(xs), len(xs[0])
    vinf = BF16_MAX if x.dtype == torch.bfloat16 else FLT_MAX if x.dtype == torch.float32 else 65504.0
    bufs = d.te_layout(q)
    ref = {}
    if recipe.block_dims == 1:
        rc, rs, rsi = ref_blocks(xs, 1, 128, fmt, recipe.force_pow_2_scales, recipe.amax_epsilon, vinf)
        cc, cs, csi = ref_blocks(xs, 128, 1, fmt, recipe.force_pow_2_scales, recipe.amax_epsilon, vinf)
        assert_codes(q.plane("rowwise").data, rc, "rowwise")
        assert_codes(q.plane("columnwise").data, cc, "columnwise")
        assert_f32_equal(q.plane("rowwise").scale_inv, rsi, "rowwise scale_inv")
        assert_f32_equal(q.plane("columnwise").scale_inv, csi, "columnwise scale_inv")
        # TE GEMM-ready storage: rowwise scale [kblk][m] padded to (ceil(K/128), roundup(M,4));
        # columnwise data (K, M), scale [mblk][k] padded to (ceil(M/128), roundup(K,4)).
        ru = lambda n, a: -(-n // a) * a  # noqa: E731
        assert tuple(bufs["_rowwise_scale_inv"].shape) == (-(-k // 128), ru(m, 4))
        assert tuple(bufs["_columnwise_scale_inv"].shape) == (-(-m // 128), ru(k, 4))
        assert_f32_equal(bufs["_rowwise_scale_inv"][:, :m], [list(c) for c in zip(*rsi)], "te rowwise scale")
        assert_f32_equal(bufs["_columnwise_scale_inv"][:, :k], csi, "te columnwise scale")
        assert_codes(bufs["_columnwise_data"].view(recipe.fp8_dtype), [list(c) for c in zip(*cc)], "te columnwise data")
        ref = {"rowwise": rs, "columnwise": cs}
    else:
        rc, rs, rsi = ref_blocks(xs, 128, 128, fmt, recipe.force_pow_2_scales, recipe.amax_epsilon, vinf)
        assert_codes(q.plane("rowwise").data, rc, "rowwise")
        assert_f32_equal(q.plane("rowwise").scale_inv, rsi, "scale_inv")
        gm, gk = -(-m // 128), -(-k // 128)
        ru4 = lambda n: -(-n // 4) * 4  # noqa: E731
        assert tuple(bufs["_rowwise_scale_inv"].shape) == (gm, ru4(gk))
        assert tuple(bufs["_columnwise_scale_inv"].shape) == (gk, ru4(gm))
        assert_f32_equal(bufs["_rowwise_scale_inv"][:, :gk], rsi, "te rowwise scale")
        assert_f32_equal(bufs["_columnwise_scale_inv"][:, :gm], [list(c) for c in zip(*rsi)], "te columnwise scale")
        assert_codes(bufs["_columnwise_data"].view(recipe.fp8_dtype), [list(c) for c in zip(*rc)], "te columnwise data")
        ref = {"rowwise": rs}
    assert_codes(bufs["_rowwise_data"].view(recipe.fp8_dtype), rc, "te rowwise data")
    return q, ref


@pytest.mark.parametrize("dims", [1, 2])
@pytest.mark.parametrize("shape", [(200, 300), (128, 256), (130, 129)])
@pytest.mark.parametrize("pow2", [True, False])
def test_blockwise_random_ragged(dims, shape, pow2):
    g = torch.Generator().manual_seed(20)
    x = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-8, 8, (shape[0], 1), generator=g).float())
    check_blockwise(x.to(torch.bfloat16), d.Blockwise(block_dims=dims, force_pow_2_scales=pow2))


@pytest.mark.parametrize("dims", [1, 2])
def test_blockwise_e5m2_fp32(dims):
    check_blockwise(_rand(160, 136, 21, torch.float32, 1000.0),
                    d.Blockwise(block_dims=dims, fp8_dtype=torch.float8_e5m2, force_pow_2_scales=False))


@pytest.mark.parametrize("dims", [1, 2])
def test_blockwise_zero_block_eps_inf_nan(dims):
    x = _rand(256, 256, 22, torch.float32, 5.0)
    x[:128, :128] = 0.0  # a zero 2-D block, and zero 1-D rows/cols inside it
    x[200, 3] = INF
    x[140, 250] = NAN
    x[130:132, 130:140] *= 1e-6  # tiny values, floor with eps
    for recipe in (d.Blockwise(block_dims=dims), d.Blockwise(block_dims=dims, amax_epsilon=0.5, force_pow_2_scales=False)):
        q, ref = check_blockwise(x, recipe)
        assert ref["rowwise"][0][0] == (1.0 if recipe.amax_epsilon == 0 else f32(448 / 0.5))
        if dims == 2:
            assert ref["rowwise"][1][0] == 1.0  # Inf amax -> scale 1 (not 0)
        else:
            assert ref["rowwise"][200][0] == 1.0 and ref["columnwise"][1][3] == 1.0
        assert torch.isnan(q.plane("rowwise").data[140, 250].float())
        assert q.plane("rowwise").data.view(torch.uint8)[200, 3].item() == 0x7E


@pytest.mark.parametrize("dims", [1, 2])
@pytest.mark.parametrize("hp,expected", [(torch.bfloat16, {False: BF16_MAX, True: 2.0**127}),
                                         (torch.float32, {False: FLT_MAX, True: 2.0**127})])
def test_blockwise_overflow_uses_input_dtype_max(dims, hp, expected):
    x = _rand(128, 128, 23, torch.float32, 1.0)
    x[:, :] = 1e-38
    x[0, 0] = -2e-39
    x = x.to(hp)
    for pow2 in (False, True):
        _, ref = check_blockwise(x, d.Blockwise(block_dims=dims, force_pow_2_scales=pow2))
        assert ref["rowwise"][0][0] == expected[pow2]


# ================================== delayed scaling ========================================================
def kernel_bulk(history: list[float], scale: float, fp8_max: float, margin: int, algo: str):
    """TE common/recipe/delayed_scaling.cu amax_and_scale_update_impl::kernel_bulk, one scale,
    no amax reduction buffer. Returns (new_history, new_scale)."""
    length = len(history)
    last_amax = history[0]
    new = list(history)
    amax = 0.0
    if last_amax != 0.0:  # NaN != 0 is true
        for i in range(length):
            a = history[i + 1] if i < length - 1 else last_amax
            amax = fmaxf(amax, a)
            new[i] = a if i > 0 else 0.0
    if algo == "most_recent":
        amax = last_amax
    scaled_max = f32(fp8_max * f32(2.0 ** (-margin)))  # host: fp8_dtype_max * std::pow(2.f, -margin)
    if math.isfinite(amax) and amax > 0:
        s = f32(scaled_max / amax)
    else:
        s = scale
    if math.isinf(s):
        s = FLT_MAX
    return new, s


DELAYED_CASES = [
    [2.5], [0.0], [INF], [1e-40], [NAN],
    [3.0, 1.0, 7.0, 2.0],
    [3.0, 9.0, 1.0, 2.0],  # old[1] leaves the window but still counts for 'max'
    [0.0, 5.0, 6.0, 7.0],  # last_amax == 0: no roll, scale kept (even for 'max')
    [INF, 1.0, 2.0],
    [1.0, 2.0, INF],
    [1e-40, 0.0, 0.0],
    [0.7, 0.0, 0.0, 0.0, 0.0],
    [NAN, 1.0, 2.0, 3.0],
    [1.0, NAN, 5.0],
]


def _random_histories():
    rng = random.Random(30)
    out = []
    for n in (1, 2, 16, 300):
        for _ in range(3):
            out.append([f32(rng.choice([0.0, 1.0]) * 2.0 ** rng.uniform(-20, 20)) for _ in range(n)])
    return out


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("fp8,margin", [(torch.float8_e4m3fn, 0), (torch.float8_e4m3fn, 2), (torch.float8_e5m2, 1)])
@pytest.mark.parametrize("history", DELAYED_CASES + _random_histories())
def test_delayed_update_scale_vs_kernel_bulk(algo, fp8, margin, history):
    recipe = d.DelayedScaling(fp8_dtype=fp8, margin=margin, amax_history_len=len(history), amax_compute_algo=algo)
    prev_scale = 0.75
    new_hist, new_scale = recipe.update_scale(torch.tensor(history, dtype=torch.float32),
                                              torch.tensor([prev_scale], dtype=torch.float32))
    exp_hist, exp_scale = kernel_bulk(history, prev_scale, FORMATS[fp8].max, margin, algo)
    assert_f32_equal(new_hist, exp_hist, "history")
    assert_f32_equal(new_scale, [exp_scale], "scale")


@pytest.mark.parametrize("history", [[0.0, 3.0], [INF, 2.0], [1e-40, 0.0]])
def test_delayed_update_scale_infinite_previous_scale(history):
    """kernel_bulk applies ``if (isinf(scale)) scale = FLT_MAX`` after choosing between the new and the
    previous scale, so a kept Inf scale is also replaced."""
    recipe = d.DelayedScaling(amax_history_len=len(history))
    _, new_scale = recipe.update_scale(torch.tensor(history), torch.tensor([INF]))
    assert_f32_equal(new_scale, [kernel_bulk(history, INF, 448.0, 0, "max")[1]])
    assert new_scale.item() == FLT_MAX


@pytest.mark.parametrize("mixed", [False, True], ids=["states", "one_state_missing"])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("recipe_cls", [d.DelayedScaling, d.CurrentScaling])
def test_requantize_planes_batch_equals_one_by_one(recipe_cls, algo, mixed):
    """An optimizer step requantizes all tensors of a recipe in one batch; each result must be what
    requantizing that tensor alone gives (bytes, scale_inv, delayed scaling's history and scale),
    for histories that roll (last != 0), stay (last == 0), hold a NaN, or see an Inf amax."""
    kwargs = {"amax_history_len": 4, "amax_compute_algo": algo} if recipe_cls is d.DelayedScaling else {}
    recipe = recipe_cls(**kwargs)
    hps = [_rand(32, 48, seed, torch.float32, scale) for seed, scale in ((1, 3.0), (2, 0.01), (3, 200.0), (4, 1.0))]
    hps[3][0, 0] = INF
    currents = [recipe.quantize_plane(hp, d.ROWWISE) for hp in hps]
    histories = [[0.0, 5.0, 1.0, 2.0], [0.0, 0.0, 0.0, 0.0], [3.0, float("nan"), 7.0, 1.0], [1.0, 2.0, 3.0, 4.0]]
    states = [{"amax_history": torch.tensor(h), "scale": torch.tensor([0.5 + i])} for i, h in enumerate(histories)]
    if recipe_cls is d.CurrentScaling:
        states = [None] * 4
    elif mixed:  # no state: that tensor keeps its current scale, the others update theirs
        states[2] = None
    amaxes = [None, torch.tensor([[9.0]]), None, None]
    batch = list(recipe.requantize_planes(d.ROWWISE, hps, currents, amaxes, states))
    # The in-place form (an optimizer step): the same bytes and states, in the existing storage.
    targets = [d.Plane(c.data.clone(), c.scale_inv.clone()) for c in currents]
    ptrs = [(t.data.data_ptr(), t.scale_inv.data_ptr()) for t in targets]
    in_place_states = recipe.requantize_planes_(d.ROWWISE, hps, targets, amaxes, states)
    assert [(t.data.data_ptr(), t.scale_inv.data_ptr()) for t in targets] == ptrs
    for i, ((plane, state), target, in_place) in enumerate(zip(batch, targets, in_place_states, strict=True)):
        assert torch.equal(target.data.view(torch.uint8), plane.data.view(torch.uint8)), i
        assert torch.equal(target.scale_inv.view(torch.uint8), plane.scale_inv.view(torch.uint8)), i
        assert (in_place is None) == (state is None), i
        if state is not None:
            for field in state:
                assert torch.equal(in_place[field], state[field]), (i, field)
    for i, (plane, state) in enumerate(batch):
        alone, alone_state = recipe.requantize_plane(hps[i], d.ROWWISE, currents[i], amax=amaxes[i], state=states[i])
        assert torch.equal(plane.data.view(torch.uint8), alone.data.view(torch.uint8)), i
        assert_f32_equal(plane.scale_inv.reshape(-1), alone.scale_inv.reshape(-1).tolist(), f"scale_inv {i}")
        if state is not None:
            assert_f32_equal(state["amax_history"], alone_state["amax_history"].tolist(), f"history {i}")
            assert_f32_equal(state["scale"], alone_state["scale"].tolist(), f"scale {i}")
    if mixed and recipe_cls is d.DelayedScaling:
        assert batch[2][1] is None and torch.equal(batch[2][0].scale_inv, currents[2].scale_inv)
    if recipe_cls is d.DelayedScaling:  # each row against TE's kernel_bulk, written out above
        for i, (plane, state) in enumerate(batch):
            if states[i] is None:
                continue
            amax = float(amaxes[i]) if amaxes[i] is not None else float(hps[i].abs().nan_to_num(nan=0.0, posinf=math.inf).max())
            recorded = [float(v) for v in states[i]["amax_history"]]
            recorded[0] = amax if math.isnan(recorded[0]) else max(recorded[0], amax)
            exp_hist, exp_scale = kernel_bulk(recorded, float(states[i]["scale"]), 448.0, 0, algo)
            assert_f32_equal(state["amax_history"], exp_hist, f"history {i} vs kernel_bulk")
            assert_f32_equal(state["scale"], [exp_scale], f"scale {i} vs kernel_bulk")
    if recipe_cls is d.DelayedScaling:  # and "alone" itself follows record_amax + update_scale
        h = recipe.record_amax(states[0]["amax_history"], recipe.block_amax(hps[0], d.ROWWISE))
        exp_hist, exp_scale = recipe.update_scale(h, states[0]["scale"])
        assert_f32_equal(batch[0][1]["amax_history"], exp_hist.tolist(), "history vs update_scale")
        assert_f32_equal(batch[0][1]["scale"], exp_scale.tolist(), "scale vs update_scale")


def test_delayed_record_amax_accumulates():
    recipe = d.DelayedScaling(amax_history_len=3)
    h = torch.tensor([0.0, 4.0, 5.0])
    h = recipe.record_amax(h, torch.tensor(2.0))
    h = recipe.record_amax(h, torch.tensor(1.5))
    h = recipe.record_amax(h, torch.tensor(3.0))
    assert_f32_equal(h, [3.0, 4.0, 5.0])
    h2, s = recipe.update_scale(h, torch.tensor([1.0]))
    assert_f32_equal(h2, [0.0, 5.0, 3.0])
    assert_f32_equal(s, [f32(448 / 5.0)])  # max(3, old[1:]=4,5)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_delayed_quantize_with_given_scale(fp8):
    x = _rand(48, 64, 31, torch.bfloat16, 40.0)
    s = f32(7.3)
    q = d.quantize(x, d.DelayedScaling(fp8_dtype=fp8), scale=torch.tensor(s))
    fmt = FORMATS[fp8]
    codes = [[fmt.encode(f32(v * s)) for v in row] for row in as_floats(x)]
    bufs = d.te_layout(q)
    assert_codes(bufs["_data"].view(fp8), codes)
    assert_f32_equal(bufs["_scale_inv"], [f32(1.0 / s)])
    if fp8 == torch.float8_e4m3fn:
        assert (bufs["_data"].view(fp8).float().abs() == 448).any()  # saturated, not NaN


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("make", [lambda f: d.CurrentScaling(fp8_dtype=f), lambda f: d.DelayedScaling(fp8_dtype=f),
                                  lambda f: d.Blockwise(block_dims=1, fp8_dtype=f), lambda f: d.Blockwise(block_dims=2, fp8_dtype=f),
                                  lambda f: d.MXFP8(fp8_dtype=f)], ids=["current", "delayed", "block1d", "block2d", "mxfp8"])
def test_nan_is_written_as_te_canonical_byte(make, fp8_dtype):
    """TE (H200, both FP8 formats) writes 0x7F for every NaN, whatever its sign; so must we on any
    device (torch's CPU cast alone would write 0xFF for -NaN)."""
    x = torch.full((64, 128), 0.5)
    x[0, 0], x[0, 1], x[5, 7] = float("nan"), -float("nan"), 2.0
    q = d.quantize(x, make(fp8_dtype))
    for usage in q.usages:
        raw = q.plane(usage).data.view(torch.uint8)
        assert raw[0, 0].item() == 0x7F and raw[0, 1].item() == 0x7F, usage
        nan_bytes = (raw.bitwise_and(0x7F) == 0x7F)
        assert nan_bytes.sum().item() == 2, usage  # no finite value was turned into NaN
