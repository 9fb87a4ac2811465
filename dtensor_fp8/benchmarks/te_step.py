"""Training-step time and peak memory of a Transformer Engine TransformerLayer stack, four ways.

``python -m dtensor_fp8.benchmarks te_step [--layers 4 --hidden 4096 --ffn 16384 --heads 32
--seq 2048 --batch 2 --recipes delayed,current,blockwise2d --out DIR]``

One process, one GPU, an NCCL process group of size 1 (FileStore on local disk). Model:
``layers`` x ``te.TransformerLayer(hidden, ffn, heads, fuse_qkv_params=True, params_dtype=bf16,
hidden_dropout=0, attention_dropout=0)`` (causal self-attention), input ``(seq, batch, hidden)``
bf16, loss ``output.float().pow(2).mean()``. For each recipe (TE ``DelayedScaling`` /
``Float8CurrentScaling`` / ``Float8BlockScaling`` (128x128 weights); ours ``DelayedScaling`` /
``CurrentScaling`` / ``Blockwise(block_dims=2)``) and each variant:

* (a) ``bf16_fsdp``: bf16 parameters under ``fully_shard`` (each layer, then the root), FP8
  compute in ``te.autocast(recipe)``; ``torch.optim.Adam`` on the (bf16) parameters.
* (b) ``te_fp8_fsdp``: TE's own FP8 parameters (``te.quantized_model_init``) under ``fully_shard``
  (TE's ``fsdp_pre/post_all_gather``); ``torch.optim.Adam`` over FP32 master copies of the FP8
  weights (DTensors like the parameters) plus the high-precision parameters, FP8 local shards
  rewritten with TE's ``quantize_`` after each step (what TE's ``FusedAdam(master_weights=True)``
  does for quantized parameters). Whether the weights are still TE FP8 tensors after
  ``fully_shard`` (and in forward) is checked and reported: FSDP2's sharding of a TE tensor class
  that does not implement the ops it uses (``new_zeros``, ...) silently yields bf16 shards.
* (c) ``te_fp8_nofsdp``: the same TE FP8 parameters and masters, no ``fully_shard``
  (like ``tests/gpu/test_te_modules.py``'s reference run).
* (d) ``ours_fsdp``: :func:`dtensor_fp8.te.quantize_te_module_` on the bf16 model, ``fully_shard``,
  :class:`dtensor_fp8.MasterWeightOptimizer` around ``torch.optim.Adam`` (FP32 masters); after the
  timed steps every GEMM weight must still be a DTensor whose local shard is an FP8
  :class:`QuantizedTensor`.
* (e) ``ours_fsdp_bf16_masters``: (d) with ``master_dtype=torch.bfloat16`` (masters and Adam state
  in bf16, as (a) keeps its parameters and Adam state).

Every variant's ``torch.optim.Adam`` is the same implementation (``--adam``, default ``fused``).

Masters of (b), (c), (d) start from the dequantized FP8 weights (no high-precision init copies).
Timing: ``--warmup`` steps (default 3), then ``--steps`` (default 10) steps, each between
``torch.cuda.synchronize()`` and a pair of CUDA events around forward + backward + optimizer step
+ zero_grad (a third event after backward splits forward + backward from the optimizer); the
median is reported, with the host's time to issue the step (``host ms``: when it is close to the
step time, Python is the bottleneck, not the GPU). ``--gpu-only N`` times N more steps each queued
behind a GPU sleep kernel, which gives the GPU's own time for a step; ``--host-split`` sums the host
time spent inside FSDP2's per-group steps, the all-gather hooks and the requantization; ``--rounds
R`` re-times every variant in R interleaved rounds. Memory: ``torch.cuda.reset_peak_memory_stats()`` at the start
of each variant (its peak including model build: ``variant_peak``) and again after the warm-up
(``step_peak``: the peak over the timed steps, shown in the table); everything is freed and
``empty_cache()`` called between variants. A variant that raises (an OOM included) is recorded and
the run goes on. The markdown table goes to stdout, the JSON (torch / TE versions, device, date,
config) to ``--out/te_step.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
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
import warnings

import torch

from ..placement import like

GIB = 2**30
VARIANTS = {
    "a": ("bf16_fsdp", "(a) bf16 params, FSDP2"),
    "b": ("te_fp8_fsdp", "(b) TE FP8 params, FSDP2"),
    "c": ("te_fp8_nofsdp", "(c) TE FP8 params, no FSDP"),
    "d": ("ours_fsdp", "(d) dtensor_fp8 params, FSDP2"),
    "e": ("ours_fsdp_bf16_masters", "(e) = (d), bf16 masters"),
}
OURS = ("d", "e")
RECIPES = ("delayed", "current", "blockwise2d")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


# ---- environment ------------------------------------------------------------------------------------
def _import_te():
    """``(namespace, None)`` or ``(None, reason)``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import transformer_engine
            import transformer_engine.pytorch as te
            from transformer_engine.common import recipe as te_recipe
            from transformer_engine.pytorch.quantized_tensor import QuantizedTensor as TEQuantizedTensor
    except Exception as e:  # noqa: BLE001  (ImportError, or a native library that fails to load)
        return None, f"{type(e).__name__}: {e}".splitlines()[0][:300]
    version = getattr(transformer_engine, "__version__", None) or getattr(te, "__version__", "unknown")
    return argparse.Namespace(te=te, recipe=te_recipe, TEQuantizedTensor=TEQuantizedTensor, version=version), None


