"""Where the GPU waited for the host: idle gaps in a torch.profiler Chrome trace, and what the host
was running when each one ended.

``python -m dtensor_fp8.benchmarks gpu_gaps TRACE.json[.gz] [--min-gap-us 20] [--steps N] [--top 25]
[--out DIR]``

The trace is what ``linear_step --profile --trace`` / ``te_step --profile --trace`` write. A gap is
a stretch between the first and the last GPU activity (kernels, copies, memsets; all streams
merged) where nothing runs. Each gap ends when the host's launch of the next GPU activity
arrives; the gap is charged to the host events enclosing that launch on the thread that issued
it (the autograd engine's thread for the backward): ``record_function`` annotations (FSDP2's
``FSDP::...``, torch.compile's regions), aten ops, and Python frames where the trace has them
(``with_stack``; they slow the host several times over, so the benchmarks do not record them).
Gaps are summed by the innermost of those frames, which names the host work the GPU waited on.
The table goes to stdout, the JSON (every gap with its stack, the sums) to
``--out/gpu_gaps_<trace name>.json``.

A step measured between synchronizations starts with the GPU idle while the host issues the
first work; that lead-in is before the first GPU activity and is reported apart (``lead_in_us``),
as the time from the trace's first CPU event of the profiled steps to the first GPU activity.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import os
import sys
from collections import defaultdict

_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
_FRAME_CATS = ("python_function", "cpu_op", "user_annotation")


def load_trace(path: str) -> list[dict]:
    """The complete events (``"ph": "X"``) of a Chrome trace file (gzipped or not)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "ts" in e]


def _frame_name(name: str) -> str:
    """``.../site-packages/torch/distributed/fsdp/_x.py(12): fn`` -> ``torch/distributed/fsdp/_x.py(12): fn``."""
    for marker in ("site-packages/", "dtensor_fp8/"):
        i = name.rfind(marker)
        if i >= 0:
            return name[i + len(marker):] if marker == "site-packages/" else name[i:]
    return name


def _stacks_by_thread(events: list[dict]) -> dict:
    """Per (pid, tid): the host events that nest (Python frames when recorded, aten ops,
    ``record_function`` annotations such as FSDP2's), sorted by start, with their starts (for
    bisect) and each one's innermost enclosing event (a sweep with a stack: they nest in time)."""
    by_thread = defaultdict(list)
    for e in events:
        if e.get("cat") in _FRAME_CATS:
            by_thread[(e["pid"], e["tid"])].append(e)
    out = {}
    for key, evs in by_thread.items():
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        parents, open_ = [], []
        for i, e in enumerate(evs):
            while open_ and evs[open_[-1]]["ts"] + evs[open_[-1]].get("dur", 0) < e["ts"]:
                open_.pop()
            parents.append(open_[-1] if open_ else -1)
            open_.append(i)
        out[key] = (evs, [e["ts"] for e in evs], parents)
    return out


def _contains(e: dict, t: float) -> bool:
    return e["ts"] <= t <= e["ts"] + e.get("dur", 0)


def _stack_at(stacks: dict, thread, t: float) -> list[str]:
    """Host events enclosing time ``t`` on ``thread``, outermost first: from the last event that
    started before ``t``, up its enclosing ones (an event that already ended is skipped)."""
    if thread not in stacks:
        return []
    evs, starts, parents = stacks[thread]
    i = bisect.bisect_right(starts, t) - 1
    frames = []
    while i >= 0:
        if _contains(evs[i], t):
            frames.append(evs[i])
        i = parents[i]
    return [_frame_name(f["name"]) for f in reversed(frames)]


