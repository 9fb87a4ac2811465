"""torchtitan 0.3's DeepSeek-V3 debug model with FP8 routed experts under pipeline parallelism: PP 2
x FSDP2 2 at 4 gloo ranks through the model spec's ``pipeline_llm`` (it splits the meta model into
this rank's stage, applies ``parallelize_deepseekv3`` to it, FSDP2 with torchtitan's PP policy, and
builds the 1F1B schedule), as tests/test_torchtitan.py's ``_PipelineRun`` drives the Llama3 one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_utils import BACKEND, WORLD_SIZES, backend_spec

if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 14):
    pytest.skip(f"torchtitan 0.3 needs torch >= 2.14 (this is {torch.__version__})", allow_module_level=True)
pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e '.[torchtitan]', see pyproject)")

import torchtitan_moe as moe  # noqa: E402
from test_torchtitan import init_model_parts, pipeline_step  # noqa: E402

pytestmark = pytest.mark.skipif(4 not in WORLD_SIZES, reason="the suite runs without world size 4")
#: the dense first layer and two MoE layers: a stage each
MOE_LAYERS = 2


class PipelineMoERun(moe.MoERun):
    """One pp=2 x dp=2 setup on this rank (see the module docstring); ``train`` is the trainer's
    ``pp_forward_backward_step``: ``schedule.step`` over micro-batches of one sequence."""

    def __init__(self, recipe: str | None):
        import torchtitan.distributed.parallel_dims as parallel_dims_module
        from torchtitan.components.loss import CrossEntropyLoss
        from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
        from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
        from torchtitan.distributed import ParallelDims, utils as dist_utils

        from dtensor_fp8.integrations.torchtitan import master_weight_adamw

        device = backend_spec(BACKEND).device
        parallel_dims_module.device_type = device
        self.recipe, self.ep = recipe, 1
        parallelism = ParallelismConfig(spmd_backend="partial_dtensor", pipeline_parallel_degree=2,
                                        pipeline_parallel_schedule="1F1B")
        training = TrainingConfig(local_batch_size=moe.BATCH, seq_len=moe.SEQ, mixed_precision_param="float32")
        dist_utils.set_spmd_backend("partial_dtensor")
        key = ("pp", dist.get_world_size())
        if key not in moe._PARALLEL_DIMS:
            moe._PARALLEL_DIMS[key] = ParallelDims.from_config(parallelism, dist.get_world_size())
            moe._PARALLEL_DIMS[key].build_mesh()
        self.dims = moe._PARALLEL_DIMS[key]
        self.batch_mesh = self.dims.get_mesh("batch")
        spec = moe.model_spec("deepseek_v3", recipe, moe_layers=MOE_LAYERS)
        with torch.device("meta"):
            model = spec.model.build()
        self.loss_fn = CrossEntropyLoss.Config(global_vocab_size=moe.VOCAB).build()
        self.schedule, parts, self.first, self.last = spec.pipelining_fn(
            model, parallel_dims=self.dims, training=training, parallelism=parallelism,
            compile_config=CompileConfig(), ac_config=None, dump_folder="", device=torch.device(device),
            model_config=spec.model, parallelize_fn=spec.parallelize_fn, loss_fn=self.loss_fn)
        self.parts = parts
        self.parallelized = self.fp8_weights()
        torch.manual_seed(0)
        init_model_parts(parts, device, force_sum_reduction=True)
        self.optimizers = (default_adamw if recipe is None else master_weight_adamw)(lr=moe.LR).build(model_parts=parts)
        self.schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=self.optimizers,
                                                                             training_steps=16)

    def train(self, steps) -> list[float]:
        dp, rank = self.batch_mesh.size(), self.batch_mesh.get_local_rank()
        losses = []
        for step in steps:
            tokens = torch.randint(0, moe.VOCAB, (dp * moe.BATCH, moe.SEQ + 1),
                                   generator=torch.Generator().manual_seed(step % 2))
            mine = tokens[rank * moe.BATCH:(rank + 1) * moe.BATCH]
            args = [(mine[i:i + 1, :-1].contiguous(),) for i in range(moe.BATCH)]
            kwargs = [{"positions": torch.arange(moe.SEQ)[None]} for _ in range(moe.BATCH)]
            targets = [mine[i:i + 1, 1:].contiguous() for i in range(moe.BATCH)]
            losses.append(pipeline_step(self, args, kwargs, targets, dp * moe.BATCH * moe.SEQ))
        return losses


def _pipeline_side_by_side(recipe, steps=3):
    out = {"bf16": PipelineMoERun(None).train(range(steps))}
    run = PipelineMoERun(recipe)
    losses = run.train(range(steps))
    out[recipe] = {"losses": losses, "parallelized": run.parallelized, "fp8_after": run.fp8_weights(),
                   "unlike": run.unlike_per_expert_quantize()}
    return out


@pytest.mark.parametrize("recipe", ["blockwise2d"])
def test_pipeline_x_fsdp_four_ranks_fp8_experts_train_like_bf16(pools, recipe):
    """pp=2 x dp=2: the two stages' FP8 weights together are every routed expert weight of the
    model (nothing else), FP8 after training too, their gathered planes equal per-expert
    ``quantize`` of the masters; the losses (the last stage's) within 1 % of bf16 experts'."""
    out = pools[4].run(_pipeline_side_by_side, recipe)
    bf16, losses = out[0]["bf16"], out[0][recipe]["losses"]
    assert all(o[recipe]["losses"] == losses for o in out)
    parallelized = {n: v for o in out for n, v in o[recipe]["parallelized"].items()}
    assert len(parallelized) == 3 * MOE_LAYERS and all(moe.ROUTED in n for n in parallelized), sorted(parallelized)
    assert {n for o in out for n in o[recipe]["fp8_after"]} == set(parallelized)
    assert all(o[recipe]["unlike"] == [] for o in out)
    for a, b in zip(losses, bf16):
        assert abs(a - b) <= 0.01 * b, (losses, bf16)
