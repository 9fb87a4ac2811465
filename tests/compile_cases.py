"""torch.compile cases shared by tests/test_torch_compile.py (CPU, inductor's C++ backend) and
tests/gpu/test_compile.py (CUDA, Triton): each runs a model eagerly and compiled from the same
start and returns what both produced, for the test to compare byte for byte.

[Note: what "matches eager" means]
Bit-exact: after every step the loss, the input gradient and every FP8 plane (data and scale_inv,
compared as bytes) of the compiled run equal the eager run's. That holds because inductor keeps
the ops of the FP8 path: dequantization is an FP8 -> fp32 convert and one multiply by the block
scale (exact, or one rounding, the same in generated code), quantization is max-reductions (exact
in any order), elementwise scale math and a saturating cast, and the GEMMs are the same extern
matmul calls. What inductor may reorder is a floating-point *sum* it generates itself (a bias
gradient, a norm); the models here have none, so nothing needs a tolerance. A model that has
them matches to float rounding, not bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

import dtensor_fp8 as d
from dtensor_fp8._compat import TORCH_VERSION

DIM = 256  # a multiple of 128: blockwise recipes shard at 128-row boundaries over 2 ranks
TOKENS = 128  # a multiple of 128: torch's blockwise scaled GEMMs take the batch (on CUDA)
STEPS = 3


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def planes_bytes(model: nn.Module) -> dict:
    """Every FP8 plane of ``model`` (local shards under FSDP) as bytes, by parameter and usage."""
    out = {}
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if isinstance(local, d.QuantizedTensor):
            for usage, plane in local.planes.items():  # names without torch.compile(block)'s prefix
                out[name.replace("_orig_mod.", ""), usage] = (as_bytes(plane.data).clone(), as_bytes(plane.scale_inv).clone())
    return out


class Block(nn.Module):
    """A block class of one's own (the ``"own"`` kind of :func:`block`): what ``nn.Sequential``
    holds, called by a ``forward`` written here."""

    def __init__(self, fc1: nn.Linear, act: nn.Module, fc2: nn.Linear):
        super().__init__()
        self.fc1, self.act, self.fc2 = fc1, act, fc2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


#: How a block is built: ``"own"``, a :class:`Block`; ``"container"``, an ``nn.Sequential``.
KINDS = ("own", "container")


def block(device, seed: int, kind: str = "container") -> nn.Module:
    """Two bias-free linears whose weights spread over 12 binades per element, so that MXFP8 /
    1x128 row and column planes differ (the input gradient then shows which one was read) and
    every recipe quantizes differently; ``kind`` (:data:`KINDS`) chooses the module holding them
    (the same weights either way)."""
    torch.manual_seed(seed)
    layers = (nn.Linear(DIM, DIM, bias=False), nn.ReLU(), nn.Linear(DIM, DIM, bias=False))
    with torch.no_grad():
        for layer in (layers[0], layers[2]):
            layer.weight.mul_(2.0 ** -torch.randint(0, 12, layer.weight.shape).float())
    b = {"own": Block, "container": nn.Sequential}[kind](*layers)
    return b.to(device)


def fullgraph_under_fully_shard(kind: str, style: str) -> bool:
    """Whether a block of ``kind`` compiled by ``style`` (see :func:`per_block_compile_vs_eager`)
    before ``fully_shard`` compiles as one graph under FSDP2 on this torch. Not a container's
    ``module.compile()`` from torch 2.14: dynamo then traces the container's ``__call__`` with its
    hooks, and FSDP2's hooks are ``torch._dynamo.disable``-d (a graph break; with
    ``fullgraph=True`` the error "Call to `torch._dynamo.disable()`"), with or without FP8 weights.
    ``torch.compile(container)`` and a block class of one's own compile whole on every version."""
    return not (kind == "container" and style == "module.compile" and TORCH_VERSION >= (2, 14))


