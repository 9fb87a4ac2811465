"""The ``step`` part of ``python -m dtensor_fp8.benchmarks moe`` (CUDA): forward + backward time of
one MoE layer on one GPU.

Variants, each on the same layer (``moe_model.MoE``: router, token sort, grouped experts, combine)
and the same tokens:

* ``bf16``: bf16 experts, ``torch._grouped_mm``;
* each recipe: our FP8 experts (``quantize_module_(..., experts=...)``) through
  ``experts_grouped_mm``: torch's scaled grouped GEMM where the device and recipe have one, else the
  emulated path (the row says which ran: ``grouped_fp8.unsupported_reason``);
* ``torchao-mxfp8`` / ``torchao-float8``: bf16 experts whose grouped GEMMs quantize both operands
  every call (torchao's ``_quantize_then_scaled_grouped_mm`` with its MXFP8 recipe, as torchtitan's
  MXFP8 grouped-experts converter does; ``Float8TrainingOpConfig`` rowwise FP8 via ``quantize_``, as
  its float8 one does), where torchao imports and runs on this device.

Median of ``--iters`` CUDA-event-timed steps after warm-up; peak allocated memory of a step.
"""

from __future__ import annotations

import statistics

import torch

from .moe_model import MoE, convert

WARMUP, ITERS = 3, 10


def _torchao(model: MoE, which: str) -> None:
    """torchtitan's torchao grouped-experts converters on our experts (``_grouped_mm`` seam)."""
    if which == "torchao-mxfp8":
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
        from torchao.prototype.moe_training.utils import _quantize_then_scaled_grouped_mm

        config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe("mxfp8_rceil"))

        def grouped(self, *, A, B_t, offs):
            return _quantize_then_scaled_grouped_mm(A, B_t, config=config, offs=offs)

        model.experts._grouped_mm = grouped.__get__(model.experts)
    else:
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig
        from torchao.quantization.quant_api import quantize_

        quantize_(model.experts, config=Float8TrainingOpConfig(), filter_fn=lambda mod, fqn: mod is model.experts)


def _layer(variant: str, dims) -> MoE:
    experts, dim, hidden, top_k = dims
    torch.manual_seed(0)
    model = MoE(experts, dim, hidden, top_k).cuda()
    model.experts.init_weights()
    if variant.startswith("torchao"):
        model.experts.to(torch.bfloat16)
        _torchao(model, variant)
        return model
    return convert(model, variant)


def _time(model: MoE, x: torch.Tensor) -> tuple[float, float]:
    def step():
        model(x).float().pow(2).mean().backward()
        for p in model.parameters():
            p.grad = None

    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(ITERS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30


def measure(dims, recipes, tokens: int) -> list[dict]:
    """One row per variant: median ms per step, peak GiB, which grouped GEMM ran, or the error."""
    from dtensor_fp8 import gemm, grouped_fp8

    if not torch.cuda.is_available():
        return [{"variant": "all", "error": "no CUDA device: the step part runs on a GPU"}]
    rows = []
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, dims[1], generator=g).cuda().bfloat16()
    for variant in ("bf16", *recipes, "torchao-mxfp8", "torchao-float8"):
        row = {"variant": variant, "device": torch.cuda.get_device_name(), "tokens": tokens}
        try:
            model = _layer(variant, dims)
            if variant not in ("bf16",) and not variant.startswith("torchao"):
                why = grouped_fp8.unsupported_reason(x, model.experts.w1)
                row["grouped_gemm"] = "torch._scaled_grouped_mm" if why is None else f"emulated: {why}"
            with gemm.fp8_gemms("auto"):
                row["median_ms"], row["peak_gib"] = _time(model, x)
        except Exception as e:  # noqa: BLE001  a variant this device or torch does not run: say why
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        rows.append(row)
        torch.cuda.empty_cache()
    base = next((r for r in rows if r["variant"] == "bf16" and "median_ms" in r), None)
    for r in rows:
        if base and "median_ms" in r:
            r["vs_bf16"] = r["median_ms"] / base["median_ms"]
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| experts | ms / step (fwd + bwd) | vs bf16 | peak GiB | grouped GEMM |", "|---|---:|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | error: {r['error']} | | | |")
            continue
        lines.append(f"| {r['variant']} | {r['median_ms']:.3f} | {r.get('vs_bf16', float('nan')):.2f}x | "
                     f"{r['peak_gib']:.2f} | {r.get('grouped_gemm', '')} |")
    return "\n".join(lines)