def gpu_gaps(events: list[dict], *, min_gap_us: float = 20.0, depth: int = 3) -> dict:
    """The GPU's idle gaps in ``events`` and the host code each one waited on.

    Args:
        events: complete events of a Chrome trace (:func:`load_trace`).
        min_gap_us: shorter gaps are counted in the idle total but not listed.
        depth: the innermost frames of the launching stack a gap is summed under.

    Returns:
        ``{"busy_us", "idle_us", "span_us", "lead_in_us", "gaps": [...], "by_frames": [...]}``;
        ``gaps`` lists ``{"start", "us", "next", "launch", "stack"}``, ``by_frames`` the sums, largest first.

    Example:
        >>> report = gpu_gaps(load_trace("bench_out/trace_current_bf16_masters.json.gz"))
        >>> report["idle_us"], report["by_frames"][0]
    """
    gpu = sorted((e for e in events if e.get("cat") in _GPU_CATS), key=lambda e: e["ts"])
    if not gpu:
        raise ValueError("gpu_gaps: the trace has no GPU events (kernels, copies); was it recorded on a GPU "
                         "with ProfilerActivity.CUDA?")
    launches = {}
    for e in events:
        if e.get("cat") in _LAUNCH_CATS and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = e
    stacks = _stacks_by_thread(events)
    busy = idle = 0.0
    gaps = []
    end = gpu[0]["ts"] + gpu[0].get("dur", 0)
    busy += gpu[0].get("dur", 0)
    for e in gpu[1:]:
        start, stop = e["ts"], e["ts"] + e.get("dur", 0)
        if start > end:
            gap = start - end
            idle += gap
            if gap >= min_gap_us:
                launch = launches.get(e.get("args", {}).get("correlation"))
                stack = _stack_at(stacks, (launch["pid"], launch["tid"]), launch["ts"]) if launch else []
                gaps.append({"start": end, "us": gap, "next": e["name"][:80],
                             "launch": launch["name"] if launch else None, "stack": stack})
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    sums = defaultdict(lambda: [0.0, 0])
    for g in gaps:
        key = " < ".join(reversed(g["stack"][-depth:])) or "(no host event around the launch)"
        sums[key][0] += g["us"]
        sums[key][1] += 1
    cpu_starts = [e["ts"] for e in events if e.get("cat") in _FRAME_CATS]
    lead_in = max(0.0, gpu[0]["ts"] - min(cpu_starts)) if cpu_starts else 0.0
    by_frames = sorted(({"frames": k, "us": v[0], "gaps": v[1]} for k, v in sums.items()), key=lambda r: -r["us"])
    return {"busy_us": busy, "idle_us": idle, "span_us": end - gpu[0]["ts"], "lead_in_us": lead_in,
            "gaps": gaps, "by_frames": by_frames}


def format_report(report: dict, steps: int, top: int) -> str:
    per = 1e3 * steps
    lines = [f"GPU busy {report['busy_us'] / per:.2f} ms / step, idle between its first and last activity "
             f"{report['idle_us'] / per:.2f} ms / step, lead-in before the first {report['lead_in_us'] / per:.2f} ms / step "
             f"({len(report['gaps'])} gaps listed)", "",
             "| idle ms / step | gaps | host events around the launch that ended the gap (innermost first) |",
             "|---:|---:|---|"]
    for r in report["by_frames"][:top]:
        lines.append(f"| {r['us'] / per:.3f} | {r['gaps']} | {r['frames']} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m dtensor_fp8.benchmarks gpu_gaps", description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="a Chrome trace written by linear_step / te_step --profile --trace (.json or .json.gz)")
    p.add_argument("--min-gap-us", type=float, default=20.0, help="list gaps at least this long (default 20 us)")
    p.add_argument("--steps", type=int, default=2, help="training steps in the trace, for per-step figures (default 2, "
                   "as --profile records)")
    p.add_argument("--depth", type=int, default=3, help="innermost frames a gap is summed under (default 3)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default="bench_out")
    args = p.parse_args(argv)
    if args.steps < 1 or args.depth < 1:
        p.error("--steps and --depth must be >= 1")
    try:
        report = gpu_gaps(load_trace(args.trace), min_gap_us=args.min_gap_us, depth=args.depth)
    except (OSError, ValueError) as e:
        print(f"gpu_gaps: {e}", file=sys.stderr)
        return 2
    print(format_report(report, args.steps, args.top))
    os.makedirs(args.out, exist_ok=True)
    name = os.path.basename(args.trace).split(".json")[0]
    with open(os.path.join(args.out, f"gpu_gaps_{name}.json"), "w") as f:
        json.dump({"trace": args.trace, "steps": args.steps, "min_gap_us": args.min_gap_us, **report}, f, indent=1)
    return 0
