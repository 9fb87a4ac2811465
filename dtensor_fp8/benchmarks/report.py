"""``python -m dtensor_fp8.benchmarks`` (no subcommand): every benchmark this machine can run, one
JSON and one PNG.

Runs the FSDP2 wire-bytes / memory measurement (``fsdp.py``) on ``--world-size`` ranks of this
machine (CPU/gloo, or CUDA/NCCL where GPUs are present), the quantize throughput benchmark
(``quantize.py``) on this device and, where CUDA and Transformer Engine are present, the TE training
step benchmark (``te_step.py``); results of another machine (e.g. the H200 runs recorded in
``docs/benchmarks.md``) can be merged with ``--quantize-json`` / ``--te-step-json``. Writes ``--out/report.json`` and, when
matplotlib is installed (``pip install dtensor_fp8[bench]``), ``--out/report.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from . import fsdp, quantize, te_step


def plot(report: dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    results = report["fsdp"]["results"]
    names = [r["variant"] for r in results]
    steps = report.get("te_step", {})
    fig, axes = plt.subplots(1, 4 if steps else 3, figsize=(21 if steps else 16, 4.5))
    ax = axes[0]
    ax.bar(names, [r["wire_bytes_per_param_step"] for r in results], color=["gray"] + ["tab:blue"] * (len(names) - 1))
    ax.set_title("FSDP2 all-gather bytes / parameter / step")
    ax.axhline(4.0, ls="--", c="gray", lw=0.8)
    ax = axes[1]
    mib = 2**20
    ax.bar(names, [r["sharded_param_bytes"] / mib for r in results], label="sharded params")
    ax.bar(names, [r["master_bytes"] / mib for r in results], bottom=[r["sharded_param_bytes"] / mib for r in results],
           label="fp32 masters")
    ax.set_title(f"per-rank parameter memory (MiB), {report['fsdp']['world_size']} ranks")
    ax.legend()
    ax = axes[2]
    for label, data in report.get("quantize", {}).items():
        rows = [r for r in data["results"] if r.get("input_gbps") and r["impl"] in ("ours", "ours_te_kernels", "te")]
        ax.barh([f"{r['recipe']} {r['impl']} ({label})" for r in rows], [r["input_gbps"] for r in rows])
    ax.set_title("quantize GB/s (input read)\nours = reference, ours_te_kernels = its CUDA fast path")
    for label, data in steps.items():
        rows = [x for x in data["results"] if x.get("status") == "ok"]
        axes[3].barh([f"{x['recipe']} ({x['key']}) {label}" for x in rows], [x["median_ms"] for x in rows])
        axes[3].set_title("TE layers, ms/step: (a) bf16 (b) TE (c) no FSDP\n(d) ours (e) ours, bf16 masters")
    for a in axes[:2]:
        a.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return True


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m dtensor_fp8.benchmarks", description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--out", default="bench_out")
    p.add_argument("--quantize-json", action="append", default=[], help="extra quantize.json files to include")
    p.add_argument("--te-step-json", action="append", default=[], help="extra te_step.json files to include")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= args.world_size else "cpu"
    fsdp.main(["--world-size", str(args.world_size), "--device", device, "--out", args.out])
    quantize.main(["--out", args.out])
    report = {"fsdp": json.load(open(os.path.join(args.out, "fsdp.json"))), "quantize": {}}
    here = json.load(open(os.path.join(args.out, "quantize.json")))
    report["quantize"][here["meta"]["device"]] = here
    for extra in args.quantize_json:
        data = json.load(open(extra))
        report["quantize"][data["meta"]["device"]] = data
    report["te_step"] = {}
    if torch.cuda.is_available():  # te_step prints why and returns 2 where TE is missing
        if te_step.main(["--out", args.out]) == 0:
            data = json.load(open(os.path.join(args.out, "te_step.json")))
            report["te_step"]["this machine"] = data
    for extra in args.te_step_json:
        report["te_step"][os.path.basename(os.path.dirname(os.path.abspath(extra))) or extra] = json.load(open(extra))
    path = os.path.join(args.out, "report.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    png = os.path.join(args.out, "report.png")
    print(f"wrote {path}" + (f" and {png}" if plot(report, png) else " (no PNG: install matplotlib)"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
