"""Run one te_step variant: build it, warm up, time it, check it, free it.

Memory: ``torch.cuda.reset_peak_memory_stats()`` at the start of each variant (its peak including
model build: ``variant_peak``) and again after the warm-up (``step_peak``: the peak over the timed
steps, shown in the tables); figures are what the variant allocated on top of what was allocated
before it was built (other variants kept alive for the rounds, idle meanwhile). A variant that
raises (an OOM included) is recorded in its row and the run goes on.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import statistics
import time
import traceback

import torch

from ..host_profile import host_profile
from .host_split import HostSplit
from .rows import Row
from .timing import gpu_only_times, medians, profile, timed_steps
from .variants import (OURS, VARIANTS, Variant, build_variant, check_ours_fp8, gemm_weights, record_forward_kinds,
                       weight_kinds)

GIB = 2**30


def _allocated(base: int) -> float:
    return (torch.cuda.memory_allocated() - base) / GIB


def _peak(base: int) -> float:
    return (torch.cuda.max_memory_allocated() - base) / GIB


def _warm_up(v: Variant, row: Row, steps: int, losses: list) -> None:
    """``steps`` steps, recording which weight classes the modules see in the first forward."""
    seen: dict = {}
    handles = record_forward_kinds(v.model, seen)
    try:
        for _ in range(steps):
            losses.append(v.step())
            seen["_done"] = True
    finally:
        for h in handles:
            h.remove()
    seen.pop("_done", None)
    row.weights_in_forward = seen


def _time(v: Variant, row: Row, cfg, losses: list, base: int) -> None:
    """The first timed steps (under ``--host-split``'s wrappers if asked), then ``--gpu-only``
    and ``--profile`` steps."""
    torch.cuda.reset_peak_memory_stats()
    split = HostSplit() if cfg.host_split else contextlib.nullcontext()
    with split:
        if cfg.host_split:
            v.phase_sink.append(split)
        try:
            timed_steps(cfg.steps, v.step, row.first_times(), losses)
        finally:
            v.phase_sink.clear()
    if cfg.host_split:
        row.host_split_ms = split.per_step(cfg.steps)
    row.set_medians(medians(row.first_times()))
    row.step_peak_gib = _peak(base)
    row.variant_peak_gib = max(row.warmup_peak_gib, row.step_peak_gib)
    row.resident_gib = _allocated(base)
    if cfg.gpu_only:
        row.gpu_only_ms = gpu_only_times(v.step, cfg.gpu_only)
        row.median_gpu_only_ms = statistics.median(row.gpu_only_ms)
    if cfg.profile:
        row.profile = profile(v.step, cfg.out, f"{v.recipe_name}_{VARIANTS[v.key][0]}", trace=cfg.trace)
    if cfg.host_profile:
        row.host_profile = host_profile(v.step, cfg.host_profile,
                                        os.path.join(cfg.out, f"host_profile_{v.recipe_name}_{VARIANTS[v.key][0]}.txt"))


def _check(v: Variant, row: Row, cfg, losses: list) -> None:
    """Losses finite, and for our variants every GEMM weight still an FP8 shard."""
    vals = [float(x) for x in torch.stack(losses).cpu()]
    row.loss_first, row.loss_last = vals[0], vals[-1]
    row.losses_finite = all(math.isfinite(x) for x in vals)
    if not row.losses_finite:
        row.add_warning("non-finite loss")
    if v.key in OURS:
        graph = v.optimizer._requantize
        row.requantize_graph = {"replays": graph.replays, "disabled_reason": graph.disabled_reason}
        row.fp8_shards_ok, row.fp8_shards = check_ours_fp8(v.model, gemm_weights(cfg))
        if not row.fp8_shards_ok:
            row.add_warning(row.fp8_shards)
    if v.key in ("b", "c"):
        row.weights_after_steps = weight_kinds(v.model)


def _failed(row: Row, e: Exception) -> None:
    if isinstance(e, torch.cuda.OutOfMemoryError):
        row.status, row.error = "OOM", f"OutOfMemoryError: {str(e).splitlines()[0][:300]}"
    else:
        row.status = "error"
        row.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    row.traceback = traceback.format_exc()[-4000:]


def _free() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def run_variant(key: str, recipe_name: str, cfg, mesh, keep: bool = False):
    """Build, warm up and time one variant.

    Args:
        key: ``"a"`` ... ``"e"``.
        recipe_name: one of ``variants.RECIPE_NAMES``.
        cfg: the command line's namespace (a :class:`variants.StepConfig`'s fields plus
            ``steps``, ``warmup``, ``host_split``, ``gpu_only``, ``profile``, ``out``).
        mesh: the one-rank device mesh.
        keep: keep the variant alive for :func:`timing.time_rounds`.

    Returns:
        The :class:`Row`, or with ``keep`` the pair ``(row, step)`` (``step`` is ``None`` when the
        variant failed).
    """
    row = Row(recipe=recipe_name, variant=VARIANTS[key][0], key=key)
    _free()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    row.allocated_before_gib = base / GIB
    v = kept = None
    t_setup = time.perf_counter()
    try:
        v = build_variant(key, recipe_name, cfg, mesh)
        row.add_notes(v.notes)
        torch.cuda.synchronize()
        row.setup_s = time.perf_counter() - t_setup
        row.after_setup_gib = _allocated(base)
        losses: list = []
        _warm_up(v, row, cfg.warmup, losses)
        torch.cuda.synchronize()
        row.warmup_peak_gib = _peak(base)
        _time(v, row, cfg, losses, base)
        _check(v, row, cfg, losses)
        row.status = "ok"
        kept = v.step if keep else None
    except Exception as e:  # noqa: BLE001  (report, go on with the next variant)
        _failed(row, e)
    finally:
        with contextlib.suppress(Exception):
            if row.variant_peak_gib is None:
                row.variant_peak_gib = _peak(base)
        if kept is None:  # free the variant before the next (a kept step's closure still needs it)
            v = None
            try:
                _free()
                row.allocated_after_free_gib = torch.cuda.memory_allocated() / GIB
            except Exception as e:  # noqa: BLE001
                row.cleanup_error = f"{type(e).__name__}: {e}"[:300]
    return (row, kept) if keep else row
