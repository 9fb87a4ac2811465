"""Training-step time and peak memory of a Transformer Engine TransformerLayer stack, five ways.

``python -m dtensor_fp8.benchmarks te_step [--shape te-default|llama3-8b --layers N ...
--recipes delayed,current,blockwise2d --variants a,b,c,d,e --out DIR]``

One process, one GPU, an NCCL process group of size 1 (FileStore on local disk). For each recipe
(ours ``DelayedScaling`` / ``CurrentScaling`` / ``Blockwise(block_dims=2)`` under the TE recipe
matching it) and each variant — (a) bf16 params under FSDP2, (b) TE's FP8 params under FSDP2,
(c) TE's FP8 params without FSDP, (d) dtensor_fp8 params under FSDP2 with FP32 masters, (e) = (d)
with bf16 masters; see ``variants.py`` — it builds the model, warms up (``--warmup`` steps), times
``--steps`` steps and reports the median (``timing.py``); ``--gpu-only N`` times N more steps
queued behind a GPU sleep (the GPU's own time), ``--host-split`` sums the host time inside FSDP2's
per-group steps, the all-gather hooks and the requantization (``host_split.py``), ``--rounds R``
re-times every variant in R interleaved rounds, ``--profile`` writes torch.profiler tables (with
``--trace`` the Chrome trace too, for ``gpu_gaps``),
``--host-profile N`` cProfile tables of N more steps (``benchmarks/host_profile.py``). The
markdown tables (step ms, tokens/s and MFU as ``benchmarks/shapes.py`` counts them) go to stdout,
the JSON (torch / TE versions, device, date, config, one entry per ``rows.Row``) to
``--out/te_step.json`` (``report.py``).

The parts: ``variants.py`` (models, optimizers, the training step: :func:`build_variant`),
``run.py`` (one variant: warm up, time, check, free), ``timing.py``, ``host_split.py``,
``rows.py``, ``report.py``; this file parses the command line and runs the recipes.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time

import torch

from ...formats import te_import
from .host_split import HostSplit
from .report import format_breakdown, format_host_split, format_table, write_json
from .rows import Row
from .run import run_variant
from .timing import time_rounds
from ..host_profile import add_profiling_args
from ..shapes import add_shape_arguments, mfu, peak_flops, shape_from_args, tokens_per_s
from .variants import OURS, RECIPE_NAMES, VARIANTS, StepConfig, Variant, build_variant, init_process_group

__all__ = ["HostSplit", "OURS", "RECIPE_NAMES", "Row", "StepConfig", "VARIANTS", "Variant", "build_variant",
           "init_process_group", "main", "run_variant"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dtensor_fp8.benchmarks te_step", description=__doc__.split("\n\n")[0])
    add_shape_arguments(p)
    p.add_argument("--recipes", default=",".join(RECIPE_NAMES), help=f"comma-separated subset of {','.join(RECIPE_NAMES)}")
    p.add_argument("--variants", default="a,b,c,d,e", help="comma-separated subset of a (bf16, FSDP2), b (TE FP8 params, "
                   "FSDP2), c (TE FP8 params, no FSDP), d (dtensor_fp8, FSDP2), e (d with bf16 masters)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--adam", choices=("fused", "foreach"), default="fused",
                   help="torch.optim.Adam implementation used by every variant (default fused: one CUDA kernel)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nonfinite", choices=("raise", "skip", "ignore"), default="ignore",
                   help="MasterWeightOptimizer's non-finite gradient check in (d)/(e) (default ignore: the check "
                        "synchronizes with the host every step, which --gpu-only cannot time around)")
    p.add_argument("--rounds", type=int, default=0, metavar="R",
                   help="keep every variant of a recipe alive and time R more rounds of --round-steps steps of "
                        "each in turn; the step medians reported are over these interleaved steps (the host's "
                        "speed drifts between spells of seconds; interleaving spreads that over all variants)")
    p.add_argument("--round-steps", type=int, default=5)
    p.add_argument("--host-split", action="store_true",
                   help="time the host's work inside FSDP2's unshard / wait_for_unshard / post_backward / reshard, "
                        "the FP8 all-gather hooks (ours, TE's) and our requantization during the first --steps "
                        "timed steps (host split table)")
    p.add_argument("--gpu-only", type=int, default=0, metavar="N",
                   help="also time N steps each enqueued behind a GPU sleep, so the host never holds the GPU back "
                        "(GPU-only ms in the breakdown)")
    add_profiling_args(p, "<recipe>_<variant>")
    p.add_argument("--out", default="bench_out", help="directory for te_step.json (default ./bench_out)")
    return p


def _parse(argv) -> tuple[argparse.Namespace, list[str], list[str]]:
    p = _parser()
    args = p.parse_args(argv)
    recipes = [r for r in args.recipes.split(",") if r]
    variants = [v for v in args.variants.split(",") if v]
    if set(recipes) - set(RECIPE_NAMES):
        p.error(f"unknown recipes {sorted(set(recipes) - set(RECIPE_NAMES))}; choose from {list(RECIPE_NAMES)}")
    if set(variants) - set(VARIANTS):
        p.error(f"unknown variants {sorted(set(variants) - set(VARIANTS))}; choose from {list(VARIANTS)}")
    args.model_shape = shape_from_args(p, args)
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be >= 1")
    if args.gpu_only < 0 or args.rounds < 0 or args.round_steps < 1 or args.host_profile < 0:
        p.error("--gpu-only, --rounds and --host-profile must be >= 0, --round-steps >= 1")
    return args, recipes, variants


def _run_recipe(rec: str, variants: list[str], args, mesh) -> list[Row]:
    """Every variant of one recipe, then (``--rounds``) their interleaved rounds."""
    rows, live = [], []
    for v in variants:
        t0 = time.perf_counter()
        r = run_variant(v, rec, args, mesh, keep=args.rounds > 0)
        if args.rounds > 0:
            r, step = r
            if step is not None:
                live.append((r, step))
        r.variant_wall_s = time.perf_counter() - t0
        rows.append(r)
        msg = f"{r.median_ms:.2f} ms, step peak {r.step_peak_gib:.2f} GiB" if r.ok else f"{r.status}: {r.error}"
        print(f"  {rec:<12} {VARIANTS[v][1]:<32} {msg}  [{r.variant_wall_s:.1f} s]"
              + (f"  WARNING: {r.warning}" if r.warning else ""), flush=True)
    if live:
        time_rounds(live, args.rounds, args.round_steps)
        print(f"  {rec:<12} interleaved: " + ", ".join(f"{r.key} {r.median_ms:.1f}" for r, _ in live) + " ms", flush=True)
        live.clear()
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    args, recipes, variants = _parse(argv)
    te = te_import.load()
    if te is None:
        print(f"te_step: Transformer Engine does not import here ({te_import.import_error()}); this benchmark needs "
              "transformer_engine.pytorch and a CUDA GPU. Nothing was run.", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("te_step: no CUDA device; this benchmark needs a GPU. Nothing was run.", file=sys.stderr)
        return 2
    import torch.distributed as dist

    torch.cuda.set_device(0)
    cc = torch.cuda.get_device_capability()
    shape = args.model_shape
    print(f"# te_step: TransformerLayer {shape.describe()}; {torch.cuda.get_device_name()} (sm_{cc[0]}{cc[1]}); torch "
          f"{torch.__version__}; TE {te.version}", flush=True)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        mesh = init_process_group(tmp)
        try:
            for rec in recipes:
                rows += _run_recipe(rec, variants, args, mesh)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    peak = peak_flops(torch.cuda.get_device_name())
    for r in rows:
        if r.ok:
            r.tokens_per_s, r.mfu = tokens_per_s(shape, r.median_ms), mfu(shape, r.median_ms, peak)
    tables = {"table_markdown": format_table(rows, recipes, variants), "breakdown_markdown": format_breakdown(rows),
              "host_split_markdown": format_host_split(rows)}
    print()
    print(tables["breakdown_markdown"])
    if tables["host_split_markdown"]:
        print()
        print(tables["host_split_markdown"])
    print()
    print(tables["table_markdown"])
    path = f"{args.out}/te_step.json"
    write_json(path, args, rows, recipes, variants, te.version, tables)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
