"""te_step's timed loops: CUDA-event step times, interleaved rounds, GPU-only times, a profile.

* :func:`timed_steps`: each step between ``torch.cuda.synchronize()`` and a pair of CUDA events
  around forward + backward + optimizer step + zero_grad (a third event after backward splits
  forward + backward from the optimizer), plus the host's time to issue the step (``host ms``:
  when it is close to the step time, Python is the bottleneck, not the GPU) and wall time.
* :func:`time_rounds`: every kept variant of a recipe takes turns, round by round, so slow and
  fast spells of the host (seconds long) fall on all of them alike.
* :func:`gpu_only_times`: each step queued behind a GPU sleep long enough for the host to issue it
  all, so the host never holds the GPU back: the GPU's own time for a step.
* :func:`profile`: ``torch.profiler`` tables of two more steps.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

#: What :func:`timed_steps` records per step: CUDA-event time of the step and of its forward +
#: backward, the host's time to issue it, and wall time.
TIMES = ("step_ms", "fwd_bwd_ms", "host_ms", "wall_ms")


def timed_steps(n: int, step, times: dict[str, list], losses: list | None = None) -> None:
    """``n`` steps, each between synchronizes, their :data:`TIMES` appended to ``times`` (and
    their losses to ``losses``)."""
    for _ in range(n):
        start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        loss = step(mid)
        times["host_ms"].append((time.perf_counter() - t0) * 1e3)
        end.record()
        torch.cuda.synchronize()
        times["wall_ms"].append((time.perf_counter() - t0) * 1e3)
        times["step_ms"].append(start.elapsed_time(end))
        times["fwd_bwd_ms"].append(start.elapsed_time(mid))
        if losses is not None:
            losses.append(loss)


def medians(times: dict[str, list]) -> dict[str, float]:
    """The step figures the tables show, from :func:`timed_steps`' lists."""
    ms, fb = times["step_ms"], times["fwd_bwd_ms"]
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "median_fwd_bwd_ms": statistics.median(fb),
            "median_opt_ms": statistics.median(e - f for e, f in zip(ms, fb)),
            "median_host_ms": statistics.median(times["host_ms"]), "median_wall_ms": statistics.median(times["wall_ms"])}


def time_rounds(live: list, rounds: int, steps: int) -> None:
    """Time ``rounds`` x ``steps`` more steps of every kept ``(row, step)``, the variants taking
    turns round by round. Each row's ``round_*`` lists get these steps, and its step medians
    (wall time included) become those over them."""
    times = [row.round_times() for row, _ in live]
    for _ in range(rounds):
        for (_, step), t in zip(live, times):
            timed_steps(steps, step, t)
    for (row, _), t in zip(live, times):
        row.set_medians(medians(t))


def gpu_only_times(step, n_steps: int, sleep_cycles: int = 400_000_000) -> list[float]:
    """GPU time of ``n_steps`` more steps with the host out of the way: each step is enqueued
    behind a GPU sleep kernel long enough (~0.2 s) for the host to issue the whole step before
    the GPU reaches it; the step's GPU time is the event time minus the sleep's. A step whose
    host time exceeds the sleep (a host-device sync inside) raises rather than report a wrong
    number."""
    torch.cuda._sleep(1000)  # the first sleep of a process also pays for loading the kernel
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(sleep_cycles)
    end.record()
    torch.cuda.synchronize()
    sleep_ms = start.elapsed_time(end)
    out = []
    for _ in range(n_steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        torch.cuda._sleep(sleep_cycles)
        t0 = time.perf_counter()
        step()
        host_ms = (time.perf_counter() - t0) * 1e3
        end.record()
        torch.cuda.synchronize()
        if host_ms > 0.8 * sleep_ms:
            raise RuntimeError(f"--gpu-only: issuing a step took {host_ms:.1f} ms of host time, not well within "
                               f"the {sleep_ms:.1f} ms GPU sleep ahead of it (a host-device sync in the step?)")
        out.append(start.elapsed_time(end) - sleep_ms)
    return out


def profile(step, out_dir: str, tag: str, n_steps: int = 2, trace: bool = False) -> dict:
    """``torch.profiler`` over ``n_steps`` more steps: the kernel and CPU-op tables go to
    ``out_dir/profile_<tag>.txt``; returned: the GPU time of the kernels and copies per step
    (device events only: an op's row and a user annotation's GPU row repeat their kernels' time)
    next to the step's CUDA-event time, so gaps where the GPU waits for the host show as
    kernels < step. ``trace``: also write the Chrome trace to ``out_dir/trace_<tag>.json.gz``
    (``benchmarks/gpu_gaps.py`` reads where the GPU waited; no Python stacks: recording them
    slows the host several times over, which would move the gaps)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=False) as prof:
        start.record()
        for _ in range(n_steps):
            step()
        end.record()
        torch.cuda.synchronize()
    events = prof.key_averages()

    def device_self(e):
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)

    busy_us = sum(device_self(e) for e in events)  # ops, annotations and kernels: counts kernels more than once
    kernel_us = sum(device_self(e) for e in events
                    if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False))
    sort_dev = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    path = os.path.join(out_dir, f"profile_{tag}.txt")
    os.makedirs(out_dir, exist_ok=True)
    with open(path, "w") as f:
        f.write(f"# {tag}: {n_steps} steps, {start.elapsed_time(end):.2f} ms (CUDA events), "
                f"GPU kernels and copies {kernel_us / 1e3:.2f} ms\n\n")
        f.write(events.table(sort_by=sort_dev, row_limit=40, max_name_column_width=90))
        f.write("\n\n# by self CPU time\n")
        f.write(events.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=90))
    result = {"steps": n_steps, "ms_per_step": start.elapsed_time(end) / n_steps,
              "gpu_busy_ms_per_step": busy_us / 1e3 / n_steps, "gpu_kernel_ms_per_step": kernel_us / 1e3 / n_steps,
              "table": path}
    if trace:
        import gzip
        import shutil
        import tempfile

        result["trace"] = os.path.join(out_dir, f"trace_{tag}.json.gz")
        with tempfile.NamedTemporaryFile(suffix=".json") as raw:
            prof.export_chrome_trace(raw.name)
            with open(raw.name, "rb") as src, gzip.open(result["trace"], "wb") as dst:
                shutil.copyfileobj(src, dst)
    return result
