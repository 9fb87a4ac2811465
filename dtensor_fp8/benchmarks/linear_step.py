"""Training-step time, tokens/s, MFU and peak memory of plain-torch decoder blocks (``nn.Linear``)
under FSDP2 on one device: bf16 parameters vs dtensor_fp8 FP8 parameters with FP8 GEMMs.

``python -m dtensor_fp8.benchmarks linear_step [--shape te-default|llama3-8b|toy --layers N ...
--variants ... --compile --profile --host-profile N --device cuda|cpu --out DIR]``

Model: ``layers`` x a pre-norm block written in plain torch in the ``--shape`` preset's form
(benchmarks/shapes.py): ``norm -> Linear(h, qkv) -> causal SDPA (grouped-query: KV heads
repeated) -> Linear(h, h) -> +x -> norm -> Linear(h, ffn or 2 ffn) -> GELU(tanh) or SwiGLU ->
Linear(ffn, h) -> +x``; ``te-default`` is te_step's ``te.TransformerLayer`` (LayerNorm, GELU,
biases), ``llama3-8b`` a Llama3-8B decoder layer (RMSNorm, 32/8 heads, SwiGLU, no biases) at seq
8192 x batch 1; bf16, input ``(seq, batch, hidden)``, loss ``out.float().pow(2).mean()``;
``fully_shard`` on each block, then the root, over a one-rank group (NCCL; gloo with ``--device
cpu``, where ``--shape toy`` runs in the CPU suite); ``torch.optim.Adam(fused=True)``. Variants:

* ``bf16``: bf16 parameters, bf16 GEMMs (torch's ``nn.Linear``).
* ``{current,blockwise2d}_{bf16,fp32}_masters``: :func:`dtensor_fp8.quantize_module_` (the
  ``nn.Linear`` weights become FP8 ``QuantizedTensor`` s), ``F.linear`` runs FP8 GEMMs on the
  gathered planes (dtensor_fp8/gemm.py), :class:`dtensor_fp8.MasterWeightOptimizer` with bf16 or
  FP32 masters. The second warm-up step counts the FP8 GEMMs that ran, at run time from the
  profiler, compiled rows too (must be 3 per linear: :func:`scaled_gemms_in`).
* ``te_{current,blockwise2d}``: te_step's variant (e) (TE TransformerLayers with dtensor_fp8
  parameters, bf16 masters), built by ``benchmarks/te_step``'s ``build_variant``, for reference.
* ``torchao``: torchao's ``Float8Linear`` (tensorwise dynamic scaling, bf16 parameters), when
  torchao imports (it is not installed on the GPU image: carry its wheel, see docs/benchmarks.md).
* ``*_compiled`` (named, or all with ``--compile``): each block ``torch.compile``'d before ``fully_shard``
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
waited), ``--host-profile N`` a cProfile table of N more steps (``host_profile.py``),
``--memory-at-peak`` what is alive at one step's peak, by allocation site (``peak_memory.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
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

from .host_profile import add_profiling_args, host_profile
from .shapes import ModelShape, add_shape_arguments, mfu, peak_flops, shape_from_args, tokens_per_s

GIB = 2**30
OURS = {f"{r}_{m}_masters": (r, m) for r in ("current", "blockwise2d") for m in ("bf16", "fp32")}
TE_ROWS = {"te_current": "current", "te_blockwise2d": "blockwise2d"}
EAGER = ["bf16", *OURS, *TE_ROWS, "torchao"]
COMPILABLE = ["bf16", *OURS, "torchao"]
ALL = EAGER + [f"{v}_compiled" for v in COMPILABLE]

# Ceilings measured on the H200 (docs/benchmarks.md, issue 18): GEMM rates and memory bandwidth.
BF16_FLOPS = 790e12
FP8_SPEEDUP = {"current": (1.82, 1.82), "blockwise2d": (1.68, 1.33)}  # (fprop/dgrad, wgrad) vs bf16
ATTN_FLOPS = 450e12
BANDWIDTH = 3.3e12


class Block(nn.Module):
    """A pre-norm decoder block of plain torch modules in ``shape``'s form: te.TransformerLayer's
    (LayerNorm, GELU, biases) or Llama's (RMSNorm, grouped-query attention, SwiGLU, no biases)."""

    def __init__(self, shape: ModelShape, device, dtype):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        norm = nn.RMSNorm if shape.norm == "rmsnorm" else nn.LayerNorm
        self.shape = shape
        self.ln1, self.ln2 = norm(shape.hidden, **kw), norm(shape.hidden, **kw)
        linears = {name: nn.Linear(i, o, bias=shape.bias, **kw) for name, (o, i) in shape.linear_shapes().items()}
        self.qkv, self.proj, self.fc1, self.fc2 = (linears[n] for n in ("qkv", "proj", "fc1", "fc2"))

    def forward(self, x):
        sh = self.shape
        s, b, h = x.shape
        d, kv = sh.head_dim, sh.kv_heads * sh.head_dim
        q, k, v = self.qkv(self.ln1(x)).split([h, kv, kv], dim=-1)
        q = q.reshape(s, b, sh.heads, d).permute(1, 2, 0, 3)
        k, v = (t.reshape(s, b, sh.kv_heads, 1, d).expand(s, b, sh.kv_heads, sh.heads // sh.kv_heads, d)
                .reshape(s, b, sh.heads, d).permute(1, 2, 0, 3) for t in (k, v))  # GQA: KV heads repeated (HF's repeat_kv)
        return self.attention_and_mlp(x, q, k, v)

    def attention_and_mlp(self, x, q, k, v):
        """The block after its query / key / value heads (``(batch, heads, seq, head_dim)``, KV heads
        already repeated): causal attention, the output projection's residual, then the MLP's."""
        s, b, h = x.shape
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(s, b, h)
        x = x + self.proj(a)
        y = self.fc1(self.ln2(x))
        if self.shape.mlp == "swiglu":
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        else:
            y = F.gelu(y, approximate="tanh")
        return x + self.fc2(y)


class Model(nn.Module):
    def __init__(self, shape: ModelShape, device):
        super().__init__()
        self.layers = nn.ModuleList(Block(shape, device, torch.bfloat16) for _ in range(shape.layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def predict(cfg, variant: str) -> dict:
    """GPU-time floor of one step (ms) from FLOPs and bytes, by part (see the module docstring)."""
    shape = cfg.model_shape
    h, t, n = shape.hidden, shape.tokens, shape.layers
    fc1_out = shape.linear_shapes()["fc1"][0]
    params = shape.gemm_params
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
    attn_ms = n * 3.5 * 2 * shape.batch * shape.seq**2 * h / ATTN_FLOPS * 1e3  # causal fwd + 2.5x bwd
    # Elementwise (norms, GELU/SwiGLU, residuals, biases, attention layout copies): ~3x the forward's bytes.
    elementwise = n * 3 * t * (30 * h + 8 * fc1_out)
    quant = 0
    if recipe is not None:  # activations (x) and output gradients (dy) of every linear
        linears = shape.linear_shapes().values()
        x_elems, dy_elems = n * t * sum(i for _, i in linears), n * t * sum(o for o, _ in linears)
        per_elem = 6 if recipe == "current" else 4  # per-tensor: amax pass + cast+transpose; block: one pass
        quant = (x_elems + dy_elems) * per_elem + (params * 2 if recipe in ("current", "blockwise2d") else 0)
    per_param = {None: 22 + 24, "bf16": 27 + 16, "fp32": 43 + 16, "bf16_params": 22 + 24}[master]  # Adam + FSDP copies
    optimizer_fsdp = params * per_param
    mem_ms = (elementwise + quant + optimizer_fsdp) / BANDWIDTH * 1e3
    return {"gemm_ms": gemm_ms, "attention_ms": attn_ms, "memory_ms": mem_ms, "total_ms": gemm_ms + attn_ms + mem_ms,
            "gemm_tflop": flops / 1e12, "memory_gb": (elementwise + quant + optimizer_fsdp) / 1e9}


# ---- variants -----------------------------------------------------------------------------------
def shard_layers(model, mesh, compiled: bool):
    """``fully_shard`` each of ``model.layers``, then the root, over ``mesh``; with ``compiled`` each
    layer is ``torch.compile``d first."""
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
    model = Model(cfg.model_shape, cfg.device)
    notes = {}
    if base == "bf16":
        model = shard_layers(model, mesh, compiled)
        return model, torch.optim.Adam(model.parameters(), lr=cfg.lr, fused=True), notes
    if base == "torchao":
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model)
        notes["torchao"] = __import__("torchao").__version__
        model = shard_layers(model, mesh, compiled)
        return model, torch.optim.Adam(model.parameters(), lr=cfg.lr, fused=True), notes
    recipe_name, master = OURS[base]
    recipe = d.RECIPES[recipe_name]
    d.quantize_module_(model, recipe, keep_hp_init=False)
    model = shard_layers(model, mesh, compiled)
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
    cuda = cfg.device == "cuda"
    for _ in range(cfg.warmup - len(losses)):
        losses.append(step())
    if cuda:  # the peak of the timed steps alone; the allocator's cache stays warm
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    ms, host = [], []
    for _ in range(cfg.steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if cuda:
            start.record()
        losses.append(step())
        host.append((time.perf_counter() - t0) * 1e3)
        if cuda:
            end.record()
            torch.cuda.synchronize()
            ms.append(start.elapsed_time(end))
        else:  # the CPU ran the step while issuing it
            ms.append(host[-1])
    vals = [float(v) for v in torch.stack(losses).cpu()]
    shape, median = cfg.model_shape, statistics.median(ms)
    row.update(status="ok", step_ms=ms, host_ms=host, median_ms=median, min_ms=min(ms),
               median_host_ms=statistics.median(host),
               tokens_per_s=tokens_per_s(shape, median), mfu=mfu(shape, median, cfg.peak_flops),
               step_peak_gib=(torch.cuda.max_memory_allocated() - base_mem) / GIB if cuda else None,
               loss_first=vals[0], loss_last=vals[-1], losses_finite=all(math.isfinite(v) for v in vals))
    if cfg.profile:
        from .te_step.timing import profile

        row["profile"] = profile(step, cfg.out, row["variant"], trace=cfg.trace)
    if cfg.host_profile:
        row["host_profile"] = host_profile(step, cfg.host_profile,
                                           os.path.join(cfg.out, f"host_profile_{row['variant']}.txt"))
    if cfg.memory_at_peak and cuda:
        from .peak_memory import memory_at_peak

        row["memory_at_peak"] = memory_at_peak(step, os.path.join(cfg.out, f"peak_memory_{row['variant']}.txt"))


def scaled_gemms_in(step, losses: list) -> int:
    """How many FP8 GEMMs one call of ``step`` runs: torch's scaled-GEMM ops (``aten::_scaled_mm``
    and its successors) as the profiler sees them at run time, so calls from a compiled graph
    count too (counting our F.linear's calls would count tracing, which compiled code skips once
    a graph is cached); an op called from another scaled-GEMM op is not counted again."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        losses.append(step())

    def scaled(e) -> bool:
        return e is not None and e.name.startswith("aten::") and "scaled_mm" in e.name

    return sum(1 for e in prof.events() if scaled(e) and not scaled(e.cpu_parent))


def _fresh(device: str) -> int:
    """Free what can be freed and restart the peak: the bytes allocated now (CUDA; 0 on the CPU,
    whose allocations torch does not count)."""
    gc.collect()
    if device != "cuda":
        return 0
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _failed(row: dict, e: Exception) -> None:
    if isinstance(e, torch.OutOfMemoryError):
        row.update(status="OOM", error=str(e).splitlines()[0][:300])
    else:
        row.update(status="error", error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300],
                   traceback=traceback.format_exc()[-12000:])


def run_variant(variant: str, cfg, mesh) -> dict:
    from dtensor_fp8 import gemm

    row = {"variant": variant, "prediction": predict(cfg, variant)}
    base_mem = _fresh(cfg.device)
    model = opt = None
    try:
        try:
            model, opt, notes = _setup(variant, cfg, mesh)
        except ImportError as e:
            row.update(status="not run", error=f"{type(e).__name__}: {e}"[:300])
            return row
        row.update(notes)
        g = torch.Generator(device=cfg.device).manual_seed(cfg.seed + 1)
        shape = cfg.model_shape
        x = torch.randn(shape.seq, shape.batch, shape.hidden, device=cfg.device, dtype=torch.bfloat16, generator=g)

        def step():
            loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        losses = []
        try:
            losses.append(step())  # compiles the compiled rows
        except Exception as e:  # noqa: BLE001
            if variant.endswith("_compiled"):
                row.update(status="compile failed", error=f"compile failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}",
                           traceback=traceback.format_exc()[-12000:])
                return row
            raise
        row["fp8_gemms_per_step"] = scaled_gemms_in(step, losses)
        if variant.removesuffix("_compiled") in OURS:
            expected = 3 * 4 * cfg.model_shape.layers
            row["fp8_weights"] = _fp8_shards(model)
            if row["fp8_gemms_per_step"] != expected and gemm.expected_on(cfg.device):
                row["warning"] = f"{row['fp8_gemms_per_step']} FP8 GEMMs in a step, expected {expected}"
        _measure(row, step, cfg, base_mem, losses)
    except Exception as e:  # noqa: BLE001  (recorded; the run goes on)
        _failed(row, e)
    finally:
        model = opt = None  # noqa: F841
        _fresh(cfg.device)
    return row


def run_te_row(name: str, cfg, mesh) -> dict:
    """te_step's variant (e) for one recipe: TE TransformerLayers with dtensor_fp8 parameters and
    bf16 masters, built by te_step's public ``build_variant`` (the only coupling to te_step) and
    timed here like the other rows."""
    from .te_step import StepConfig, build_variant

    row = {"variant": name, "prediction": predict(cfg, name),
           "te_step_variant": "(e) TE TransformerLayer, dtensor_fp8 params, bf16 masters"}
    if cfg.device != "cuda":
        row.update(status="not run", error="te_step's variants need Transformer Engine on a CUDA device")
        return row
    base_mem = _fresh(cfg.device)
    v = None
    try:
        step_cfg = StepConfig(model_shape=cfg.model_shape, lr=cfg.lr, seed=cfg.seed)
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
        _fresh(cfg.device)
    return row


# ---- report -------------------------------------------------------------------------------------
def _gib(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def format_table(rows: list[dict]) -> str:
    """The markdown table of ``rows`` (one per variant), ratios against ``bf16`` and te_step (e)."""
    by = {r["variant"]: r for r in rows}
    bf16 = by.get("bf16") if by.get("bf16", {}).get("status") == "ok" else None
    lines = ["| variant | ms / step | tokens/s | MFU | host ms | peak GiB | vs bf16 | vs TE (e) | predicted GPU ms | "
             "FP8 GEMMs / step | note |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        pred = r.get("prediction", {}).get("total_ms")
        pred_s = f"{pred:.1f}" if pred else "-"
        if r.get("status") != "ok":
            lines.append(f"| {r['variant']} | - | - | - | - | - | - | - | {pred_s} | | {r.get('status')}: {r.get('error', '')} |")
            continue
        vs = f"{r['median_ms'] / bf16['median_ms']:.3f}" if bf16 else "-"
        recipe = next((rc for rc in ("current", "blockwise2d") if r["variant"].startswith(rc)), None)
        te = by.get(f"te_{recipe}") if recipe else None
        vs_te = f"{r['median_ms'] / te['median_ms']:.3f}" if te and te.get("status") == "ok" else "-"
        mfu_s = "-" if r.get("mfu") is None else f"{100 * r['mfu']:.1f} %"
        note = r.get("warning", "")
        if "fp8_weights" in r:
            note = (f"FP8 weights {r['fp8_weights']}; " + note).strip("; ")
        lines.append(f"| {r['variant']} | {r['median_ms']:.1f} | {r['tokens_per_s']:,.0f} | {mfu_s} | "
                     f"{r.get('median_host_ms', 0):.1f} | {_gib(r.get('step_peak_gib'))} | {vs} | {vs_te} | {pred_s} | "
                     f"{r.get('fp8_gemms_per_step', '-')} | {note} |")
    lines.append("")
    lines.append("ms / step: median time of a step (forward + backward + optimizer + zero_grad; CUDA events on the GPU); "
                 "MFU: torchtitan's FLOPs per token (benchmarks/shapes.py) x tokens/s over the device's dense bf16 "
                 "peak, FP8 rows too; host ms: time to issue it; peak GiB: max allocated over the timed steps (CUDA); "
                 "predicted: H200 GPU floor from FLOPs and bytes (predict()); vs TE (e): against te_step (e) of the "
                 "same recipe.")
    return "\n".join(lines)


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m dtensor_fp8.benchmarks linear_step", description=__doc__.split("\n\n")[0])
    add_shape_arguments(p)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where to step (default cuda when there is one; the CPU steps small shapes, e.g. --shape toy, "
                        "over a gloo group: te_* rows need CUDA)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's dense bf16 peak for MFU (default: by device name, benchmarks/shapes.py)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nonfinite", choices=("raise", "skip", "ignore"), default="raise",
                   help="MasterWeightOptimizer's non-finite gradient check (default: the library's, raise)")
    p.add_argument("--variants", default=",".join(EAGER), help=f"comma-separated subset of {','.join(ALL)}")
    p.add_argument("--compile", action="store_true", help="also run the *_compiled row of every variant given "
                   "(blocks torch.compile'd)")
    add_profiling_args(p, "<variant>")
    p.add_argument("--memory-at-peak", action="store_true", help="CUDA: also record one step's allocations and write "
                   "what is alive at its peak, by allocation site (--out/peak_memory_<variant>.txt, peak_memory.py)")
    p.add_argument("--predict-only", action="store_true", help="print the predicted GPU floor of each variant and exit")
    p.add_argument("--out", default="bench_out", help="directory for linear_step.json (default ./bench_out)")
    args = p.parse_args(argv)
    args.model_shape = shape_from_args(p, args)
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(ALL)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {ALL}")
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available() and not args.predict_only:
        p.error("--device cuda: no CUDA device here; pass --device cpu (with a small --shape, e.g. toy)")
    if args.compile:
        variants += [f"{v}_compiled" for v in variants if v in COMPILABLE and f"{v}_compiled" not in variants]
    return args, variants


def main(argv: list[str] | None = None) -> int:
    args, variants = _parse(argv)
    shape = args.model_shape
    if args.predict_only:
        for v in variants:
            pr = predict(args, v)
            print(f"{v:<32} {pr['total_ms']:6.1f} ms  (GEMM {pr['gemm_ms']:.1f}, attention {pr['attention_ms']:.1f}, "
                  f"memory {pr['memory_ms']:.1f} = {pr['memory_gb']:.1f} GB)")
        return 0

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    cuda = args.device == "cuda"
    if cuda and any(v.startswith("te_") for v in variants):
        # Transformer Engine is imported before any step runs: once torch's attention has loaded its
        # own cuDNN, TE's import can bind the system's other cuDNN build and fail (seen on the H200:
        # "libcudnn_cnn.so.9: undefined symbol"), which te_step, importing TE first, never meets.
        try:
            import transformer_engine.pytorch  # noqa: F401
        except Exception:  # noqa: BLE001  (the te_* rows then say why they did not run)
            pass
    if cuda:
        torch.cuda.set_device(0)
        cc, name = torch.cuda.get_device_capability(), torch.cuda.get_device_name()
    else:
        cc, name = None, f"CPU ({platform.processor() or platform.machine()})"
    args.peak_flops = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(name) if cuda else None
    print(f"# linear_step: {shape.describe()}; {shape.gemm_params / 1e6:,.1f} M GEMM params, "
          f"{shape.flops_per_token / 1e9:.3f} GFLOP/token; {name}" + (f" (sm_{cc[0]}{cc[1]})" if cc else "")
          + f"; torch {torch.__version__}", flush=True)
    rows = []
    meta = {"benchmark": "linear_step", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": name, "compute_capability": list(cc) if cc else None, "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(), "argv": sys.argv,
            "config": {"shape": args.shape, **dataclasses.asdict(shape), "steps": args.steps, "warmup": args.warmup,
                       "lr": args.lr},
            "gemm_params": shape.gemm_params, "flops_per_token": shape.flops_per_token, "peak_flops": args.peak_flops}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "linear_step.json")

    def write(table=None):  # after every variant: a run cut short still leaves its rows
        with open(path, "w") as f:
            json.dump({"meta": meta, "results": rows, "table_markdown": table or format_table(rows)}, f, indent=1, default=str)

    with tempfile.TemporaryDirectory() as tmp:
        if not dist.is_initialized():
            store = dist.FileStore(os.path.join(tmp, "store"), 1)
            dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1,
                                    **({"device_id": torch.device("cuda", 0)} if cuda else {}))
        mesh = init_device_mesh(args.device, (1,))
        try:
            for v in variants:
                t0 = time.perf_counter()
                r = run_te_row(v, args, mesh) if v in TE_ROWS else run_variant(v, args, mesh)
                r["wall_s"] = time.perf_counter() - t0
                rows.append(r)
                msg = (f"{r['median_ms']:.2f} ms, {r['tokens_per_s']:,.0f} tokens/s, peak {_gib(r['step_peak_gib'])} GiB"
                       if r.get("status") == "ok" else f"{r.get('status')}: {r.get('error')}")
                print(f"  {v:<32} {msg}  [{r['wall_s']:.1f} s]", flush=True)
                if r.get("traceback"):  # the one-line reason rarely names the op; the JSON keeps it too
                    print(r["traceback"], file=sys.stderr, flush=True)
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
