"""``--memory-at-peak`` of the step benchmarks: what is alive on the GPU at a step's peak, by where
it was allocated.

``max_memory_allocated`` says how high a step goes, not what is there. This records one step with
the CUDA caching allocator's history (``torch.cuda.memory._record_memory_history``, Python stacks),
replays its allocations and frees to find the moment of the peak, and groups what is alive then by
the innermost frame in this library (else in torch, else anywhere): "fsdp_buffers.py:gather_inputs"
says more than a total. What was allocated before the step began (parameters, optimizer state,
caches kept across steps) has no stack in the step's history and is one line, "held before the
step". The table goes to a text file beside the benchmark's JSON.

Example:
    >>> memory_at_peak(step, "bench_out/peak_memory_current.txt")
    {'peak_gib': 21.49, 'before_step_gib': 12.1, 'table': 'bench_out/peak_memory_current.txt'}
"""

from __future__ import annotations

import collections
import os

import torch

GIB = 1024 ** 3


#: where a frame's file must lie to count as this library's or torch's: the packages' own directories
#: (a substring test matched any site-packages file under an environment at /opt/torch/...)
_PACKAGE_DIRS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)
_TORCH_DIRS = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,)


def _site(frames: list[dict]) -> str:
    """The innermost frame in dtensor_fp8, else in torch, else the innermost one."""
    def where(f):
        return f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}"

    frames = [f for f in frames if f.get("filename") != __file__]  # not this module's own call of step()
    for dirs in (_PACKAGE_DIRS, _TORCH_DIRS):
        for f in frames:
            if os.path.abspath(f.get("filename", "")).startswith(dirs):
                return where(f)
    return where(frames[0]) if frames else "(no stack)"


def live_at_peak(trace: list[dict]) -> tuple[int, dict[str, int], int]:
    """Replay one device's allocator trace (``_snapshot()["device_traces"][i]``): the largest rise
    above the bytes held when the trace began, the bytes allocated in the trace and alive at that
    moment by allocation site, and the bytes held before the trace that were freed by then (last
    step's gradients, say).

    Args:
        trace: the allocator's events in order, each with ``action`` (``alloc``, ``free_completed``,
            ...), ``addr``, ``size`` and ``frames``.

    Example:
        >>> rise, sites, freed_before = live_at_peak(torch.cuda.memory._snapshot()["device_traces"][0])
    """
    live: dict[int, tuple[int, str]] = {}
    held = peak = freed_before = peak_freed_before = 0
    peak_live: dict[int, tuple[int, str]] = {}
    for event in trace:
        action, addr = event["action"], event["addr"]
        if action == "alloc":
            live[addr] = (event["size"], _site(event.get("frames", [])))
            held += event["size"]
            if held > peak:
                peak, peak_live, peak_freed_before = held, dict(live), freed_before
        elif action == "free_completed":
            if addr in live:
                held -= live.pop(addr)[0]
            else:  # held before the trace began
                held -= event["size"]
                freed_before += event["size"]
    sites: dict[str, int] = collections.Counter()
    for size, site in peak_live.values():
        sites[site] += size
    return peak, dict(sites), peak_freed_before


def memory_at_peak(step, path: str, rows: int = 40) -> dict:
    """Run ``step()`` once with the allocator's history on and write what is alive at its peak, by
    allocation site, to ``path``.

    Args:
        step: one training step (no arguments), already warmed up.
        path: the text file to write.
        rows: allocation sites listed.

    Returns:
        ``{"peak_gib", "before_step_gib", "table"}``.
    """
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    device = torch.cuda.current_device()
    rise, sites, freed_before = live_at_peak(snapshot["device_traces"][device])
    lines = [f"peak {(before + rise) / GIB:.3f} GiB = held before the step {before / GIB:.3f} GiB "
             f"- of it freed by the peak {freed_before / GIB:.3f} GiB "
             f"+ allocated in the step and alive at its peak {(rise + freed_before) / GIB:.3f} GiB", "",
             f"{'GiB':>8}  allocated at (innermost dtensor_fp8 frame, else torch's)"]
    for site, size in sorted(sites.items(), key=lambda kv: -kv[1])[:rows]:
        lines.append(f"{size / GIB:8.3f}  {site}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return {"peak_gib": round((before + rise) / GIB, 3), "before_step_gib": round(before / GIB, 3), "table": path}
