"""Does a model with FP8 parameters train on real text as well as bf16, to within 1 %? A small
byte-level language model trained once per row and seed, every row on the SAME seeds (paired),
bf16 against dtensor_fp8 recipes and torchao, under FSDP2 on one device.

``python -m dtensor_fp8.benchmarks convergence [--variants ... --seeds 0,1,2 --steps 600
--workers 6 --device cuda|cpu --out DIR]``

Text: the Python standard library's own ``.py`` files, read from this interpreter's installation
(benchmarks/text_corpus.py: which files, the split into train and held-out by file, what the
JSON records of them). Bytes are the tokens (vocabulary 256).

Model (benchmarks/byte_lm.py): byte embedding, ``--shape`` (default ``byte-lm-small``: 4 blocks,
hidden 768, 6 heads of 128 / 2 KV heads, SwiGLU ffn 2048, 25.2 M GEMM weights) decoder blocks of
``linear_step``'s ``Block`` with rotary positions (RoPE: no plateau while attention learns
positions, byte_lm.py says why), a final RMSNorm, an output head. fp32 parameters initialized on
the CPU from the seed, moved to the device; ``fully_shard`` on every block, then the root, over a
one-rank mesh (NCCL on CUDA, gloo on the CPU). Every row runs under ``torch.autocast`` in bf16 with
fp32 parameters or masters. AdamW (betas 0.9 / 0.95, weight decay 0.1 on the matrices), ``--lr``
with a linear warm-up over ``--warmup`` steps then a cosine decay to 10 %, gradients clipped to
norm 1.

Pairing: a seed fixes the init and the order of the training batches, and every row runs every
seed of ``--seeds``; so the runs of one seed differ only by what the row changes, and each row is
compared with bf16 seed by seed (convergence_stats.py: the statistics and the target).

Rows (``--variants``; ``_compiled`` after any name compiles each block before sharding):

* ``bf16``: fp32 parameters, torch AdamW, bf16 GEMMs under autocast: the reference.
* a recipe of ``dtensor_fp8.RECIPES`` (``current``, ``delayed``, ``blockwise2d``, ``mxfp8``, ...):
  the blocks' linear weights become FP8 parameters (:func:`dtensor_fp8.quantize_module_`, before
  ``fully_shard``), :class:`dtensor_fp8.MasterWeightOptimizer` over fp32 masters that start from
  the same init as bf16's, ``F.linear`` runs FP8 GEMMs where the device has them (CUDA).
* ``<recipe>_emulated``: the same with FP8 GEMMs off (``fp8_gemms("off")``): the weights' FP8
  values dequantized into bf16 GEMMs, activations and gradients not quantized. ``mxfp8_emulated``
  is the MXFP8 row on an H100 (sm_90 has no MXFP8 GEMM; ``mxfp8`` there takes the same emulated
  path, with a warning).
* ``torchao``: torchao's ``Float8Linear`` (tensorwise dynamic scaling) on the blocks' linears,
  fp32 parameters, torch AdamW; where torchao does not import, the row is skipped (said, and
  listed in the JSON's ``meta.skipped_rows``).

Measured per run: the held-out loss (nats per byte) on a fixed set, ``--eval-windows`` windows of
``seq`` bytes spread evenly over the held-out stream, every ``--eval-every`` steps; the run's
figure is the mean of its last ``--eval-last`` evaluations (the cosine tail: less sensitive to
one evaluation than the final value). Also the train losses, tokens/s over the steps after the
warm-up (evaluations excluded; with several workers on one device these are shared-device
figures) and FP8 GEMMs per step (the profiler's count: ``linear_step.scaled_gemms_in``).

Runs go to ``--workers`` processes (each with its own one-rank process group on the same device):
small models are bound by the host, so runs side by side use the device better than one after
another, and a run's losses do not depend on its speed. Runs are queued seed by seed, so a run cut
short keeps whole seeds. ``--out/convergence.json`` is written after every run;
``--from-json`` re-renders its table, target and plot (``--out/convergence.png`` with matplotlib).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import importlib.util
import json
import math
import os
import platform
import queue
import signal
import sys
import tempfile
import time
import traceback

import torch
import torch.nn.functional as F

from . import convergence_stats as stats
from .byte_lm import POSITIONS, ByteLM
from .linear_step import scaled_gemms_in, shard_layers
from .shapes import add_shape_arguments, peak_flops, shape_from_args
from .text_corpus import load_stdlib_corpus

DEFAULT_VARIANTS = "bf16,current,delayed,blockwise2d,mxfp8_emulated,torchao_compiled"
REFERENCE = "bf16"


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # "bf16", "fp8" (a dtensor_fp8 recipe), "torchao"
    recipe: str | None = None
    fp8_gemms: bool = True
    compiled: bool = False


def parse_variant(name: str) -> Variant:
    """A ``--variants`` entry (see the module docstring); ``ValueError`` naming the choices otherwise."""
    import dtensor_fp8 as d

    base, compiled = name.removesuffix("_compiled"), name.endswith("_compiled")
    if base == "bf16":
        return Variant(name, "bf16", compiled=compiled)
    if base.startswith("bf16_seed"):
        raise ValueError(f"variant {name!r}: every row now runs every seed of --seeds (e.g. --seeds 0,1,2); "
                         "drop the bf16_seed<N> rows")
    if base == "torchao":
        return Variant(name, "torchao", compiled=compiled)
    recipe, emulated = base.removesuffix("_emulated"), base.endswith("_emulated")
    if recipe in d.RECIPES:
        return Variant(name, "fp8", recipe=recipe, fp8_gemms=not emulated, compiled=compiled)
    raise ValueError(f"unknown variant {name!r}: use bf16, torchao, a recipe of dtensor_fp8.RECIPES "
                     f"({', '.join(sorted(d.RECIPES))}) or <recipe>_emulated, each optionally with _compiled")


# ---- one run ------------------------------------------------------------------------------------
def _param_groups(model):
    decayed = lambda n, p: p.dim() == 2 and not n.startswith(("embed", "pos"))  # noqa: E731
    return [{"params": [p for n, p in model.named_parameters() if decayed(n, p)], "weight_decay": 0.1},
            {"params": [p for n, p in model.named_parameters() if not decayed(n, p)], "weight_decay": 0.0}]


def build(v: Variant, seed: int, cfg, mesh):
    """The sharded model and its optimizer for ``v`` at ``seed``; notes for the report."""
    import dtensor_fp8 as d

    torch.manual_seed(seed)
    model = ByteLM(cfg.model_shape, positions=cfg.positions)
    model.init_weights(seed)  # on the CPU: the same values on every device and in every row
    model = model.to(cfg.device)
    blocks = lambda m, fqn: fqn.startswith("layers.")  # noqa: E731  (embedding, norms, head stay high precision)
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


def lr_factor(cfg, step: int) -> float:
    """Linear warm-up over ``cfg.warmup`` steps, then a cosine from 1 to 0.1 at ``cfg.steps``."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


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


