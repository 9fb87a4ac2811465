"""Per-rank peak memory of building a model larger than one rank: build + shard + init +
optimizer + one step, FP8 parameters against the same model's FP32 parameters under FSDP2.

    python -m dtensor_fp8.benchmarks build [--worlds 1,2,4] [--dim 4096] [--layers 16]
                                           [--recipes current,mxfp8,blockwise2d] [--flows meta] [--out DIR]

Flows, each rank in a fresh process (CPU / gloo):

* ``fp32_meta``: FSDP2's own meta flow with FP32 parameters: build on the meta device,
  ``fully_shard`` each layer and the root, ``to_empty``, ``reset_parameters()``, ``torch.optim.AdamW``,
  one step. The reference: its peak falls as 1 / world.
* ``<recipe>_meta``: the same flow with ``quantize_module_`` before ``fully_shard`` and
  :class:`~dtensor_fp8.MasterWeightOptimizer` (AdamW, FP32 masters): no rank holds more than its
  shards. Goal: at most 1.10x ``fp32_meta`` at every world size.
* ``<recipe>_materialized`` (``--flows meta,materialized``): the model built and initialized whole on
  every rank, then quantized (``keep_hp_init=True``) and sharded: what the meta flow replaces.

Peak memory is the process's peak resident set (``ru_maxrss``) minus its resident set after
``import torch`` and the process group's start: everything the flow allocated at its peak.

[Note: measuring peak memory on the CPU]
torch's CPU tensors come from glibc's ``malloc``, whose mmap threshold grows with every large block
freed (up to 32 MiB): after a few steps, transients below it (a shard's dequantized or requantized
copy, 16 MiB at 4 ranks) are carved from the heap and stay resident after they are freed, so the
resident set reports fragmentation, not memory in use (at 1 rank, 8 x 4096^2: live tensors 2.14 GiB
for FP8 against 2.00 for FP32, resident 2.94 against 2.38). By default the ranks run with
``MALLOC_MMAP_THRESHOLD_=65536`` (``--malloc fixed``): every large block is mapped and returned when
freed, for both flows alike, and the peak resident set is the peak of memory in use (the
measurement CUDA's ``max_memory_allocated`` gives on a GPU). ``--malloc default`` keeps glibc's
behaviour.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

GOAL = 1.10


def _model(dim: int, layers: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)])


def _run(rank: int, world: int, store: str, flow: str, dim: int, layers: int, out: str) -> None:
    import dtensor_fp8 as d
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", rank=rank, world_size=world, store=dist.FileStore(store, world),
                            timeout=timedelta(seconds=600))
    mesh = init_device_mesh("cpu", (world,))
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    recipe_name, how = flow.rsplit("_", 1)
    torch.manual_seed(0)
    if how == "materialized":
        model = _model(dim, layers)  # whole, initialized by nn.Linear's own reset_parameters()
        d.quantize_module_(model, d.RECIPES[recipe_name])
    else:
        with torch.device("meta"):
            model = _model(dim, layers)
        if recipe_name != "fp32":
            d.quantize_module_(model, d.RECIPES[recipe_name])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if how == "meta":
        model.to_empty(device="cpu")
        for layer in model:
            layer.reset_parameters()  # the user's init, on this rank's shards only
    if recipe_name == "fp32":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-3)
    x = torch.randn(8, dim)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peaks = [None] * world
    dist.all_gather_object(peaks, (rss1 - rss0) * 1024, group=dist.group.WORLD)
    if rank == 0:
        numel = dim * dim * layers
        with open(os.path.join(out, f"{flow}-{world}.json"), "w") as f:
            json.dump({"flow": flow, "world_size": world, "numel": numel, "peak_bytes_per_rank": peaks}, f)
    dist.barrier(group=dist.group.WORLD)
    dist.destroy_process_group()


def measure(worlds, flows, dim: int, layers: int, malloc: str = "fixed") -> list[dict]:
    """Every flow at every world size, in fresh processes; rank 0's gathered peaks (see the note
    for ``malloc``)."""
    if malloc == "fixed":  # read by glibc when each spawned rank starts
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in worlds:
            for flow in flows:
                store = os.path.join(tmp, f"store-{flow}-{world}")
                torch.multiprocessing.spawn(_run, args=(world, store, flow, dim, layers, tmp), nprocs=world)
                with open(os.path.join(tmp, f"{flow}-{world}.json")) as f:
                    results.append({**json.load(f), "malloc": malloc})
    return results


def table(results: list[dict]) -> str:
    """A markdown table: max per-rank peak per flow and world, and its ratio to ``fp32_meta``."""
    gib = 2**30
    ref = {r["world_size"]: max(r["peak_bytes_per_rank"]) for r in results if r["flow"] == "fp32_meta"}
    lines = ["| flow | world | peak GiB / rank (max over ranks) | vs fp32_meta | goal |", "|---|---:|---:|---:|---|"]
    for r in results:
        peak = max(r["peak_bytes_per_rank"])
        base = ref.get(r["world_size"])
        ratio = peak / base if base else float("nan")
        goal = "" if r["flow"] == "fp32_meta" or not r["flow"].endswith("_meta") else (
            "met" if ratio <= GOAL else "missed")
        lines.append(f"| {r['flow']} | {r['world_size']} | {peak / gib:.2f} | {ratio:.2f}x | {goal} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m dtensor_fp8.benchmarks build", description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--recipes", default="current,mxfp8,blockwise2d")
    p.add_argument("--flows", default="meta", help="meta, or meta,materialized")
    p.add_argument("--malloc", choices=["fixed", "default"], default="fixed",
                   help="glibc's mmap threshold: fixed at 64 KiB (peak of memory in use) or glibc's default")
    p.add_argument("--out", default="bench_out")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    worlds = [int(w) for w in args.worlds.split(",")]
    hows = args.flows.split(",")
    flows = ["fp32_meta"] + [f"{r}_{h}" for h in hows for r in args.recipes.split(",")]
    results = measure(worlds, flows, args.dim, args.layers, args.malloc)
    print(f"# build + shard + init + optimizer + one step: {args.layers} x Linear({args.dim}, {args.dim}) "
          f"({args.layers * args.dim * args.dim * 4 / 2**30:.2f} GiB in FP32), CPU / gloo, malloc {args.malloc}, "
          f"torch {torch.__version__}")
    print(table(results))
    path = os.path.join(args.out, "build.json")
    with open(path, "w") as f:
        json.dump({"torch": torch.__version__, "dim": args.dim, "layers": args.layers, "goal": GOAL,
                   "malloc": args.malloc, "results": results}, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
