"""FP8 grouped GEMMs of MoE expert weights on the GPU (dtensor_fp8/grouped_fp8.py).

1. Where torch's scaled grouped GEMM runs (per-tensor recipes on sm_90 / sm_100): the forward and
   input-gradient GEMMs ran ``torch._scaled_grouped_mm`` (recorded by ``gemm.recording()``, and no
   fallback warning); output and x.grad agree with the emulated path (dequantized planes,
   ``torch._grouped_mm``) within FP8 tolerance and with a per-expert loop of the dense FP8 GEMM
   (``F.linear`` on each expert's 2-D weight, ``fp8_gemms("on")``); the weight gradient is the
   emulated path's, bit for bit (the same high-precision grouped GEMM of the same ``x`` and ``dy``).
2. The forward GEMM's operands are the weight's own rowwise bytes and its per-expert scales.
3. Block recipes (no rowwise scales): the emulated path runs and says so once, with the reason.

Needs CUDA (sm_90 or sm_100 for 1 and 2).
"""

from __future__ import annotations

import warnings

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: grouped FP8 GEMM tests need a GPU", allow_module_level=True)

import dtensor_fp8 as d  # noqa: E402
from dtensor_fp8 import gemm  # noqa: E402
from dtensor_fp8.grouped_mm import grouped_mm  # noqa: E402

