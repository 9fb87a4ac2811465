"""Requantizing FP8 parameters in place from high-precision values (an optimizer step's masters).

[Note: requantizing sharded FP8 weights]
After ``step()`` every FP8 parameter's local shard is requantized in place from its master
shard, into every plane it stores. A scaling block that lies inside one shard needs nothing from
other ranks. A block that spans a sharded dim (per-tensor scaling: the block is the whole tensor)
needs the max over all shards, and so does a block that a shard boundary splits (FSDP2 at a
degree whose shards are not whole blocks, a ColwiseParallel / RowwiseParallel shard starting
inside a block: see "block phase" in ``formats/base.py``): each rank places the partial amaxes of
the blocks it touches in the weight's whole block grid along every split dim (zeros elsewhere) and
the grids are MAX-reduced over the mesh dims sharding those dims (dp for FSDP2's cut, tp for the
TP style's, both where both cut), so every rank holding part of a block gets the amax over exactly
its elements. This is the one place a TP shard's split blocks meet: at each requantization, never
in a GEMM. All those amaxes,
of *all* weights, are packed into one tensor per group and reduced with a single all-reduce, not
one per weight. Delayed scaling records the global amax in its per-weight amax history (the
weight's owner record, ``QuantizedTensor.param_state``) and takes the next scale from TE's update
rule. The grid of a split weight costs 4 bytes per block of the dim per requantization (128x128:
1/4096 of a byte per element; MXFP8's 32-row column blocks: 1/8): only weights whose shards split
blocks send it.
"""

from __future__ import annotations

import contextlib
import gc

import torch

from . import groups
from ._compat import dtensor_local
from .groups import sharded_dims, split_blocks
from .layout import SplitBlocks
from .placement import local_tensor


class AmaxReduction:
    """The block amaxes of a set of (weight, plane) jobs that need other ranks' values: blocks
    spanning a sharded dim (per-tensor scales) and blocks split between shards (see the note at the
    top); one MAX all-reduce per group for all of them. Decided once (Python only), computed by
    :meth:`amaxes` from the high-precision values.

    Args:
        jobs: ``(param, q, usage)``: the parameter (a DTensor, or a local shard whose owner record
            is bound), its local QuantizedTensor and the plane.

    Example:
        >>> amaxes = AmaxReduction([(p, local_tensor(p), "rowwise")]).amaxes([master])
    """

    def __init__(self, jobs):
        self.spanning: dict = {}  # (recipe, usage) -> job indices whose blocks span a sharded dim
        self.split: dict[int, SplitBlocks] = {}  # job index -> where its split blocks lie
        self.reduce_over: dict[int, tuple] = {}
        self.jobs = [(q, usage) for _, q, usage in jobs]
        for i, (p, q, usage) in enumerate(jobs):
            sharded = sharded_dims(p)
            if any(q.recipe.spans_dim(usage, d) for d in sharded):
                self.spanning.setdefault((q.recipe, usage), []).append(i)
                self.reduce_over[i] = groups.weight_groups(p, lambda d, q=q, usage=usage: q.recipe.spans_dim(usage, d))
            elif sharded and (split := split_blocks(p, usage)) is not None:
                self.split[i] = split
                self.reduce_over[i] = split.groups
        #: whether :meth:`amaxes` communicates (blocks across shards on a mesh dim of more than one rank)
        self.reduces = groups.reduces(self.reduce_over.values())

    def amaxes(self, hps) -> list:
        """Per job: the amax grid to quantize with (reduced over its groups), or ``None`` where
        the recipe computes it from the shard alone."""
        out = [None] * len(self.jobs)
        for (recipe, usage), idx in self.spanning.items():  # per recipe and plane, in one batch
            # as the plane's matrix (a weight of more than two dims has its leading dims flattened)
            matrices = [hps[i].reshape(self.jobs[i][0].planes[usage].data.shape) for i in idx]
            for i, amax in zip(idx, recipe.block_amaxes(usage, matrices), strict=True):
                out[i] = amax
        for i, split in self.split.items():
            q, usage = self.jobs[i]
            out[i] = split.whole(q.recipe.block_amax_at(hps[i].reshape(q.planes[usage].data.shape), usage, q.phase))
        if self.reduces:
            order = list(self.reduce_over)
            reduced = groups.max_by_groups_([out[i] for i in order], [self.reduce_over[i] for i in order])
            for i, amax in zip(order, reduced, strict=True):
                out[i] = amax
        for i, split in self.split.items():  # back to the blocks this shard touches
            out[i] = split.touched(out[i], tuple(self.jobs[i][0].planes[self.jobs[i][1]].scale_inv.shape))
        return out


