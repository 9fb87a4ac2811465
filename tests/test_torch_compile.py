"""torch.compile with FP8 parameters on CPU (inductor's C++ backend), every recipe: compiled
models train bit-exactly like eager (see the note in compile_cases.py), with and without FSDP2,
and ``dtensor_fp8.quantize`` and the recipes' quantize / dequantize functions compile with
``fullgraph=True``. The same cases run on CUDA in tests/gpu/test_compile.py.

[Note: graph breaks that remain]
None inside what is compiled: a model with FP8 weights compiles as one graph (counted below with
``torch._dynamo.explain``), and each block of an FSDP2 model compiles with ``fullgraph=True``.
What is not compiled, by design: FSDP2's hooks (the all-gathers and our
``fsdp_pre/post_all_gather``) run eagerly around each compiled block, because dynamo skips FSDP2's
hooks (``torch._dynamo.config.skip_fsdp_hooks``), and the optimizer step (``MasterWeightOptimizer``:
the requantization runs eagerly, as a CUDA graph on the GPU). A whole-model ``torch.compile``
over ``fully_shard``-ed blocks therefore breaks the graph at every block boundary.

[Note: blocks of one's own and containers]
Every per-block case runs with a block class of one's own (``compile_cases.Block``); containers
(``nn.Sequential``) run through ``torch.compile(block)`` and ``block.compile()``. The latter differs
by torch version (``compile_cases.fullgraph_under_fully_shard``): up to 2.13 dynamo skips a torch.nn
container's ``__call__`` and ``forward`` and compiles only the frames below them (here the FP8
linears, each a graph; the ReLU between them runs eagerly); from 2.14 it traces the container's
``__call__`` with its hooks, FSDP2's among them, which are ``torch._dynamo.disable``-d: the block
compiles as one graph after a graph break at those hooks, and ``fullgraph=True`` raises (plain torch
too). Both are asserted below, per version.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dtensor_fp8 as d
from compile_cases import (
    KINDS, compiled_model_vs_eager, fullgraph_under_fully_shard, graph_breaks_of_model, mismatches,
    per_block_compile_vs_eager, quantize_compiled_vs_eager,
)
from dist_utils import DEVICE, WORLD_SIZES
from dtensor_fp8._compat import TORCH_VERSION

RECIPES = list(d.RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_quantize_and_recipe_functions_compile(name):
    assert quantize_compiled_vs_eager(name, DEVICE) == []


@pytest.mark.parametrize("name", RECIPES)
def test_compiled_model_trains_like_eager(name):
    eager, compiled, counters = compiled_model_vs_eager(name, DEVICE)
    assert mismatches(eager, compiled) == []
    assert counters["graph_breaks"] == 0 and counters["unique_graphs"] >= 1, counters
    # The run is not trivially equal: the weights change every step.
    assert eager["planes"][0] != {} and any(
        not torch.equal(a[0], b[0]) for a, b in zip(eager["planes"][0].values(), eager["planes"][-1].values()))


def test_model_compiles_to_one_graph():
    graphs, breaks, reasons = graph_breaks_of_model("mxfp8", DEVICE)
    assert (graphs, breaks) == (1, 0), reasons


#: (recipe, block kind, style): every recipe with its own block class and ``block.compile()``; the
#: other kinds and styles with a one-plane and a two-plane recipe (the same graphs otherwise).
PER_BLOCK = ([(name, "own", "module.compile") for name in RECIPES] + [("current", "own", "torch.compile")]
             + [(name, "container", style) for style in ("torch.compile", "module.compile") for name in ("current", "mxfp8")])


@pytest.mark.parametrize("name,kind,style", PER_BLOCK)
def test_per_block_compile_under_fully_shard(pools, name, kind, style):
    world = WORLD_SIZES[0]
    fullgraph = fullgraph_under_fully_shard(kind, style)
    results = pools[world].run(per_block_compile_vs_eager, name, style, DEVICE, fullgraph, None, kind)
    for rank, (eager, compiled, counters) in enumerate(results):
        assert mismatches(eager, compiled) == [], f"rank {rank}"
        assert counters["unique_graphs"] >= 1, counters  # the blocks really ran compiled
        if fullgraph:
            assert counters["graph_breaks"] == 0, counters  # fullgraph=True would have raised anyway
        else:  # a container's block.compile() from torch 2.14: the breaks are FSDP2's disabled hooks
            assert counters["graph_breaks"] >= 1 and all(
                r.startswith("Call to `torch._dynamo.disable()`") for r in counters["break_reasons"]), counters


@pytest.mark.parametrize("name", ["mxfp8", "blockwise1d"])
def test_per_block_compile_under_fully_shard_one_rank(pools, name):
    """At one rank every scale is the shard's own, copied into the unsharded weight at each
    gather (fsdp_buffers._scale_copy): the backward's gather rewrites a scale the compiled forward saved,
    which must not count as an in-place change (two-plane recipes: the columnwise scale)."""
    (eager, compiled, counters), = pools[1].run(per_block_compile_vs_eager, name, "module.compile", DEVICE)
    assert mismatches(eager, compiled) == []
    assert counters["graph_breaks"] == 0 and counters["unique_graphs"] >= 1, counters


def _container_compile_fullgraph(fp8: bool) -> str:
    """``block.compile(fullgraph=True)`` on ``nn.Sequential`` blocks, then ``fully_shard``, one
    forward and backward: "ok", or the error."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from compile_cases import block

    torch._dynamo.reset()
    mesh = init_device_mesh(torch.device(DEVICE).type, (torch.distributed.get_world_size(),))
    model = nn.Sequential(block(DEVICE, 0, "container"), block(DEVICE, 1, "container"))
    if fp8:
        d.quantize_module_(model, d.MXFP8())
    for b in model:
        b.compile(fullgraph=True)
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    try:
        model(torch.randn(8, 256, device=DEVICE)).sum().backward()
    except Exception as err:  # noqa: BLE001  (returned to the test)
        return f"{type(err).__name__}: {err}"
    return "ok"