def batch_starts(seed: int, steps: int, batch: int, seq: int, train_bytes: int) -> torch.Tensor:
    """``(steps, batch)`` offsets into the train stream: the order of the data, a function of the seed only."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, train_bytes - seq - 1, (steps, batch), generator=g)


def train_run(v: Variant, seed: int, cfg, mesh, data) -> dict:
    """Train ``v`` at ``seed`` for ``cfg.steps`` steps; the run's record (status "ok", "not run", "error")."""
    from dtensor_fp8 import gemm

    run = {"variant": v.name, "kind": v.kind, "seed": seed, "recipe": v.recipe, "compiled": v.compiled}
    model = opt = None
    t_start = time.perf_counter()
    try:
        try:
            model, opt, notes = build(v, seed, cfg, mesh)
        except ImportError as e:
            run.update(status="not run", error=f"{type(e).__name__}: {e}"[:300])
            return run
        run.update(notes)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: lr_factor(cfg, i))
        seq, batch = cfg.model_shape.seq, cfg.model_shape.batch
        starts = batch_starts(seed, cfg.steps, batch, seq, data["train"].numel()).to(cfg.device)
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
        evals, train_s, timed_steps, t0 = [], 0.0, 0, time.perf_counter()
        with gemm.fp8_gemms("auto" if v.fp8_gemms else "off"):
            for i in range(cfg.steps):
                if i == 1 and v.kind != "bf16":  # the FP8 GEMMs one step runs, counted by the profiler
                    run["fp8_gemms_per_step"] = scaled_gemms_in(lambda: step(i), [])
                else:
                    step(i)
                if i + 1 == cfg.warmup:  # tokens/s from here on: compilation and warm-up excluded
                    sync()
                    t0 = time.perf_counter()
                if (i + 1) % cfg.eval_every == 0 or i + 1 == cfg.steps:
                    sync()
                    if i + 1 > cfg.warmup:
                        train_s += time.perf_counter() - t0
                        timed_steps = i + 1 - cfg.warmup
                    evals.append((i + 1, held_out_loss(model, data["held_out"], batch, cfg.device)))
                    t0 = time.perf_counter()
        train = [float(x) for x in losses.cpu()]
        last = [x for _, x in evals[-cfg.eval_last:]]
        run.update(status="ok", train_losses=train, eval_steps=[s for s, _ in evals], eval_losses=[x for _, x in evals],
                   held_out_loss=sum(last) / len(last), final_held_out_loss=evals[-1][1],
                   tokens_per_s=timed_steps * cfg.model_shape.tokens / train_s if train_s > 0 else None,
                   finite=all(math.isfinite(x) for x in train + [x for _, x in evals]))
    except Exception as e:  # noqa: BLE001  (recorded; the other runs go on)
        run.update(status="error", error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300],
                   traceback=traceback.format_exc()[-3000:])
    finally:
        run["wall_s"] = time.perf_counter() - t_start
        model = opt = None  # noqa: F841
        gc.collect()
        if v.compiled:
            torch._dynamo.reset()
        if cfg.device == "cuda":
            torch.cuda.empty_cache()
    return run


