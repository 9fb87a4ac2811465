"""Cost of checkpoint checksums on save and load, against DCP's own save / load time.

    python -m dtensor_fp8.benchmarks checkpoint [--gib 1.0] [--world-size 2] [--reps 3] [--out DIR]

A state dict shaped like an FP8 training checkpoint (per weight: rowwise + columnwise FP8 bytes as
uint8, E8M0 scales, FP32 master, two AdamW moments, a step counter; plus plain values), ``--gib``
in all, as DTensors sharded over ``--world-size`` CPU ranks (gloo). Per repetition, into a fresh
directory (loads read what the save just wrote: the page cache, as a resume right after a save):

- ``dcp``: ``dcp.save`` / ``dcp.load`` with DCP's defaults (FileSystemWriter with fsync,
  DefaultLoadPlanner) -- DCP's own time (the variants alternate which runs first);
- ``checksums``: the same calls with dtensor_fp8's writer + planner (a checksum per stored item,
  ``checksums.json``) and reader (allow-list metadata, every item verified);
- ``reader, no verify``: that reader without checksums (its read loop alone);
- ``checksum compute``: the checksums of the rank's own items computed alone (no I/O), the save's
  cost itself (timing differences of whole saves are noisy); on load the checksum is taken during
  the copy into the target (``copy_with_checksum``, numpy, one thread): its cost is that pass minus
  the same copy without sums (``np.copyto``);
- ``save_checkpoint`` / ``load_checkpoint``: the whole atomic save / checked load.

Times are the slowest rank's (each operation between barriers, after an ``os.sync()`` before each
save so that one save's writeback does not land on the next one's fsyncs), medians over ``--reps``. The same
data is hashed with ``zlib.crc32``, ``zlib.adler32`` and ``hashlib.sha256`` for comparison. Writes
``--out/checkpoint.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
import zlib
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

DIM = 2048  # weights of DIM x DIM
BYTES_PER_WEIGHT_ELEMENT = 2 + 4 + 4 + 4  # rowwise + columnwise FP8, FP32 master, exp_avg, exp_avg_sq


def _state(gib: float, mesh) -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    weights = max(1, round(gib * 2**30 / (DIM * DIM * BYTES_PER_WEIGHT_ELEMENT)))
    g = torch.Generator().manual_seed(0)
    shard = [Shard(0)]

    def dt(t, placements=shard):
        return distribute_tensor(t, mesh, placements, src_data_rank=None)

    model, optim = {}, {}
    for i in range(weights):
        rows = torch.randint(0, 256, (DIM, DIM), dtype=torch.uint8, generator=g)
        model[f"layers.{i}.weight"] = {
            "rowwise_data": dt(rows), "rowwise_scale_inv": dt(torch.randint(100, 140, (DIM, DIM // 32), dtype=torch.uint8)),
            "columnwise_data": dt(rows.t().contiguous()),
            "columnwise_scale_inv": dt(torch.randint(100, 140, (DIM // 32, DIM), dtype=torch.uint8)),
            "recipe": '{"recipe": "MXFP8", "format": 1, "fp8_dtype": "float8_e4m3fn"}',
        }
        optim[f"layers.{i}.weight"] = {
            "master": dt(torch.randn(DIM, DIM, generator=g)), "exp_avg": dt(torch.randn(DIM, DIM, generator=g) * 1e-3),
            "exp_avg_sq": dt(torch.rand(DIM, DIM, generator=g) * 1e-6), "step": dt(torch.tensor(100.0), [Replicate()]),
        }
    return {"model": model, "optim": {"state": optim, "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.95),
                                                                         "weight_decay": 0.1, "params": sorted(optim)}]},
            "step": 100, "scheduler": {"last_epoch": 100, "base_lrs": [1e-3]}}


def _local_tensors(obj):
    from torch.distributed.tensor import DTensor

    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _local_tensors(v)]
    if isinstance(obj, list):
        return [t for v in obj for t in _local_tensors(v)]
    if isinstance(obj, DTensor):
        return [obj.to_local()]
    return [obj] if isinstance(obj, torch.Tensor) else []


def _fresh_like(state):
    if isinstance(state, dict):
        return {k: _fresh_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_fresh_like(v) for v in state]
    return torch.empty_like(state) if isinstance(state, torch.Tensor) else state


def _timed(fn, sync: bool) -> float:
    if sync:  # earlier saves' writeback must not land on this one's fsyncs
        os.sync()
    dist.barrier(group=dist.group.WORLD)
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=dist.group.WORLD)
    return float(elapsed)


def _worker(rank: int, world: int, store: str, gib: float, reps: int, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import dtensor_fp8 as d
    from dtensor_fp8.checkpoint.checksum import copy_with_checksum, tensor_checksum
    from dtensor_fp8._compat import flatten_state_dict
    from dtensor_fp8.checkpoint.dcp_io import SafeFileSystemReader, SafeLoadPlanner, read_metadata
    from dtensor_fp8.checkpoint.dcp_write import ChecksumFileSystemWriter, ChecksumSavePlanner
    from dtensor_fp8.checkpoint.checksum import read_checksums

    warnings.filterwarnings("ignore")  # DCP's overwrite / planner notices
    dist.init_process_group("gloo", rank=rank, world_size=world, store=dist.FileStore(store, world),
                            timeout=timedelta(seconds=600))
    mesh = init_device_mesh("cpu", (world,))
    state = _state(gib, mesh)
    local = _local_tensors(state)
    local_bytes = sum(t.numel() * t.element_size() for t in local)
    contiguous = [t.contiguous() for t in local]
    buffers = [torch.ones_like(t) for t in contiguous]  # touched: no page faults in the timing
    total = torch.tensor(local_bytes, dtype=torch.float64)
    dist.all_reduce(total, group=dist.group.WORLD)
    work = os.path.join(out, "work")
    times: dict[str, list[float]] = {}

    def record(name, fn):
        times.setdefault(name, []).append(_timed(fn, sync=name.endswith("save") or name == "save_checkpoint"))

    def flat_fresh():
        return flatten_state_dict(_fresh_like(state))[0]

    for rep in range(reps):
        if rank == 0:
            shutil.rmtree(work, ignore_errors=True)
            os.makedirs(work)
        dist.barrier(group=dist.group.WORLD)
        plain, summed, root = (os.path.join(work, n) for n in ("plain", "summed", "atomic"))
        saves = [("dcp save", lambda: dcp.save(state, checkpoint_id=plain)),
                 ("checksums save", lambda: dcp.save(state, storage_writer=ChecksumFileSystemWriter(summed),
                                                     planner=ChecksumSavePlanner()))]
        for name, fn in saves[::1 if rep % 2 == 0 else -1]:  # alternate which goes first
            record(name, fn)
        record("checksum compute", lambda: [tensor_checksum(t) for t in local])
        # on load the checksum is taken while DCP's copy into the target runs (copy_with_checksum):
        # its cost is that pass minus the plain copy
        record("copy", lambda: [np.copyto(b.view(-1).view(torch.uint8).numpy(), t.view(-1).view(torch.uint8).numpy())
                                for t, b in zip(contiguous, buffers)])  # the same one-thread copy, no sums
        record("copy with checksum", lambda: [copy_with_checksum(t, b) for t, b in zip(contiguous, buffers)])
        metadata, checksums = read_metadata(summed), read_checksums(summed)
        loads = [
            ("dcp load", lambda: _fresh_like(state), lambda t: dcp.load(t, checkpoint_id=plain)),
            ("reader, no verify load", flat_fresh, lambda t: dcp.load(
                t, storage_reader=SafeFileSystemReader(summed, metadata=metadata), planner=SafeLoadPlanner())),
            ("checksums load", flat_fresh, lambda t: dcp.load(
                t, storage_reader=SafeFileSystemReader(summed, metadata=metadata, checksums=checksums),
                planner=SafeLoadPlanner())),
        ]
        for name, make, fn in loads[::1 if rep % 2 == 0 else -1]:
            target = make()
            record(name, lambda: fn(target))
        record("save_checkpoint", lambda: d.save_checkpoint(state, root, 100))
        target = _fresh_like(state)
        record("load_checkpoint", lambda: d.load_checkpoint(target, d.latest_checkpoint(root)))
        del target

    hashes = {}
    if rank == 0:  # stdlib hashes of the same bytes, one thread (as a save or load would run them)
        views = [memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()) for t in local]
        for name, fn in (("blocksum-sha256 (ours)", None), ("zlib.crc32", zlib.crc32), ("zlib.adler32", zlib.adler32),
                         ("hashlib.sha256", lambda v: hashlib.sha256(v).digest())):
            start = time.perf_counter()
            if fn is None:
                [tensor_checksum(t) for t in local]
            else:
                [fn(v) for v in views]
            hashes[name] = local_bytes / (time.perf_counter() - start) / 1e9
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"times_s": times, "bytes_total": float(total), "bytes_per_rank": local_bytes,
                       "hash_gbps_rank0": hashes}, f)
    dist.barrier(group=dist.group.WORLD)
    if rank == 0:
        shutil.rmtree(work, ignore_errors=True)
    dist.destroy_process_group()


def measure(gib: float = 1.0, world: int = 2, reps: int = 3, work_dir: str | None = None) -> dict:
    """Run the benchmark on ``world`` fresh CPU ranks; return the medians and the raw times."""
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        torch.multiprocessing.spawn(_worker, args=(world, os.path.join(tmp, "store"), gib, reps, tmp), nprocs=world)
        with open(os.path.join(tmp, "result.json")) as f:
            raw = json.load(f)
    med = {k: statistics.median(v) for k, v in raw["times_s"].items()}
    return {"median_s": med, **raw, "world_size": world, "reps": reps,
            "save_overhead_pct": 100 * (med["checksums save"] - med["dcp save"]) / med["dcp save"],
            "load_overhead_pct": 100 * (med["checksums load"] - med["dcp load"]) / med["dcp load"],
            "save_compute_pct": 100 * med["checksum compute"] / med["dcp save"],
            # paired: both copies run back to back in each repetition
            "load_verify_s": statistics.median(a - b for a, b in zip(raw["times_s"]["copy with checksum"],
                                                                      raw["times_s"]["copy"])),
            "load_compute_pct": 100 * statistics.median(a - b for a, b in zip(raw["times_s"]["copy with checksum"],
                                                                               raw["times_s"]["copy"])) / med["dcp load"]}


def table(r: dict) -> str:
    m, t = r["median_s"], r["times_s"]

    def cell(name):
        return f"{m[name]:.3f} ({min(t[name]):.3f})"

    lines = [
        "Seconds, median (min) over the repetitions; shares of DCP's own time: median (min / min) on save, "
        "the median of each repetition's paired difference on load.",
        "",
        "| operation | DCP's own | with checksums | checksum work alone | its share of DCP's time |",
        "|---|---:|---:|---:|---:|",
        f"| save | {cell('dcp save')} | {cell('checksums save')} | {cell('checksum compute')} | "
        f"{r['save_compute_pct']:.1f} % ({100 * min(t['checksum compute']) / min(t['dcp save']):.1f} %) |",
        f"| load | {cell('dcp load')} | {cell('checksums load')} | {r['load_verify_s']:.3f} | "
        f"{r['load_compute_pct']:.1f} % |",
        "",
        "(checksum work alone: on save, the checksums of the rank's items, which run beside DCP's writing; "
        "on load, copy-with-checksum minus the same copy without sums, run back to back: medians "
        f"{m['copy with checksum']:.3f} and {m['copy']:.3f} s)",
        "",
        "| whole operation | seconds |",
        "|---|---:|",
        f"| load, this reader without verification | {cell('reader, no verify load')} |",
        f"| save_checkpoint (atomic, checksums) | {cell('save_checkpoint')} |",
        f"| load_checkpoint (checks, verification, copy-back) | {cell('load_checkpoint')} |",
        "",
        "| hash, one thread, rank 0's bytes | GB/s |",
        "|---|---:|",
    ]
    lines += [f"| {name} | {gbps:.2f} |" for name, gbps in r["hash_gbps_rank0"].items()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m dtensor_fp8.benchmarks checkpoint", description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="checkpoint size in GiB (all ranks)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--work-dir", default=None, help="where checkpoints are written (default: the temp dir)")
    p.add_argument("--out", default="bench_out")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    r = measure(args.gib, args.world_size, args.reps, args.work_dir)
    print(f"# checkpoint checksums: {r['bytes_total'] / 2**30:.2f} GiB on {args.world_size} CPU ranks (gloo), "
          f"median of {args.reps}, torch {torch.__version__}")
    print(table(r))
    path = os.path.join(args.out, "checkpoint.json")
    with open(path, "w") as f:
        json.dump({"torch": torch.__version__, "gib": args.gib, **r}, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
