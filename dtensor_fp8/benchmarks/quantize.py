"""Quantize throughput: our pure-PyTorch recipes vs Transformer Engine's kernels vs a device copy.

``python -m dtensor_fp8.benchmarks quantize [--size N] [--dtype bf16] [--out DIR]``

For one ``N x N`` input (default 8192 x 8192 bf16 on CUDA, 1024 x 1024 on CPU) and each recipe,
times quantization producing both the rowwise and the columnwise usage:

* ``ours``: :func:`dtensor_fp8.quantize` with the recipes' pure-torch reference (stored planes in
  the logical orientation; per-tensor and 128x128 recipes store one plane, TE's transpose is not
  built);
* ``ours_triton``: the same call with the recipes' Triton fast path only (``formats/triton_*.py``:
  CUDA with Triton; every recipe, both planes of MXFP8 / 128x128 blockwise in one pass, 1x128 in one pass a plane), checked byte for
  byte against ``ours``;
* ``ours_te_kernels``: the same call with the recipes' TE-kernel fast path only
  (``formats/te_kernels.py``: CUDA with TE present; per-tensor and blockwise recipes), checked
  likewise; the note column says which fast path the recipe takes by default (both available:
  the first of its ``kernel_order``);
* ``ours+te_layout``: the same followed by :func:`dtensor_fp8.te_layout` (TE's physical buffers:
  transposed copies, padded scales), i.e. the same bytes TE's kernels write;
* ``te``: TE's quantizer (``quantizer(x)``), where TE imports and runs that recipe on this device
  (TE's MXFP8 kernels need sm_100+);
* ``copy``: ``dst.copy_(src)`` of the input, the memory-bandwidth reference.

Timing: CUDA events around each call (wall clock on CPU), after warm-up, median over ``--reps``
calls (at least 20) rotating over ``--buffers`` (at least 3) inputs so no call reads an input the
previous one left in L2. GB/s counts the input bytes read (``numel * itemsize``); the copy is also
reported counting read + write. A call timed alone includes the host's time to issue it whenever
that is longer than its kernels (a Python call is); on CUDA each row therefore also gives its GPU
time with the host ahead: the same calls queued behind a ``torch.cuda._sleep`` so that every
kernel is issued before the first one runs, two events around all of them (``gpu ms``; an upper
bound on the kernels' time, as a gap would be counted). That is the cost inside a training step or
an optimizer step, where the host runs ahead of the GPU. The markdown table goes to stdout, the JSON to
``--out/quantize.json`` (default ``./bench_out/quantize.json``) with torch/TE versions, device, date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time

import torch

import dtensor_fp8 as d
from dtensor_fp8.formats import te_import, te_kernels, triton_kernels
from dtensor_fp8.formats.te_binding import te_quantizer, te_unsupported_reason

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_MIN_REPS, _MIN_BUFFERS = 20, 3


# ---- recipes --------------------------------------------------------------------------------------
def _recipes() -> dict[str, d.Recipe]:
    return {
        "delayed_e4m3": d.DelayedScaling(fp8_dtype=torch.float8_e4m3fn),
        "current_e4m3": d.CurrentScaling(fp8_dtype=torch.float8_e4m3fn),
        "blockwise1d_e4m3": d.Blockwise(block_dims=1),
        "blockwise2d_e4m3": d.Blockwise(block_dims=2),
        "mxfp8_e4m3": d.MXFP8(),
    }


_DELAYED_SCALE = 0.75  # an explicit, non-power-of-two delayed-scaling scale
#: Cases quantized with that explicit scale (delayed scaling takes one; the others compute theirs).
_GIVEN_SCALE = {"delayed_e4m3"}


def _import_te():
    """``(TE namespace, None)`` or ``(None, reason)`` (formats/te_import.py)."""
    return te_import.load(), te_import.import_error()


def _te_quantizer(recipe: d.Recipe, device: torch.device, cc: tuple[int, int], scale):
    """``(quantizer, None)`` or ``(None, why TE does not run it here)``."""
    if device.type != "cuda":
        return None, "TE needs CUDA"
    why = te_unsupported_reason(recipe, cc)
    if why is not None:
        return None, why
    return te_quantizer(recipe, rowwise=True, columnwise=True, device=device, scale=scale), None


def _te_call(quantizer):
    def run(x):
        with torch.no_grad():
            return quantizer(x)
    return run


def _te_buffers(t, names):
    if getattr(t, "_transpose_invalid", False) or ("_transpose" in names and getattr(t, "_transpose", 0) is None):
        t._create_transpose()
    return {n: getattr(t, n) for n in names}


def _valid_region(name: str, m: int, k: int, recipe: d.Recipe):
    """Unpadded extent of one of TE's padded scale tensors (TE leaves the padding uninitialized)."""
    return recipe.te_scale_extents((m, k)).get(name)


