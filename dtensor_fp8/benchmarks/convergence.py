"""Does a model with FP8 parameters train on real text as well as bf16? Loss curves of a small
Llama-style byte-level language model, bf16 (two seeds: the noise yardstick) against dtensor_fp8
recipes and torchao, under FSDP2 on one device.

``python -m dtensor_fp8.benchmarks convergence [--steps 1000 --seq 512 --batch 16 --variants ...
--device cuda|cpu --out DIR]``

Text: the Python standard library's own ``.py`` files, read from this interpreter's installation
(benchmarks/text_corpus.py: which files, the split into train and held-out by file, what the
JSON records of them). Bytes are the tokens (vocabulary 256).

Model: a byte embedding plus learned positions, ``--shape`` (default ``byte-lm``: 4 layers of
100.7 M GEMM weights in all) decoder blocks of ``linear_step``'s ``Block`` (RMSNorm, grouped-query causal SDPA,
SwiGLU, no biases), a final RMSNorm and an output head (102.3 M parameters in all). Built in
fp32 on the CPU from the seed (normal init, std 0.02; the projections into the residual stream
0.02 / sqrt(2 layers)), moved to the device; ``fully_shard`` on every block, then the root, over
a one-rank mesh (NCCL on CUDA, gloo on the CPU). Every row runs under ``torch.autocast`` in bf16
with fp32 parameters or masters: the usual mixed-precision setup, the yardstick an FP8 recipe has
to meet. AdamW (betas 0.9 / 0.95, weight decay 0.1 on the matrices), ``--lr`` with a linear
warm-up over ``--warmup`` steps then a cosine decay to 10 %, gradients clipped to norm 1.

Rows (``--variants``; ``_compiled`` after any name compiles each block before sharding):

* ``bf16``: fp32 parameters, torch AdamW, bf16 GEMMs under autocast, seed ``--seed``;
  ``bf16_seedN``: the same at seed N (init and data order both change with the seed): the spread
  of the bf16 rows is the run-to-run noise the FP8 rows are judged against.
* a recipe of ``dtensor_fp8.RECIPES`` (``current``, ``delayed``, ``blockwise2d``, ``mxfp8``, ...):
  the blocks' linear weights become FP8 parameters (:func:`dtensor_fp8.quantize_module_`, before
  ``fully_shard``), :class:`dtensor_fp8.MasterWeightOptimizer` over fp32 masters that start from
  the same init as bf16's, ``F.linear`` runs FP8 GEMMs where the device has them (CUDA); seed
  ``--seed``. The embeddings, norms and head stay high precision, as in every row.
* ``<recipe>_emulated``: the same with FP8 GEMMs off (``fp8_gemms("off")``): the FP8 weights'
  values in bf16 GEMMs (MXFP8 on a GPU without MXFP8 GEMMs, e.g. ``mxfp8_emulated`` on an H100).
* ``torchao``: torchao's ``Float8Linear`` (tensorwise dynamic scaling) on the blocks' linears,
  fp32 parameters, torch AdamW; run where torchao imports, otherwise reported as not run.

Every row sees the same held-out set: ``--eval-windows`` windows of ``seq`` bytes spread evenly
over the held-out stream, evaluated every ``--eval-every`` steps and at the end. Reported per row:
the final train loss (mean of the last ``--final-window`` steps' losses), the held-out loss (nats
per byte; bits per byte = / ln 2), tokens/s over the training steps after the first ``--warmup``
(evaluations excluded), and FP8 GEMMs per step (the profiler's count of one step:
``linear_step.scaled_gemms_in``). Target, printed: every dtensor_fp8 row's final held-out loss
within the bf16 rows' spread (max - min over seeds) of bf16's, or within 1 % of it.
Writes ``--out/convergence.json`` (after every row) and, with matplotlib, ``--out/convergence.png``.
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
import sys
import tempfile
import time
import traceback

import torch
import torch.nn.functional as F
from torch import nn

from .linear_step import Block, scaled_gemms_in, shard_layers
from .shapes import ModelShape, add_shape_arguments, peak_flops, shape_from_args
from .text_corpus import load_stdlib_corpus

VOCAB = 256
DEFAULT_VARIANTS = "bf16,bf16_seed1,current,delayed,blockwise2d,torchao_compiled"
TARGET_RELATIVE = 0.01


class ByteLM(nn.Module):
    """Byte embedding + learned positions -> ``shape.layers`` x :class:`linear_step.Block` -> RMSNorm
    -> output head; ``tokens (batch, seq) -> logits (batch, seq, 256)``."""

    def __init__(self, shape: ModelShape, device="cpu"):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, shape.hidden, device=device)
        self.pos = nn.Embedding(shape.seq, shape.hidden, device=device)
        self.layers = nn.ModuleList(Block(shape, device, torch.float32) for _ in range(shape.layers))
        self.norm = nn.RMSNorm(shape.hidden, device=device)
        self.head = nn.Linear(shape.hidden, VOCAB, bias=False, device=device)

    def init_weights(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * len(self.layers))
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 1:
                    p.fill_(1.0)  # RMSNorm scales
                else:
                    p.normal_(0.0, residual_std if name.endswith(("proj.weight", "fc2.weight")) else 0.02, generator=g)

    def forward(self, tokens):
        s = tokens.shape[1]
        x = (self.embed(tokens) + self.pos.weight[:s]).transpose(0, 1)  # Block's layout: (seq, batch, hidden)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x.transpose(0, 1)))  # not a view: FSDP2's backward hook stays on it


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # "bf16", "fp8" (a dtensor_fp8 recipe), "torchao"
    seed: int
    recipe: str | None = None
    fp8_gemms: bool = True
    compiled: bool = False


def parse_variant(name: str, seed: int) -> Variant:
    """A ``--variants`` entry (see the module docstring); ``ValueError`` naming the choices otherwise."""
    import dtensor_fp8 as d

    base, compiled = name.removesuffix("_compiled"), name.endswith("_compiled")
    if base == "bf16":
        return Variant(name, "bf16", seed, compiled=compiled)
    if base.startswith("bf16_seed") and base[len("bf16_seed"):].isdigit():
        return Variant(name, "bf16", int(base[len("bf16_seed"):]), compiled=compiled)
    if base == "torchao":
        return Variant(name, "torchao", seed, compiled=compiled)
    recipe, emulated = base.removesuffix("_emulated"), base.endswith("_emulated")
    if recipe in d.RECIPES:
        return Variant(name, "fp8", seed, recipe=recipe, fp8_gemms=not emulated, compiled=compiled)
    raise ValueError(f"unknown variant {name!r}: use bf16, bf16_seed<N>, torchao, a recipe of dtensor_fp8.RECIPES "
                     f"({', '.join(sorted(d.RECIPES))}) or <recipe>_emulated, each optionally with _compiled")


# ---- one row ------------------------------------------------------------------------------------
def _param_groups(model):
    matrices = [p for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith(("embed", "pos"))]
    others = [p for n, p in model.named_parameters() if not (p.dim() == 2 and not n.startswith(("embed", "pos")))]
    return [{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}]


def build(v: Variant, cfg, mesh):
    """The sharded model and its optimizer for ``v``; notes for the report."""
    import dtensor_fp8 as d

    torch.manual_seed(v.seed)
    model = ByteLM(cfg.model_shape)
    model.init_weights(v.seed)  # on the CPU: the same values on every device
    model = model.to(cfg.device)
    blocks = lambda m, fqn: fqn.startswith("layers.")  # noqa: E731  (embeddings, norms, head stay high precision)
    notes = {}
    adamw = dict(lr=cfg.lr, betas=(0.9, 0.95), **({"fused": True} if cfg.device == "cuda" else {}))
    if v.kind == "torchao":
        import torchao
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, module_filter_fn=blocks)
        notes["torchao"] = torchao.__version__
    if v.kind == "fp8":
        d.quantize_module_(model, d.RECIPES[v.recipe], filter_fn=blocks)  # keeps the init for the masters
    model = shard_layers(model, mesh, v.compiled)
    if v.kind == "fp8":
        opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, _param_groups(model), **adamw)
        notes["fp8_weights"] = sum(isinstance(p.to_local(), d.QuantizedTensor) for p in model.parameters())
    else:
        opt = torch.optim.AdamW(_param_groups(model), **adamw)
    return model, opt, notes


def _schedule(cfg):
    def factor(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _loss(model, tokens, device) -> torch.Tensor:
    with torch.autocast(device, dtype=torch.bfloat16):
        logits = model(tokens[:, :-1].long())
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].long().flatten())


@torch.no_grad()
def held_out_loss(model, windows: torch.Tensor, batch: int, device: str) -> float:
    """Mean loss per byte over the held-out windows (every window the same length)."""
    total = torch.zeros((), device=device)
    for chunk in windows.split(batch):
        total += _loss(model, chunk, device) * chunk.shape[0]
    return float(total) / windows.shape[0]


def train_row(v: Variant, cfg, mesh, data) -> dict:
    """Train ``v`` for ``cfg.steps`` steps; the row of the report (status "ok", "not run", "error")."""
    from dtensor_fp8 import gemm

    row = {"variant": v.name, "kind": v.kind, "seed": v.seed, "recipe": v.recipe, "compiled": v.compiled}
    model = opt = None
    try:
        try:
            model, opt, notes = build(v, cfg, mesh)
        except ImportError as e:
            row.update(status="not run", error=f"{type(e).__name__}: {e}"[:300])
            return row
        row.update(notes)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(cfg))
        g = torch.Generator().manual_seed(v.seed)
        seq, batch, n = cfg.model_shape.seq, cfg.model_shape.batch, data["train"].numel()
        starts = torch.randint(0, n - seq - 1, (cfg.steps, batch), generator=g).to(cfg.device)
        offsets = torch.arange(seq + 1, device=cfg.device)
        losses = torch.zeros(cfg.steps, device=cfg.device)

        def step(i: int) -> torch.Tensor:
            loss = _loss(model, data["train"][starts[i][:, None] + offsets], cfg.device)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            losses[i] = loss.detach()
            return loss.detach()

        sync = torch.cuda.synchronize if cfg.device == "cuda" else (lambda: None)
        evals, train_s, timed_steps, t_start = [], 0.0, 0, time.perf_counter()
        with gemm.fp8_gemms("auto" if v.fp8_gemms else "off"):
            for i in range(cfg.steps):
                if i == 1 and v.kind != "bf16":  # the FP8 GEMMs one step runs, counted by the profiler
                    counted: list = []
                    row["fp8_gemms_per_step"] = scaled_gemms_in(lambda: step(i), counted)
                else:
                    step(i)
                if i + 1 == cfg.warmup:  # tokens/s from here on: compilation and warm-up excluded
                    sync()
                    t0 = time.perf_counter()
                last = i + 1 == cfg.steps
                if (i + 1) % cfg.eval_every == 0 or last:
                    sync()
                    if i + 1 > cfg.warmup:
                        train_s += time.perf_counter() - t0
                        timed_steps = i + 1 - cfg.warmup
                    evals.append((i + 1, held_out_loss(model, data["held_out"], batch, cfg.device)))
                    t0 = time.perf_counter()
        train = [float(x) for x in losses.cpu()]
        final = train[-cfg.final_window:]
        row.update(status="ok", train_losses=train, eval_steps=[s for s, _ in evals], eval_losses=[x for _, x in evals],
                   final_train_loss=sum(final) / len(final), held_out_loss=evals[-1][1],
                   held_out_bits_per_byte=evals[-1][1] / math.log(2),
                   tokens_per_s=timed_steps * cfg.model_shape.tokens / train_s if train_s > 0 else None,
                   wall_s=time.perf_counter() - t_start,
                   finite=all(math.isfinite(x) for x in train + [x for _, x in evals]))
    except Exception as e:  # noqa: BLE001  (recorded; the other rows go on)
        row.update(status="error", error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300],
                   traceback=traceback.format_exc()[-3000:])
    finally:
        model = opt = None  # noqa: F841
        gc.collect()
        if v.compiled:
            torch._dynamo.reset()
        if cfg.device == "cuda":
            torch.cuda.empty_cache()
    return row


# ---- report -------------------------------------------------------------------------------------
def target_check(rows: list[dict]) -> dict:
    """Each dtensor_fp8 row's held-out loss against bf16's (the ``bf16`` row, seed ``--seed``): within
    the bf16 rows' spread (max - min over their seeds) or within 1 % passes."""
    bf16 = [r for r in rows if r["kind"] == "bf16" and not r["compiled"] and r.get("status") == "ok"]
    ref = next((r for r in bf16 if r["variant"] == "bf16"), bf16[0] if bf16 else None)
    if ref is None:
        return {"reference": None, "note": "no bf16 row ran: nothing to compare with", "rows": {}}
    losses = [r["held_out_loss"] for r in bf16]
    spread = max(losses) - min(losses) if len(bf16) > 1 else None
    allowed = max(spread or 0.0, TARGET_RELATIVE * ref["held_out_loss"])
    out = {"reference": ref["variant"], "reference_loss": ref["held_out_loss"], "bf16_seeds": len(bf16),
           "bf16_spread": spread, "allowed": allowed, "rows": {}}
    for r in rows:
        if r["kind"] != "fp8":
            continue
        if r.get("status") != "ok":
            out["rows"][r["variant"]] = {"pass": False, "why": f"{r.get('status')}: {r.get('error', '')}"}
            continue
        delta = r["held_out_loss"] - ref["held_out_loss"]
        out["rows"][r["variant"]] = {"delta": delta, "relative": delta / ref["held_out_loss"],
                                     "pass": math.isfinite(delta) and abs(delta) <= allowed}
    return out