# ---- runs side by side --------------------------------------------------------------------------
def load_data(cfg) -> dict:
    """The train stream and the fixed held-out windows, on ``cfg.device``."""
    corpus = load_stdlib_corpus(cfg.stdlib)
    seq, held = cfg.model_shape.seq, corpus.held_out
    if held.numel() < seq + 1:
        raise SystemExit(f"the held-out files hold {held.numel()} bytes, fewer than one window of --seq {seq} + 1")
    starts = torch.linspace(0, held.numel() - seq - 1, cfg.eval_windows).long()
    return {"train": corpus.train.to(cfg.device), "held_out": held[starts[:, None] + torch.arange(seq + 1)].to(cfg.device)}


@contextlib.contextmanager
def _session(cfg):
    """A one-rank process group of this process's own (a file store in a fresh directory) unless one
    exists, a one-rank mesh and the data."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    cuda = cfg.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    owner = not dist.is_initialized()  # a worker's own; in a caller's process its group is reused
    with tempfile.TemporaryDirectory() as tmp:
        if owner:
            dist.init_process_group("nccl" if cuda else "gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1),
                                    rank=0, world_size=1, **({"device_id": torch.device("cuda", 0)} if cuda else {}))
        try:
            yield init_device_mesh(cfg.device, (1,)), load_data(cfg)
        finally:
            if owner:
                dist.destroy_process_group()


def _worker(cfg, tasks, results) -> None:
    """A worker process: takes ``(index, variant, seed)`` from ``tasks`` until ``None``, puts ``(index, run)``."""
    torch.set_num_threads(cfg.threads)
    with _session(cfg) as (mesh, data):
        while (task := tasks.get()) is not None:
            index, v, seed = task
            results.put((index, train_run(v, seed, cfg, mesh, data)))


class Stopped(Exception):
    """SIGTERM (the GPU script's time limit): stop, keep the runs that finished."""


def run_all(cfg, tasks: list, on_run) -> None:
    """Run ``tasks`` (``(variant, seed)``) on ``cfg.workers`` processes, calling ``on_run(index,
    run)`` as each finishes; a run whose worker died is recorded as an error. Workers are ended on
    the way out, also by SIGTERM (raised here as :class:`Stopped`)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    todo, done = ctx.Queue(), ctx.Queue()
    for i, (v, seed) in enumerate(tasks):
        todo.put((i, v, seed))
    n = min(cfg.workers, len(tasks))
    for _ in range(n):
        todo.put(None)
    procs = [ctx.Process(target=_worker, args=(cfg, todo, done), daemon=True) for _ in range(n)]
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    finished: set[int] = set()
    try:
        for p in procs:
            p.start()
        while len(finished) < len(tasks):
            try:
                index, run = done.get(timeout=2)
            except queue.Empty:
                if any(p.is_alive() for p in procs):
                    continue
                try:  # every worker has ended: what they put last may still be in the pipe
                    index, run = done.get(timeout=5)
                except queue.Empty:
                    codes = sorted({p.exitcode for p in procs})
                    for i, (v, seed) in enumerate(tasks):
                        if i not in finished:
                            on_run(i, {"variant": v.name, "kind": v.kind, "seed": seed, "recipe": v.recipe,
                                       "compiled": v.compiled, "status": "error",
                                       "error": f"lost: its worker process ended (exit codes {codes})"})
                    return
            finished.add(index)
            on_run(index, run)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def _raise_stopped(signum, frame):
    raise Stopped()


# ---- report -------------------------------------------------------------------------------------
def render(report: dict) -> dict:
    """``report`` with its ``summary``, ``table_markdown`` and ``per_seed_markdown`` (re)computed from its runs."""
    summary = stats.summarize(report["runs"], REFERENCE)
    return {**report, "summary": summary, "table_markdown": stats.format_table(summary),
            "per_seed_markdown": stats.format_per_seed(summary)}


def plot(report: dict, path: str) -> bool:
    """Held-out loss per row (mean over seeds) and each row's paired difference from bf16 (mean over
    seeds) against the step; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = [r for r in report["runs"] if r.get("status") == "ok"]
    curves: dict[str, dict[int, list]] = {}
    for r in runs:
        curves.setdefault(r["variant"], {})[r["seed"]] = r["eval_losses"]
    steps = next((r["eval_steps"] for r in runs), [])
    fig, (ax_loss, ax_diff) = plt.subplots(1, 2, figsize=(14, 5))
    ref = curves.get(REFERENCE, {})
    for index, (name, by_seed) in enumerate(curves.items()):
        color = f"C{index}"  # one colour per row in both panels
        mean = [sum(c[i] for c in by_seed.values()) / len(by_seed) for i in range(len(steps))]
        ax_loss.plot(steps, mean, marker="o", ms=3, color=color, label=f"{name} ({len(by_seed)} seeds)")
        shared = [s for s in by_seed if s in ref]
        if name != REFERENCE and shared:
            per_seed = {s: [100 * (by_seed[s][i] / ref[s][i] - 1) for i in range(len(steps))] for s in shared}
            for curve in per_seed.values():  # each seed thin: a mean can hide runs that split apart
                ax_diff.plot(steps, curve, color=color, lw=0.7, alpha=0.35)
            diff = [sum(c[i] for c in per_seed.values()) / len(shared) for i in range(len(steps))]
            ax_diff.plot(steps, diff, marker="o", ms=3, color=color, label=name)
    cfg = report["meta"]["config"]
    ax_loss.set_title(f"held-out loss, nats/byte (mean over seeds; {report['meta']['data']['held_out_files']} stdlib files)")
    ax_diff.set_title("held-out loss vs bf16 at the same seed, % (mean over seeds; each seed thin)")
    ax_diff.axhspan(-100 * stats.TARGET_RELATIVE, 100 * stats.TARGET_RELATIVE, color="green", alpha=0.08)
    if steps:
        tail = [r["eval_losses"][min(1, len(steps) - 1)] for r in runs]
        ax_loss.set_ylim(top=max(tail) * 1.05)
    for ax in (ax_loss, ax_diff):
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"byte-level LM, {report['meta']['params'] / 1e6:.1f} M params, {cfg['steps']} steps x "
                 f"{cfg['seq']}x{cfg['batch']} bytes, seeds {cfg['seeds']}, {report['meta']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def print_report(report: dict, out: str) -> None:
    print()
    print(report["table_markdown"])
    print()
    print(report["per_seed_markdown"])
    print()
    print(stats.format_target(report["summary"]))
    for row, why in report["meta"].get("skipped_rows", {}).items():
        print(f"  {row:<24} skipped: {why}")
    os.makedirs(out, exist_ok=True)
    png = os.path.join(out, "convergence.png")
    print(f"\nwrote {png}" if plot(report, png) else "\nno PNG: install matplotlib", flush=True)


