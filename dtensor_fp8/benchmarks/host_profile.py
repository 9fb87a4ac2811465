"""``--host-profile`` of the step benchmarks: where a step's host (Python) time goes, by function.

The step benchmarks on the H200 are bound by the host, so the question after "how fast" is
"which Python runs". ``torch.profiler`` answers for aten ops and kernels; this answers for
Python functions, with the standard library's ``cProfile`` (deterministic: every call is
counted, at a cost of ~1 us per call, so absolute times read high; compare functions within one
table). The table goes to a text file beside the benchmark's JSON.

Example:
    >>> host_profile(step, 3, "bench_out/host_profile_current.txt")
    {'steps': 3, 'profiled_ms_per_step': 61.2, 'table': 'bench_out/host_profile_current.txt'}
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import time

import torch


def _synchronize() -> None:
    if torch.cuda.is_available():  # on the CPU (--device cpu) the host's time is the step's
        torch.cuda.synchronize()


def host_profile(step, n_steps: int, path: str, rows: int = 60) -> dict:
    """Run ``step()`` ``n_steps`` times under ``cProfile`` and write the functions with the most
    own time and the most cumulative time to ``path``.

    Args:
        step: one training step (no arguments).
        n_steps: steps to profile (after the benchmark's own warm-up and timed steps).
        path: the text file to write.
        rows: functions listed per table.

    Returns:
        ``{"steps", "profiled_ms_per_step", "table"}`` (host ms per step with the profiler on).
    """
    _synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(n_steps):
        step()
    prof.disable()
    host_ms = (time.perf_counter() - t0) * 1e3 / n_steps
    _synchronize()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    buf.write(f"# {n_steps} steps, {host_ms:.1f} ms of host time per step under cProfile\n\n# by own time\n")
    stats.sort_stats("tottime").print_stats(rows)
    buf.write("\n# by cumulative time\n")
    stats.sort_stats("cumulative").print_stats(rows)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(buf.getvalue())
    return {"steps": n_steps, "profiled_ms_per_step": host_ms, "table": path}


def add_profiling_args(parser, per: str) -> None:
    """The step benchmarks' profiling options, with the same meaning in each (``linear_step``,
    ``te_step``): ``--profile`` (torch.profiler tables), ``--trace`` (the Chrome trace that
    ``gpu_gaps`` reads) and ``--host-profile N`` (:func:`host_profile`).

    Args:
        parser: the benchmark's ``argparse.ArgumentParser``.
        per: how the benchmark names one row in its output files, e.g. ``"<variant>"``.

    Example:
        >>> add_profiling_args(p, "<recipe>_<variant>")
    """
    parser.add_argument("--profile", action="store_true", help="also profile 2 steps per variant (torch.profiler "
                        f"kernel tables to --out/profile_{per}.txt; GPU-busy vs step time in the JSON)")
    parser.add_argument("--trace", action="store_true", help="with --profile: also write the Chrome trace "
                        f"(--out/trace_{per}.json.gz; `python -m dtensor_fp8.benchmarks gpu_gaps` reads it)")
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help=f"also run N steps per variant under cProfile (--out/host_profile_{per}.txt)")