@torch.no_grad()
def requantize_from_hp_(items) -> None:
    """Requantize FP8 parameters in place from high-precision local shards; a stateful recipe
    (delayed scaling) updates the weight scaling state in each parameter's owner record
    (``param_state.scaling.weight``, created from the current scale if it has none yet).

    Args:
        items: ``(name, param, hp_local)``; ``param`` is a QuantizedTensor or a DTensor of one,
            ``hp_local`` the high-precision values of this rank's shard.

    Example:
        >>> requantize_from_hp_([("w", model.w, master_shard)])
    """
    plan = _RequantizePlan(items)
    plan.run()
    plan.finish()


class _RequantizePlan:
    """One requantization of a set of FP8 parameters, split into what it decides (here, Python
    only), the device work (:meth:`run`: the only part a CUDA graph captures) and the Python-side
    bookkeeping after it (:meth:`finish`)."""

    def __init__(self, items):
        jobs = []
        for name, p, hp in items:
            groups.bind_layout_(p)
            q = dtensor_local(p)  # the shard itself, the same object every step (see _fingerprint)
            for usage in q.planes:
                jobs.append((name, p, q, hp, usage))
        self.jobs = [(name, q, hp, usage) for name, _, q, hp, usage in jobs]
        # Only blocks that need other ranks' values need their amax now (see the note at the top);
        # the recipe computes the others itself, fused into its quantization where it can.
        self.reduction = AmaxReduction([(p, q, usage) for _, p, q, _, usage in jobs])
        #: whether run() all-reduces amaxes (blocks across shards on a mesh dim of more than one rank)
        self.reduces = self.reduction.reduces
        # One batch per (recipe, plane) for all its tensors: per-tensor scales are computed together.
        # A shard that splits blocks is quantized on its own (its block phase: formats/base.py).
        self.batches: dict = {}
        for i, (name, q, hp, usage) in enumerate(self.jobs):
            if i in self.reduction.split:
                continue
            plane = q.planes[usage]
            # Kept in the owner record from now on and updated in place by run().
            state = q.param_state.scaling.weight_state(q.recipe, usage, plane)
            # hp as the plane's matrix (a weight of more than two dims: its leading dims flattened)
            self.batches.setdefault((q.recipe, usage), []).append((i, hp.reshape(plane.data.shape), plane, state))
        self.tensors = list(dict.fromkeys(q for _, q, _, _ in self.jobs))

    def run(self) -> None:
        """The device work: amaxes (all-reduced where blocks lie across shards), new FP8 bytes and
        scales into the existing planes, new scaling states into the existing states."""
        jobs = self.jobs
        amaxes = self.reduction.amaxes([hp for _, _, hp, _ in jobs])
        kept, fresh = [], []
        for (recipe, usage), batch in self.batches.items():
            idx, hps, planes, states = zip(*batch)
            # In place: the FP8 bytes and scales keep their storage (FSDP's sharded parameters,
            # TE views and checkpoint plans all refer to it).
            new_states = recipe.requantize_planes_(usage, list(hps), list(planes), [amaxes[i] for i in idx], list(states))
            for old, new in zip(states, new_states, strict=True):
                if old is not None and new is not None and new is not old:
                    kept += [old[k] for k in old]
                    fresh += [new[k] for k in old]
        if kept:  # the states keep their storage too (one batched copy)
            torch._foreach_copy_(kept, fresh)
        for i in self.reduction.split:
            _, q, hp, usage = jobs[i]
            plane = q.planes[usage]
            made = q.recipe.quantize_plane_at(hp.reshape(plane.data.shape), usage, q.phase, amax=amaxes[i])
            plane.data.copy_(made.data)
            plane.scale_inv.copy_(made.scale_inv)

    def finish(self) -> None:
        for q in self.tensors:
            q.discard_transpose_cache()