def format_table(rows: list[dict], target: dict) -> str:
    lines = ["| row | seed | final train loss | held-out loss | held-out bits/byte | vs bf16 | tokens/s | FP8 GEMMs / step | note |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    ref = target.get("reference_loss")
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r['variant']} | {r['seed']} | - | - | - | - | - | - | {r.get('status')}: {r.get('error', '')} |")
            continue
        vs = f"{100 * (r['held_out_loss'] / ref - 1):+.2f} %" if ref else "-"
        tps = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-"
        note = "; ".join(x for x in (f"FP8 weights {r['fp8_weights']}" if "fp8_weights" in r else "",
                                     f"torchao {r['torchao']}" if "torchao" in r else "",
                                     "" if r["finite"] else "non-finite loss") if x)
        lines.append(f"| {r['variant']} | {r['seed']} | {r['final_train_loss']:.4f} | {r['held_out_loss']:.4f} | "
                     f"{r['held_out_bits_per_byte']:.4f} | {vs} | {tps} | {r.get('fp8_gemms_per_step', '-')} | {note} |")
    lines += ["", "Losses in nats per byte; final train loss: mean of the last steps' losses; held-out: the fixed "
              "held-out windows after the last step; vs bf16: held-out loss against the bf16 row's."]
    return "\n".join(lines)