def _recipe_pair(name: str, ns):
    """``(our recipe, TE recipe factory)`` for a recipe name."""
    import dtensor_fp8 as d

    if name == "delayed":
        return d.DelayedScaling(), lambda: ns.recipe.DelayedScaling()
    if name == "current":
        return d.CurrentScaling(), lambda: ns.recipe.Float8CurrentScaling()
    if name == "blockwise2d":
        return d.Blockwise(block_dims=2), lambda: ns.recipe.Float8BlockScaling()
    raise KeyError(name)


def _init_process_group(tmpdir: str):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        store = dist.FileStore(os.path.join(tmpdir, "te_step_store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    return init_device_mesh("cuda", (1,))


# ---- model / data -----------------------------------------------------------------------------------
def _build(ns, cfg, fp8_recipe=None):
    """The TransformerLayer stack; with ``fp8_recipe``, inside ``te.quantized_model_init``."""
    from contextlib import nullcontext

    te = ns.te
    torch.manual_seed(cfg.seed)
    ctx = (te.quantized_model_init(enabled=True, recipe=fp8_recipe) if fp8_recipe is not None else nullcontext())
    with ctx:
        layers = [te.TransformerLayer(cfg.hidden, cfg.ffn, cfg.heads, hidden_dropout=0.0, attention_dropout=0.0,
                                      fuse_qkv_params=True, params_dtype=torch.bfloat16, device="cuda",
                                      self_attn_mask_type="causal", layer_number=i + 1)
                  for i in range(cfg.layers)]
    return torch.nn.Sequential(*layers)


def _shard(model, mesh, *, keep_attrs: bool):
    """``fully_shard`` each layer, then the root (as TE's FSDP2 tests do, custom attributes of TE
    parameters restored on the DTensors when ``keep_attrs``)."""
    from torch.distributed.fsdp import fully_shard

    saved = {}
    if keep_attrs:
        for n, p in model.named_parameters():
            attrs = vars(p)
            saved[n] = {k: v for k, v in attrs.items() if not k.startswith("_")}
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if keep_attrs:
        for n, p in model.named_parameters():
            for k, v in saved.get(n, {}).items():
                try:
                    setattr(p, k, v)
                except Exception:  # noqa: BLE001
                    pass
    return model


def _local(p):
    from torch.distributed.tensor import DTensor

    return p._local_tensor if isinstance(p, DTensor) else p


def _kind(t) -> str:
    """Short description of a (local) weight: TE class name, ``QuantizedTensor[fp8]`` or its dtype."""
    import dtensor_fp8 as d

    if isinstance(t, d.QuantizedTensor):
        dts = sorted({str(pl.data.dtype).replace("torch.", "") for pl in t._planes.values()})
        return f"QuantizedTensor[{','.join(dts)}]"
    name = type(t).__name__
    if name not in ("Tensor", "Parameter"):
        return name
    return str(t.dtype).replace("torch.", "")


def _weight_kinds(model) -> dict[str, int]:
    counts: dict[str, int] = {}
    for _, p in model.named_parameters():
        if p.dim() == 2:
            k = _kind(_local(p))
            counts[k] = counts.get(k, 0) + 1
    return counts


def _forward_kind_hook(model, seen: dict):
    """Forward pre-hooks on TE modules recording the classes of their (unsharded) 2-D weights."""
    handles = []

    def hook(m, args):
        if seen.get("_done"):
            return
        for p in m.parameters(recurse=False):
            if p.dim() == 2:
                k = _kind(_local(p))
                seen[k] = seen.get(k, 0) + 1

    for m in model.modules():
        if any(p.dim() == 2 for p in m.parameters(recurse=False)):
            handles.append(m.register_forward_pre_hook(hook))
    return handles


class _TEMasterAdam:
    """``torch.optim.Adam`` over FP32 masters of TE FP8 weights (DTensors where the weights are)
    and the high-precision parameters as they are; after ``step()`` each FP8 weight (its local
    shard under FSDP) is requantized in place from its master with TE's own quantizer."""

    def __init__(self, model, te_qt_cls, lr: float, adam_kwargs: dict):
        self.model = model
        self.fp8 = []
        others = []
        with torch.no_grad():
            for _, p in model.named_parameters():
                local = _local(p)
                if isinstance(local, te_qt_cls):
                    master = torch.nn.Parameter(like(p, local.dequantize(dtype=torch.float32).clone()))
                    self.fp8.append((p, master))
                else:
                    others.append(p)
        self.optimizer = torch.optim.Adam([m for _, m in self.fp8] + others, lr=lr, **adam_kwargs)

    @torch.no_grad()
    def step(self):
        for p, m in self.fp8:
            g = p.grad
            m.grad = None if g is None else like(m, _local(g).float())
        self.optimizer.step()
        for p, m in self.fp8:
            _local(p).quantize_(_local(m))

    def zero_grad(self):
        self.model.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)


def _adam_kwargs(cfg) -> dict:
    """The same ``torch.optim.Adam`` implementation for every variant (``--adam``)."""
    return {"fused": True} if cfg.adam == "fused" else {"foreach": True}


# ---- one variant ------------------------------------------------------------------------------------
def _setup(variant: str, ns, cfg, recipe, make_recipe, mesh):
    """``(model, optimizer, notes)`` for one variant."""
    import dtensor_fp8 as d
    from dtensor_fp8 import te as dte

    notes: dict = {}
    expected = 4 * cfg.layers
    if variant == "a":
        model = _shard(_build(ns, cfg), mesh, keep_attrs=True)
        opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, **_adam_kwargs(cfg))
        notes["weights_after_shard"] = _weight_kinds(model)
        return model, opt, notes
    if variant in ("b", "c"):
        model = _build(ns, cfg, make_recipe())
        notes["weights_after_init"] = _weight_kinds(model)
        if variant == "b":
            model = _shard(model, mesh, keep_attrs=True)
            notes["weights_after_shard"] = _weight_kinds(model)
        n_fp8 = sum(1 for p in model.parameters() if p.dim() == 2 and isinstance(_local(p), ns.TEQuantizedTensor))
        notes["fp8_weights"] = f"{n_fp8}/{expected}"
        if n_fp8 != expected:
            where = "after fully_shard" if variant == "b" and "weights_after_shard" in notes else "after quantized_model_init"
            notes["warning"] = (f"TE weights are NOT all FP8 {where}: {n_fp8}/{expected} are TE quantized tensors "
                                f"({notes.get('weights_after_shard', notes['weights_after_init'])}); "
                                "the others are trained as high-precision parameters")
        opt = _TEMasterAdam(model, ns.TEQuantizedTensor, cfg.lr, _adam_kwargs(cfg))
        notes["optimizer"] = f"torch.optim.Adam over {len(opt.fp8)} FP32 masters + high-precision params; TE quantize_"
        return model, opt, notes
    if variant in OURS:
        model = _build(ns, cfg)
        dte.quantize_te_module_(model, recipe, keep_hp_init=False)
        model = _shard(model, mesh, keep_attrs=False)
        master_dtype = torch.bfloat16 if variant == "e" else torch.float32
        opt = d.MasterWeightOptimizer(model, torch.optim.Adam, lr=cfg.lr, master_dtype=master_dtype, **_adam_kwargs(cfg))
        notes["weights_after_shard"] = _weight_kinds(model)
        notes["optimizer"] = repr(opt)
        return model, opt, notes
    raise KeyError(variant)


