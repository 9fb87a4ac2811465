"""te_step's tables (markdown, printed and stored in the JSON) and ``te_step.json``."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys

import torch

from .host_split import OUR_POST_HOOK, TE_POST_HOOKS, WAIT_FOR_UNSHARD
from .rows import Row
from .variants import OURS, VARIANTS


def _cell(r: Row | None) -> str:
    if r is None:
        return "not run"
    if r.ok:
        return f"{r.median_ms:.1f} ({r.step_peak_gib:.2f})" + (" ⚠" if r.warning else "")
    return "OOM" if r.status == "OOM" else "error"


def _ratio(a: Row | None, b: Row | None) -> str:
    if a and b and a.ok and b.ok:
        return f"{a.median_ms / b.median_ms:.3f} (mem {a.step_peak_gib / b.step_peak_gib:.3f})"
    return "-"


def _notes(rows: list[Row]) -> list[str]:
    notes = []
    for r in rows:
        tag = f"{r.recipe} {VARIANTS[r.key][1]}"
        if not r.ok:
            notes.append(f"- {tag}: **{r.status}**: {r.error}")
        if r.warning:
            notes.append(f"- {tag}: ⚠ {r.warning}")
        if r.key == "b" and r.ok:
            notes.append(f"- {tag}: weights after fully_shard {r.weights_after_shard}, in forward {r.weights_in_forward}")
        if r.key in OURS and r.fp8_shards is not None:
            notes.append(f"- {tag}: {r.fp8_shards}")
        if r.key in OURS and r.requantize_graph is not None:
            g = r.requantize_graph
            notes.append(f"- {tag}: requantization replayed as a CUDA graph in {g['replays']} steps"
                         + (f" (graphs off: {g['disabled_reason']})" if g["disabled_reason"] else ""))
    return notes


def format_table(rows: list[Row], recipes: list[str], variants: list[str]) -> str:
    """Step ms (peak GiB) per recipe and variant, with our variants' ratios to (c) and (b)."""
    by = {(r.recipe, r.key): r for r in rows}
    ours = [v for v in OURS if v in variants] or ["d"]
    head = ["recipe"] + [VARIANTS[v][1] for v in variants] + [f"({v})/({ref}) time (mem)" for v in ours for ref in ("c", "b")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rec in recipes:
        cells = [rec] + [_cell(by.get((rec, v))) for v in variants]
        cells += [_ratio(by.get((rec, v)), by.get((rec, ref))) for v in ours for ref in ("c", "b")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "cells: median step ms (fwd+bwd+optimizer) over the timed steps (peak GiB allocated during them); "
                  "⚠ = see notes"]
    notes = _notes(rows)
    return "\n".join(lines + (["", "notes:"] + notes if notes else []))


def format_breakdown(rows: list[Row]) -> str:
    """Where the step time goes: forward + backward vs optimizer step (+ zero_grad), the host's
    time to issue a step, and (``--gpu-only``) the GPU's time for it; medians."""
    lines = ["| recipe | variant | step ms | tokens/s | MFU | fwd+bwd ms | optimizer ms | host ms (issue) | GPU-only ms | "
             "resident GiB after step |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.ok:
            gpu_only = f"{r.median_gpu_only_ms:.1f}" if r.median_gpu_only_ms is not None else "-"
            tps = f"{r.tokens_per_s:,.0f}" if r.tokens_per_s is not None else "-"
            mfu = f"{100 * r.mfu:.1f} %" if r.mfu is not None else "-"
            lines.append(f"| {r.recipe} | {VARIANTS[r.key][1]} | {r.median_ms:.1f} | {tps} | {mfu} | {r.median_fwd_bwd_ms:.1f} | "
                         f"{r.median_opt_ms:.1f} | {r.median_host_ms:.1f} | {gpu_only} | {r.resident_gib:.2f} |")
    lines += ["", "host ms: time for Python to issue a step (forward, backward, optimizer) before the GPU finishes it; "
                  "when it is close to the step time the step is bound by the host, not the GPU. GPU-only ms: the step "
                  "enqueued behind a GPU sleep, so the host never holds the GPU back."]
    return "\n".join(lines)


def post_hook_ratios(rows: list[Row]) -> dict[str, dict[str, float]]:
    """Per recipe: our post-all-gather hook's host ms per step in (d) / (e) over TE's own in (b)."""
    out: dict[str, dict[str, float]] = {}
    te = {r.recipe: sum(r.host_split_ms.get(k, 0.0) for k in TE_POST_HOOKS) for r in rows
          if r.key == "b" and r.host_split_ms}
    for r in rows:
        if r.key in OURS and r.host_split_ms and te.get(r.recipe):
            out.setdefault(r.recipe, {})[r.key] = r.host_split_ms.get(OUR_POST_HOOK, 0.0) / te[r.recipe]
    return out


def format_host_split(rows: list[Row]) -> str:
    """``--host-split``: host ms per step inside each timed function, per variant."""
    rows = [r for r in rows if r.host_split_ms]
    if not rows:
        return ""
    labels = list(dict.fromkeys(k for r in rows for k in r.host_split_ms))
    lines = ["| recipe | variant | host ms (issue) | " + " | ".join(labels) + " |", "|---|---|---:|" + "---:|" * len(labels)]
    for r in rows:
        cells = [f"{r.host_split_ms[k]:.2f}" if k in r.host_split_ms else "-" for k in labels]
        lines.append(f"| {r.recipe} | {VARIANTS[r.key][1]} | {statistics.median(r.host_ms):.1f} | " + " | ".join(cells) + " |")
    lines += ["", "host ms per step spent inside each function during the first timed steps (entries nest: on one rank "
                  "wait_for_unshard runs the post-all-gather hooks, and the pre-all-gather hook too)"]
    ratios = post_hook_ratios(rows)
    if ratios:
        lines.append("our post-all-gather hook / TE's (in (b)): " + "; ".join(
            f"{rec} " + ", ".join(f"({k}) {v:.2f}x" for k, v in by.items()) for rec, by in ratios.items()))
    wait = {(r.recipe, r.key): r.host_split_ms.get(WAIT_FOR_UNSHARD) for r in rows}
    pairs = [f"{rec} ({k}) {wait[rec, k] / wait[rec, 'a']:.2f}x" for rec, k in wait
             if k in OURS and wait[rec, k] and wait.get((rec, "a"))]
    if pairs:
        lines.append("FSDP2 wait_for_unshard, ours / bf16 params (a): " + ", ".join(pairs))
    return "\n".join(lines)


def write_json(path: str, args, rows: list[Row], recipes: list[str], variants: list[str], te_version: str,
               tables: dict[str, str]) -> None:
    """``te_step.json``: versions, device, date, config, the rows and the tables."""
    cc = torch.cuda.get_device_capability()
    config = {"shape": args.shape, **dataclasses.asdict(args.model_shape)}
    config.update({k: getattr(args, k) for k in ("steps", "warmup", "lr", "seed", "adam", "gpu_only", "rounds",
                                                 "round_steps", "host_split", "host_profile")})
    meta = {
        "benchmark": "te_step", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(), "compute_capability": list(cc), "torch": torch.__version__,
        "cuda": torch.version.cuda, "transformer_engine": te_version, "python": platform.python_version(),
        "config": config, "recipes": recipes, "variants": {v: VARIANTS[v][1] for v in variants},
        "timing": ("median of per-step CUDA-event times (synchronize before each step) over the timed steps, after "
                   "warm-up" + (f"; then over {args.rounds} interleaved rounds of {args.round_steps} steps per variant "
                                "(all variants of a recipe alive, taking turns)" if args.rounds else "")),
        "memory": "step_peak: max_memory_allocated over the timed steps (reset after warm-up); variant_peak: from "
                  "the start of the variant (model build included); both minus what was allocated before the "
                  "variant was built",
        "post_hook_vs_te": post_hook_ratios(rows),
        "argv": sys.argv,
    }
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": [r.to_json() for r in rows], **tables}, f, indent=1, default=str)
