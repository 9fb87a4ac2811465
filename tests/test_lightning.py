"""Lightning Fabric's ``ModelParallelStrategy`` (FSDP2 through the user's ``parallelize_fn``) training
a model with FP8 weights under ``precision="bf16-mixed"`` (Fabric runs the forward under
``torch.autocast``), in Fabric's idiom, on 2 gloo ranks with a tiny ``LlamaForCausalLM``.

The ranks are started by the test harness, as ``torchrun`` starts them: with ``LOCAL_RANK`` set,
Fabric's ``LightningEnvironment`` creates no processes, ``fabric.launch()`` only sets up, and the
process group the ranks already hold is used (Fabric skips ``init_process_group`` when one
exists). ``Fabric(accelerator="cpu", devices=2)`` launching its own processes would re-run the
calling script, which under pytest is pytest itself; the strategy code is the same either way.

accelerate and lightning are test extras (``pip install -e ".[test,frameworks]"``).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import dtensor_fp8 as d
from dist_utils import BACKEND, DEVICE, WORLD_SIZES, backend_spec
from test_hf_llama import FP8_WEIGHTS, _config, _global_mean, _snapshot, _tokens

fabric_module = pytest.importorskip("lightning.fabric")
strategies = pytest.importorskip("lightning.fabric.strategies")
transformers = pytest.importorskip("transformers")

LR, STEPS = 2e-3, 4
#: Fabric's accelerator is the suite's device: "cuda" puts rank r on cuda:r (its ``LOCAL_RANK``),
#: as the NCCL backend does, and Fabric's meshes, hence FSDP2's shards, are on it.
ACCELERATOR = DEVICE
pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and not backend_spec(BACKEND).gpu_per_rank,
    reason=f"Fabric places one rank per GPU (it refuses duplicate device ids); DTENSOR_FP8_TEST_BACKEND={BACKEND} "
           "puts every rank on cuda:0: run it under gloo or nccl")


def _fabric(recipe: str | None, precision: str = "bf16-mixed"):
    """A Fabric over the harness' ranks whose ``parallelize_fn`` converts (``recipe``) and shards."""
    world, rank = dist.get_world_size(), dist.get_rank()
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))

    def parallelize(model, mesh):
        if recipe is not None:
            d.quantize_module_(model, d.RECIPES[recipe], filter_fn=lambda m, fqn: fqn.startswith("model.layers."))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["data_parallel"])
        fully_shard(model, mesh=mesh["data_parallel"])
        return model

    strategy = strategies.ModelParallelStrategy(parallelize, data_parallel_size=world, tensor_parallel_size=1)
    fabric = fabric_module.Fabric(accelerator=ACCELERATOR, devices=world, strategy=strategy, precision=precision)
    fabric.launch()
    return fabric


def _train(recipe: str | None):
    fabric = _fabric(recipe)
    torch.manual_seed(0)
    # ModelParallelStrategy leaves placement to the user (its module_to_device does nothing): the
    # model goes to the rank's device before parallelize_fn quantizes and shards it.
    model = fabric.setup(transformers.LlamaForCausalLM(_config()).to(fabric.device))  # parallelize_fn runs here
    if recipe is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    else:  # the optimizer over the module Fabric wraps (FQNs without the wrapper's prefix)
        optimizer = d.MasterWeightOptimizer(model.module, torch.optim.AdamW, lr=LR)
    optimizer = fabric.setup_optimizers(optimizer)
    losses, dtypes = [], set()
    # Fabric casts the model's outputs back to fp32: what a linear inside returns shows the autocast.
    q_proj = model.module.model.layers[0].self_attn.q_proj
    q_proj.register_forward_hook(lambda m, args, out: dtypes.add(str(out.dtype)))
    for step in range(STEPS):
        x = _tokens(step)
        out = model(input_ids=x, labels=x)
        fabric.backward(out.loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_global_mean(out.loss.item()))
    fp8 = sum(isinstance(p.to_local(), d.QuantizedTensor) for p in model.parameters())
    # Learning shows on a batch already trained on: the next batches' losses wander with the data
    # at world size 1 (seen on an H100: 5.60, 5.54, 5.34, 5.53), so the first batch is scored again.
    with torch.no_grad():
        x = _tokens(0)
        losses.append(_global_mean(model(input_ids=x, labels=x).loss.item()))
    return losses, sorted(dtypes), fp8


@pytest.mark.parametrize("recipe", ["mxfp8", "current"])
def test_model_parallel_strategy_bf16_mixed_trains_like_the_model_without_fp8(pools, recipe):
    """``bf16-mixed``: the FP8 linears' outputs are bf16 (autocast ran them), every FP8 weight stays an
    FP8 shard, and each loss is within 1 % of the model without FP8 under the same strategy and
    precision (the FP8 rounding of the weights moved them by at most 0.13 % when measured). The last
    loss is the first batch's again, after training."""
    ref, ref_dtypes, _ = pools[WORLD_SIZES[0]].run(_train, None)[0]
    losses, dtypes, fp8 = pools[WORLD_SIZES[0]].run(_train, recipe)[0]
    assert len(ref) == STEPS + 1 and ref[-1] < 0.95 * ref[0], ref
    assert dtypes == ref_dtypes == ["torch.bfloat16"]
    assert fp8 == FP8_WEIGHTS
    for a, b in zip(losses, ref):
        assert abs(a - b) <= 0.01 * b, (losses, ref)


