"""MoE expert weights: all-gather bytes per step, per-rank memory of build / save / load, and on
CUDA the layer's step time, FP8 experts (every recipe) against bf16 / fp32 experts.

    python -m dtensor_fp8.benchmarks moe [--shapes deepseek-v3,qwen3-moe] [--expert-divisor 1]
                                         [--dim-divisor 1] [--recipes ...] [--parts wire,memory,step]
                                         [--tokens 256] [--worlds 1,2,4] [--ep 1] [--out DIR]

The layer (``moe_model.py``): a router and torchtitan-style grouped experts of a real model's
expert dims (``SHAPES``: DeepSeek-V3, Qwen3-30B-A3B), scaled down with ``--expert-divisor`` /
``--dim-divisor`` for CPU runs. Every rank in a fresh process, real process groups (gloo on the
CPU, NCCL with ``--device cuda``):

* ``wire``: bytes each rank receives from all-gathers in one forward + backward
  (``reshard_after_forward=True``: one gather per direction), counted at the collective
  (:class:`dtensor_fp8.comm.CollectiveBytes`), at FSDP2 over 2 and 4 ranks and at expert
  parallelism 2 x FSDP2 2 (experts ``Shard(0)`` over ``ep``, FSDP2 over ``efsdp``), against the
  same layer with bf16 experts. Built as a model larger than a rank is: meta device, quantize,
  shard, ``to_empty``, init, optimizer (``moe_memory.py``).
* ``memory`` (``moe_memory.py``): per-rank peak of that build, of a DCP save of the model and
  optimizer state, and of a fresh build plus DCP load, at world 1, 2 and 4 (``--worlds``), FSDP2
  alone or expert parallelism ``--ep`` x FSDP2.
* ``step`` (CUDA, ``moe_step.py``): forward + backward time of the layer with bf16 experts
  (``torch._grouped_mm``), our FP8 experts per recipe, and torchao's MXFP8 grouped experts where
  torchao imports.

Prints a table per part and writes ``moe.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

from .moe_model import SHAPES, build, init_ranks, mesh_for, refusal, scaled

#: (layout, world size, ep degree): the layouts the ``wire`` part measures.
WIRE_LAYOUTS = (("fsdp", 2, 1), ("fsdp", 4, 1), ("ep_fsdp", 4, 2))
#: Issue 48's bounds on expert all-gather bytes against bf16's.
BOUNDS = {"delayed": 0.55, "current": 0.55, "blockwise2d": 0.55, "mxfp8": 0.62, "blockwise1d": 0.62}


def received_per_step(variant: str, dims, layout: str, ep: int, tokens: int) -> int:
    """On every rank of the default process group: build the layer in ``layout`` and count the
    bytes this rank receives from all-gathers in its second forward + backward (the first one
    lazily initializes FSDP2). Returns this rank's count.

    Example:
        >>> received_per_step("mxfp8", scaled("qwen3-moe", 16, 8), "ep_fsdp", 2, 64)   # on 4 ranks
    """
    from dtensor_fp8.comm import CollectiveBytes

    world = dist.get_world_size(group=dist.group.WORLD)
    device_type = "cuda" if torch.cuda.is_available() and dist.get_backend(group=dist.group.WORLD) == "nccl" else "cpu"
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    mesh = mesh_for(layout, world, ep, device_type)
    model, _ = build(variant, dims, layout, mesh, ep, device)
    g = torch.Generator().manual_seed(dist.get_rank(group=dist.group.WORLD))
    x = torch.randn(tokens, dims[1], generator=g).to(device)
    model(x).float().pow(2).mean().backward()  # lazy init outside the count
    with CollectiveBytes() as counted:
        model(x).float().pow(2).mean().backward()
    return counted.received


def _wire_rank(rank, world, store, variant, dims, layout, ep, tokens, device_type, out):
    init_ranks(rank, world, store, device_type)
    received = [None] * world
    dist.all_gather_object(received, received_per_step(variant, dims, layout, ep, tokens), group=dist.group.WORLD)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(received, f)
    dist.barrier(group=dist.group.WORLD)
    dist.destroy_process_group()


def wire_row(shape: str, dims, layout: str, world: int, ep: int, variant: str, received: list[int] | None) -> dict:
    """A ``wire`` table row: the layout, the variant and each rank's received bytes (``None``:
    the recipe refuses the shape, the row says why)."""
    return {"shape": shape, "layout": layout, "world_size": world, "ep": ep, "fsdp": world // ep, "variant": variant,
            "expert_numel": 3 * dims[0] * dims[1] * dims[2], "refused": refusal(variant, dims),
            "received_bytes_per_rank": received}


def add_ratios(rows: list[dict]) -> list[dict]:
    """Each row's max-over-ranks bytes against bf16's row of the same layout (``vs_bf16``)."""
    for row in rows:
        base = next(r for r in rows if r["layout"] == row["layout"] and r["world_size"] == row["world_size"]
                    and r["shape"] == row["shape"] and r["variant"] == "bf16")
        if row.get("received_bytes_per_rank"):
            row["vs_bf16"] = max(row["received_bytes_per_rank"]) / max(base["received_bytes_per_rank"])
    return rows


def measure_wire(shape: str, dims, variants, tokens: int, device_type: str = "cpu", layouts=WIRE_LAYOUTS) -> list[dict]:
    """Expert all-gather bytes per step of every rank, every variant and layout (fresh processes)."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layout, world, ep in layouts:
            for variant in ("bf16", *variants):
                received, error = None, None
                if refusal(variant, dims) is None:
                    out = os.path.join(tmp, f"{layout}-{world}-{variant}.json")
                    try:
                        torch.multiprocessing.spawn(
                            _wire_rank, args=(world, os.path.join(tmp, f"store-{layout}-{world}-{variant}"), variant,
                                              dims, layout, ep, tokens, device_type, out), nprocs=world)
                        with open(out) as f:
                            received = json.load(f)
                    except torch.multiprocessing.ProcessRaisedException as e:  # the row says why, the rest run
                        error = str(e).strip().splitlines()[-1][:300]
                rows.append({**wire_row(shape, dims, layout, world, ep, variant, received), "error": error})
    return add_ratios(rows)


