"""Wire bytes and memory of FP8 parameters under FSDP2, measured on real ranks (CPU/gloo or GPU/NCCL).

    python -m dtensor_fp8.benchmarks wire   [--world-size 2] [--out DIR]
    python -m dtensor_fp8.benchmarks memory [--world-size 2] [--out DIR]

``wire``: bytes all-gathered per parameter per training step (forward + backward gathers,
``reshard_after_forward=True``), counted at the collective (:class:`dtensor_fp8.comm.CollectiveBytes`),
for every recipe and for the same model in bf16 under plain FSDP2.

``memory``: per rank, the bytes of the sharded parameters (every FP8 plane and scale, or the bf16
shard), of the FP32 masters and the optimizer state, and the process's peak resident memory
increase over one training step (``ru_maxrss``; each variant in a fresh process).
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

from ..formats import RECIPES


def _model(dim: int, layers: int, device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)]).to(device)


def _local_bytes(t: torch.Tensor) -> int:
    from dtensor_fp8 import QuantizedTensor

    t = t.to_local() if hasattr(t, "to_local") else t
    if isinstance(t, QuantizedTensor):
        return sum(x.numel() * x.element_size() for x in t.inner_tensors())
    return t.numel() * t.element_size()


def _run_variant(rank: int, world: int, store: str, variant: str, dim: int, layers: int, device_type: str, out: str):
    import dtensor_fp8 as d
    from dtensor_fp8.comm import CollectiveBytes
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=rank, world_size=world,
                            store=dist.FileStore(store, world), timeout=timedelta(seconds=300))
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    mesh = init_device_mesh(device_type, (world,))
    model = _model(dim, layers, device)
    numel = sum(p.numel() for p in model.parameters())
    if variant == "bf16":
        model = model.to(torch.bfloat16)
    else:
        d.quantize_module_(model, d.RECIPES[variant], keep_hp_init=False)
    for layer in model:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    if variant == "bf16":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = opt.step
    else:
        opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-3)
        step = opt.step
    x = torch.randn(16, dim, device=device, dtype=torch.bfloat16 if variant == "bf16" else torch.float32)
    model(x).float().sum().backward()  # lazy init + first step outside the count
    step()
    opt.zero_grad()
    with CollectiveBytes() as counted:
        model(x).float().sum().backward()
    step()
    opt.zero_grad()
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    params = sum(_local_bytes(p) for p in model.parameters())
    if variant == "bf16":
        masters = 0
        state = sum(_local_bytes(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    else:
        masters = sum(_local_bytes(m) for m in opt.masters.values())
        state = sum(_local_bytes(v) for s in opt.inner.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    result = {
        "variant": variant, "rank": rank, "world_size": world, "numel": numel,
        "wire_bytes_per_param_step": counted.received / numel,
        "sharded_param_bytes": params, "master_bytes": masters, "optimizer_state_bytes": state,
        "peak_rss_increase_bytes": (rss1 - rss0) * 1024,
    }
    if rank == 0:
        with open(os.path.join(out, f"{variant}.json"), "w") as f:
            json.dump(result, f)
    dist.barrier(group=dist.group.WORLD)
    dist.destroy_process_group()


def measure(world: int = 2, dim: int = 2048, layers: int = 4, device_type: str = "cpu") -> list[dict]:
    """Run every variant in fresh processes; return rank 0's measurements."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("bf16", *RECIPES):
            store = os.path.join(tmp, f"store_{variant}")
            torch.multiprocessing.spawn(_run_variant, args=(world, store, variant, dim, layers, device_type, tmp), nprocs=world)
            with open(os.path.join(tmp, f"{variant}.json")) as f:
                results.append(json.load(f))
    return results


def table(results: list[dict]) -> str:
    mib = 2**20
    lines = [
        "| variant | wire bytes / param / step | sharded params MiB / rank | masters MiB / rank | optimizer state MiB / rank | peak RSS increase MiB / rank |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['variant']} | {r['wire_bytes_per_param_step']:.4f} | {r['sharded_param_bytes'] / mib:.2f} | "
            f"{r['master_bytes'] / mib:.2f} | {r['optimizer_state_bytes'] / mib:.2f} | {r['peak_rss_increase_bytes'] / mib:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m dtensor_fp8.benchmarks wire|memory", description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", default="bench_out")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    results = measure(args.world_size, args.dim, args.layers, args.device)
    header = (f"# FSDP2 wire bytes and memory: {args.layers} x Linear({args.dim}, {args.dim}), "
              f"{args.world_size} {args.device} ranks, torch {torch.__version__}")
    print(header)
    print(table(results))
    path = os.path.join(args.out, "fsdp.json")
    with open(path, "w") as f:
        json.dump({"torch": torch.__version__, "world_size": args.world_size, "dim": args.dim,
                   "layers": args.layers, "device": args.device, "results": results}, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
