"""torch.compile with FP8 parameters on CUDA (inductor's Triton backend), every recipe: the cases of
tests/test_torch_compile.py (see tests/compile_cases.py) on the GPU. MXFP8 runs through the
reference recipe on sm_90 (TE's MXFP8 kernels need sm_100); per-tensor and blockwise quantization
inside a compiled graph is the compiled reference too (TE's kernels are skipped under
torch.compile: dynamo cannot trace them), and must give the bytes eager TE kernels give.

FSDP2 runs on a one-rank NCCL group in this process (the hooks, the all-gather extension and the
per-block compile are exercised; there is nothing to move between ranks). Its blocks are a class of
one's own (``compile_cases.Block``), which compiles whole on every torch version; containers are
covered on the CPU (tests/test_torch_compile.py, [Note: blocks of one's own and containers]).

``F.linear`` runs two ways here (``gemm`` parameter): ``"emulated"`` (``fp8_gemms("off")``: dequantize
+ high-precision GEMM) and ``"fp8"`` (the FP8 GEMM path of gemm.py, where torch has the recipe's
scaled GEMM on this GPU), both compiled with ``fullgraph=True`` (block-scaled GEMMs call the aten op
``_scaled_mm_v2`` itself: torch 2.11's dynamo broke the graph at ``F.scaled_mm``'s binding); both
must be bit-exact with eager, step for step. Delayed scaling is the exception by design: its
activation / gradient amax histories live outside the graph, so under compile it runs the
emulated linear (``gemm.unsupported_reason``), and its compiled run is compared with an eager run
of the emulated linear (``EAGER_GEMMS``). Each test prints the graph breaks it counted.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import torch.distributed as dist  # noqa: E402

import contextlib  # noqa: E402

import dtensor_fp8 as d  # noqa: E402
from dtensor_fp8 import gemm as dgemm  # noqa: E402
from compile_cases import (  # noqa: E402
    compiled_model_vs_eager, graph_breaks_of_model, mismatches, per_block_compile_vs_eager,
    quantize_compiled_vs_eager,
)

RECIPES = list(d.RECIPES)
DEVICE = "cuda"
GEMMS = ["emulated", "fp8"]


def _eager_gemms(name: str, gemm: str) -> str | None:
    """The eager run's FP8-GEMM mode: as the compiled run's, except delayed scaling's FP8 path,
    which runs the emulated linear under compile (see the module docstring)."""
    return "off" if (name, gemm) == ("delayed", "fp8") else None


def _gemm_mode(gemm: str):
    """(context, fullgraph) for a ``gemm`` parameter (see the module docstring)."""
    if gemm == "emulated":
        return dgemm.fp8_gemms("off"), True
    return contextlib.nullcontext(), True


@pytest.fixture(scope="module")
def one_rank_group():
    """A one-rank process group for FSDP2 (created here unless one exists; destroyed after)."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            pytest.skip("a process group of several ranks already exists in this process")
        yield
        return
    fd, path = tempfile.mkstemp(prefix="dtensor_fp8_compile_store_")
    os.close(fd)
    os.unlink(path)
    dist.init_process_group("nccl", store=dist.FileStore(path, 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        if os.path.exists(path):
            os.unlink(path)


@pytest.mark.parametrize("name", RECIPES)
def test_quantize_and_recipe_functions_compile(name):
    assert quantize_compiled_vs_eager(name, DEVICE) == []


@pytest.mark.parametrize("name", RECIPES)
def test_quantize_compiled_gives_te_kernel_bytes(name):
    """Eager quantize on CUDA takes TE's kernels where TE imports; the compiled reference must
    make the same bytes."""
    recipe = d.RECIPES[name]
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = (torch.randn(256, 512, device=DEVICE, dtype=torch.bfloat16, generator=gen)
         * torch.logspace(-4, 4, 256, device=DEVICE)[:, None])
    kw = {"scale": torch.tensor(0.5, device=DEVICE)} if name == "delayed" else {}
    torch._dynamo.reset()
    eager, comp = d.quantize(x, recipe, **kw), torch.compile(d.quantize, fullgraph=True)(x, recipe, **kw)
    for usage, plane in eager.planes.items():
        other = comp.planes[usage]
        assert torch.equal(plane.data.view(torch.uint8), other.data.view(torch.uint8)), usage
        assert torch.equal(plane.scale_inv.reshape(-1).view(torch.uint8), other.scale_inv.reshape(-1).view(torch.uint8)), usage


def _random_fp32(n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` positive finite fp32 values with uniformly drawn bit patterns (subnormals to FLT_MAX)."""
    return torch.randint(1, 0x7F800000, (n,), device=DEVICE, dtype=torch.int32, generator=gen).view(torch.float32)


def test_compiled_scale_rules_divide_as_eager():
    """The scale rules' divisions (``fp8_max / amax``, ``1 / scale``, delayed scaling's update)
    compiled by inductor give eager's IEEE-rounded fp32 quotients, byte for byte, over a million
    random amaxes: an fp32 ``/`` compiles to Triton's approximate division, one ulp off on a
    fraction of these (see [Note: exact scale division under torch.compile])."""
    from dtensor_fp8.formats.scaling import reciprocal, scale_from_amax

    def rules(amax):
        scale = scale_from_amax(amax, 448.0, force_pow_2_scales=False, amax_epsilon=0.0)
        history, delayed = d.DelayedScaling(margin=1)._update_scales(amax[:, None], torch.ones_like(amax))
        return scale, reciprocal(scale), reciprocal(amax), delayed

    amax = _random_fp32(1 << 20, torch.Generator(device=DEVICE).manual_seed(0))
    torch._dynamo.reset()
    for what, eager, compiled in zip(("scale", "scale_inv", "1/amax", "delayed scale"), rules(amax),
                                     torch.compile(rules, fullgraph=True)(amax)):
        differ = (eager.view(torch.int32) != compiled.view(torch.int32)).sum().item()
        assert differ == 0, f"{what}: {differ} of {amax.numel()} quotients differ from eager"


@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("name", RECIPES)
def test_compiled_model_trains_like_eager(name, gemm):
    context, fullgraph = _gemm_mode(gemm)
    with context:
        eager, compiled, counters = compiled_model_vs_eager(name, DEVICE, fullgraph=fullgraph,
                                                            eager_gemms=_eager_gemms(name, gemm))
    print(f"{name} {gemm}: {counters}")
    assert mismatches(eager, compiled) == []
    assert counters["unique_graphs"] >= 1, counters


def test_model_compiles_to_one_graph():
    graphs, breaks, reasons = graph_breaks_of_model("mxfp8", DEVICE)
    assert (graphs, breaks) == (1, 0), reasons


@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("style", ["module.compile", "torch.compile"])
@pytest.mark.parametrize("name", RECIPES)
def test_per_block_compile_under_fully_shard(one_rank_group, name, style, gemm):
    context, fullgraph = _gemm_mode(gemm)
    with context:
        eager, compiled, counters = per_block_compile_vs_eager(name, style, DEVICE, fullgraph=fullgraph,
                                                               eager_gemms=_eager_gemms(name, gemm))
    print(f"{name} {style} {gemm}: {counters}")
    assert mismatches(eager, compiled) == []
    assert counters["unique_graphs"] >= 1, counters
    if fullgraph:
        assert counters["graph_breaks"] == 0, counters


@pytest.mark.parametrize("name", RECIPES)
def test_decoder_block_compiles_to_one_graph(name):
    """``linear_step``'s Llama-form decoder block (bf16, RMSNorm, GQA attention, SwiGLU) with FP8
    weights and the FP8 GEMM path: one graph, no break. On torch 2.11 a subclass's ``F.linear`` runs
    on fake tensors outside dynamo's tracing, where ``torch.compiler.is_compiling()`` is False: the
    amax's data-dependent NaN check then broke the graph at every linear (16 breaks in a block)
    until the codecs asked ``_compat.is_traced`` instead."""
    import dataclasses

    from dtensor_fp8.benchmarks import linear_step
    from dtensor_fp8.benchmarks.shapes import PRESETS

    shape = dataclasses.replace(PRESETS["llama3-8b"], layers=1, hidden=512, ffn=1024, heads=4, kv_heads=2, seq=256)
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = d.quantize_module_(linear_step.Block(shape, DEVICE, torch.bfloat16), d.RECIPES[name])
    x = torch.randn(shape.seq, shape.batch, shape.hidden, device=DEVICE, dtype=torch.bfloat16)
    explained = torch._dynamo.explain(block)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), [str(r.reason)[:300] for r in explained.break_reasons]