class _Net(torch.nn.Module):
    """Modules that all define ``reset_parameters()``, as Fabric's meta-device init requires."""

    def __init__(self, dim=256):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(dim), torch.nn.Linear(dim, dim), torch.nn.ReLU(),
                                torch.nn.Linear(dim, dim)) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def _train_empty_init(recipe: str):
    world = dist.get_world_size()
    os.environ.update(LOCAL_RANK=str(dist.get_rank()), NODE_RANK="0", WORLD_SIZE=str(world))

    def parallelize(model, mesh):
        d.quantize_module_(model, d.RECIPES[recipe])  # on meta: FP8 parameters without bytes yet
        for block in model.blocks:
            fully_shard(block, mesh=mesh["data_parallel"])
        fully_shard(model, mesh=mesh["data_parallel"])
        return model

    strategy = strategies.ModelParallelStrategy(parallelize, data_parallel_size=world, tensor_parallel_size=1)
    fabric = fabric_module.Fabric(accelerator=ACCELERATOR, devices=world, strategy=strategy, precision="bf16-mixed")
    fabric.launch()
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True):
        model = _Net()
    assert all(p.is_meta for p in model.parameters())
    model = fabric.setup(model)  # parallelize_fn, then to_empty + reset_parameters() on each rank's shards
    optimizer = fabric.setup_optimizers(d.MasterWeightOptimizer(model.module, torch.optim.AdamW, lr=1e-3))
    fp8 = {n: p for n, p in model.module.named_parameters() if isinstance(p.to_local(), d.QuantizedTensor)}
    for name, p in fp8.items():  # the bytes are the quantized init, the masters the init itself
        want = d.quantize(optimizer.optimizer.masters[name].full_tensor(), d.RECIPES[recipe])
        for usage, plane in want.planes.items():
            assert torch.equal(p.full_tensor().planes[usage].data.view(torch.uint8), plane.data.view(torch.uint8)), name
    g = torch.Generator().manual_seed(3)
    x, target = torch.randn(8, 256, generator=g).to(fabric.device), torch.randn(8, 256, generator=g).to(fabric.device)
    losses = []
    for _ in range(4):
        loss = torch.nn.functional.mse_loss(model(x).float(), target)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_global_mean(loss.item()))
    return len(fp8), losses


@pytest.mark.parametrize("recipe", ["current", "mxfp8"])
def test_init_module_empty_init_builds_fp8_weights_shard_by_shard(pools, recipe):
    """``fabric.init_module(empty_init=True)``: the model is built on meta, quantized and sharded in
    ``parallelize_fn``, and Fabric materializes each rank's shards (``to_empty`` +
    ``reset_parameters()``); the optimizer then makes the FP8 bytes from those values."""
    n_fp8, losses = pools[WORLD_SIZES[0]].run(_train_empty_init, recipe)[0]
    assert n_fp8 == 4
    assert losses[-1] < losses[0], losses


def _setup(recipe: str, seed: int):
    fabric = _fabric(recipe)
    torch.manual_seed(seed)
    model = fabric.setup(transformers.LlamaForCausalLM(_config()).to(fabric.device))
    optimizer = fabric.setup_optimizers(d.MasterWeightOptimizer(model.module, torch.optim.AdamW, lr=LR))
    return fabric, model, optimizer


def _steps(fabric, model, optimizer, steps) -> list[float]:
    losses = []
    for step in steps:
        x = _tokens(step)
        out = model(input_ids=x, labels=x)
        fabric.backward(out.loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_global_mean(out.loss.item()))
    return losses


def _save_and_go_on(root: str, recipe: str):
    fabric, model, optimizer = _setup(recipe, seed=0)
    _steps(fabric, model, optimizer, range(2))
    fabric.save(root, {"model": model, "optimizer": optimizer, "step": 2})
    losses = _steps(fabric, model, optimizer, range(2, 4))
    return losses, _snapshot(model.module, optimizer.optimizer)


def _load_and_go_on(root: str, recipe: str):
    fabric, model, optimizer = _setup(recipe, seed=1)  # another init: everything must come from the files
    state = {"model": model, "optimizer": optimizer, "step": 0}
    remainder = fabric.load(root, state)
    losses = _steps(fabric, model, optimizer, range(state["step"], state["step"] + 2))
    return losses, _snapshot(model.module, optimizer.optimizer), state["step"], remainder


@pytest.mark.parametrize("recipe", ["mxfp8", "delayed"])
def test_fabric_save_and_load_resume_bit_exactly(pools, tmp_path, recipe):
    """``fabric.save`` after 2 steps (Fabric's sharded checkpoint: torch's DCP state-dict helpers and
    ``dcp.save``), ``fabric.load`` into a differently initialized model and optimizer: the next 2
    losses, every FP8 plane and scale, master and high-precision weight equal the uninterrupted
    run's byte for byte (delayed scaling: its amax histories travel in the optimizer state)."""
    root = str(tmp_path / "fabric-ckpt")
    expected = pools[WORLD_SIZES[0]].run(_save_and_go_on, root, recipe)
    resumed = pools[WORLD_SIZES[0]].run(_load_and_go_on, root, recipe)
    for (losses, snap), (r_losses, r_snap, step, remainder) in zip(expected, resumed):
        assert step == 2 and remainder == {}
        assert r_losses == losses
        assert snap.keys() == r_snap.keys() and sum(k.endswith("/master") for k in snap) == FP8_WEIGHTS
        for key in snap:
            assert torch.equal(snap[key], r_snap[key]), key