def format_target(target: dict) -> str:
    if target["reference"] is None:
        return f"target: {target['note']}"
    spread = "-" if target["bf16_spread"] is None else f"{target['bf16_spread']:.4f}"
    lines = [f"target: each dtensor_fp8 row's held-out loss within max(bf16 seed spread {spread}, "
             f"1 % = {TARGET_RELATIVE * target['reference_loss']:.4f}) = {target['allowed']:.4f} of "
             f"{target['reference']}'s {target['reference_loss']:.4f}"]
    for name, t in target["rows"].items():
        verdict = "PASS" if t["pass"] else "FAIL"
        detail = t.get("why") or f"{t['delta']:+.4f} ({100 * t['relative']:+.2f} %)"
        lines.append(f"  {name:<24} {verdict}  {detail}")
    if not target["rows"]:
        lines.append("  (no dtensor_fp8 row among the results)")
    return "\n".join(lines)


def plot(report: dict, path: str) -> bool:
    """Train loss (moving average) and held-out loss per row against the step; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in report["results"] if r.get("status") == "ok"]
    cfg = report["meta"]["config"]
    k = max(1, min(25, cfg["steps"] // 10))  # the train curves' moving average
    fig, (ax_train, ax_eval) = plt.subplots(1, 2, figsize=(14, 5))
    for r in rows:
        smooth = torch.tensor(r["train_losses"]).unfold(0, k, 1).mean(1)
        ax_train.plot(range(k, k + len(smooth)), smooth.tolist(), label=r["variant"], lw=1)
        ax_eval.plot(r["eval_steps"], r["eval_losses"], marker="o", ms=3, label=r["variant"])
    ax_train.set_title("train loss, nats/byte" + (f" (moving mean over {k} steps)" if k > 1 else ""))
    ax_eval.set_title(f"held-out loss, nats/byte ({report['meta']['data']['held_out_files']} stdlib files)")
    for ax in (ax_train, ax_eval):
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    if rows:
        top = max(r["eval_losses"][min(1, len(r["eval_losses"]) - 1)] for r in rows)
        ax_eval.set_ylim(top=top * 1.05)
    fig.suptitle(f"byte-level LM, {report['meta']['params'] / 1e6:.0f} M params, {cfg['steps']} steps x "
                 f"{cfg['seq']}x{cfg['batch']} bytes, {report['meta']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---- command line -------------------------------------------------------------------------------
def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m dtensor_fp8.benchmarks convergence", description=__doc__.split("\n\n")[0])
    add_shape_arguments(p, default="byte-lm")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma-separated rows (default {DEFAULT_VARIANTS})")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=None, help="LR warm-up steps (default 5 %% of --steps, at least 1)")
    p.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (default 6e-4)")
    p.add_argument("--seed", type=int, default=0, help="seed of every row but bf16_seedN (init and data order)")
    p.add_argument("--eval-every", type=int, default=None, help="steps between held-out evaluations (default steps/10)")
    p.add_argument("--eval-windows", type=int, default=64, help="held-out windows of --seq bytes (default 64)")
    p.add_argument("--final-window", type=int, default=20, help="steps the final train loss averages (default 20)")
    p.add_argument("--stdlib", default=None, help="the standard library directory to read (default: this Python's)")
    p.add_argument("--out", default="bench_out", help="directory for convergence.json / .png (default ./bench_out)")
    p.add_argument("--from-json", default=None, metavar="JSON",
                   help="train nothing: print the table and target of a convergence.json (a run cut short keeps "
                        "the rows it finished) and plot it to --out/convergence.png")
    args = p.parse_args(argv)
    args.model_shape = shape_from_args(p, args)
    try:
        args.variant_list = [parse_variant(v, args.seed) for v in args.variants.split(",") if v]
    except ValueError as e:
        p.error(str(e))
    if args.steps < 2:
        p.error("--steps must be >= 2")
    args.warmup = args.warmup if args.warmup is not None else max(1, args.steps // 20)
    args.eval_every = args.eval_every or max(1, args.steps // 10)
    args.final_window = max(1, min(args.final_window, args.steps))
    if not 1 <= args.warmup < args.steps:
        p.error(f"--warmup {args.warmup} must be in [1, --steps)")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here; pass --device cpu (with a small shape, e.g. --shape toy)")
    return args


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    args = _parse(argv)
    if args.from_json:
        with open(args.from_json) as f:
            report = json.load(f)
        report["target"] = target_check(report["results"])
        report["table_markdown"] = format_table(report["results"], report["target"])
        return _print_report(report, args.out)
    shape, cuda = args.model_shape, args.device == "cuda"
    corpus = load_stdlib_corpus(args.stdlib)
    if cuda:
        torch.cuda.set_device(0)
        name = torch.cuda.get_device_name()
    else:
        name = f"CPU ({platform.processor() or platform.machine()})"
    held = corpus.held_out
    if held.numel() < shape.seq + 1:
        raise SystemExit(f"the held-out files hold {held.numel()} bytes, fewer than one window of --seq {shape.seq} + 1")
    starts = torch.linspace(0, held.numel() - shape.seq - 1, args.eval_windows).long()
    data = {"train": corpus.train.to(args.device),
            "held_out": held[starts[:, None] + torch.arange(shape.seq + 1)].to(args.device)}
    params = sum(p.numel() for p in ByteLM(shape, "meta").parameters())
    step_flops = shape.flops_per_token * shape.tokens
    peak = peak_flops(name) if cuda else None
    desc = corpus.describe()
    print(f"# convergence: {params / 1e6:.1f} M params ({shape.describe()}), {args.steps} steps x {shape.tokens} bytes; "
          f"{name}; torch {torch.__version__}", flush=True)
    print(f"# text: {desc['train_files']} train files ({desc['train_bytes'] / 1e6:.2f} MB), {desc['held_out_files']} held-out "
          f"({desc['held_out_bytes'] / 1e6:.2f} MB) from {desc['root']} (Python {desc['python']}); "
          f"one row trains on {args.steps * shape.tokens / 1e6:.1f} MB", flush=True)
    if peak:
        print(f"# {step_flops * args.steps / 1e15:.1f} PFLOP a row: {step_flops * args.steps / peak:.0f} s at the bf16 peak",
              flush=True)
    meta = {"benchmark": "convergence", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": name, "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "argv": sys.argv, "params": params, "flops_per_step": step_flops,
            "config": {"shape": args.shape, **dataclasses.asdict(shape), "steps": args.steps, "warmup": args.warmup,
                       "lr": args.lr, "seed": args.seed, "eval_every": args.eval_every,
                       "eval_windows": args.eval_windows, "final_window": args.final_window},
            "data": desc}
    rows: list[dict] = []
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "convergence.json")

    def write():  # after every row: a run cut short keeps the rows it finished
        target = target_check(rows)
        with open(path, "w") as f:
            json.dump({"meta": meta, "results": rows, "target": target, "table_markdown": format_table(rows, target)},
                      f, indent=1, default=str)
        return target

    with tempfile.TemporaryDirectory() as tmp:
        if not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1),
                                    rank=0, world_size=1, **({"device_id": torch.device("cuda", 0)} if cuda else {}))
        mesh = init_device_mesh(args.device, (1,))
        try:
            for v in args.variant_list:
                r = train_row(v, args, mesh, data)
                rows.append(r)
                msg = (f"train {r['final_train_loss']:.4f}, held-out {r['held_out_loss']:.4f}, "
                       f"{r['tokens_per_s'] or 0:,.0f} tokens/s" if r.get("status") == "ok" else
                       f"{r.get('status')}: {r.get('error')}")
                print(f"  {v.name:<24} {msg}  [{r.get('wall_s', 0):.1f} s]", flush=True)
                write()
        finally:
            dist.destroy_process_group()
    write()
    with open(path) as f:
        report = json.load(f)
    print(f"\nwrote {path}")
    return _print_report(report, args.out)


def _print_report(report: dict, out: str) -> int:
    print()
    print(report["table_markdown"])
    print()
    print(format_target(report["target"]))
    os.makedirs(out, exist_ok=True)
    png = os.path.join(out, "convergence.png")
    print(f"\nwrote {png}" if plot(report, png) else "\nno PNG: install matplotlib")
    return 0


if __name__ == "__main__":
    sys.exit(main())