DEV = torch.device("cuda")
CC = torch.cuda.get_device_capability()
HAS_KERNEL = CC in ((9, 0), (10, 0)) and hasattr(torch, "_scaled_grouped_mm")
EXPERTS, OUT, IN = 4, 256, 384
#: tokens per expert (one gets none): multiples of 16 as torchtitan aligns them for FP8 (and as the
#: dense FP8 GEMM of the per-expert reference needs), and unaligned ones
COUNTS = {"aligned": [48, 0, 80, 144], "unaligned": [40, 0, 77, 139]}
PER_TENSOR = {"delayed": d.DelayedScaling(), "current": d.CurrentScaling()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


class _Experts(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = torch.nn.Parameter(w.clone())


def _weights(recipe, seed=0):
    """High-precision expert weights ``[E, out, in]`` and the FP8 parameter ``quantize_module_``
    makes of them."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(EXPERTS, OUT, IN, generator=g) * torch.logspace(-1, 1, EXPERTS).reshape(-1, 1, 1) * 0.05).to(DEV)
    m = _Experts(w)
    d.quantize_module_(m, recipe, experts=lambda mod, fqn: ("w",) if isinstance(mod, _Experts) else ())
    assert isinstance(m.w, d.QuantizedTensor)
    return w, m.w


def _dense(w2d, recipe):
    """One expert's matrix as an FP8 nn.Linear weight (the dense FP8 GEMM's)."""
    lin = torch.nn.Linear(w2d.shape[1], w2d.shape[0], bias=False, device=DEV)
    with torch.no_grad():
        lin.weight.copy_(w2d)
    d.quantize_module_(lin, recipe)
    return lin


def _inputs(counts=COUNTS["aligned"], seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = sum(counts)
    x = torch.randn(tokens, IN, generator=g).to(DEV, torch.bfloat16)
    upstream = torch.randn(tokens, OUT, generator=g).to(DEV, torch.bfloat16)
    offs = torch.cumsum(torch.tensor(counts), 0).to(DEV, torch.int32)
    return x, upstream, offs


def _step(weight, x, upstream, offs, mode):
    xx = x.clone().requires_grad_()
    weight.grad = None
    with gemm.fp8_gemms(mode), gemm.recording() as log:
        y = grouped_mm(xx, weight.bfloat16().transpose(-2, -1), offs)
        (y.float() * upstream.float()).sum().backward()
    return y.detach(), xx.grad, weight.grad, [e["gemm"] for e in log]


@pytest.mark.skipif(not HAS_KERNEL, reason=f"torch's scaled grouped GEMM needs sm_90 / sm_100, this is sm_{CC[0]}{CC[1]}")
@pytest.mark.parametrize("counts", sorted(COUNTS))
@pytest.mark.parametrize("name", sorted(PER_TENSOR))
def test_fp8_grouped_gemm_runs_and_matches(name, counts):
    recipe = PER_TENSOR[name]
    w, weight = _weights(recipe)
    counts = COUNTS[counts]
    x, upstream, offs = _inputs(counts)
    gemm._warned.clear()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="dtensor_fp8")  # a fallback would warn: the FP8 kernel must run
        y8, gx8, gw8, ran = _step(weight, x, upstream, offs, "auto")
    assert ran == ["grouped_fprop", "grouped_dgrad"], ran
    y_em, gx_em, gw_em, ran_em = _step(weight, x, upstream, offs, "off")
    assert ran_em == []
    # FP8 activations / gradients (E4M3: 3 mantissa bits) against bf16 ones on the same FP8 weights
    assert rel_err(y8, y_em) < 0.06 and rel_err(gx8, gx_em) < 0.06, (rel_err(y8, y_em), rel_err(gx8, gx_em))
    assert rel_err(y8, y_em) > 0  # x was quantized: the FP8 path is not the emulated one
    assert torch.equal(gw8, gw_em)  # the weight gradient is the same high-precision grouped GEMM
    if any(n % 16 for n in counts):
        return  # the dense FP8 GEMM needs tokens divisible by 16: the aligned case compares with it
    # a per-expert loop of the dense FP8 GEMM (2-D weights, per-tensor x per expert slice, E5M2 dy)
    ys, gxs = [], []
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        xe = x[start:start + n].clone().requires_grad_()
        lin = _dense(w[e], recipe)
        with gemm.fp8_gemms("on"), gemm.recording() as log:
            ye = lin(xe)
            (ye.float() * upstream[start:start + n].float()).sum().backward()
        assert [r["gemm"] for r in log][:2] == ["fprop", "dgrad"], log
        ys.append(ye.detach())
        gxs.append(xe.grad)
        start += n
    assert rel_err(y8, torch.cat(ys)) < 0.06, rel_err(y8, torch.cat(ys))
    assert rel_err(gx8, torch.cat(gxs)) < 0.12, rel_err(gx8, torch.cat(gxs))


@pytest.mark.skipif(not HAS_KERNEL, reason="torch's scaled grouped GEMM needs sm_90 / sm_100")
def test_fp8_grouped_gemm_reads_the_weight_planes():
    """The forward B operand is the rowwise plane's own storage; its scales are each expert's."""
    recipe = d.CurrentScaling()
    _, weight = _weights(recipe)
    x, _, offs = _inputs()
    with gemm.fp8_gemms("auto"), gemm.recording() as log:
        grouped_mm(x, weight.bfloat16().transpose(-2, -1), offs)
    (entry,) = log
    plane = weight.plane("rowwise")
    assert entry["b"].data.data_ptr() == plane.data.data_ptr()
    want = plane.scale_inv.float().reshape(EXPERTS, 1).expand(EXPERTS, OUT)
    assert torch.equal(entry["b"].scale_inv, want)
    assert entry["a"].data.dtype == torch.float8_e4m3fn and entry["a"].scale_inv.shape == (x.shape[0],)


@pytest.mark.parametrize("name", ["mxfp8", "blockwise1d", "blockwise2d"])
def test_block_recipes_fall_back_once(name):
    recipe = d.RECIPES[name]
    _, weight = _weights(recipe)
    x, upstream, offs = _inputs()
    gemm._warned.clear()
    with pytest.warns(UserWarning, match=r"grouped GEMM of a .*per-expert expert weight .* emulated"):
        y, _, _, ran = _step(weight, x, upstream, offs, "auto")
    assert ran == []
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="dtensor_fp8")  # said once per process and reason
        _step(weight, x, upstream, offs, "auto")
