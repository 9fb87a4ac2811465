"""Training-step time and peak memory of plain-torch transformer blocks (``nn.Linear``) under
FSDP2 on one GPU: bf16 parameters vs dtensor_fp8 FP8 parameters with FP8 GEMMs.

``python -m dtensor_fp8.benchmarks linear_step [--layers 4 --hidden 4096 --ffn 16384 --heads 32
--seq 2048 --batch 2 --variants ... --compile --profile --host-profile N --out DIR]``

Model: ``layers`` x a pre-norm block written in plain torch, shaped like te_step's
``te.TransformerLayer``: ``LayerNorm -> Linear(h, 3h) -> causal SDPA -> Linear(h, h) -> +x ->
LayerNorm -> Linear(h, ffn) -> GELU(tanh) -> Linear(ffn, h) -> +x``, biases on, bf16, input
``(seq, batch, hidden)``, loss ``out.float().pow(2).mean()``; ``fully_shard`` on each block, then
the root, over an NCCL group of size 1; ``torch.optim.Adam(fused=True)``. Variants:

* ``bf16``: bf16 parameters, bf16 GEMMs (torch's ``nn.Linear``).
* ``{current,blockwise2d}_{bf16,fp32}_masters``: :func:`dtensor_fp8.quantize_module_` (the
  ``nn.Linear`` weights become FP8 ``QuantizedTensor`` s), ``F.linear`` runs FP8 GEMMs on the
  gathered planes (dtensor_fp8/gemm.py), :class:`dtensor_fp8.MasterWeightOptimizer` with bf16 or
  FP32 masters. The first warm-up step counts the FP8 GEMMs that ran (must be 3 per linear).
* ``te_{current,blockwise2d}``: te_step's variant (e) (TE TransformerLayers with dtensor_fp8
  parameters, bf16 masters), built by ``benchmarks/te_step``'s ``build_variant``, for reference.
* ``torchao``: torchao's ``Float8Linear`` (tensorwise dynamic scaling, bf16 parameters), when
  torchao imports (it is not installed on the GPU image: carry its wheel, see docs/benchmarks.md).
* with ``--compile``: ``*_compiled`` rows, each block ``torch.compile``'d before ``fully_shard``
  (torchtitan's order); a variant whose compilation fails is reported as
  ``compile failed: <reason>`` and the run goes on.

Timing: ``--warmup`` steps, then ``--steps`` steps each between ``synchronize()`` with CUDA events
(median reported) and the host's time to issue it. Memory: peak allocated over the timed steps
(reset after warm-up), minus what was allocated before the variant was built. Each row also has a
*predicted* GPU time from counting FLOPs and bytes (:func:`predict`, the method of
``.library/device/METHOD.md``): the floor the step cannot go under without overlap of compute
and memory traffic, at the H200's measured ceilings (bf16 GEMM 790 TFLOP/s; FP8 tensorwise 1.82x,
1x128 x 128x128 1.68x, 1x128 x 1x128 1.33x of it; flash attention ~450 TFLOP/s; memory
3.3 TB/s). A measured time far above it with host ms close to the step is host-bound.
The table goes to stdout, the JSON to ``--out/linear_step.json``. ``--profile`` adds a
``torch.profiler`` table of two more steps per variant (``--out/profile_<variant>.txt``, with the
GPU time of kernels and copies per step in the JSON: a step longer than that waited for the
host), ``--trace`` with it the Chrome trace (``gpu_gaps.py`` reads where the GPU
waited), ``--host-profile N`` a cProfile table of N more steps (``host_profile.py``).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.nn.functional as F
from torch import nn

from .host_profile import host_profile

GIB = 2**30
OURS = {f"{r}_{m}_masters": (r, m) for r in ("current", "blockwise2d") for m in ("bf16", "fp32")}
TE_ROWS = {"te_current": "current", "te_blockwise2d": "blockwise2d"}
EAGER = ["bf16", *OURS, *TE_ROWS, "torchao"]
COMPILABLE = ["bf16", *OURS, "torchao"]

# Ceilings measured on the H200 (docs/benchmarks.md, issue 18): GEMM rates and memory bandwidth.
BF16_FLOPS = 790e12
FP8_SPEEDUP = {"current": (1.82, 1.82), "blockwise2d": (1.68, 1.33)}  # (fprop/dgrad, wgrad) vs bf16
ATTN_FLOPS = 450e12
BANDWIDTH = 3.3e12


class Block(nn.Module):
    """A pre-norm transformer block of plain torch modules (te.TransformerLayer's shape)."""

    def __init__(self, hidden: int, ffn: int, heads: int, device, dtype):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden, **kw), nn.LayerNorm(hidden, **kw)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden, **kw), nn.Linear(hidden, hidden, **kw)
        self.fc1, self.fc2 = nn.Linear(hidden, ffn, **kw), nn.Linear(ffn, hidden, **kw)

    def forward(self, x):
        s, b, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(s, b, 3, self.heads, h // self.heads).permute(2, 1, 3, 0, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(s, b, h)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.ModuleList(Block(cfg.hidden, cfg.ffn, cfg.heads, "cuda", torch.bfloat16) for _ in range(cfg.layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def predict(cfg, variant: str) -> dict:
    """GPU-time floor of one step (ms) from FLOPs and bytes, by part (see the module docstring)."""
    h, f, t, n = cfg.hidden, cfg.ffn, cfg.seq * cfg.batch, cfg.layers
    params = n * (3 * h * h + h * h + 2 * h * f)  # GEMM weights
    flops = 6 * t * params
    recipe, master = OURS.get(variant.removesuffix("_compiled"), (None, None))
    if variant in TE_ROWS:
        recipe, master = TE_ROWS[variant], "bf16"
    if recipe is None and variant.startswith("torchao"):
        recipe, master = "current", "bf16_params"
    if recipe is None:
        gemm_ms = flops / BF16_FLOPS * 1e3
    else:
        fwd_dgrad, wgrad = FP8_SPEEDUP[recipe]
        gemm_ms = (flops * 2 / 3 / (BF16_FLOPS * fwd_dgrad) + flops / 3 / (BF16_FLOPS * wgrad)) * 1e3
    attn_ms = n * 3.5 * 2 * cfg.batch * cfg.seq**2 * h / ATTN_FLOPS * 1e3  # causal fwd + 2.5x bwd
    # Elementwise (norms, GELU, residuals, biases, attention layout copies): ~3x the forward's bytes.
    elementwise = n * 3 * t * (30 * h + 8 * f)
    quant = 0
    if recipe is not None:  # activations (x) and output gradients (dy) of every linear
        x_elems, dy_elems = n * t * (3 * h + f), n * t * (5 * h + f)
        per_elem = 6 if recipe == "current" else 4  # per-tensor: amax pass + cast+transpose; block: one pass
        quant = (x_elems + dy_elems) * per_elem + (params * 2 if recipe in ("current", "blockwise2d") else 0)
    per_param = {None: 22 + 24, "bf16": 27 + 16, "fp32": 43 + 16, "bf16_params": 22 + 24}[master]  # Adam + FSDP copies
    optimizer_fsdp = params * per_param
    mem_ms = (elementwise + quant + optimizer_fsdp) / BANDWIDTH * 1e3
    return {"gemm_ms": gemm_ms, "attention_ms": attn_ms, "memory_ms": mem_ms, "total_ms": gemm_ms + attn_ms + mem_ms,
            "gemm_tflop": flops / 1e12, "memory_gb": (elementwise + quant + optimizer_fsdp) / 1e9}


# ---- variants -----------------------------------------------------------------------------------
def _shard(model, mesh, compiled: bool):
    from torch.distributed.fsdp import fully_shard

    if compiled:  # torchtitan's order: compile each block, then shard the compiled module
        for i, layer in enumerate(model.layers):
            model.layers[i] = torch.compile(layer)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _setup(variant: str, cfg, mesh):
    import dtensor_fp8 as d

    base = variant.removesuffix("_compiled")
    compiled = variant.endswith("_compiled")
    torch.manual_seed(cfg.seed)
    model = Model(cfg)
    notes = {}
    if base == "bf16":
        model = _shard(model, mesh, compiled)
        return model, torch.optim.Adam(model.parameters(), lr=cfg.lr, fused=True), notes
    if base == "torchao":
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model)
        notes["torchao"] = __import__("torchao").__version__
        model = _shard(model, mesh, compiled)
        return model, torch.optim.Adam(model.parameters(), lr=cfg.lr, fused=True), notes
    recipe_name, master = OURS[base]
    recipe = d.RECIPES[recipe_name]
    d.quantize_module_(model, recipe, keep_hp_init=False)
    model = _shard(model, mesh, compiled)
    opt = d.MasterWeightOptimizer(model, torch.optim.Adam, lr=cfg.lr, fused=True, nonfinite=cfg.nonfinite,
                                  master_dtype=torch.bfloat16 if master == "bf16" else torch.float32)
    return model, opt, notes


