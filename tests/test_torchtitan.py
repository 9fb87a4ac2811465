"""torchtitan 0.3 with dtensor_fp8's converter, driven through torchtitan's own functions: its
Llama3 debug model config (``model_registry``), the converter applied by that config, its sharding
config and ``parallelize_llama`` (FSDP2 on 2 ranks; FSDP2 x TP on 4; the default ``spmd_types``
backend and the DTensor one; pipeline x FSDP2 on 4, pp=2 x dp=2, through ``pipeline_llm`` and the
1F1B / GPipe schedule it builds), ``init_weights``, its optimizers container, LR schedulers, loss and
DCP ``CheckpointManager`` (dtensor_fp8/integrations/torchtitan.py).

What differs from torchtitan's trainer, and why (a CPU over gloo; the trainer itself imports the
``datasets`` package, which the test extra leaves out):
* ``torchtitan.distributed.parallel_dims.device_type`` is set to the ranks' device: torchtitan takes
  "cuda" when no accelerator is present;
* the attention is torchtitan's ``ScaledDotProductAttention`` (its FlexAttention has no CPU
  backward; its config helper refuses "sdpa" for language models, so the config is set here);
* the sharding config comes from ``set_llama3_sharding_config`` (what the trainer's
  ``update_from_config`` calls; that method imports the trainer);
* the training step is the trainer's ``forward_backward_step`` / ``pp_forward_backward_step``
  written out (forward, loss, backward; or ``pp_schedule.step`` over micro-batches);
* FSDP reduce-scatters with a SUM (``set_force_sum_reduction_for_comms``): gloo has no PREMUL_SUM,
  which torchtitan's gradient-divide factor of 1 asks for; the sum is the same.

torchtitan needs torch >= 2.14; install it with the test extra (pyproject.toml's ``torchtitan``).
"""

from __future__ import annotations

import pytest
import torch

import dtensor_fp8 as d
import fp8_snapshot
from dist_utils import BACKEND, WORLD_SIZES, backend_spec

if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 14):
    pytest.skip(f"torchtitan 0.3 needs torch >= 2.14 (this is {torch.__version__})", allow_module_level=True)
pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e '.[torchtitan]', see pyproject)")

import torch.distributed as dist  # noqa: E402

from dtensor_fp8._compat import dtensor_local  # noqa: E402
from dtensor_fp8.integrations.torchtitan import (  # noqa: E402
    FP8ParameterConverter,
    FP8ParameterLinear,
    master_weight_adamw,
    recipe_from_tensor,
)

LR = 1e-3
SEQ = 64
BATCH = 2  # per data-parallel rank
VOCAB = 2048  # the debug model's
#: Linear layers of the debug model: 6 blocks x (wqkv, wo, w1, w2, w3), and the output head
LINEARS = 6 * 5 + 1


