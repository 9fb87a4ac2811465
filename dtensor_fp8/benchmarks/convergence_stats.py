"""The convergence benchmark's statistics, target and tables: every row runs the same seeds, so each
row is compared with bf16 seed by seed (paired), which removes the seed-to-seed spread that an
unpaired comparison has to beat.

For a row ``r`` and a seed ``s``, ``L[r][s]`` is that run's held-out loss (the mean of its last
evaluations, ``convergence.py``). Per row: the mean over its seeds, the sample standard deviation
and min / max. Paired with ``bf16``: ``d_s = L[r][s] / L[bf16][s] - 1`` over the seeds both rows
finished; its mean ``m``, sample standard deviation ``sd`` and the half-width of the two-sided
95 % Student-t interval of the mean, ``h = t(0.975, n - 1) * sd / sqrt(n)``.

Target (``TARGET_RELATIVE``, 1 %): a row **passes** when the whole interval lies within +-1 %
(``|m| + h <= 1 %``): FP8 changed the loss by less than 1 %, and the benchmark resolved it. It
**fails** when ``|m| > 1 %``. Otherwise it is **unresolved**: the estimate is within 1 % but the
seeds disagree too much to say so at 95 % (fewer than two paired seeds, or ``h`` too wide: more
seeds or steps would decide).

Example:
    >>> runs = [{"variant": v, "seed": s, "status": "ok", "held_out_loss": x}
    ...         for v, xs in {"bf16": [1.0, 1.1, 0.9], "current": [1.001, 1.102, 0.9]}.items()
    ...         for s, x in enumerate(xs)]
    >>> summary = summarize(runs, reference="bf16")
    >>> summary["rows"]["current"]["verdict"]
    'PASS'
"""

from __future__ import annotations

import math
import statistics

TARGET_RELATIVE = 0.01
#: two-sided 95 % quantiles of Student's t by degrees of freedom
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def t_quantile(dof: int) -> float:
    """The 0.975 quantile of Student's t with ``dof`` degrees of freedom (table; the next smaller
    tabulated dof between entries, which is conservative; 1.96 beyond 30)."""
    if dof < 1:
        raise ValueError(f"t_quantile: dof must be >= 1, got {dof}")
    if dof > 30:
        return 1.96
    return T_975[max(k for k in T_975 if k <= dof)]


def describe(values: list[float]) -> dict:
    """``n``, ``mean``, ``sd`` (sample; ``None`` for one value), ``min``, ``max`` of ``values``."""
    return {"n": len(values), "mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else None,
            "min": min(values), "max": max(values)}


def paired(row: dict[int, float], reference: dict[int, float]) -> dict | None:
    """Per-seed relative differences ``row[s] / reference[s] - 1`` over the seeds both have, with
    their mean, sd and 95 % half-width (``None`` below two seeds); ``None`` if no seed is shared."""
    seeds = sorted(set(row) & set(reference))
    if not seeds:
        return None
    diffs = {s: row[s] / reference[s] - 1 for s in seeds}
    out = {"seeds": seeds, "per_seed": diffs, **describe(list(diffs.values()))}
    out["half_width"] = t_quantile(len(seeds) - 1) * out["sd"] / math.sqrt(len(seeds)) if len(seeds) > 1 else None
    return out


def verdict(p: dict | None, target: float = TARGET_RELATIVE) -> str:
    """``PASS`` / ``FAIL`` / ``UNRESOLVED`` for a :func:`paired` result (the module docstring)."""
    if p is None or not all(math.isfinite(x) for x in p["per_seed"].values()):
        return "FAIL" if p is not None else "UNRESOLVED"
    if abs(p["mean"]) > target:
        return "FAIL"
    if p["half_width"] is not None and abs(p["mean"]) + p["half_width"] <= target:
        return "PASS"
    return "UNRESOLVED"


def summarize(runs: list[dict], reference: str = "bf16") -> dict:
    """Per row (in the order rows first appear in ``runs``): its finished seeds' losses and
    :func:`describe`, tokens/s, and (all rows but ``reference``) :func:`paired` against
    ``reference`` with a :func:`verdict`; runs that did not finish are listed per row."""
    rows: dict[str, dict] = {}
    for r in runs:
        row = rows.setdefault(r["variant"], {"losses": {}, "tokens_per_s": [], "not_ok": {}, "notes": {}})
        if r.get("status") == "ok":
            row["losses"][r["seed"]] = r["held_out_loss"]
            if r.get("tokens_per_s"):
                row["tokens_per_s"].append(r["tokens_per_s"])
            for key in ("fp8_gemms_per_step", "fp8_weights", "torchao"):
                if key in r:
                    row["notes"][key] = r[key]
        else:
            row["not_ok"][r["seed"]] = f"{r.get('status')}: {r.get('error', '')}"
    ref = rows.get(reference, {}).get("losses", {})
    for name, row in rows.items():
        row["stats"] = describe(list(row["losses"].values())) if row["losses"] else None
        row["tokens_per_s"] = statistics.fmean(row["tokens_per_s"]) if row["tokens_per_s"] else None
        if name != reference:
            row["paired"] = paired(row["losses"], ref) if ref and row["losses"] else None
            row["verdict"] = verdict(row["paired"])
    return {"reference": reference if ref else None, "target_relative": TARGET_RELATIVE, "rows": rows}


