"""Delayed scaling with FP8 GEMMs (torch's CPU tensorwise kernel) trains the same under FSDP2 on 2
gloo ranks, each with half the batch, as in one process with the whole batch, with and without
``checkpoint_wrapper``: the masters agree to fp32 rounding (the order of the gradient sums), not to
the FP8 error. Each rank's loss is a mean over its own half, so its output gradients are exactly
twice the one process's; the casts' scales differ by that power of two and no byte's rounding
changes. It did before the first operand scale came from the tensor's own amax (see "the first
operand scale" in ``formats/per_tensor.py``): at scale 1 the gradients fell into E5M2's subnormals,
by an amount that depends on their absolute size, and the runs differed by as much as the FP8 error.
"""

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dtensor_fp8 as d
from dtensor_fp8 import gemm
from dist_utils import DEVICE, WORLD_SIZES

STEPS, BATCH, DIM = 4, 32, 256  # 16 tokens per rank: the CPU kernel's smallest GEMM dim

needs_two = pytest.mark.skipif(2 not in WORLD_SIZES, reason="needs 2 ranks")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, DIM, bias=False)
        self.w2 = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        return self.w2(torch.nn.functional.gelu(self.w1(x)))


def _model(wrapped: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block()).to(DEVICE)
    d.quantize_module_(model, d.DelayedScaling())
    if wrapped:
        for i in range(len(model)):
            model[i] = checkpoint_wrapper(model[i])
    return model


def _train(model, rank: int, world: int, steps: int = STEPS) -> dict:
    opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-2)
    g = torch.Generator().manual_seed(1)
    n = BATCH // world
    with gemm.fp8_gemms("on"):
        for _ in range(steps):
            x, y = torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, DIM, generator=g)
            x, y = x[rank * n:(rank + 1) * n].to(DEVICE), y[rank * n:(rank + 1) * n].to(DEVICE)
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
    return {k: (m.full_tensor() if hasattr(m, "full_tensor") else m).detach().cpu() for k, m in opt.masters.items()}


def _fsdp2(wrapped: bool) -> dict:
    model = _model(wrapped)
    mesh = init_device_mesh(DEVICE, (torch.distributed.get_world_size(),))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _train(model, torch.distributed.get_rank(), torch.distributed.get_world_size())


@needs_two
@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "checkpoint_wrapper"])
def test_fsdp2_delayed_fp8_gemms_train_as_one_process(pools, wrapped):
    one = _train(_model(wrapped), 0, 1)
    fsdp = pools[2].run(_fsdp2, wrapped)[0]
    start = _train(_model(wrapped), 0, 1, steps=0)
    for name, master in one.items():
        assert (master - start[name]).abs().max() > 1e-2, f"{name}: did not train"
        torch.testing.assert_close(fsdp[name], master, rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")