def _model_config(recipe: str | None, filter_fqns=(), *, enable_sp: bool = False):
    """torchtitan's debug model config, through ``model_registry`` with the converter (or none),
    then the CPU attention and torchtitan's sharding config (see the module docstring)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    converters = None if recipe is None else [FP8ParameterConverter.Config(recipe=recipe, filter_fqns=list(filter_fqns))]
    config = model_registry("debugmodel", converters=converters).model
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_llama3_sharding_config(config, enable_sp=enable_sp)
    return config


#: (spmd backend, TP degree, world size) -> the ParallelDims (and meshes) this rank process uses
_PARALLEL_DIMS: dict = {}


class _Run:
    """One torchtitan training setup on this rank: model, optimizers, schedulers, checkpointer."""

    def __init__(self, recipe, tp: int, backend: str, ckpt_dir: str | None = None, ac=None, checkpoint=None,
                 optimizer=None):
        """``ac``: torchtitan's activation-checkpointing config (``SelectiveAC.Config()``, ...) or ``None``;
        ``checkpoint``: the checkpointer's config (default: one that saves everything at every step);
        ``optimizer``: the optimizers container's config (default: the one the recipe needs)."""
        from torchtitan.components.checkpoint import CheckpointManager
        from torchtitan.components.loss import CrossEntropyLoss
        from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
        from torchtitan.config import CompileConfig
        from torchtitan.models.llama3 import parallelize_llama

        device, parallelism, training = self._setup(backend, tp)
        with torch.device("meta"):
            model = _model_config(recipe, enable_sp=False).build()
        torch.manual_seed(0)  # init_weights draws the same values with and without FP8
        model = parallelize_llama(model, parallel_dims=self.dims, training=training, parallelism=parallelism,
                                  compile_config=CompileConfig(), ac_config=ac, dump_folder="")
        #: the parameters right after parallelization (before to_empty): name -> (class of the local tensor, recipe)
        self.parallelized = {n: (type(dtensor_local(p)).__name__, getattr(dtensor_local(p), "recipe", None))
                             for n, p in model.named_parameters()}
        init_model_parts([model], device, force_sum_reduction=BACKEND != "nccl")
        self.model = model
        optimizer = optimizer or (default_adamw if recipe is None else master_weight_adamw)(lr=LR)
        self.optimizers = optimizer.build(model_parts=[model])
        self.schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=self.optimizers,
                                                                             training_steps=16)
        self.loss_fn = CrossEntropyLoss.Config(global_vocab_size=VOCAB).build()
        self.checkpointer = None
        if ckpt_dir is not None:
            from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

            checkpoint = checkpoint or CheckpointManager.Config(enable=True, folder="checkpoint", interval=1,
                                                                keep_latest_k=0, last_save_model_only=False)
            self.checkpointer = checkpoint.build(
                dataloader=None, model_parts=[model], optimizers=self.optimizers, lr_schedulers=self.schedulers,
                states={}, sd_adapter=Llama3StateDictAdapter(_model_config(recipe), None), base_folder=ckpt_dir)

    def _setup(self, backend: str, tp: int, pp: int = 1, schedule: str = "1F1B"):
        """torchtitan's configs and ``ParallelDims`` (its meshes) for this layout; the device."""
        import torchtitan.distributed.parallel_dims as parallel_dims_module
        from torchtitan.config import ParallelismConfig, TrainingConfig
        from torchtitan.distributed import ParallelDims, utils as dist_utils

        device = backend_spec(BACKEND).device
        parallel_dims_module.device_type = device
        self.backend = backend
        parallelism = ParallelismConfig(spmd_backend=backend, tensor_parallel_degree=tp, pipeline_parallel_degree=pp,
                                        pipeline_parallel_schedule=schedule)
        training = TrainingConfig(local_batch_size=BATCH, seq_len=SEQ, mixed_precision_param="float32")
        dist_utils.set_spmd_backend(backend)
        key = (backend, tp, pp, dist.get_world_size())
        if key not in _PARALLEL_DIMS:  # one set of meshes per rank process: FSDP's spmd_types path matches mesh objects
            _PARALLEL_DIMS[key] = ParallelDims.from_config(parallelism, dist.get_world_size())
            _PARALLEL_DIMS[key].build_mesh()
        self.dims = _PARALLEL_DIMS[key]
        self.batch_mesh = self.dims.get_mesh("batch") if self.dims.dp_enabled else None
        self.dp = self.batch_mesh.size() if self.batch_mesh is not None else 1
        return device, parallelism, training

    def _batch(self, step: int):
        """This data-parallel rank's rows of one of two fixed batches (the loss falls by memorizing them)."""
        rank = self.batch_mesh.get_local_rank() if self.batch_mesh is not None else 0
        tokens = torch.randint(0, VOCAB, (self.dp * BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step % 2))
        mine = tokens[rank * BATCH:(rank + 1) * BATCH]
        return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()

    def train(self, steps) -> list[float]:
        """Steps over two fixed batches; the global mean loss."""
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.distributed.spmd_types import annotate_input_spmd_types

        losses = []
        for step in steps:
            inputs, labels = self._batch(step)
            extra = {"positions": torch.arange(SEQ).expand(BATCH, SEQ).contiguous()}
            if self.backend == "spmd_types":
                inputs, labels, extra = annotate_input_spmd_types(self.dims, inputs, labels, extra)
            with dist_utils.get_spmd_context(parallel_dims=self.dims)():
                loss, _ = self.loss_fn(self.model(inputs, **extra), labels,
                                       torch.tensor(float(self.dp * BATCH * SEQ)))
                loss.backward()
            self.optimizers.step()
            self.schedulers.step()
            self.optimizers.zero_grad()
            total = loss.detach().clone()
            if self.batch_mesh is not None:
                dist.all_reduce(total, group=self.batch_mesh.get_group())
            losses.append(total.item())
        return losses

    def fp8_weights(self) -> dict[str, str]:
        return {n: repr(dtensor_local(p).recipe) for n, p in self._named_parameters()
                if isinstance(dtensor_local(p), d.QuantizedTensor)}

    def _named_parameters(self):
        return list(self.model.named_parameters())

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Every parameter's local bytes (FP8 planes) and the optimizer state's (fp8_snapshot.py)."""
        return fp8_snapshot.snapshot(self._named_parameters(), self.optimizers)


_bytes = fp8_snapshot.as_bytes


def _train_side_by_side(recipes, tp, backend, steps=4):
    """Losses of the model without FP8 and with each recipe; what parallelization left FP8."""
    out = {"plain": _Run(None, tp, backend).train(range(steps))}
    for recipe in recipes:
        run = _Run(recipe, tp, backend)
        before = run.snapshot()
        out[recipe] = {"losses": run.train(range(steps)), "parallelized": run.parallelized,
                       "fp8_after": run.fp8_weights()}
        after = run.snapshot()
        out[recipe]["unchanged"] = sorted(k for k in before if k.endswith("/rowwise") and torch.equal(before[k], after[k]))
    return out


def _check_side_by_side(out, recipes):
    plain = out["plain"]
    assert plain[-1] < 0.95 * plain[0], plain
    for recipe in recipes:
        r = out[recipe]
        fp8 = {n: rec for n, (cls, rec) in r["parallelized"].items() if cls == "QuantizedTensor"}
        linears = {n for n in r["parallelized"] if n.endswith(("wqkv.weight", "wo.weight", "w1.weight", "w2.weight",
                                                              "w3.weight")) or n == "lm_head.weight"}
        assert set(fp8) == linears and len(fp8) == LINEARS, (recipe, sorted(set(linears) ^ set(fp8)))
        assert {repr(v) for v in fp8.values()} == {repr(d.RECIPES[recipe])}, fp8
        assert set(r["fp8_after"]) == linears, recipe
        assert r["unchanged"] == [], (recipe, r["unchanged"])
        for a, b in zip(r["losses"], plain):
            assert abs(a - b) <= 0.01 * b, (recipe, r["losses"], plain)


RECIPES_2 = list(d.RECIPES)

#: The debug model's 30 block Linear weights (6 layers x wqkv, wo, w1, w2, w3): what torchtitan's
#: activation checkpointing recomputes. One plane of them, each rank receives: 1 byte a value plus
#: 1/32 byte of scales (MXFP8: an E8M0 per 32; 1x128: an FP32 per 128).
BLOCK_LINEAR_NUMEL = 5_111_808


def _ac_against_off(recipe, steps=2):
    """The same training with torchtitan's selective AC (its debug config's) and without: losses,
    every local byte, and the all-gather bytes each rank received over ``steps`` after a warm-up."""
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    from dtensor_fp8.comm import CollectiveBytes

    out = {}
    for name, ac in (("off", None), ("selective", SelectiveAC.Config())):
        run = _Run(recipe, 1, "spmd_types", ac=ac)
        run.train(range(1))  # lazy init, outside the count
        with CollectiveBytes() as wire:
            losses = run.train(range(1, 1 + steps))
        snap = {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in run.snapshot().items()}
        out[name] = (losses, snap, wire.received, wire.calls)
    return out


@pytest.mark.parametrize("recipe", RECIPES_2)
def test_selective_activation_checkpointing_trains_bitwise_and_moves_each_plane_once(pools, recipe):
    """torchtitan's selective AC (``checkpoint_wrapper`` with a per-op policy around every block):
    the same losses and bytes as without it, bitwise; MXFP8 / 1x128 receive exactly one more plane
    of the block weights per step (the recompute's rowwise plane, completed at the backward gather;
    gathering both planes in both gathers received two more), the one-plane recipes nothing more."""
    steps = 2
    for out in pools[2].run(_ac_against_off, recipe, steps):
        (losses, snap, received, _), (ref_losses, ref_snap, ref_received, _) = out["selective"], out["off"]
        assert losses == ref_losses, (losses, ref_losses)
        assert snap.keys() == ref_snap.keys()
        assert [k for k in snap if not torch.equal(snap[k], ref_snap[k])] == []
        two_plane = recipe in ("mxfp8", "blockwise1d")
        extra = steps * (BLOCK_LINEAR_NUMEL + BLOCK_LINEAR_NUMEL // 32) if two_plane else 0
        assert received - ref_received == extra, (recipe, received - ref_received, extra)


def test_fsdp_two_ranks_every_recipe_trains_like_bf16(pools):
    """2 ranks, FSDP2 (torchtitan's default spmd_types backend): the converter in the model config
    leaves every Linear weight FP8 through ``parallelize_llama``, training, and the losses stay
    within 1 % of the same run without FP8 (measured: 0.05 % at most)."""
    out = pools[2].run(_train_side_by_side, RECIPES_2, 1, "spmd_types")
    assert out[0] == out[1]
    _check_side_by_side(out[0], RECIPES_2)


@pytest.mark.skipif(4 not in WORLD_SIZES, reason="the suite runs without world size 4")
def test_fsdp_four_ranks_every_recipe_trains_like_bf16(pools):
    """4 ranks, FSDP2: the debug model's 768-row MLP weights shard into 192-row pieces, which split
    128-row blocks (refused before shards could split blocks): every recipe trains within 1 % of the
    run without FP8."""
    out = pools[4].run(_train_side_by_side, RECIPES_2, 1, "spmd_types")
    assert all(o == out[0] for o in out)
    _check_side_by_side(out[0], RECIPES_2)


@pytest.mark.skipif(4 not in WORLD_SIZES, reason="the suite runs without world size 4")
@pytest.mark.parametrize("backend", ["spmd_types", "partial_dtensor"])
def test_fsdp_x_tp_four_ranks_trains_like_bf16(pools, backend):
    """4 ranks, FSDP2 x TP (2 x 2): torchtitan's TP (spmd_types' local shards, or DTensor's) cuts
    each FP8 weight at block boundaries, FSDP shards it again (splitting 128-row blocks: the 768-row MLP
    weights' 384-row TP shards into 192 rows); losses within 1 % of bf16."""
    recipes = ["mxfp8", "current", "blockwise2d"]
    out = pools[4].run(_train_side_by_side, recipes, 2, backend)
    assert all(o == out[0] for o in out)
    _check_side_by_side(out[0], recipes)


def _resume(recipe, tp, backend, root):
    first = _Run(recipe, tp, backend, root)
    first.train(range(2))
    assert first.checkpointer.save(curr_step=2)
    losses = first.train(range(2, 4))
    expected = first.snapshot()
    first.checkpointer.close()
    resumed = _Run(recipe, tp, backend, root)
    assert resumed.checkpointer.load(step=2)
    again = resumed.train(range(2, 4))
    got = resumed.snapshot()
    keys = sorted(set(expected) | set(got))
    differ = fp8_snapshot.differing(expected, got)
    resumed.checkpointer.close()
    return {"losses": losses, "again": again, "differ": differ, "n": len(keys)}


@pytest.mark.parametrize("recipe", ["mxfp8", "delayed"])
def test_resume_through_torchtitans_checkpointer_is_bit_exact(pools, tmp_path, recipe):
    """torchtitan's own ``CheckpointManager`` saves and loads the FP8 model and the masters
    optimizer (delayed scaling: its amax histories too); the resumed run's losses, FP8 bytes,
    scales, masters and optimizer state equal the uninterrupted run's byte for byte."""
    out = pools[2].run(_resume, recipe, 1, "spmd_types", str(tmp_path))
    for r in out:
        assert r["differ"] == [] and r["n"] > LINEARS, r["differ"][:8]
        assert r["again"] == r["losses"], r


@pytest.mark.skipif(4 not in WORLD_SIZES, reason="the suite runs without world size 4")
def test_resume_fsdp_x_tp_is_bit_exact(pools, tmp_path):
    out = pools[4].run(_resume, "mxfp8", 2, "spmd_types", str(tmp_path))
    for r in out:
        assert r["differ"] == [] and r["again"] == r["losses"], r["differ"][:8]


# ---- pipeline parallelism over FSDP2: torchtitan's pipeline_llm, its schedule, its checkpointer ------
def init_model_parts(parts, device, *, force_sum_reduction: bool) -> None:
    """Materialize model parts (a model, or its pipeline stages) built on meta as torchtitan's trainer does (``to_empty``,
    ``init_weights``, train mode); with ``force_sum_reduction`` their FSDP2 modules reduce with SUM
    (gloo has no PREMUL_SUM)."""
    from torch.distributed.fsdp import FSDPModule

    for part in parts:
        if force_sum_reduction:
            for m in part.modules():
                if isinstance(m, FSDPModule):
                    m.set_force_sum_reduction_for_comms(True)
        part.to_empty(device=device)
        with torch.no_grad():
            part.init_weights(buffer_device=None)
        part.train()


def pipeline_step(run, arg_mbs, kwarg_mbs, target_mbs, valid_tokens: int) -> float:
    """One step of ``run``'s pipeline schedule, optimizers and LR schedulers, as torchtitan's
    ``pp_forward_backward_step`` and ``train_step`` run it: the last stage's summed micro-batch
    losses, summed over the batch mesh and broadcast from the last stage over the ``pp`` group."""
    pp_group = run.dims.get_mesh("pp").get_group()
    last_rank = dist.get_global_rank(pp_group, run.dims.get_mesh("pp").size() - 1)
    mb_losses = [] if run.last else None
    run.schedule.step(arg_mbs=arg_mbs if run.first else None, kwarg_mbs=kwarg_mbs,
                      target_mbs=target_mbs if run.last else None, losses=mb_losses,
                      loss_kwargs={"global_valid_tokens": torch.tensor(float(valid_tokens))}, return_outputs=False)
    run.optimizers.step()
    run.schedulers.step()
    run.optimizers.zero_grad()
    total = torch.stack(mb_losses).sum().detach() if run.last else torch.zeros(())
    dist.all_reduce(total, group=run.batch_mesh.get_group())
    dist.broadcast(total, src=last_rank, group=pp_group)
    return total.item()


class _PipelineRun(_Run):
    """One torchtitan pp=2 x dp=2 setup on this rank, as its trainer builds it: ``pipeline_llm``
    splits the meta model into this rank's stage, applies ``parallelize_llama`` to it (FSDP2 with
    torchtitan's PP policy, ``reshard_after_forward=False``) and builds the schedule the config
    names; then ``to_empty`` / ``init_weights`` per model part, the optimizers container over the
    parts, and ``pp_schedule.step`` over micro-batches of one sequence (the trainer's
    ``pp_forward_backward_step``)."""

    def __init__(self, recipe, schedule: str, ckpt_dir: str | None = None, checkpoint=None):
        from torch.distributed.fsdp import FSDPModule
        from torchtitan.components.checkpoint import CheckpointManager
        from torchtitan.components.loss import CrossEntropyLoss
        from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
        from torchtitan.config import CompileConfig
        from torchtitan.models.llama3 import parallelize_llama
        from torchtitan.distributed.pipeline_parallel import pipeline_llm

        device, parallelism, training = self._setup("spmd_types", tp=1, pp=2, schedule=schedule)
        config = _model_config(recipe)
        with torch.device("meta"):
            model = config.build()
        self.loss_fn = CrossEntropyLoss.Config(global_vocab_size=VOCAB).build()
        self.schedule, parts, self.first, self.last = pipeline_llm(
            model, parallel_dims=self.dims, training=training, parallelism=parallelism,
            compile_config=CompileConfig(), ac_config=None, dump_folder="", device=torch.device(device),
            model_config=config, parallelize_fn=parallelize_llama, loss_fn=self.loss_fn)
        self.parallelized = {n: (type(dtensor_local(p)).__name__, getattr(dtensor_local(p), "recipe", None))
                             for part in parts for n, p in part.named_parameters()}
        # FSDP2 keeps a post-forward mesh exactly for modules that reshard after forward
        groups = [m._get_fsdp_state()._fsdp_param_group for part in parts for m in part.modules()
                  if isinstance(m, FSDPModule)]
        self.reshard_after_forward = sorted({g.post_forward_mesh_info is not None for g in groups if g is not None})
        torch.manual_seed(0)
        init_model_parts(parts, device, force_sum_reduction=BACKEND != "nccl")
        self.parts = parts
        self.optimizers = (default_adamw if recipe is None else master_weight_adamw)(lr=LR).build(model_parts=parts)
        self.schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=self.optimizers,
                                                                             training_steps=16)
        self.checkpointer = None
        if ckpt_dir is not None:
            checkpoint = checkpoint or CheckpointManager.Config(enable=True, folder="checkpoint", interval=1,
                                                                keep_latest_k=0, last_save_model_only=False)
            self.checkpointer = checkpoint.build(
                dataloader=None, model_parts=parts, optimizers=self.optimizers, lr_schedulers=self.schedulers,
                states={}, sd_adapter=None, base_folder=ckpt_dir)

    def train(self, steps) -> list[float]:
        """Like ``_Run.train``, through the schedule: the last stage's summed micro-batch losses,
        summed over the batch mesh and broadcast from the last stage over the ``pp`` group."""
        from torchtitan.distributed.spmd_types import annotate_input_spmd_types

        losses = []
        for step in steps:
            inputs, labels = self._batch(step)
            arg_mbs, kwarg_mbs, target_mbs = [], [], []
            for i in range(BATCH):  # micro-batches of one sequence (pipeline_parallel_microbatch_size=1)
                x, y, extra = annotate_input_spmd_types(self.dims, inputs[i:i + 1], labels[i:i + 1],
                                                        {"positions": torch.arange(SEQ)[None]})
                arg_mbs.append((x,))
                kwarg_mbs.append(extra)
                target_mbs.append(y)
            losses.append(pipeline_step(self, arg_mbs, kwarg_mbs, target_mbs, self.dp * BATCH * SEQ))
        return losses

    def _named_parameters(self):
        return [item for part in self.parts for item in part.named_parameters()]


def _pipeline_side_by_side(recipe, schedule, steps=4):
    out = {"plain": _PipelineRun(None, schedule).train(range(steps))}
    run = _PipelineRun(recipe, schedule)
    before = run.snapshot()
    out[recipe] = {"losses": run.train(range(steps)), "parallelized": run.parallelized,
                   "fp8_after": run.fp8_weights(), "reshard_after_forward": run.reshard_after_forward}
    after = run.snapshot()
    out[recipe]["unchanged"] = sorted(k for k in before if k.endswith("/rowwise") and torch.equal(before[k], after[k]))
    return out


@pytest.mark.skipif(4 not in WORLD_SIZES, reason="the suite runs without world size 4")
@pytest.mark.parametrize("recipe,schedule", [("mxfp8", "1F1B"), ("current", "GPipe"),
                                             ("blockwise1d", "Interleaved1F1B")])
def test_pipeline_x_fsdp_four_ranks_trains_like_bf16(pools, recipe, schedule):
    """4 ranks, pp=2 x dp=2: torchtitan's ``pipeline_llm`` splits the converted model into two
    stages (four when interleaved, two per rank) and FSDP2-shards each over its dp pair (reshard_after_forward=False, torchtitan's PP
    policy); the two stages' FP8 weights together are every Linear of the model; the losses
    (the last stage's, the same on every rank) within 1 % of the same pipeline without FP8."""
    out = pools[4].run(_pipeline_side_by_side, recipe, schedule)
    assert all(o[recipe]["losses"] == out[0][recipe]["losses"] for o in out)
    merged = {"plain": out[0]["plain"], recipe: {
        "losses": out[0][recipe]["losses"],
        "parallelized": {n: v for o in out for n, v in o[recipe]["parallelized"].items()},
        "fp8_after": {n: v for o in out for n, v in o[recipe]["fp8_after"].items()},
        "unchanged": sorted({k for o in out for k in o[recipe]["unchanged"]})}}
    assert all(o[recipe]["reshard_after_forward"] == [False] for o in out), [o[recipe]["reshard_after_forward"] for o in out]
    _check_side_by_side(merged, [recipe])


def _pipeline_resume(recipe, schedule, root):
    first = _PipelineRun(recipe, schedule, root)
    first.train(range(2))
    assert first.checkpointer.save(curr_step=2)
    losses = first.train(range(2, 4))
    expected = first.snapshot()
    first.checkpointer.close()
    resumed = _PipelineRun(recipe, schedule, root)
    assert resumed.checkpointer.load(step=2)
    again = resumed.train(range(2, 4))
    got = resumed.snapshot()
    keys = sorted(set(expected) | set(got))
    differ = fp8_snapshot.differing(expected, got)
    resumed.checkpointer.close()
    return {"losses": losses, "again": again, "differ": differ, "n": len(keys)}


@pytest.mark.skipif(4 not in WORLD_SIZES, reason="the suite runs without world size 4")
@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_pipeline_x_fsdp_resume_is_bit_exact(pools, tmp_path, schedule):
    """pp=2 x dp=2 through torchtitan's ``CheckpointManager``: each rank saves and loads its own
    stages (one, or two model parts and their two optimizers when interleaved: FP8 planes, masters
    and optimizer state); the resumed run equals the uninterrupted one byte for byte on every rank."""
    out = pools[4].run(_pipeline_resume, "mxfp8", schedule, str(tmp_path))
    for r in out:
        assert r["differ"] == [] and r["n"] > 4, r["differ"][:8]
        assert r["again"] == r["losses"], r


# ---- in one process: the config-time refusals, the plain optimizer, the state-dict layout ------------
def _built(recipe, filter_fqns=()):
    with torch.device("meta"):
        model = _model_config(recipe, filter_fqns).build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def test_converter_selects_by_config_and_refuses_what_it_cannot_convert():
    from torchtitan.models.llama3 import llama3_configs
    from torchtitan.models.common.linear import Linear

    config = _model_config("mxfp8", filter_fqns=["lm_head", "layers.5"])
    kinds = {fqn: type(c) for fqn, c, _, _ in config.traverse(Linear.Config)}
    assert sum(k is FP8ParameterLinear.Config for k in kinds.values()) == 25
    assert kinds["lm_head"] is Linear.Config and kinds["layers.5.feed_forward.w1"] is Linear.Config

    bad = llama3_configs["debugmodel"](attn_backend="flex")
    bad.lm_head = Linear.Config(in_features=256, out_features=2000)
    with pytest.raises(d.RecipeError, match=r"(?s)nothing was converted.*lm_head.*filter_fqns=\['lm_head'\]"):
        FP8ParameterConverter.Config(recipe="mxfp8").build().convert(bad)
    assert all(type(c) is Linear.Config for _, c, _, _ in bad.traverse(Linear.Config))

    tied = llama3_configs["1B"](attn_backend="flex")
    with pytest.raises(d.RecipeError, match="tied to the token embedding"):
        FP8ParameterConverter.Config(recipe="mxfp8").build().convert(tied)
    with pytest.raises(d.RecipeError, match="unknown recipe 'fp4'"):
        FP8ParameterConverter.Config(recipe="fp4").build()


def test_torchtitans_own_optimizer_over_fp8_weights_is_refused_with_the_fix():
    """torchtitan's ``OptimizersContainer`` (``default_adamw``) over the converted model: the first
    forward and ``state_dict()`` refuse (the FP8 bytes are made by dtensor_fp8's container), and so
    would its step, naming ``master_weight_adamw``."""
    from torchtitan.components.optimizer import default_adamw

    from dtensor_fp8.integrations.torchtitan import FP8CheckpointManager

    model = _built("mxfp8")
    optimizers = default_adamw(lr=LR).build(model_parts=[model])
    # the trainer builds its checkpointer (enabled or not) right after the optimizers: refused there
    with pytest.raises(d.RecipeError, match=r"(?s)torchtitan's OptimizersContainer builds plain AdamW.*31 FP8 "
                                            r"weights.*master_weight_adamw"):
        FP8CheckpointManager.Config().build(dataloader=None, model_parts=[model], optimizers=optimizers,
                                            lr_schedulers=None, states={}, sd_adapter=None)
    tokens = torch.randint(0, VOCAB, (1, 8))
    with pytest.raises(d.RecipeError, match="master_weight_adamw"):
        model(tokens, positions=torch.arange(8)[None])
    with pytest.raises(d.RecipeError, match="master_weight_adamw"):
        model.state_dict()
    d.finish_init_(model)  # bytes made by hand: then its step would write FP8 weights in place
    model(tokens, positions=torch.arange(8)[None]).float().mean().backward()
    with pytest.raises(NotImplementedError, match=r"(?s)updating FP8 weights in place.*master_weight_adamw"):
        optimizers.step()


def test_state_dict_layout_round_trips_and_refuses_another_recipe():
    """What torchtitan's checkpointer keeps: tensors only, an FP8 weight's entry flattened, the
    recipe as a uint8 tensor of its config; ``load_state_dict`` rebuilds the weights bit-exactly,
    and a checkpoint of another recipe is refused naming both."""
    model = _built("mxfp8")
    master_weight_adamw(lr=LR).build(model_parts=[model])  # makes the FP8 bytes
    sd = model.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in sd.values())
    assert "layers.0.feed_forward.w1.weight" not in sd
    assert '"MXFP8"' in recipe_from_tensor(sd["layers.0.feed_forward.w1.weight.recipe"])
    fresh = _built("mxfp8")
    master_weight_adamw(lr=LR).build(model_parts=[fresh])
    fresh.load_state_dict({k: v.clone() for k, v in sd.items()})
    for (n, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters()):
        if isinstance(a, d.QuantizedTensor):
            for usage in a.planes:
                assert torch.equal(a.planes[usage].data.view(torch.uint8), b.planes[usage].data.view(torch.uint8)), n
        else:
            assert torch.equal(a, b), n
    with torch.device("meta"):
        other = FP8ParameterLinear.Config(in_features=256, out_features=768, recipe="blockwise1d").build()
    other.to_empty(device="cpu")
    other.reset_parameters()
    d.finish_init_(other)
    prefix = "layers.0.attention.qkv_linear.wqkv."
    with pytest.raises(d.RecipeError, match=r"(?s)holds this weight in MXFP8.*Blockwise"):
        other.load_state_dict({k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)})

