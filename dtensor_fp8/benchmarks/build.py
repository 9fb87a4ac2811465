"""Per-rank peak memory of building a model larger than one rank: build + shard + init +
optimizer + one step, FP8 parameters against the same model's FP32 parameters under FSDP2.

    python -m dtensor_fp8.benchmarks build [--worlds 1,2,4] [--dim 4096] [--layers 16]
                                           [--recipes current,mxfp8,blockwise2d] [--flows meta] [--out DIR]
                                           [--dump-stacks-after S]

Flows, each rank in a fresh process (CPU / gloo):

* ``fp32_meta``: FSDP2's own meta flow with FP32 parameters: build on the meta device,
  ``fully_shard`` each layer and the root, ``to_empty``, ``reset_parameters()``, ``torch.optim.AdamW``,
  one step. The reference: its peak falls as 1 / world.
* ``<recipe>_meta``: the same flow with ``quantize_module_`` before ``fully_shard`` and
  :class:`~dtensor_fp8.MasterWeightOptimizer` (AdamW, FP32 masters): no rank holds more than its
  shards. Goal: at most 1.10x ``fp32_meta`` at every world size.
* ``<recipe>_materialized`` (``--flows meta,materialized``): the model built and initialized whole on
  every rank, then quantized (``keep_hp_init=True``) and sharded: what the meta flow replaces.

Each flow also reports its wall time (the ranks' spawn to their exit, as the parent sees it) and
rank 0's time in each phase (``start``: the spawn to the rank's function, the interpreter and its
imports; ``process_group``; ``build`` on meta and ``quantize_module_``; ``fully_shard``; ``to_empty``;
``init``; ``optimizer`` (the FP8 bytes are made here); ``fwd_bwd``; ``step``; ``teardown``: the peaks'
gather, a barrier and ``destroy_process_group``). Ranks do
not synchronize between phases, so a phase that waits on a slower rank's collective carries the
wait; on a shared machine the times move with load, the memory does not. ``--dump-stacks-after S``
makes every rank write all its threads' Python stacks to ``DIR/stacks-<flow>-<world>-<rank>.txt``
every ``S`` seconds (``faulthandler``): where a run that does not finish is.

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
import faulthandler
import json
import os
import resource
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

GOAL = 1.10


def _model(dim: int, layers: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)])


def _run(rank: int, world: int, store: str, flow: str, dim: int, layers: int, out: str,
         dump_stacks_after: float = 0.0, spawned_at: float = 0.0) -> None:
    entered = time.time()
    import dtensor_fp8 as d
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if dump_stacks_after > 0:
        stacks = open(os.path.join(out, f"stacks-{flow}-{world}-{rank}.txt"), "w")  # noqa: SIM115 (kept open for the dumps)
        faulthandler.dump_traceback_later(dump_stacks_after, repeat=True, file=stacks)
    dist.init_process_group("gloo", rank=rank, world_size=world, store=dist.FileStore(store, world),
                            timeout=timedelta(seconds=600))
    mesh = init_device_mesh("cpu", (world,))
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    recipe_name, how = flow.rsplit("_", 1)
    # Wall-clock stamps, comparable with the parent's: the process start and imports, then the
    # process group's start, then each phase.
    phases: dict[str, float] = {"start": round(entered - spawned_at, 3), "process_group": round(time.time() - entered, 3)}
    last = time.perf_counter()

    def phase(name: str) -> None:
        nonlocal last
        now = time.perf_counter()
        phases[name] = round(now - last, 3)
        last = now

    torch.manual_seed(0)
    if how == "materialized":
        model = _model(dim, layers)  # whole, initialized by nn.Linear's own reset_parameters()
        d.quantize_module_(model, d.RECIPES[recipe_name])
    else:
        with torch.device("meta"):
            model = _model(dim, layers)
        if recipe_name != "fp32":
            d.quantize_module_(model, d.RECIPES[recipe_name])
    phase("build")
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    phase("fully_shard")
    if how == "meta":
        model.to_empty(device="cpu")
        phase("to_empty")
        for layer in model:
            layer.reset_parameters()  # the user's init, on this rank's shards only
        phase("init")
    if recipe_name == "fp32":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-3)
    phase("optimizer")
    x = torch.randn(8, dim)
    model(x).pow(2).mean().backward()
    phase("fwd_bwd")
    opt.step()
    opt.zero_grad()
    phase("step")
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peaks = [None] * world
    dist.all_gather_object(peaks, (rss1 - rss0) * 1024, group=dist.group.WORLD)
    dist.barrier(group=dist.group.WORLD)
    dist.destroy_process_group()
    phase("teardown")
    if rank == 0:
        numel = dim * dim * layers
        with open(os.path.join(out, f"{flow}-{world}.json"), "w") as f:
            json.dump({"flow": flow, "world_size": world, "numel": numel, "peak_bytes_per_rank": peaks,
                       "rank0_phase_s": phases}, f)


def measure(worlds, flows, dim: int, layers: int, malloc: str = "fixed", out: str | None = None,
            dump_stacks_after: float = 0.0) -> list[dict]:
    """Every flow at every world size, in fresh processes, one after another; rank 0's gathered
    peaks and phase times, and the flow's wall time (see the note for ``malloc``; the ranks'
    stack dumps go to ``out``)."""
    if malloc == "fixed":  # read by glibc when each spawned rank starts
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in worlds:
            for flow in flows:
                store = os.path.join(tmp, f"store-{flow}-{world}")
                start, load = time.perf_counter(), os.getloadavg()[0]
                torch.multiprocessing.spawn(
                    _run, args=(world, store, flow, dim, layers, out or tmp, dump_stacks_after, time.time()), nprocs=world)
                wall = time.perf_counter() - start
                with open(os.path.join(out or tmp, f"{flow}-{world}.json")) as f:
                    results.append({**json.load(f), "malloc": malloc, "wall_s": round(wall, 1),
                                    "load_avg_1min": [load, os.getloadavg()[0]]})
                print(f"{flow} world {world}: {wall:.1f} s", flush=True)
    return results


def table(results: list[dict]) -> str:
    """A markdown table: max per-rank peak per flow and world, its ratio to ``fp32_meta``, and the
    flow's wall time and its ratio to ``current_meta``'s at the same world size."""
    gib = 2**30
    ref = {r["world_size"]: max(r["peak_bytes_per_rank"]) for r in results if r["flow"] == "fp32_meta"}
    ref_s = {r["world_size"]: r.get("wall_s") for r in results if r["flow"] == "current_meta"}
    lines = ["| flow | world | peak GiB / rank (max over ranks) | vs fp32_meta | goal | wall s | vs current_meta |",
             "|---|---:|---:|---:|---|---:|---:|"]
    for r in results:
        peak = max(r["peak_bytes_per_rank"])
        base = ref.get(r["world_size"])
        ratio = peak / base if base else float("nan")
        goal = "" if r["flow"] == "fp32_meta" or not r["flow"].endswith("_meta") else (
            "met" if ratio <= GOAL else "missed")
        wall, base_s = r.get("wall_s"), ref_s.get(r["world_size"])
        vs_s = f"{wall / base_s:.2f}x" if wall and base_s else ""
        lines.append(f"| {r['flow']} | {r['world_size']} | {peak / gib:.2f} | {ratio:.2f}x | {goal} | "
                     f"{'' if wall is None else f'{wall:.1f}'} | {vs_s} |")
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
    p.add_argument("--dump-stacks-after", type=float, default=0.0, metavar="S",
                   help="every rank writes its Python stacks to OUT/stacks-<flow>-<world>-<rank>.txt every S seconds (0: off)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    worlds = [int(w) for w in args.worlds.split(",")]
    hows = args.flows.split(",")
    flows = ["fp32_meta"] + [f"{r}_{h}" for h in hows for r in args.recipes.split(",")]
    results = measure(worlds, flows, args.dim, args.layers, args.malloc, args.out, args.dump_stacks_after)
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