def _fp8_shards(model) -> str:
    import dtensor_fp8 as d
    from torch.distributed.tensor import DTensor

    ws = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() == 2]
    good = sum(isinstance(p, DTensor) and isinstance(p.to_local(), d.QuantizedTensor) for p in ws)
    return f"{good}/{len(ws)}"


def _measure(row: dict, step, cfg, base_mem: int, losses: list) -> None:
    """The rest of the warm-up, then the timed steps of ``step()`` (one training step -> loss)."""
    for _ in range(cfg.warmup - len(losses)):
        losses.append(step())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms, host = [], []
    for _ in range(cfg.steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        losses.append(step())
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        torch.cuda.synchronize()
        ms.append(start.elapsed_time(end))
    vals = [float(v) for v in torch.stack(losses).cpu()]
    row.update(status="ok", step_ms=ms, host_ms=host, median_ms=statistics.median(ms), min_ms=min(ms),
               median_host_ms=statistics.median(host),
               step_peak_gib=(torch.cuda.max_memory_allocated() - base_mem) / GIB,
               loss_first=vals[0], loss_last=vals[-1], losses_finite=all(math.isfinite(v) for v in vals))
    if cfg.profile:
        from .te_step.timing import profile

        row["profile"] = profile(step, cfg.out, row["variant"], trace=cfg.trace)
    if cfg.host_profile:
        row["host_profile"] = host_profile(step, cfg.host_profile,
                                           os.path.join(cfg.out, f"host_profile_{row['variant']}.txt"))


def _fresh() -> int:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _failed(row: dict, e: Exception) -> None:
    if isinstance(e, torch.cuda.OutOfMemoryError):
        row.update(status="OOM", error=str(e).splitlines()[0][:300])
    else:
        row.update(status="error", error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300],
                   traceback=traceback.format_exc()[-3000:])


