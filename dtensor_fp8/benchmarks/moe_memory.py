"""The ``memory`` part of ``python -m dtensor_fp8.benchmarks moe``: per-rank peak memory of building,
saving and loading MoE expert weights under FSDP2 (or expert parallelism x FSDP2, ``--ep``), FP8
experts against fp32 / bf16 experts.

Two fresh processes per (variant, world size), every rank on the CPU over gloo:

* ``save``: the build of ``moe.build`` (meta device, quantize, experts ``Shard(0)`` over ``ep`` when
  ``ep > 1``, ``fully_shard``, ``to_empty``, init
  on each rank's shards, the optimizer: for FP8, ``MasterWeightOptimizer`` makes the fp32 masters
  and the FP8 bytes there), its peak read (``build``), then a DCP save of the model's and the
  optimizer's state dicts (``get_state_dict``, ``dtensor_fp8.save_checkpoint``) and the peak again
  (``save``: the build's peak or the save's, whichever is higher);
* ``load``: the same build, then ``load_checkpoint`` of that checkpoint and ``set_state_dict``
  (``load``: the peak over both).

No rank holds more than its shards at any point: the model is never whole in memory. Peaks are
the process's peak resident set (``ru_maxrss``) above its resident set after the process group
started, with glibc's mmap threshold fixed at 64 KiB (see the note in ``build.py``: freed blocks go
back, so the peak is the peak of memory in use). What the checkpoint holds is read from the disk:
FP8 planes and scales plus fp32 masters for FP8 experts, the weights alone for fp32 / bf16 experts
(AdamW keeps no state before its first step).
"""

from __future__ import annotations

import json
import os
import resource
import tempfile

import torch
import torch.distributed as dist


def _peak(rss0: int) -> int:
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024


def _rank(rank, world, store, variant, dims, ckpt, phase, out, ep=1):
    import dtensor_fp8 as d
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from .moe_model import build, init_ranks, mesh_for

    import torch.distributed.checkpoint  # noqa: F401  imported before the baseline: modules are not the flow's
    import torch.distributed.fsdp  # noqa: F401

    init_ranks(rank, world, store, "cpu")
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    layout = "fsdp" if ep == 1 else "ep_fsdp"
    model, opt = build(variant, dims, layout, mesh_for(layout, world, ep, "cpu"), ep, torch.device("cpu"))
    peaks = {"build": _peak(rss0)}
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    if phase == "save":
        d.save_checkpoint(state, ckpt, 0)
        peaks["save"] = _peak(rss0)
    else:
        d.load_checkpoint(state, d.latest_checkpoint(ckpt))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        peaks["load"] = _peak(rss0)
    gathered = [None] * world
    dist.all_gather_object(gathered, peaks, group=dist.group.WORLD)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.barrier(group=dist.group.WORLD)
    dist.destroy_process_group()


def _disk_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(dirpath, f)) for dirpath, _, files in os.walk(root) for f in files)


def measure(shape: str, dims, recipes, worlds, ep: int = 1) -> list[dict]:
    """Peaks per rank of build, save and load for fp32, bf16 and every recipe at each world size
    (``ep > 1``: expert parallelism ``ep`` x FSDP2 ``world / ep``; every world a multiple of ``ep``)."""
    from .moe_model import refusal

    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by glibc as each spawned rank starts
    rows = []
    numel = 3 * dims[0] * dims[1] * dims[2]
    for world in worlds:
        if world % ep or dims[0] % world:
            raise ValueError(f"moe memory: world size {world} with --ep {ep}: the world must be a multiple of the EP "
                             f"degree and divide the {dims[0]} experts; pick --worlds accordingly")
    with tempfile.TemporaryDirectory() as tmp:
        for world in worlds:
            for variant in ("fp32", "bf16", *recipes):
                row = {"shape": shape, "world_size": world, "ep": ep, "variant": variant, "expert_numel": numel,
                       "refused": refusal(variant, dims)}
                rows.append(row)
                if row["refused"]:
                    continue
                ckpt = os.path.join(tmp, f"ckpt-{world}-{variant}")
                for phase in ("save", "load"):
                    out = os.path.join(tmp, f"{phase}-{world}-{variant}.json")
                    torch.multiprocessing.spawn(_rank, args=(world, os.path.join(tmp, f"store-{phase}-{world}-{variant}"),
                                                             variant, dims, ckpt, phase, out, ep), nprocs=world)
                    with open(out) as f:
                        per_rank = json.load(f)
                    for key in per_rank[0]:
                        row.setdefault(f"{key}_peak_bytes_per_rank", [p[key] for p in per_rank])
                row["checkpoint_bytes"] = _disk_bytes(ckpt)
    return rows


def table(rows: list[dict]) -> str:
    """Max over ranks of each peak, and its ratio to the fp32 flow's at the same world size."""
    mib = 2**20
    ref = {r["world_size"]: r for r in rows if r["variant"] == "fp32"}
    lines = ["| shape | layout | ranks | experts | build MiB / rank | vs fp32 | save MiB / rank | vs fp32 | load MiB / rank | vs fp32 | checkpoint MiB |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ep = r.get("ep", 1)
        layout = "FSDP2" if ep == 1 else f"EP {ep} x FSDP2 {r['world_size'] // ep}"
        if r["refused"]:
            lines.append(f"| {r['shape']} | {layout} | {r['world_size']} | {r['variant']} | refused: {r['refused'][:80]} | | | | | | |")
            continue
        cells = []
        for key in ("build", "save", "load"):
            peak, base = max(r[f"{key}_peak_bytes_per_rank"]), max(ref[r["world_size"]][f"{key}_peak_bytes_per_rank"])
            cells += [f"{peak / mib:.1f}", f"{peak / base:.2f}x"]
        lines.append(f"| {r['shape']} | {layout} | {r['world_size']} | {r['variant']} | {' | '.join(cells)} | "
                     f"{r['checkpoint_bytes'] / mib:.1f} |")
    return "\n".join(lines)