def _bit_exact(ours: dict, theirs: dict, shape, recipe) -> str:
    m, k = math.prod(shape[:-1]), shape[-1]
    bad = []
    for name, a in ours.items():
        b = theirs.get(name)
        if b is None or tuple(a.shape) != tuple(b.shape):
            bad.append(f"{name}:shape")
            continue
        r = _valid_region(name, m, k, recipe)
        if r is not None:
            a, b = a[: r[0], : r[1]], b[: r[0], : r[1]]
        if not torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)):
            bad.append(name)
    return "yes" if not bad else "NO: " + ",".join(bad)


# ---- timing ---------------------------------------------------------------------------------------
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _warm_up(fn, inputs, warmup: int, device) -> None:
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    _sync(device)


def time_calls(fn, inputs, *, reps: int, warmup: int, device: torch.device) -> list[float]:
    """Milliseconds of each of ``reps`` calls ``fn(inputs[i % len(inputs)])`` after ``warmup``."""
    _warm_up(fn, inputs, warmup, device)
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for i, (start, end) in enumerate(events):
            x = inputs[i % len(inputs)]
            start.record()
            fn(x)
            end.record()
        _sync(device)
        return [s.elapsed_time(e) for s, e in events]
    out = []
    for i in range(reps):
        x = inputs[i % len(inputs)]
        t0 = time.perf_counter()
        fn(x)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


#: GPU cycles the stream sleeps before the queued calls of :func:`time_gpu` (about 0.15 s on an
#: H200's ~2 GHz clock: far longer than the host takes to issue ``reps`` quantizations).
_SLEEP_CYCLES = 300_000_000


def time_gpu(fn, inputs, *, reps: int, warmup: int, device: torch.device) -> float | None:
    """GPU milliseconds per call of ``fn`` with the host ahead (``None`` off CUDA): ``reps`` calls
    issued while the stream sleeps, timed by two events around all of them."""
    if device.type != "cuda":
        return None
    _warm_up(fn, inputs, warmup, device)
    torch.cuda._sleep(_SLEEP_CYCLES)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(reps):
        fn(inputs[i % len(inputs)])
    end.record()
    _sync(device)
    return start.elapsed_time(end) / reps


def _row(recipe: str, impl: str, ms: list[float] | None, in_bytes: int, copy_gbps: float | None,
         gpu_ms: float | None = None, **extra) -> dict:
    row = {"recipe": recipe, "impl": impl}
    if ms:
        med = statistics.median(ms)
        row.update(median_ms=med, min_ms=min(ms), input_gbps=in_bytes / (med * 1e-3) / 1e9, reps=len(ms))
        if copy_gbps:
            row["vs_copy"] = row["input_gbps"] / copy_gbps
    if gpu_ms:
        row.update(gpu_ms=gpu_ms, gpu_input_gbps=in_bytes / (gpu_ms * 1e-3) / 1e9)
    row.update(extra)
    return row