def train(model: nn.Module, call, device, steps: int = STEPS, seed: int = 1) -> dict:
    """``steps`` optimizer steps of ``call(x)`` (the model, or its compiled form) with
    ``MasterWeightOptimizer``; per step the loss, x.grad and the planes after the step."""
    opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    record = {"loss": [], "grad": [], "planes": []}
    for _ in range(steps):
        x = torch.randn(TOKENS, DIM, generator=g).to(device).requires_grad_(True)
        loss = call(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        record["loss"].append(loss.detach().clone())
        record["grad"].append(x.grad.clone())
        record["planes"].append(planes_bytes(model))
    return record


def mismatches(eager: dict, compiled: dict) -> list[str]:
    """What differs between two :func:`train` records (empty when bit-exact)."""
    bad = []
    for step, (le, lc) in enumerate(zip(eager["loss"], compiled["loss"], strict=True)):
        if not torch.equal(le, lc):
            bad.append(f"step {step}: loss {le.item()} vs {lc.item()}")
    for step, (ge, gc) in enumerate(zip(eager["grad"], compiled["grad"], strict=True)):
        if not torch.equal(ge, gc):
            bad.append(f"step {step}: x.grad differs by {(ge - gc).abs().max().item()}")
    for step, (pe, pc) in enumerate(zip(eager["planes"], compiled["planes"], strict=True)):
        if pe.keys() != pc.keys():
            bad.append(f"step {step}: planes {sorted(pe)} vs {sorted(pc)}")
            continue
        for key, (de, se) in pe.items():
            dc, sc = pc[key]
            if not (torch.equal(de, dc) and torch.equal(se, sc)):
                bad.append(f"step {step}: plane {key} bytes differ")
    return bad


# ---- one process, no FSDP ---------------------------------------------------------------------------
def compiled_model_vs_eager(recipe_name: str, device, fullgraph: bool = True,
                            eager_gemms: str | None = None) -> tuple[dict, dict, dict]:
    """``torch.compile(model, fullgraph=...)`` vs the eager model, from the same FP8 weights;
    also the compiled run's dynamo counters. ``eager_gemms``: the eager run under
    ``fp8_gemms(eager_gemms)`` (what the compiled run is expected to run instead of FP8 GEMMs)."""
    torch._dynamo.reset()
    runs = []
    for compiled in (False, True):
        torch._dynamo.utils.counters.clear()
        model = d.quantize_module_(block(device, 0), d.RECIPES[recipe_name])
        call = torch.compile(model, fullgraph=fullgraph) if compiled else model
        with _gemms(None if compiled else eager_gemms):
            runs.append(train(model, call, device))
    return runs[0], runs[1], _counters()


def _gemms(mode: str | None):
    import contextlib

    from dtensor_fp8 import gemm

    return gemm.fp8_gemms(mode) if mode is not None else contextlib.nullcontext()


def _counters() -> dict:
    counters = torch._dynamo.utils.counters
    return {"graph_breaks": sum(counters["graph_break"].values()), "unique_graphs": counters["stats"]["unique_graphs"],
            "break_reasons": sorted(counters["graph_break"])}


def quantize_compiled_vs_eager(recipe_name: str, device, dtype=torch.bfloat16) -> list[str]:
    """``torch.compile(dtensor_fp8.quantize, fullgraph=True)`` (the recipe's ``quantize_plane`` for
    every stored plane, traced) and a compiled ``dequantize`` of each usage (the recipe's
    ``dequantize_plane``) against eager: the names of what differs (none when bit-exact)."""
    torch._dynamo.reset()
    recipe = d.RECIPES[recipe_name]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(DIM, DIM, generator=g) * 2.0 ** torch.randint(-12, 12, (DIM, 1), generator=g).float()
    x[:128, :128] = 0  # a zero block: the scale rules for amax == 0
    x[5, 7], x[9, 200] = 1e30, -1e-30  # an outlier and a value far below every block's range
    x = x.to(device=device, dtype=dtype)
    kw = {"scale": torch.tensor(0.25, device=device)} if recipe_name == "delayed" else {}
    eager = d.quantize(x, recipe, **kw)
    comp = torch.compile(d.quantize, fullgraph=True)(x, recipe, **kw)
    if not isinstance(comp, d.QuantizedTensor) or comp.usages != eager.usages:
        return [f"compiled quantize returned {comp!r}"]
    bad = []
    for usage, plane in eager.planes.items():
        other = comp.planes[usage]
        if plane.scale_inv.dtype != other.scale_inv.dtype or not (
                torch.equal(as_bytes(plane.data), as_bytes(other.data))
                and torch.equal(as_bytes(plane.scale_inv), as_bytes(other.scale_inv))):
            bad.append(f"quantize: {usage} plane")

    def dequantize_each(q):
        return [q.dequantize(torch.float32, usage) for usage in q.usages]

    for usage, hp, ref in zip(eager.usages, torch.compile(dequantize_each, fullgraph=True)(eager),
                              dequantize_each(eager), strict=True):
        if not torch.equal(hp, ref):
            bad.append(f"dequantize: {usage}")
    return bad


def graph_breaks_of_model(recipe_name: str, device) -> tuple[int, int, list]:
    """``torch._dynamo.explain`` of a model with FP8 weights: (graphs, graph breaks, reasons)."""
    torch._dynamo.reset()
    model = d.quantize_module_(block(device, 0), d.RECIPES[recipe_name])
    x = torch.randn(8, DIM, device=device, requires_grad=True)
    explained = torch._dynamo.explain(model)(x)
    return explained.graph_count, explained.graph_break_count, [str(r.reason) for r in explained.break_reasons]


# ---- per-block compile under fully_shard (what torchtitan does) ------------------------------------------
def per_block_compile_vs_eager(recipe_name: str, style: str, device, fullgraph: bool = True,
                               eager_gemms: str | None = None, kind: str = "own") -> tuple[dict, dict, dict]:
    """Two blocks of ``kind`` (:data:`KINDS`), each ``fully_shard``-ed, then the root; the compiled
    run compiles each block first (``fullgraph=True`` unless told otherwise): ``style``
    ``"module.compile"`` (``block.compile()``) or ``"torch.compile"`` (``torch.compile(block)``, an
    ``OptimizedModule`` in the block's place). ``eager_gemms`` as for
    :func:`compiled_model_vs_eager`. Returns the eager and compiled records and the compiled
    blocks' dynamo counters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    recipe = d.RECIPES[recipe_name]
    mesh = init_device_mesh(torch.device(device).type, (torch.distributed.get_world_size(),))
    runs, counters = [], {}
    for compiled in (False, True):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model = nn.Sequential(block(device, 0, kind), block(device, 1, kind))
        if compiled and style == "torch.compile":
            # torch.compile(block) puts ``_orig_mod.`` into the parameter names, and the
            # optimizer looks the high-precision initial values up by name: quantize after it
            # (quantizing before loses them, see test_torch_compile_fqn_keeps_hp_init).
            for i in range(len(model)):
                model[i] = torch.compile(model[i], fullgraph=fullgraph)
        d.quantize_module_(model, recipe)
        for b in model:
            if compiled and style == "module.compile":
                b.compile(fullgraph=fullgraph)
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        seed = 1 + torch.distributed.get_rank()
        with _gemms(None if compiled else eager_gemms):
            runs.append(train(model, model, device, seed=seed))
        if compiled:
            counters = _counters()
    return runs[0], runs[1], counters