def wire_table(rows: list[dict]) -> str:
    mib = 2**20
    lines = ["| shape | layout | ranks | experts | MiB gathered / step / rank | vs bf16 | bound |",
             "|---|---|---:|---|---:|---:|---:|"]
    for r in rows:
        layout = "FSDP2" if r["layout"] == "fsdp" else f"EP {r['ep']} x FSDP2 {r['fsdp']}"
        if r["refused"] or r.get("error"):
            why = f"refused: {r['refused']}" if r["refused"] else f"error: {r['error']}"
            lines.append(f"| {r['shape']} | {layout} | {r['world_size']} | {r['variant']} | {why[:160]} | | |")
            continue
        bound = BOUNDS.get(r["variant"])
        lines.append(f"| {r['shape']} | {layout} | {r['world_size']} | {r['variant']} | "
                     f"{max(r['received_bytes_per_rank']) / mib:.3f} | {r['vs_bf16']:.3f}x | "
                     f"{'' if bound is None else ('<= ' if r['vs_bf16'] <= bound else 'ABOVE ') + str(bound)} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m dtensor_fp8.benchmarks moe", description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--expert-divisor", type=int, default=1, help="divide the routed expert count (CPU runs)")
    p.add_argument("--dim-divisor", type=int, default=1, help="divide the model and expert hidden dims (CPU runs)")
    p.add_argument("--recipes", default="delayed,current,mxfp8,blockwise1d,blockwise2d")
    p.add_argument("--parts", default="wire,memory", help="wire, memory, step (CUDA)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank (wire, step)")
    p.add_argument("--worlds", default="1,2,4", help="world sizes of the memory part")
    p.add_argument("--ep", type=int, default=1,
                   help="memory part: expert parallelism degree (EP ep x FSDP2 world/ep; 1: FSDP2 alone)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", default="bench_out")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    recipes = [r for r in args.recipes.split(",") if r]
    parts = args.parts.split(",")
    report = {"torch": torch.__version__, "device": args.device, "expert_divisor": args.expert_divisor,
              "dim_divisor": args.dim_divisor, "tokens": args.tokens, "shapes": {}}
    for shape in args.shapes.split(","):
        dims = scaled(shape, args.expert_divisor, args.dim_divisor)
        entry = report["shapes"][shape] = {"experts": dims[0], "dim": dims[1], "hidden": dims[2], "top_k": dims[3]}
        print(f"# {shape}: {dims[0]} experts, dim {dims[1]}, hidden {dims[2]}, top-{dims[3]} "
              f"(/{args.expert_divisor} experts, /{args.dim_divisor} dims), torch {torch.__version__}, {args.device}")
        if "wire" in parts:
            entry["wire"] = measure_wire(shape, dims, recipes, args.tokens, args.device)
            print(wire_table(entry["wire"]))
        if "memory" in parts:
            from . import moe_memory

            entry["memory"] = moe_memory.measure(shape, dims, recipes, [int(w) for w in args.worlds.split(",")], args.ep)
            print(moe_memory.table(entry["memory"]))
        if "step" in parts:
            from . import moe_step

            entry["step"] = moe_step.measure(dims, recipes, args.tokens)
            print(moe_step.table(entry["step"]))
    path = os.path.join(args.out, "moe.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