def test_container_module_compile_fullgraph_under_fully_shard_per_version(pools):
    """The doc's note (docs/README.md, torch.compile): ``nn.Sequential.compile(fullgraph=True)``
    before ``fully_shard`` runs up to torch 2.13 and raises in dynamo from 2.14, FP8 weights or not."""
    fp8 = pools[WORLD_SIZES[0]].run(_container_compile_fullgraph, True)
    if fullgraph_under_fully_shard("container", "module.compile"):
        assert fp8 == ["ok"] * WORLD_SIZES[0]
    else:
        plain = pools[WORLD_SIZES[0]].run(_container_compile_fullgraph, False)
        for msg in fp8 + plain:
            assert msg.startswith("Unsupported: Call to `torch._dynamo.disable()`") and "FSDP" in msg, msg[:300]


@pytest.mark.parametrize("kind", KINDS)
def test_what_module_compile_traces_per_version(kind):
    """``block.compile()`` (no FSDP): a block class of one's own compiles as one graph holding the
    whole forward on every version; a container does from torch 2.14, and up to 2.13 only the FP8
    linears below it compile (each a graph of its own; the ReLU between them runs eagerly)."""
    from compile_cases import DIM, block

    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm.forward

    b = d.quantize_module_(block(DEVICE, 0, kind), d.MXFP8())
    b.compile(backend=backend, fullgraph=True)
    b(torch.randn(4, DIM, device=DEVICE))
    has_relu = [any("relu" in target for target in g) for g in graphs]
    if kind == "own" or TORCH_VERSION >= (2, 14):
        assert has_relu == [True], graphs
    else:
        assert len(graphs) == 2 and not any(has_relu), graphs


def test_compiled_blocks_leave_no_transpose_cache(pools):
    """A compiled backward computes the weight's transpose inside its graph: no eager transpose
    cache (one byte per weight element) may outlive a step on any unsharded weight."""
    held = pools[WORLD_SIZES[0]].run(_transpose_caches_after_compiled_steps)
    assert held == [[]] * WORLD_SIZES[0]