def run_variant(variant: str, cfg, mesh) -> dict:
    from dtensor_fp8 import gemm

    row = {"variant": variant, "prediction": predict(cfg, variant)}
    base_mem = _fresh()
    model = opt = None
    try:
        try:
            model, opt, notes = _setup(variant, cfg, mesh)
        except ImportError as e:
            row.update(status="not run", error=f"{type(e).__name__}: {e}"[:300])
            return row
        row.update(notes)
        g = torch.Generator(device="cuda").manual_seed(cfg.seed + 1)
        x = torch.randn(cfg.seq, cfg.batch, cfg.hidden, device="cuda", dtype=torch.bfloat16, generator=g)

        def step():
            loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        losses = []
        try:
            with gemm.recording() as log:  # the first step: which GEMMs ran in FP8
                losses.append(step())
                row["fp8_gemms_first_step"] = len(log)
                log.clear()
        except Exception as e:  # noqa: BLE001
            if variant.endswith("_compiled"):
                row.update(status="compile failed", error=f"compile failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}",
                           traceback=traceback.format_exc()[-3000:])
                return row
            raise
        if variant.removesuffix("_compiled") in OURS:
            expected = 3 * 4 * cfg.layers
            row["fp8_weights"] = _fp8_shards(model)
            if row["fp8_gemms_first_step"] != expected:
                row["warning"] = f"{row['fp8_gemms_first_step']} FP8 GEMMs in a step, expected {expected}"
        _measure(row, step, cfg, base_mem, losses)
    except Exception as e:  # noqa: BLE001  (recorded; the run goes on)
        _failed(row, e)
    finally:
        model = opt = None  # noqa: F841
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return row