def _fingerprint(items) -> tuple:
    """Identity and address of every tensor a requantization of ``items`` reads or writes: equal
    fingerprints mean a graph captured for one is valid for the other."""
    out = []
    for name, p, hp in items:
        # The DTensor's own local tensor: ``to_local()`` of a parameter is a new view each call on
        # torch >= 2.13, whose id would never match the one kept (no step would reuse its plan).
        q = dtensor_local(p)
        out += [name, id(p), id(hp), hp.data_ptr(), id(q), q.recipe]
        # every plane slot (None where absent), without building the planes' dict of views
        out += [None if t is None else (id(t), t.data_ptr()) for t in q.plane_tensors()]
        for usage, state in q.param_state.scaling.weight.items():
            out += [usage, *(t.data_ptr() for t in state.values())]
    return tuple(out)


@contextlib.contextmanager
def _no_cyclic_gc():
    """Python's cyclic garbage collector off for the block. While a CUDA graph is captured, a
    collection may destroy another graph (one kept alive only by a reference cycle), which CUDA
    forbids during a capture and which invalidates it (seen on an H100 in the GPU suite of
    2026-12-06: "operation not permitted when stream is capturing (function reset)", then "operation
    failed due to a previous error during capture"). torch.cuda.graph collects beforehand only
    under ``torch.compiler.config.force_cudagraph_gc``; a collection deferred is cheaper."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


class GraphedRequantize:
    """Runs an optimizer step's requantization, decided once and repeated, as a CUDA graph where it can.

    [Note: the requantization as one CUDA graph]
    After every optimizer step each FP8 weight is rewritten from its master: per weight an amax, a
    scale update (a delayed-scaling history), a cast, scale stores. On the GPU these take little
    time; issuing them from Python takes milliseconds per step, and a training step of FP8
    weights under FSDP2 is bound by the host (docs/benchmarks.md). The work reads and writes the
    same tensors every step (the masters, the planes and the scaling states are all updated in
    place), so it is captured once into a CUDA graph and replayed: one launch per step.

    The graph is valid while those tensors are: their identities and addresses
    (:func:`_fingerprint`, checked every step) change when a weight, master, plane or state is
    replaced (a checkpoint loaded with ``assign=True``, loaded scaling states), and the step then
    runs eagerly once and captures again. Not captured: requantizations that all-reduce amaxes
    (per-tensor recipes sharded over more than one rank: a collective inside a graph is not what every
    process group supports), CPU tensors, and the first step with new tensors (it creates the
    scaling states and warms up the kernels). A capture that fails turns graphs off for this
    optimizer, with the reason in :attr:`disabled_reason`; the step then runs eagerly.

    The same rule keeps the *plan* (:class:`_RequantizePlan`: which weights reduce their amaxes
    over which groups, the batches per recipe and plane, the scaling states) where no graph is
    captured: an eager step with an unchanged fingerprint runs the plan it made before, so the
    Python that decides is paid once per set of tensors, not once per step.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.disabled_reason: str | None = None if enabled else "cuda_graph=False"
        #: steps whose requantization was a graph replay
        self.replays = 0
        #: the plan of the last tensors, their fingerprint, and the graph captured of it (or None)
        self._plan = self._key = self._graph = None

    def __call__(self, items) -> None:
        plan = self._plan if self._plan is not None and _fingerprint(items) == self._key else None
        if plan is None:  # new tensors (or the first step): decide, then run eagerly once
            self._graph = None
            plan = _RequantizePlan(items)
            # After the plan: making it creates missing scaling states, which the fingerprint holds.
            self._plan, self._key = plan, _fingerprint(items)
            plan.run()
            plan.finish()
            return
        if self._graph is None and self._capturable(plan):
            self._graph = self._capture(plan)
        if self._graph is not None:
            self._graph.replay()
            self.replays += 1
        else:
            plan.run()
        plan.finish()

    def _capture(self, plan: _RequantizePlan):
        """A CUDA graph of ``plan.run()`` (capturing runs nothing), or ``None`` with graphs turned off."""
        graph = torch.cuda.CUDAGraph()
        try:
            with _no_cyclic_gc(), torch.cuda.graph(graph, capture_error_mode="thread_local"):
                plan.run()
        except Exception as e:  # noqa: BLE001  (whatever failed to capture: eager from now on)
            self.enabled = False
            self.disabled_reason = f"capture failed: {type(e).__name__}: {e}".splitlines()[0][:300]
            return None
        return graph

    def _capturable(self, plan: _RequantizePlan) -> bool:
        if not self.enabled or plan.reduces or not plan.jobs:
            return False
        return all(hp.is_cuda for _, _, hp, _ in plan.jobs) and not torch.cuda.is_current_stream_capturing()
