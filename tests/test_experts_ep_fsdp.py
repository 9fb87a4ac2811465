"""Expert parallelism x FSDP2 over FP8 expert weights, read as torchtitan's ``GroupedExperts`` reads
them (``w.to_local()`` in the forward, an alias the grouped GEMM reads again in the backward): the
input gradient reads the columnwise planes the backward gather brought, exactly the one-process
reference, and no completion all-gathers them a second time (fsdp_completion.py, "a stale alias")."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

import dtensor_fp8 as d
import dtensor_fp8.fsdp_completion as completion

from dist_utils import DEVICE, WORLD_SIZES
from test_experts_fsdp import EXPERTS, Experts, fp8_experts, inputs, per_expert_values, reference

EP, EFSDP = 2, 2
NAMES = ("w1", "w2", "w3")


class ToLocalExperts(Experts):
    """:class:`Experts` whose forward computes on this EP rank's experts through ``to_local()``, as
    torchtitan's ``GroupedExperts.forward`` does under expert parallelism."""

    def forward(self, x, counts):
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        w1, w2, w3 = (getattr(self, n).to_local() for n in NAMES)
        h = F.silu(self._grouped_mm(A=x.bfloat16(), B_t=w1.bfloat16().transpose(-2, -1), offs=offs))
        h = h * self._grouped_mm(A=x.bfloat16(), B_t=w3.bfloat16().transpose(-2, -1), offs=offs)
        return self._grouped_mm(A=h, B_t=w2.bfloat16().transpose(-2, -1), offs=offs).type_as(x)


def _ep_fsdp_steps(name):
    recipe = d.RECIPES[name]
    mesh = init_device_mesh(DEVICE, (EP, EFSDP), mesh_dim_names=("ep", "efsdp"))
    per = EXPERTS // EP
    mine = slice(mesh["ep"].get_local_rank() * per, (mesh["ep"].get_local_rank() + 1) * per)
    plain = Experts()
    full = {n: per_expert_values(getattr(plain, n).detach()[mine], recipe) for n in NAMES}
    model = fp8_experts(recipe)
    model.__class__ = ToLocalExperts
    for n in NAMES:  # torchtitan's ExpertParallel: whole experts per EP rank
        setattr(model, n, nn.Parameter(d.distribute_quantized(getattr(model, n), mesh["ep"], [Shard(0)])))
    fully_shard(model, mesh=mesh["efsdp"], reshard_after_forward=True)
    x, counts, upstream = inputs()
    counts = counts[mine]
    x, upstream = x[:int(counts.sum())], upstream[:int(counts.sum())]
    y_ref, gx_ref = reference(full, x, counts, upstream)
    completed = []
    real = completion.GatheredWeight._all_gather

    def counting(self, t, stored):
        completed.append((tuple(t.shape), stored))
        return real(self, t, stored)

    completion.GatheredWeight._all_gather = counting
    try:
        for step in range(2):  # the second step reuses FSDP2's all-gather buffers
            xx = x.clone().requires_grad_()
            y = model(xx, counts)
            (y * upstream).sum().backward()
            assert torch.equal(y, y_ref), step
            assert torch.equal(xx.grad, gx_ref), step
    finally:
        completion.GatheredWeight._all_gather = real
    assert completed == [], completed  # the backward gather's planes served the backward
    # The check can tell the planes apart: x.grad from the rowwise planes differs.
    return not torch.equal(reference(full, x, counts, upstream, "rowwise")[1], gx_ref)


def test_ep_backward_reads_the_backward_gather(pools):
    # MXFP8 (1x128 stores two planes the same way; tests/test_moe_benchmark.py counts its bytes under EP).
    if EP * EFSDP not in WORLD_SIZES:
        pytest.skip(f"{EP * EFSDP} ranks")
    assert all(pools[EP * EFSDP].run(_ep_fsdp_steps, "mxfp8"))