# ---- command line -------------------------------------------------------------------------------
def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m dtensor_fp8.benchmarks convergence", description=__doc__.split("\n\n")[0])
    add_shape_arguments(p, default="byte-lm-small")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma-separated rows (default {DEFAULT_VARIANTS})")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds every row runs (default 0,1,2)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--warmup", type=int, default=None, help="LR warm-up steps (default 10 %% of --steps, at least 1)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    p.add_argument("--positions", choices=POSITIONS, default="rope",
                   help="rope (default) or learned: the first version's learned absolute positions, which stall")
    p.add_argument("--eval-every", type=int, default=None, help="steps between held-out evaluations (default steps/20)")
    p.add_argument("--eval-last", type=int, default=5, help="evaluations a run's held-out loss averages (default 5)")
    p.add_argument("--eval-windows", type=int, default=64, help="held-out windows of --seq bytes (default 64)")
    p.add_argument("--workers", type=int, default=None,
                   help="runs side by side, each in its own process (default 6 on CUDA, 2 on the CPU)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker (default cores / workers)")
    p.add_argument("--stdlib", default=None, help="the standard library directory to read (default: this Python's)")
    p.add_argument("--out", default="bench_out", help="directory for convergence.json / .png (default ./bench_out)")
    p.add_argument("--from-json", default=None, metavar="JSON",
                   help="train nothing: print the tables and target of a convergence.json (a run cut short keeps "
                        "the runs it finished) and plot it to --out/convergence.png")
    args = p.parse_args(argv)
    args.model_shape = shape_from_args(p, args)
    try:
        args.variant_list = [parse_variant(v) for v in args.variants.split(",") if v]
        args.seed_list = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError as e:
        p.error(str(e))
    if not args.seed_list or len(set(args.seed_list)) != len(args.seed_list):
        p.error(f"--seeds {args.seeds!r}: give distinct integer seeds, e.g. 0,1,2")
    if args.steps < 2:
        p.error("--steps must be >= 2")
    args.warmup = args.warmup if args.warmup is not None else max(1, args.steps // 10)
    args.eval_every = args.eval_every or max(1, args.steps // 20)
    if not 1 <= args.warmup < args.steps:
        p.error(f"--warmup {args.warmup} must be in [1, --steps)")
    if args.eval_last < 1:
        p.error("--eval-last must be >= 1")
    args.workers = args.workers or (6 if args.device == "cuda" else 2)
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.workers)
    if args.device == "cuda" and not args.from_json and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here; pass --device cpu (with a small shape, e.g. --shape toy)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.from_json:
        with open(args.from_json) as f:
            report = json.load(f)
        if "runs" not in report:
            raise SystemExit(f"--from-json {args.from_json}: no 'runs': written by the first version of this benchmark "
                             "(one seed per row, 'results'); it cannot be paired. Run the benchmark again.")
        report = render(report)
        print_report(report, args.out)
        return 0
    shape = args.model_shape
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU ({platform.processor() or platform.machine()})"
    desc = load_stdlib_corpus(args.stdlib).describe()
    params = sum(p.numel() for p in ByteLM(shape, "meta", args.positions).parameters())
    step_flops = shape.flops_per_token * shape.tokens
    skipped = {v.name: "torchao does not import here" for v in args.variant_list
               if v.kind == "torchao" and importlib.util.find_spec("torchao") is None}
    for row, why in skipped.items():
        print(f"# {row}: skipped, {why}", flush=True)
    tasks = [(v, s) for s in args.seed_list for v in args.variant_list if v.name not in skipped]  # seed by seed
    print(f"# convergence: {params / 1e6:.1f} M params ({shape.describe()}), {args.steps} steps x {shape.tokens} bytes, "
          f"lr {args.lr:g}, positions {args.positions}; {len(args.variant_list)} rows x seeds {args.seed_list} = {len(tasks)} runs on {args.workers} "
          f"workers x {args.threads} threads; {name}; torch {torch.__version__}", flush=True)
    print(f"# text: {desc['train_files']} train files ({desc['train_bytes'] / 1e6:.2f} MB), {desc['held_out_files']} held-out "
          f"({desc['held_out_bytes'] / 1e6:.2f} MB) from {desc['root']} (Python {desc['python']}); "
          f"one run trains on {args.steps * shape.tokens / 1e6:.1f} MB", flush=True)
    peak = peak_flops(name) if args.device == "cuda" else None
    if peak:
        print(f"# {step_flops * args.steps * len(tasks) / 1e15:.1f} PFLOP in all: "
              f"{step_flops * args.steps * len(tasks) / peak:.0f} s at the bf16 peak", flush=True)
    meta = {"benchmark": "convergence", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": name, "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "argv": sys.argv, "params": params, "flops_per_step": step_flops, "cpu_cores": os.cpu_count(),
            "config": {"shape": args.shape, **dataclasses.asdict(shape), "steps": args.steps, "warmup": args.warmup,
                       "lr": args.lr, "positions": args.positions, "seeds": args.seed_list, "variants": [v.name for v in args.variant_list],
                       "eval_every": args.eval_every, "eval_last": args.eval_last, "eval_windows": args.eval_windows,
                       "workers": args.workers, "threads": args.threads},
            "data": desc, "skipped_rows": skipped}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "convergence.json")
    results: dict[int, dict] = {}
    t0 = time.perf_counter()

    def write() -> dict:  # after every run: a run cut short keeps the runs it finished
        report = render({"meta": {**meta, "wall_s": time.perf_counter() - t0},
                         "runs": [results[i] for i in sorted(results)]})
        with open(path + ".tmp", "w") as f:
            json.dump(report, f, indent=1, default=str)
        os.replace(path + ".tmp", path)  # whole or not at all: the run may be stopped at any time
        return report

    def on_run(index: int, r: dict) -> None:
        results[index] = r
        msg = (f"held-out {r['held_out_loss']:.4f} (last {r['final_held_out_loss']:.4f}), {r['tokens_per_s'] or 0:,.0f} tokens/s"
               if r.get("status") == "ok" else f"{r.get('status')}: {r.get('error')}")
        print(f"  {r['variant']:<24} seed {r['seed']:<3} {msg}  [{r.get('wall_s', 0):.1f} s; "
              f"{len(results)}/{len(tasks)} at {time.perf_counter() - t0:.0f} s]", flush=True)
        write()

    stopped = False
    try:
        run_all(args, tasks, on_run)
    except (Stopped, KeyboardInterrupt):
        stopped = True
        print(f"\nstopped: {len(results)} of {len(tasks)} runs finished", flush=True)
    report = write()
    print(f"\nwrote {path} after {time.perf_counter() - t0:.0f} s")
    print_report(report, args.out)
    return 1 if stopped else 0


if __name__ == "__main__":
    sys.exit(main())