def _transpose_caches_after_compiled_steps():
    import gc

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from compile_cases import block, train

    torch._dynamo.reset()
    mesh = init_device_mesh(torch.device(DEVICE).type, (torch.distributed.get_world_size(),))
    model = d.quantize_module_(nn.Sequential(block(DEVICE, 0, "own"), block(DEVICE, 1, "own")), d.CurrentScaling())
    for b in model:
        b.compile(fullgraph=True)
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    train(model, model, DEVICE, steps=1)
    gc.collect()
    return [tuple(q.shape) for q in gc.get_objects()
            if isinstance(q, d.QuantizedTensor) and q.transpose_cache is not None]


def test_compiled_block_gathers_both_planes(pools):
    """A compiled block's gathers carry both planes in forward and in backward (see fsdp.py): its
    compiled backward reads what the forward's graph saved."""
    both = ("rowwise", "columnwise")
    # Two weights, each gathered for forward and then for backward.
    assert pools[WORLD_SIZES[0]].run(_gathered_usages)[0] == {
        "eager": [("rowwise",)] * 2 + [("columnwise",)] * 2, "compiled": [both] * 4}


def _gathered_usages():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from compile_cases import block

    import dtensor_fp8.fsdp as dfsdp

    mesh = init_device_mesh(DEVICE, (torch.distributed.get_world_size(),))
    seen = {}
    real = dfsdp.gather_usages
    for mode in ("eager", "compiled"):
        torch._dynamo.reset()
        model = d.quantize_module_(nn.Sequential(block(DEVICE, 0, "own"), nn.Linear(256, 8)), d.MXFP8(),
                                   filter_fn=lambda m, fqn: fqn.startswith("0."))
        if mode == "compiled":
            model[0].compile(fullgraph=True)
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        calls = []

        def recording(group, calls=calls, **kwargs):
            usages = real(group, **kwargs)
            calls.append(usages)
            return usages

        dfsdp.gather_usages = recording
        try:
            model(torch.randn(4, 256, device=DEVICE)).sum().backward()
        finally:
            dfsdp.gather_usages = real
        seen[mode] = calls
    return seen


def test_torch_compile_fqn_keeps_hp_init():
    """Masters start from the high-precision init whether or not a block was wrapped by
    torch.compile after quantize_module_ (FQNs are compared without ``_orig_mod``)."""
    from compile_cases import block, planes_bytes

    after = []
    for wrap in (False, True):
        model = d.quantize_module_(nn.Sequential(block(DEVICE, 0)), d.MXFP8())
        if wrap:
            model[0] = torch.compile(model[0])  # not run: only the parameter names change
        opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-3)
        inner = model[0]._orig_mod if wrap else model[0]
        inner(torch.ones(2, 256, device=DEVICE)).sum().backward()
        opt.step()
        after.append(list(planes_bytes(model).values()))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(*after)), "the masters did not start from the same values"


def test_dynamic_shapes_keep_fp8_gemms():
    """Current scaling (torch's CPU scaled GEMM; tests/gpu/test_compile.py runs every recipe's on
    CUDA). A compiled linear whose input dims are dynamic (``dynamic=True`` here; dynamo's automatic
    dynamic does the same once it sees a second size: the Llama3-8B ``linear_step`` rows after a
    graph break) runs torch's scaled GEMMs for both sizes and gives the eager FP8 GEMMs' output
    and gradient. Before the fix the GEMM check keyed a cache with a SymInt and compilation
    failed ("unhashable type: non-nested SymInt")."""
    from torch.profiler import ProfilerActivity, profile
    from dtensor_fp8 import gemm

    torch.manual_seed(0)
    lin = nn.Linear(256, 128, bias=False)
    d.quantize_module_(lin, d.RECIPES["current"])
    with gemm.fp8_gemms("on"):
        assert gemm.unsupported_reason(torch.randn(128, 256), lin.weight) is None
        compiled = torch.compile(lambda x: nn.functional.linear(x, lin.weight), dynamic=True)
        for tokens in (128, 256):
            x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(tokens))
            xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
            eager = nn.functional.linear(xe, lin.weight)
            eager.sum().backward()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                out = compiled(xc)
                out.sum().backward()
            assert sum("scaled_mm" in e.name for e in prof.events() if e.name.startswith("aten::")) >= 2, tokens
            assert torch.equal(out, eager), tokens
            assert torch.equal(xc.grad, xe.grad), tokens