def _check_ours_fp8(model, expected: int) -> tuple[bool, str]:
    """(d): every GEMM weight is a DTensor whose local shard is an FP8 QuantizedTensor."""
    import dtensor_fp8 as d
    from torch.distributed.tensor import DTensor

    bad, good = [], 0
    for n, p in model.named_parameters():
        if p.dim() != 2:
            continue
        local = p.to_local() if isinstance(p, DTensor) else None
        ok = (isinstance(p, DTensor) and isinstance(local, d.QuantizedTensor)
              and all(pl.data.dtype in FP8_DTYPES for pl in local._planes.values()))
        if ok:
            good += 1
        else:
            bad.append(f"{n}: {type(p).__name__}/{_kind(local if local is not None else p)}")
    ok = not bad and good == expected
    return ok, f"{good}/{expected} GEMM weights are FP8 QuantizedTensor shards" + (f"; NOT: {bad[:4]}" if bad else "")


def run_variant(variant: str, recipe_name: str, ns, cfg, mesh, keep: bool = False):
    """Build, warm up and time one variant; returns its result row, or with ``keep`` the pair
    ``(row, step)``: the variant stays alive (``step(mid=None)`` runs one more training step) for
    :func:`time_rounds`. Memory figures are what the variant allocated on top of what was
    allocated before it was built (other kept variants, idle meanwhile)."""
    te = ns.te
    row = {"recipe": recipe_name, "variant": VARIANTS[variant][0], "key": variant}
    recipe, make_recipe = _recipe_pair(recipe_name, ns)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    row["allocated_before_gib"] = base / GIB
    model = opt = x = kept = None
    handles = []
    t_setup = time.perf_counter()
    try:
        model, opt, notes = _setup(variant, ns, cfg, recipe, make_recipe, mesh)
        row.update(notes)
        torch.cuda.synchronize()
        row["setup_s"] = time.perf_counter() - t_setup
        row["after_setup_gib"] = (torch.cuda.memory_allocated() - base) / GIB
        fp8_recipe = make_recipe()
        g = torch.Generator(device="cuda").manual_seed(cfg.seed + 1)
        x = torch.randn(cfg.seq, cfg.batch, cfg.hidden, device="cuda", dtype=torch.bfloat16, generator=g)
        seen: dict = {}
        handles = _forward_kind_hook(model, seen)

        phase_sink: list = []  # the active _HostSplit, if any: it also gets each phase's host time

        def step(mid=None):
            t0 = time.perf_counter()
            with te.autocast(enabled=True, recipe=fp8_recipe):
                out = model(x)
            loss = out.float().pow(2).mean()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            if mid is not None:
                mid.record()  # forward + backward | optimizer step + zero_grad
            opt.step()
            t3 = time.perf_counter()
            opt.zero_grad()
            if phase_sink:
                phase_sink[0].add_phases(forward=t1 - t0, backward=t2 - t1, optimizer_step=t3 - t2,
                                         zero_grad=time.perf_counter() - t3)
            return loss.detach()

        losses = []
        for _ in range(cfg.warmup):
            losses.append(step())
            seen["_done"] = True
        for h in handles:
            h.remove()
        handles = []
        seen.pop("_done", None)
        row["weights_in_forward"] = seen
        torch.cuda.synchronize()
        row["warmup_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / GIB
        torch.cuda.reset_peak_memory_stats()
        times = {k: [] for k in _TIMES}
        split = _HostSplit() if cfg.host_split else contextlib.nullcontext()
        with split:
            if cfg.host_split:
                phase_sink.append(split)
            _timed_steps(cfg.steps, step, times, losses)
            phase_sink.clear()
        if cfg.host_split:
            row["host_split_ms"] = split.per_step(cfg.steps)
        row.update(times)
        row.update(_medians(times))
        row["step_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / GIB
        row["variant_peak_gib"] = max(row["warmup_peak_gib"], row["step_peak_gib"])
        row["resident_gib"] = (torch.cuda.memory_allocated() - base) / GIB
        if cfg.gpu_only:
            row["gpu_only_ms"] = _gpu_only_times(step, cfg.gpu_only)
            row["median_gpu_only_ms"] = statistics.median(row["gpu_only_ms"])
        if cfg.profile:
            row["profile"] = _profile(step, cfg, f"{recipe_name}_{VARIANTS[variant][0]}")
        vals = [float(v) for v in torch.stack(losses).cpu()]
        row["loss_first"], row["loss_last"] = vals[0], vals[-1]
        row["losses_finite"] = all(math.isfinite(v) for v in vals)
        if not row["losses_finite"]:
            row["warning"] = (row.get("warning", "") + "; non-finite loss").lstrip("; ")
        if variant in OURS:
            graph = opt._requantize
            row["requantize_graph"] = {"replays": graph.replays, "disabled_reason": graph.disabled_reason}
            ok, msg = _check_ours_fp8(model, 4 * cfg.layers)
            row["fp8_shards_ok"] = ok
            row["fp8_shards"] = msg
            if not ok:
                row["warning"] = (row.get("warning", "") + "; " + msg).lstrip("; ")
        if variant in ("b", "c"):
            row["weights_after_steps"] = _weight_kinds(model)
        row["status"] = "ok"
        if keep:
            kept = step
    except torch.cuda.OutOfMemoryError as e:
        row["status"] = "OOM"
        row["error"] = f"OutOfMemoryError: {str(e).splitlines()[0][:300]}"
        row["traceback"] = traceback.format_exc()[-4000:]
    except Exception as e:  # noqa: BLE001  (report, go on with the next variant)
        row["status"] = "error"
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        row["traceback"] = traceback.format_exc()[-4000:]
    finally:
        for h in handles:
            h.remove()
        try:
            row.setdefault("variant_peak_gib", (torch.cuda.max_memory_allocated() - base) / GIB)
        except Exception:  # noqa: BLE001
            pass
        if kept is None:  # free the variant before the next (a kept step's closure still needs these)
            model = opt = x = step = None  # noqa: F841
            gc.collect()
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                row["allocated_after_free_gib"] = torch.cuda.memory_allocated() / GIB
            except Exception as e:  # noqa: BLE001
                row["cleanup_error"] = f"{type(e).__name__}: {e}"[:300]
    return (row, kept) if keep else row


#: What :func:`_timed_steps` records per step: CUDA-event time of the step and of its forward +
#: backward, the host's time to issue it, and wall time.
_TIMES = ("step_ms", "fwd_bwd_ms", "host_ms", "wall_ms")


def _timed_steps(n: int, step, times: dict[str, list], losses: list | None = None) -> None:
    """``n`` steps, each between synchronizes, their :data:`_TIMES` appended to ``times`` (and
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


def _medians(times: dict[str, list]) -> dict[str, float]:
    """The step figures the tables show, from :func:`_timed_steps`' lists."""
    ms, fb = times["step_ms"], times["fwd_bwd_ms"]
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "median_fwd_bwd_ms": statistics.median(fb),
            "median_opt_ms": statistics.median(e - f for e, f in zip(ms, fb)),
            "median_host_ms": statistics.median(times["host_ms"]), "median_wall_ms": statistics.median(times["wall_ms"])}


class _HostSplit:
    """``--host-split``: host time spent inside FSDP2's per-group steps, the FP8 all-gather hooks
    (ours and TE's) and our optimizer-step requantization, summed per step. The entries nest
    (``wait_for_unshard`` runs the hooks on one rank), so they are read side by side, not added.
    Each wrapped call costs about a microsecond more."""

    def __init__(self):
        self.totals: dict[str, float] = {}
        self._saved: list = []

    def _targets(self):
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        import dtensor_fp8.fsdp as dfsdp
        import dtensor_fp8.optim as doptim
        from dtensor_fp8.tensor import QuantizedTensor

        out = [(FSDPParamGroup, "unshard", "FSDP2 unshard (all-gather issue)"),
               (FSDPParamGroup, "wait_for_unshard", "FSDP2 wait_for_unshard (copy-out + post-all-gather hooks)"),
               (FSDPParamGroup, "post_backward", "FSDP2 post_backward (reduce-scatter)"),
               (FSDPParamGroup, "reshard", "FSDP2 reshard"),
               (dfsdp, "fsdp_pre_all_gather", "dtensor_fp8 pre-all-gather hook"),
               (QuantizedTensor, "fsdp_post_all_gather", "dtensor_fp8 post-all-gather hook"),
               (doptim.MasterWeightOptimizer, "requantize_", "dtensor_fp8 requantize (optimizer step)"),
               (torch.optim.Adam, "step", "torch Adam.step (inside the optimizer step)")]
        try:
            from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor
            out += [(Float8Tensor, n, f"TE Float8Tensor.{n}") for n in ("fsdp_pre_all_gather", "fsdp_post_all_gather")
                    if n in vars(Float8Tensor)]
        except ImportError:  # pragma: no cover
            pass
        return out

    def __enter__(self):
        for owner, name, label in self._targets():
            original = vars(owner)[name]
            self._saved.append((owner, name, original))
            setattr(owner, name, self._wrap(original, label))
        return self

    def _wrap(self, fn, label):
        totals = self.totals

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[label] = totals.get(label, 0.0) + time.perf_counter() - t0
        return timed

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def add_phases(self, **seconds: float) -> None:
        """Host time of a step's phases (forward, backward, ...), measured by the step itself."""
        for phase, t in seconds.items():
            label = f"step phase: {phase}"
            self.totals[label] = self.totals.get(label, 0.0) + t

    def per_step(self, steps: int) -> dict[str, float]:
        return {k: v * 1e3 / steps for k, v in self.totals.items()}


def time_rounds(live: list, rounds: int, steps: int) -> None:
    """Time ``rounds`` x ``steps`` more steps of every kept variant, the variants taking turns
    round by round, so slow and fast spells of the host fall on all of them alike. The rows'
    ``median_ms`` (and the other step medians, wall time included) become those over these steps."""
    times = [{k: row.setdefault(f"round_{k}", []) for k in _TIMES} for row, _ in live]
    for _ in range(rounds):
        for (_, step), t in zip(live, times):
            _timed_steps(steps, step, t)
    for (row, _), t in zip(live, times):
        row.update(_medians(t))


def _gpu_only_times(step, n_steps: int, sleep_cycles: int = 400_000_000) -> list[float]:
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


def _profile(step, cfg, tag: str, n_steps: int = 2) -> dict:
    """``torch.profiler`` over ``n_steps`` more steps: the kernel and CPU-op tables go to
    ``--out/profile_<tag>.txt``; returned: GPU-busy time per step (sum of kernel self times) next
    to the step's CUDA-event time, so CPU-bound gaps show as busy < step."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(n_steps):
            step()
        end.record()
        torch.cuda.synchronize()
    events = prof.key_averages()

    def device_self(e):
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)

    busy_us = sum(device_self(e) for e in events)
    sort_dev = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    path = os.path.join(cfg.out, f"profile_{tag}.txt")
    os.makedirs(cfg.out, exist_ok=True)
    with open(path, "w") as f:
        f.write(f"# {tag}: {n_steps} steps, {start.elapsed_time(end):.2f} ms (CUDA events), "
                f"GPU busy {busy_us / 1e3:.2f} ms\n\n")
        f.write(events.table(sort_by=sort_dev, row_limit=40, max_name_column_width=90))
        f.write("\n\n# by self CPU time\n")
        f.write(events.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=90))
    return {"steps": n_steps, "ms_per_step": start.elapsed_time(end) / n_steps,
            "gpu_busy_ms_per_step": busy_us / 1e3 / n_steps, "table": path}


# ---- report -----------------------------------------------------------------------------------------
def _cell(r: dict | None) -> str:
    if r is None:
        return "not run"
    if r.get("status") == "ok":
        s = f"{r['median_ms']:.1f} ({r['step_peak_gib']:.2f})"
        return s + (" ⚠" if r.get("warning") else "")
    if r.get("status") == "OOM":
        return "OOM"
    return "error"


def _ratio(a: dict | None, b: dict | None) -> str:
    if a and b and a.get("status") == "ok" and b.get("status") == "ok":
        return f"{a['median_ms'] / b['median_ms']:.3f} (mem {a['step_peak_gib'] / b['step_peak_gib']:.3f})"
    return "-"


def format_table(rows: list[dict], recipes: list[str], variants: list[str]) -> str:
    by = {(r["recipe"], r["key"]): r for r in rows}
    ours = [v for v in OURS if v in variants] or ["d"]
    head = ["recipe"] + [VARIANTS[v][1] for v in variants]
    head += [f"({v})/({ref}) time (mem)" for v in ours for ref in ("c", "b")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rec in recipes:
        cells = [rec] + [_cell(by.get((rec, v))) for v in variants]
        cells += [_ratio(by.get((rec, v)), by.get((rec, ref))) for v in ours for ref in ("c", "b")]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("cells: median step ms (fwd+bwd+optimizer) over the timed steps (peak GiB allocated during them); "
                 "⚠ = see notes")
    notes = []
    for r in rows:
        tag = f"{r['recipe']} {VARIANTS[r['key']][1]}"
        if r.get("status") != "ok":
            notes.append(f"- {tag}: **{r.get('status')}**: {r.get('error')}")
        if r.get("warning"):
            notes.append(f"- {tag}: ⚠ {r['warning']}")
        if r["key"] == "b" and r.get("status") == "ok":
            notes.append(f"- {tag}: weights after fully_shard {r.get('weights_after_shard')}, in forward "
                         f"{r.get('weights_in_forward')}")
        if r["key"] in OURS and "fp8_shards" in r:
            notes.append(f"- {tag}: {r['fp8_shards']}")
        if r["key"] in OURS and "requantize_graph" in r:
            g = r["requantize_graph"]
            notes.append(f"- {tag}: requantization replayed as a CUDA graph in {g['replays']} steps"
                         + (f" (graphs off: {g['disabled_reason']})" if g["disabled_reason"] else ""))
    if notes:
        lines += ["", "notes:"] + notes
    return "\n".join(lines)


def format_host_split(rows: list[dict]) -> str:
    """``--host-split``: host ms per step inside each timed function, per variant."""
    rows = [r for r in rows if r.get("host_split_ms")]
    if not rows:
        return ""
    labels = list(dict.fromkeys(k for r in rows for k in r["host_split_ms"]))
    lines = ["| recipe | variant | host ms (issue) | " + " | ".join(labels) + " |", "|---|---|---:|" + "---:|" * len(labels)]
    for r in rows:
        cells = [f"{r['host_split_ms'][k]:.2f}" if k in r["host_split_ms"] else "-" for k in labels]
        lines.append(f"| {r['recipe']} | {VARIANTS[r['key']][1]} | {statistics.median(r['host_ms']):.1f} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("host ms per step spent inside each function during the first timed steps (entries nest: on one rank "
                 "wait_for_unshard runs the post-all-gather hooks, and the pre-all-gather hook too)")
    return "\n".join(lines)


def format_breakdown(rows: list[dict]) -> str:
    """Where the step time goes: forward + backward vs optimizer step (+ zero_grad), the host's
    time to issue a step, and (``--gpu-only``) the GPU's time for it; medians."""
    lines = ["| recipe | variant | step ms | fwd+bwd ms | optimizer ms | host ms (issue) | GPU-only ms | "
             "resident GiB after step |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.get("status") == "ok":
            gpu_only = f"{r['median_gpu_only_ms']:.1f}" if "median_gpu_only_ms" in r else "-"
            lines.append(f"| {r['recipe']} | {VARIANTS[r['key']][1]} | {r['median_ms']:.1f} | {r['median_fwd_bwd_ms']:.1f} | "
                         f"{r['median_opt_ms']:.1f} | {r['median_host_ms']:.1f} | {gpu_only} | {r['resident_gib']:.2f} |")
    lines.append("")
    lines.append("host ms: time for Python to issue a step (forward, backward, optimizer) before the GPU finishes it; "
                 "when it is close to the step time the step is bound by the host, not the GPU. GPU-only ms: the step "
                 "enqueued behind a GPU sleep, so the host never holds the GPU back.")
    return "\n".join(lines)


# ---- main -------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dtensor_fp8.benchmarks te_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=16384)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--recipes", default=",".join(RECIPES), help=f"comma-separated subset of {','.join(RECIPES)}")
    p.add_argument("--variants", default="a,b,c,d,e", help="comma-separated subset of a (bf16, FSDP2), b (TE FP8 params, FSDP2), c (TE FP8 params, no FSDP), d (dtensor_fp8, FSDP2), e (d with bf16 masters)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--adam", choices=("fused", "foreach"), default="fused",
                   help="torch.optim.Adam implementation used by every variant (default fused: one CUDA kernel)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=0, metavar="R",
                   help="keep every variant of a recipe alive and time R more rounds of --round-steps steps of "
                        "each in turn; the step medians reported are over these interleaved steps (the host's "
                        "speed drifts between spells of seconds; interleaving spreads that over all variants)")
    p.add_argument("--round-steps", type=int, default=5)
    p.add_argument("--host-split", action="store_true",
                   help="time the host's work inside FSDP2's unshard / wait_for_unshard / post_backward / reshard, "
                        "the FP8 all-gather hooks (ours, TE's) and our requantization during the first --steps "
                        "timed steps (host split table)")
    p.add_argument("--gpu-only", type=int, default=0, metavar="N",
                   help="also time N steps each enqueued behind a GPU sleep, so the host never holds the GPU back "
                        "(GPU-only ms in the breakdown)")
    p.add_argument("--profile", action="store_true", help="also profile 2 steps per variant (torch.profiler tables "
                   "to --out/profile_<recipe>_<variant>.txt; GPU-busy vs step time in the JSON)")
    p.add_argument("--out", default="bench_out", help="directory for te_step.json (default ./bench_out)")
    args = p.parse_args(argv)
    recipes = [r for r in args.recipes.split(",") if r]
    variants = [v for v in args.variants.split(",") if v]
    if set(recipes) - set(RECIPES):
        p.error(f"unknown recipes {sorted(set(recipes) - set(RECIPES))}; choose from {list(RECIPES)}")
    if set(variants) - set(VARIANTS):
        p.error(f"unknown variants {sorted(set(variants) - set(VARIANTS))}; choose from {list(VARIANTS)}")
    if args.hidden % args.heads:
        p.error("--hidden must be a multiple of --heads")
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be >= 1")
    if args.gpu_only < 0 or args.rounds < 0 or args.round_steps < 1:
        p.error("--gpu-only and --rounds must be >= 0, --round-steps >= 1")

    ns, reason = _import_te()
    if ns is None:
        print(f"te_step: Transformer Engine does not import here ({reason}); this benchmark needs "
              "transformer_engine.pytorch and a CUDA GPU. Nothing was run.", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("te_step: no CUDA device; this benchmark needs a GPU. Nothing was run.", file=sys.stderr)
        return 2

    import torch.distributed as dist

    torch.cuda.set_device(0)
    cc = torch.cuda.get_device_capability()
    device_name = torch.cuda.get_device_name()
    config = {k: getattr(args, k) for k in ("layers", "hidden", "ffn", "heads", "seq", "batch", "steps", "warmup",
                                            "lr", "seed", "adam", "gpu_only", "rounds", "round_steps", "host_split")}
    print(f"# te_step: {args.layers} x TransformerLayer(hidden={args.hidden}, ffn={args.ffn}, heads={args.heads}), "
          f"input {args.seq}x{args.batch}; {device_name} (sm_{cc[0]}{cc[1]}); torch {torch.__version__}; "
          f"TE {ns.version}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        mesh = _init_process_group(tmp)
        try:
            for rec in recipes:
                live = []
                for v in variants:
                    t0 = time.perf_counter()
                    r = run_variant(v, rec, ns, args, mesh, keep=args.rounds > 0)
                    if args.rounds > 0:
                        r, step = r
                        if step is not None:
                            live.append((r, step))
                    r["variant_wall_s"] = time.perf_counter() - t0
                    rows.append(r)
                    msg = (f"{r['median_ms']:.2f} ms, step peak {r['step_peak_gib']:.2f} GiB"
                           if r.get("status") == "ok" else f"{r.get('status')}: {r.get('error')}")
                    print(f"  {rec:<12} {VARIANTS[v][1]:<32} {msg}  [{r['variant_wall_s']:.1f} s]"
                          + (f"  WARNING: {r['warning']}" if r.get("warning") else ""), flush=True)
                if live:
                    time_rounds(live, args.rounds, args.round_steps)
                    print(f"  {rec:<12} interleaved: " + ", ".join(
                        f"{r['key']} {r['median_ms']:.1f}" for r, _ in live) + " ms", flush=True)
                    live = step = None
                    gc.collect()
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    table = format_table(rows, recipes, variants)
    breakdown = format_breakdown(rows)
    host_split = format_host_split(rows)
    print()
    print(breakdown)
    if host_split:
        print()
        print(host_split)
    print()
    print(table)
    meta = {
        "benchmark": "te_step", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name, "compute_capability": list(cc), "torch": torch.__version__, "cuda": torch.version.cuda,
        "transformer_engine": ns.version, "python": platform.python_version(), "config": config,
        "recipes": recipes, "variants": {v: VARIANTS[v][1] for v in variants},
        "timing": ("median of per-step CUDA-event times (synchronize before each step) over the timed steps, after "
                   "warm-up" + (f"; then over {args.rounds} interleaved rounds of {args.round_steps} steps per variant "
                                "(all variants of a recipe alive, taking turns)" if args.rounds else "")),
        "memory": "step_peak: max_memory_allocated over the timed steps (reset after warm-up); variant_peak: from "
                  "the start of the variant (model build included); both minus what was allocated before the "
                  "variant was built",
        "argv": sys.argv,
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "te_step.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": rows, "table_markdown": table, "breakdown_markdown": breakdown,
                   "host_split_markdown": host_split}, f, indent=1, default=str)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