def run_te_row(name: str, cfg, mesh) -> dict:
    """te_step's variant (e) for one recipe: TE TransformerLayers with dtensor_fp8 parameters and
    bf16 masters, built by te_step's public ``build_variant`` (the only coupling to te_step) and
    timed here like the other rows."""
    from .te_step import StepConfig, build_variant

    row = {"variant": name, "prediction": predict(cfg, name),
           "te_step_variant": "(e) TE TransformerLayer, dtensor_fp8 params, bf16 masters"}
    base_mem = _fresh()
    v = None
    try:
        step_cfg = StepConfig(layers=cfg.layers, hidden=cfg.hidden, ffn=cfg.ffn, heads=cfg.heads, seq=cfg.seq,
                              batch=cfg.batch, lr=cfg.lr, seed=cfg.seed)
        try:
            v = build_variant("e", TE_ROWS[name], step_cfg, mesh)
        except ImportError as e:
            row.update(status="not run", error=f"TE does not import: {e}"[:300])
            return row
        _measure(row, v.step, cfg, base_mem, [])
    except Exception as e:  # noqa: BLE001
        _failed(row, e)
    finally:
        v = None  # noqa: F841
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return row


# ---- report -------------------------------------------------------------------------------------
def format_table(rows: list[dict]) -> str:
    by = {r["variant"]: r for r in rows}
    bf16 = by.get("bf16") if by.get("bf16", {}).get("status") == "ok" else None
    lines = ["| variant | ms / step | host ms | peak GiB | vs bf16 | vs TE (e) | predicted GPU ms | FP8 GEMMs / step | note |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        pred = r.get("prediction", {}).get("total_ms")
        pred_s = f"{pred:.1f}" if pred else "-"
        if r.get("status") != "ok":
            lines.append(f"| {r['variant']} | - | - | - | - | - | {pred_s} | | {r.get('status')}: {r.get('error', '')} |")
            continue
        vs = f"{r['median_ms'] / bf16['median_ms']:.3f}" if bf16 else "-"
        recipe = next((rc for rc in ("current", "blockwise2d") if r["variant"].startswith(rc)), None)
        te = by.get(f"te_{recipe}") if recipe else None
        vs_te = f"{r['median_ms'] / te['median_ms']:.3f}" if te and te.get("status") == "ok" else "-"
        note = r.get("warning", "")
        if "fp8_weights" in r:
            note = (f"FP8 weights {r['fp8_weights']}; " + note).strip("; ")
        lines.append(f"| {r['variant']} | {r['median_ms']:.1f} | {r.get('median_host_ms', 0):.1f} | "
                     f"{r['step_peak_gib']:.2f} | {vs} | {vs_te} | {pred_s} | {r.get('fp8_gemms_first_step', '-')} | {note} |")
    lines.append("")
    lines.append("ms / step: median CUDA-event time of a step (forward + backward + optimizer + zero_grad); host ms: time "
                 "to issue it; peak GiB: max allocated over the timed steps; predicted: GPU floor from FLOPs and bytes "
                 "(predict()); vs TE (e): against te_step (e) of the same recipe.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from .te_step.variants import add_model_arguments  # no TE import: variants imports TE lazily

    p = argparse.ArgumentParser(prog="python -m dtensor_fp8.benchmarks linear_step", description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nonfinite", choices=("raise", "skip", "ignore"), default="raise",
                   help="MasterWeightOptimizer's non-finite gradient check (default: the library's, raise)")
    p.add_argument("--variants", default=",".join(EAGER), help=f"comma-separated subset of {','.join(EAGER)}")
    p.add_argument("--compile", action="store_true", help="also run the *_compiled rows (blocks torch.compile'd)")
    p.add_argument("--profile", action="store_true", help="also profile 2 steps per variant (torch.profiler "
                   "kernel tables to --out/profile_<variant>.txt; GPU-busy vs step time in the JSON)")
    p.add_argument("--trace", action="store_true", help="with --profile: also write the "
                   "Chrome trace (--out/trace_<variant>.json.gz; `python -m dtensor_fp8.benchmarks gpu_gaps` reads it)")
    p.add_argument("--host-profile", type=int, default=0, metavar="N",
                   help="also run N steps per variant under cProfile (--out/host_profile_<variant>.txt)")
    p.add_argument("--predict-only", action="store_true", help="print the predicted GPU floor of each variant and exit")
    p.add_argument("--out", default="bench_out", help="directory for linear_step.json (default ./bench_out)")
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(EAGER)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {EAGER}")
    if args.compile:
        variants += [f"{v}_compiled" for v in variants if v in COMPILABLE]
        # The FP8-GEMM count of a compiled step is recorded while AOT autograd traces F.linear on
        # the FP8 weights; a hit in its on-disk cache (an earlier process) skips that tracing and
        # the count came out short (8 of 48). Trace every time.
        from .. import _compat

        _compat.disable_aot_autograd_cache()
    if args.warmup < 1 or args.steps < 1 or args.hidden % args.heads:
        p.error("--warmup and --steps must be >= 1 and --hidden a multiple of --heads")
    if args.predict_only:
        for v in variants:
            pr = predict(args, v)
            print(f"{v:<32} {pr['total_ms']:6.1f} ms  (GEMM {pr['gemm_ms']:.1f}, attention {pr['attention_ms']:.1f}, "
                  f"memory {pr['memory_ms']:.1f} = {pr['memory_gb']:.1f} GB)")
        return 0
    if not torch.cuda.is_available():
        print("linear_step: no CUDA device; this benchmark needs a GPU. Nothing was run.", file=sys.stderr)
        return 2

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if any(v.startswith("te_") for v in variants):
        # Transformer Engine is imported before any step runs: once torch's attention has loaded its
        # own cuDNN, TE's import can bind the system's other cuDNN build and fail (seen on the H200:
        # "libcudnn_cnn.so.9: undefined symbol"), which te_step, importing TE first, never meets.
        try:
            import transformer_engine.pytorch  # noqa: F401
        except Exception:  # noqa: BLE001  (the te_* rows then say why they did not run)
            pass
    torch.cuda.set_device(0)
    cc = torch.cuda.get_device_capability()
    name = torch.cuda.get_device_name()
    print(f"# linear_step: {args.layers} x Block(hidden={args.hidden}, ffn={args.ffn}, heads={args.heads}), input "
          f"{args.seq}x{args.batch}; {name} (sm_{cc[0]}{cc[1]}); torch {torch.__version__}", flush=True)
    rows = []
    meta = {"benchmark": "linear_step", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": name, "compute_capability": list(cc), "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "argv": sys.argv,
            "config": {k: getattr(args, k) for k in ("layers", "hidden", "ffn", "heads", "seq", "batch", "steps", "warmup", "lr")}}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "linear_step.json")

    def write(table=None):  # after every variant: a run cut short still leaves its rows
        with open(path, "w") as f:
            json.dump({"meta": meta, "results": rows, "table_markdown": table or format_table(rows)}, f, indent=1, default=str)

    with tempfile.TemporaryDirectory() as tmp:
        if not dist.is_initialized():
            store = dist.FileStore(os.path.join(tmp, "store"), 1)
            dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
        mesh = init_device_mesh("cuda", (1,))
        try:
            for v in variants:
                t0 = time.perf_counter()
                r = run_te_row(v, args, mesh) if v in TE_ROWS else run_variant(v, args, mesh)
                r["wall_s"] = time.perf_counter() - t0
                rows.append(r)
                msg = (f"{r['median_ms']:.2f} ms, peak {r['step_peak_gib']:.2f} GiB" if r.get("status") == "ok"
                       else f"{r.get('status')}: {r.get('error')}")
                print(f"  {v:<32} {msg}  [{r['wall_s']:.1f} s]", flush=True)
                write()
        finally:
            dist.destroy_process_group()
    table = format_table(rows)
    print()
    print(table)
    write(table)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