def _pct(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{100 * x:+.{digits}f} %"


def format_table(summary: dict) -> str:
    """The markdown table: per row its seeds, loss mean +- sd (min - max) and the paired difference
    from the reference with its 95 % interval and verdict."""
    lines = ["| row | seeds | held-out loss, mean ± sd | min - max | vs bf16, paired: mean ± sd | 95 % interval | verdict "
             "| tokens/s | FP8 GEMMs / step | note |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    for name, row in summary["rows"].items():
        st, p = row["stats"], row.get("paired")
        note = "; ".join(([f"FP8 weights {row['notes']['fp8_weights']}"] if "fp8_weights" in row["notes"] else [])
                         + ([f"torchao {row['notes']['torchao']}"] if "torchao" in row["notes"] else [])
                         + [f"seed {s} {why}" for s, why in row["not_ok"].items()])
        if st is None:
            lines.append(f"| {name} | 0 | - | - | - | - | - | - | - | {note} |")
            continue
        sd = "-" if st["sd"] is None else f"{st['sd']:.4f}"
        if p is None:
            vs, interval = ("reference", "-") if name == summary["reference"] else ("-", "-")
        else:
            spread = "-" if p["sd"] is None else f"{100 * p['sd']:.3f} %"
            vs = f"{_pct(p['mean'], 3)} ± {spread}"
            interval = "-" if p["half_width"] is None else f"[{_pct(p['mean'] - p['half_width'])}, {_pct(p['mean'] + p['half_width'])}]"
        tps = f"{row['tokens_per_s']:,.0f}" if row["tokens_per_s"] else "-"
        lines.append(f"| {name} | {st['n']} | {st['mean']:.4f} ± {sd} | {st['min']:.4f} - {st['max']:.4f} | {vs} | {interval} "
                     f"| {row.get('verdict', '')} | {tps} | {row['notes'].get('fp8_gemms_per_step', '-')} | {note} |")
    lines += ["", "Held-out loss in nats per byte, each run's mean over its last evaluations; vs bf16, paired: the "
              "per-seed relative difference from bf16 at the same seed (same init, same batches), its mean ± sd over "
              "the seeds and the 95 % Student-t interval of the mean."]
    return "\n".join(lines)


def format_per_seed(summary: dict) -> str:
    """Each run's held-out loss, a column per seed, and (rows but the reference) its paired difference."""
    seeds = sorted({s for row in summary["rows"].values() for s in row["losses"]})
    lines = ["| row | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|---|" + "---:|" * len(seeds)]
    for name, row in summary["rows"].items():
        p = row.get("paired") or {"per_seed": {}}
        cells = [(f"{row['losses'][s]:.4f}" + (f" ({_pct(p['per_seed'][s])})" if s in p["per_seed"] else ""))
                 if s in row["losses"] else "-" for s in seeds]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_target(summary: dict) -> str:
    """The target's statement and each row's verdict (the module docstring)."""
    if summary["reference"] is None:
        return "target: no bf16 run finished: nothing to compare with"
    t = 100 * summary["target_relative"]
    lines = [f"target: each FP8 row's held-out loss within ±{t:g} % of bf16's, paired by seed: PASS when the 95 % "
             f"interval of the mean per-seed difference lies inside ±{t:g} %, FAIL when the mean is outside, "
             "UNRESOLVED otherwise (too few seeds or too much spread to tell)"]
    for name, row in summary["rows"].items():
        if name == summary["reference"]:
            continue
        p = row.get("paired")
        if p is None:
            detail = "; ".join(f"seed {s} {why}" for s, why in row["not_ok"].items()) or "no seed paired with bf16"
        else:
            hw = "" if p["half_width"] is None else f" ± {100 * p['half_width']:.3f} % (95 %, {len(p['seeds'])} seeds)"
            detail = f"{_pct(p['mean'], 3)}{hw}" + (" (one seed)" if len(p["seeds"]) == 1 else "")
        lines.append(f"  {name:<24} {row['verdict']:<10} {detail}")
    return "\n".join(lines)
