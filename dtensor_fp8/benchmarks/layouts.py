"""Which (FSDP, TP) layouts each recipe accepts on real model shapes, and what each gathers.

    python -m dtensor_fp8.benchmarks layouts [--models llama3-8b,...] [--max-ranks 1024] [--out DIR]

For every model's FP8 Linear weights (a decoder layer: attention and MLP projections, with torchtitan's
tensor-parallel plan: Q/K/V and the MLP's gate/up column-parallel, the attention output and down
projection row-parallel) and every recipe, every layout of ``fsdp x tp`` ranks (powers of two up to
``--max-ranks``) is checked with the library's own rules (the recipe's shape rule and
``check_shardable`` for TP shards; TP and FSDP2 shards may both start inside blocks) and the FSDP2
all-gather bytes per parameter per step are computed from the gather plan's own sizes
(``scale_slots.scale_slot_numel``: FP8 data, plus each shard's scale slot where blocks lie along dim
0), for every TP rank's shard at its own block phase, summed over the TP ranks, in the plain
schedule and under activation checkpointing (MXFP8 and 1x128 gather a third plane there: the
recompute's rowwise plane), against bf16 FSDP2's 4 bytes. Also the share of the scale bytes beyond
one copy of TE's grid (each shard's scale slot holds its stripe of the grid, or for uneven dims the
grid rows of every block it touches, padded to the most any shard sends over both planes: FSDP2
sizes all gathers of a weight alike). Prints a table and writes ``layouts.json``.

A computation from the same functions the gathers use, not a measurement: ``wire`` and ``torchtitan``
count the bytes at the collectives (docs/benchmarks.md), and ``tests/test_split_blocks.py`` /
``tests/test_tp_split_blocks.py`` check the gathers byte for byte (the bytes counted at the
collectives are checked against this computation for 1-D FSDP2 layouts only:
``tests/test_layouts_benchmark.py``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

#: FP8 Linear weights of one decoder layer: name -> ((out, in), TP style: "col" shards dim 0, "row" dim 1).
MODELS: dict[str, dict[str, tuple[tuple[int, int], str]]] = {
    # Llama3 (torchtitan's llama3 args): 8 KV heads of 128 everywhere
    "llama3-8b": {"wq": ((4096, 4096), "col"), "wk": ((1024, 4096), "col"), "wv": ((1024, 4096), "col"),
                  "wo": ((4096, 4096), "row"), "w1": ((14336, 4096), "col"), "w3": ((14336, 4096), "col"),
                  "w2": ((4096, 14336), "row")},
    "llama3-70b": {"wq": ((8192, 8192), "col"), "wk": ((1024, 8192), "col"), "wv": ((1024, 8192), "col"),
                   "wo": ((8192, 8192), "row"), "w1": ((28672, 8192), "col"), "w3": ((28672, 8192), "col"),
                   "w2": ((8192, 28672), "row")},
    "llama3-405b": {"wq": ((16384, 16384), "col"), "wk": ((1024, 16384), "col"), "wv": ((1024, 16384), "col"),
                    "wo": ((16384, 16384), "row"), "w1": ((53248, 16384), "col"), "w3": ((53248, 16384), "col"),
                    "w2": ((16384, 53248), "row")},
    # DeepSeek-V3's dense layer: MLA (q_a / kv_a low-rank down projections, not tensor-parallel) and its
    # 18432-wide MLP
    "deepseek-v3-dense": {"wq_a": ((1536, 7168), "none"), "wq_b": ((24576, 1536), "col"),
                          "wkv_a": ((576, 7168), "none"), "wkv_b": ((32768, 512), "col"),
                          "wo": ((7168, 16384), "row"), "w1": ((18432, 7168), "col"), "w3": ((18432, 7168), "col"),
                          "w2": ((7168, 18432), "row")},
    # Qwen3 dense: 8B (36 layers of 4096, 8 KV heads of 128, MLP 12288) and 4B (2560, MLP 9728)
    "qwen3-8b": {"q": ((4096, 4096), "col"), "k": ((1024, 4096), "col"), "v": ((1024, 4096), "col"),
                 "o": ((4096, 4096), "row"), "gate": ((12288, 4096), "col"), "up": ((12288, 4096), "col"),
                 "down": ((4096, 12288), "row")},
    "qwen3-4b": {"q": ((4096, 2560), "col"), "k": ((1024, 2560), "col"), "v": ((1024, 2560), "col"),
                 "o": ((2560, 4096), "row"), "gate": ((9728, 2560), "col"), "up": ((9728, 2560), "col"),
                 "down": ((2560, 9728), "row")},
}
BF16_BYTES_PER_PARAM_STEP = 4.0  # bf16 FSDP2: 2 bytes, gathered in forward and again in backward


def _tp_pieces(recipe, shape, style, tp) -> list[tuple[int, int, tuple[int, int]]]:
    """Every TP rank's shard of a weight: ``(rows, cols, block phase)`` by torch's chunk rule (the
    phase modulo the recipe's block period: where the shard starts inside its blocks), one entry per
    TP rank (the sums over them are per TP group, so a replicated weight counts ``tp`` times)."""
    rows, cols = shape
    dim = {"col": 0, "row": 1}.get(style)
    if dim is None:  # not tensor-parallel: every TP rank holds (and FSDP2 gathers) the whole weight
        return [(rows, cols, (0, 0))] * tp
    size = shape[dim]
    chunk = -(-size // tp)
    out = []
    for r in range(tp):
        start, stop = min(r * chunk, size), min((r + 1) * chunk, size)
        phase = [0, 0]
        phase[dim] = start % recipe.phase_period(dim)
        out.append((stop - start, cols, tuple(phase)) if dim == 0 else (rows, stop - start, tuple(phase)))
    return out


def _refusal(recipe, shape, style, tp) -> str | None:
    """Why this weight cannot be laid out so (``None``: accepted)."""
    from ..formats.base import RecipeError
    from ..ops.slicing import check_shardable

    try:
        recipe.check_shape(shape)
        if tp > 1 and style in ("col", "row"):
            check_shardable(shape, recipe, 0 if style == "col" else 1, tp, computes=True)
    except RecipeError as e:
        return str(e).split(":")[0] + ": " + str(e).split(": ", 2)[-1][:120]
    return None


@functools.lru_cache(maxsize=65536)
def _gather_bytes(recipe, rows, cols, fsdp, phase=(0, 0)) -> dict[str, tuple[int, int]]:
    """Per stored plane: ``(bytes one FSDP2 gather of it moves in all, of which scale bytes beyond
    one copy of TE's grid of the whole weight)`` (every rank sends its padded shard and its scale
    slot: the grid rows it touches, padded to the most any rank touches over both planes), for a
    ``rows x cols`` weight (or TP shard) starting at block ``phase``."""
    from ..formats.base import USAGES
    from ..scale_slots import scale_slot_numel

    padded = -(-rows // fsdp)
    out = {}
    itemsize = recipe.scale_inv_dtype.itemsize
    for usage in dict.fromkeys(recipe.stored_usage(u) for u in USAGES):
        block = recipe.block_shape(usage)
        data, scales, extra = fsdp * padded * cols, 0, 0
        if fsdp > 1 and block.extent(0) is not None:
            scales = fsdp * scale_slot_numel(recipe, padded, cols, fsdp, phase) * itemsize
            whole = block.grid((fsdp * padded, cols), phase)
            extra = max(0, scales - whole[0] * whole[1] * itemsize)
        out[usage] = (data + scales, extra)
    return out


def layout_rows(models, recipes, max_ranks: int) -> list[dict]:
    """One row per (model, recipe, fsdp, tp): accepted or why not, and bytes / param / step."""
    rows = []
    sizes = [2 ** i for i in range(max_ranks.bit_length()) if 2 ** i <= max_ranks]
    for model in models:
        weights = MODELS[model]
        for recipe_name, recipe in recipes.items():
            for tp in [t for t in sizes if t <= 64]:
                for fsdp in [f for f in sizes if f * tp <= max_ranks]:
                    refusals = {n: r for n, (shape, style) in weights.items() if (r := _refusal(recipe, shape, style, tp))}
                    # whether a TP shard starts inside a block (a layout the under-1 % scale test leaves out)
                    tp_split = any(phase != (0, 0) for shape, style in weights.values()
                                   for _, _, phase in _tp_pieces(recipe, shape, style, tp))
                    row = {"model": model, "recipe": recipe_name, "fsdp": fsdp, "tp": tp, "ranks": fsdp * tp,
                           "accepted": not refusals, "refused": sorted(refusals),
                           "why": next(iter(refusals.values()), None), "tp_splits_blocks": tp_split}
                    if not refusals and fsdp > 1:
                        numel = plain = ac = extra = 0
                        for shape, style in weights.values():
                            for r, c, phase in _tp_pieces(recipe, shape, style, tp):  # each TP rank's dp gathers
                                per_plane = _gather_bytes(recipe, r, c, fsdp, phase)
                                numel += r * c
                                # plain: forward gathers the rowwise plane, backward the columnwise one;
                                # under checkpointing two-plane recipes also complete the recompute's rowwise
                                gathers = [recipe.stored_usage("rowwise"), recipe.stored_usage("columnwise")]
                                plain += sum(per_plane[u][0] for u in gathers)
                                extra += sum(per_plane[u][1] for u in gathers)
                                ac += (sum(per_plane[u][0] for u in gathers)
                                       + (per_plane["rowwise"][0] if len(per_plane) == 2 else 0))
                        row.update(bytes_per_param_step=plain / numel, ac_bytes_per_param_step=ac / numel,
                                   vs_bf16=plain / numel / BF16_BYTES_PER_PARAM_STEP,
                                   ac_vs_bf16=ac / numel / BF16_BYTES_PER_PARAM_STEP,
                                   scale_extra_share=extra / plain)
                    rows.append(row)
    return rows


#: the layouts the table prints figures for: (fsdp, tp)
SHOWN = ((8, 1), (64, 1), (128, 8), (1024, 1))


def _table(rows) -> str:
    head = f"{'model':<18} {'recipe':<12} {'accepted':<34}" + "".join(
        f" {f'fsdp {f} x tp {t}':>26}" for f, t in SHOWN)
    lines = [head, f"{'':<66}" + "".join(f" {'plain / AC x bf16, +scale':>26}" for _ in SHOWN)]
    by_key: dict = {}
    for r in rows:
        by_key.setdefault((r["model"], r["recipe"]), {})[(r["fsdp"], r["tp"])] = r
    for (model, recipe), group in by_key.items():
        refused_tp = sorted({tp for (_, tp), r in group.items() if not r["accepted"]})
        accepted = "every fsdp; tp " + ("any" if not refused_tp else f"< {refused_tp[0]}")
        cells = []
        for key in SHOWN:
            r = group.get(key)
            if r is None:
                cells.append(f" {'-':>26}")
            elif not r["accepted"]:
                cells.append(f" {'refused':>26}")
            else:
                cells.append(f" {r['vs_bf16']:.3f} / {r['ac_vs_bf16']:.3f}, +{100 * r['scale_extra_share']:.1f}%".rjust(27))
        lines.append(f"{model:<18} {recipe:<12} {accepted:<34}" + "".join(cells))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from ..formats import RECIPES

    parser = argparse.ArgumentParser(prog="python -m dtensor_fp8.benchmarks layouts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--recipes", default=",".join(RECIPES), help=f"comma-separated, of {', '.join(RECIPES)}")
    parser.add_argument("--max-ranks", type=int, default=1024)
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        print(f"unknown model(s) {unknown}; known: {sorted(MODELS)}", file=sys.stderr)
        return 2
    recipes = {n: RECIPES[n] for n in args.recipes.split(",") if n}
    rows = layout_rows(models, recipes, args.max_ranks)
    print(_table(rows))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "layouts.json")
    with open(path, "w") as f:
        json.dump({"max_ranks": args.max_ranks, "rows": rows}, f, separators=(",", ":"))
    print(f"\nwrote {path}")
    return 0