# ---- main -----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dtensor_fp8.benchmarks quantize", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=None, help="rows = cols of the input (default 8192 on CUDA, 1024 on CPU)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--reps", type=int, default=25, help=f"timed calls per row (>= {_MIN_REPS})")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--buffers", type=int, default=_MIN_BUFFERS, help=f"rotating inputs (>= {_MIN_BUFFERS})")
    p.add_argument("--recipes", default=None, help=f"comma-separated subset of {','.join(_recipes())}")
    p.add_argument("--no-te", action="store_true", help="do not import Transformer Engine")
    p.add_argument("--out", default="bench_out", help="directory for quantize.json (default ./bench_out)")
    args = p.parse_args(argv)
    if args.reps < _MIN_REPS or args.buffers < _MIN_BUFFERS:
        p.error(f"--reps must be >= {_MIN_REPS} and --buffers >= {_MIN_BUFFERS}")

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    size = args.size or (8192 if device.type == "cuda" else 1024)
    dtype = _DTYPES[args.dtype]
    recipes = _recipes()
    if args.recipes:
        unknown = set(args.recipes.split(",")) - set(recipes)
        if unknown:
            p.error(f"unknown recipes {sorted(unknown)}; choose from {sorted(recipes)}")
        recipes = {k: v for k, v in recipes.items() if k in args.recipes.split(",")}

    cc = torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    te_ns, te_reason = (None, "--no-te") if args.no_te else _import_te()

    gen = torch.Generator(device=device).manual_seed(0)
    inputs = [torch.randn(size, size, generator=gen, device=device, dtype=torch.float32).to(dtype) for _ in range(args.buffers)]
    shape = (size, size)
    in_bytes = inputs[0].numel() * inputs[0].element_size()
    timing = dict(reps=args.reps, warmup=args.warmup, device=device)

    arch = f" (sm_{cc[0]}{cc[1]})" if device.type == "cuda" else ""
    te_desc = te_ns.version if te_ns else f"not used ({te_reason})"
    print(f"# quantize benchmark: {size}x{size} {args.dtype} on {device_name}{arch}; "
          f"torch {torch.__version__}; TE {te_desc}", flush=True)

    rows = []
    pairs = [(x, torch.empty_like(x)) for x in inputs]  # (src, dst), rotated like the inputs
    copy_ms = time_calls(lambda pair: pair[1].copy_(pair[0]), pairs, **timing)
    copy = _row("-", "copy", copy_ms, in_bytes, None, time_gpu(lambda pair: pair[1].copy_(pair[0]), pairs, **timing))
    copy["read_write_gbps"] = 2 * in_bytes / (copy["median_ms"] * 1e-3) / 1e9
    copy_gbps = copy["input_gbps"]
    rows.append(copy)

    for name, recipe in recipes.items():
        kw = {"scale": torch.tensor(_DELAYED_SCALE, device=device)} if name in _GIVEN_SCALE else {}
        ours = lambda x, r=recipe, kw=kw: d.quantize(x, r, rowwise=True, columnwise=True, **kw)  # noqa: E731
        try:
            with te_kernels.reference_only():
                rows.append(_row(name, "ours", time_calls(ours, inputs, **timing), in_bytes, copy_gbps))
                rows.append(_row(name, "ours+te_layout", time_calls(lambda x, f=ours: d.te_layout(f(x)), inputs, **timing), in_bytes, copy_gbps))
                reference = d.te_layout(ours(inputs[0]))  # TE's layout by the reference too (its transposes)
        except Exception as e:  # noqa: BLE001
            rows.append(_row(name, "ours", None, in_bytes, copy_gbps, note=f"failed: {type(e).__name__}: {e}"[:200]))
            continue
        for impl, paths in (("ours_triton", dict(te=False, triton=True)), ("ours_te_kernels", dict(te=True, triton=False))):
            with te_kernels.kernel_paths(**paths):
                path = triton_kernels.fast_path(recipe, inputs[0])
                if path is None:
                    why = ("needs CUDA and triton" if impl == "ours_triton" else "needs CUDA and TE, and a TE kernel for the recipe")
                    rows.append(_row(name, impl, None, in_bytes, copy_gbps, note=f"not run: {why}"))
                    continue
                try:
                    ms = time_calls(ours, inputs, **timing)
                    gpu_ms = time_gpu(ours, inputs, **timing)
                    exact = _bit_exact(reference, d.te_layout(ours(inputs[0])), shape, recipe)
                    rows.append(_row(name, impl, ms, in_bytes, copy_gbps, gpu_ms, bit_exact_vs_ours=exact))
                except Exception as e:  # noqa: BLE001
                    rows.append(_row(name, impl, None, in_bytes, copy_gbps, note=f"failed: {type(e).__name__}: {e}"[:200]))
        with te_kernels.kernel_paths(te=True, triton=True):
            chosen = triton_kernels.fast_path(recipe, inputs[0])
        rows[-1]["default_path"] = chosen or "reference"
        if te_ns is None:
            rows.append(_row(name, "te", None, in_bytes, copy_gbps, note=f"not run: {te_reason}"))
            continue
        quantizer, why = _te_quantizer(recipe, device, cc, kw.get("scale"))
        if quantizer is None:
            rows.append(_row(name, "te", None, in_bytes, copy_gbps, note=f"not run: {why}"))
            continue
        try:
            ms = time_calls(_te_call(quantizer), inputs, **timing)
            gpu_ms = time_gpu(_te_call(quantizer), inputs, **timing)
            ref = reference
            exact = _bit_exact(ref, _te_buffers(_te_call(quantizer)(inputs[0]), ref), shape, recipe)
            rows.append(_row(name, "te", ms, in_bytes, copy_gbps, gpu_ms, bit_exact_vs_ours=exact))
        except Exception as e:  # noqa: BLE001
            rows.append(_row(name, "te", None, in_bytes, copy_gbps, note=f"failed: {type(e).__name__}: {e}"[:200]))

    table = format_table(rows, copy)
    print(table)
    meta = {
        "benchmark": "quantize", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name, "device_type": device.type, "compute_capability": list(cc),
        "torch": torch.__version__, "cuda": torch.version.cuda, "transformer_engine": te_ns.version if te_ns else None,
        "te_note": te_reason, "python": platform.python_version(), "shape": list(shape), "dtype": args.dtype,
        "input_bytes": in_bytes, "reps": args.reps, "warmup": args.warmup, "buffers": args.buffers,
        "gbps_definition": "input bytes read (numel * itemsize) / median time; copy also as read+write; "
                           "gpu_*: the same with the GPU time per call, host ahead (time_gpu)",
        "argv": sys.argv,
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "quantize.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "copy": copy, "results": rows, "table_markdown": table}, f, indent=1)
    print(f"\nwrote {path}")
    return 0


def format_table(rows: list[dict], copy: dict) -> str:
    head = ("| recipe | impl | median ms | min ms | GB/s (input read) | vs copy | GPU ms, host ahead | GB/s (GPU) "
            "| bit-exact vs ours | note |")
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        if "median_ms" in r:
            vs = f"{r['vs_copy']:.3f}" if "vs_copy" in r else "1.000"
            note = r.get("note", "")
            if "default_path" in r:
                note = (note + f"; default fast path: {r['default_path']}").lstrip("; ")
            if r["impl"] == "copy":
                note = f"read+write {r['read_write_gbps']:.0f} GB/s"
            gpu = (f"{r['gpu_ms']:.4f} | {r['gpu_input_gbps']:.1f}" if "gpu_ms" in r else "- | -")
            lines.append(f"| {r['recipe']} | {r['impl']} | {r['median_ms']:.4f} | {r['min_ms']:.4f} | "
                         f"{r['input_gbps']:.1f} | {vs} | {gpu} | {r.get('bit_exact_vs_ours', '')} | {note} |")
        else:
            lines.append(f"| {r['recipe']} | {r['impl']} | - | - | - | - | - | - | | {r.get('note', '')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
