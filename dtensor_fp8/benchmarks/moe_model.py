"""The MoE layer the ``moe`` benchmark measures: a router and torchtitan-style grouped experts, laid
out by FSDP2 alone or by expert parallelism x FSDP2, with bf16 / fp32 or FP8 expert weights.

The experts are torchtitan's ``GroupedExperts`` (torchtitan/models/common/moe.py) in miniature:
3-D weights ``w1`` / ``w3`` ``[E, hidden, dim]`` and ``w2`` ``[E, dim, hidden]`` and the
``_grouped_mm`` seam (``dtensor_fp8.grouped_mm.experts_grouped_mm`` for FP8 weights). Under expert
parallelism the weights are DTensors ``Shard(0)`` over the ``ep`` mesh dim and the layer computes on
its own experts (``to_local()``, as torchtitan's experts do); the router picks among those, standing
in for the token dispatch (an all-to-all of activations, the same for every recipe and not part of
what is measured).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

#: Expert dims of real MoE models: (routed experts, model dim, expert hidden dim, experts per token).
SHAPES: dict[str, tuple[int, int, int, int]] = {
    "deepseek-v3": (256, 7168, 2048, 8),  # DeepSeek-V3 671B: moe_inter_dim 2048, 256 routed experts
    "qwen3-moe": (128, 2048, 768, 8),  # Qwen3-30B-A3B: moe_intermediate_size 768, 128 experts
}
EXPERT_WEIGHTS = ("w1", "w2", "w3")


def scaled(shape: str, expert_divisor: int = 1, dim_divisor: int = 1) -> tuple[int, int, int, int]:
    """``SHAPES[shape]`` with the expert count and both dims divided (for CPU runs).

    Example:
        >>> scaled("deepseek-v3", 32, 8)
        (8, 896, 256, 8)
    """
    experts, dim, hidden, top_k = SHAPES[shape]
    for what, n, k in (("experts", experts, expert_divisor), ("dims", dim, dim_divisor), ("dims", hidden, dim_divisor)):
        if n % k:
            raise ValueError(f"moe: {shape}'s {what} {n} are not divisible by {k}")
    return experts // expert_divisor, dim // dim_divisor, hidden // dim_divisor, min(top_k, experts // expert_divisor)


class GroupedExperts(nn.Module):
    """torchtitan's routed experts: ``silu(x w1^T) * (x w3^T)`` then ``w2``, one grouped GEMM each."""

    def __init__(self, experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, dim))

    def init_weights(self, std: float = 0.02) -> None:
        """torchtitan's init of the experts (on each rank's shards only, after ``to_empty``)."""
        with torch.no_grad():
            for name in EXPERT_WEIGHTS:
                nn.init.trunc_normal_(getattr(self, name), std=std)

    def _local(self, name: str) -> torch.Tensor:
        w = getattr(self, name)
        return w.to_local() if hasattr(w, "to_local") else w  # expert parallelism: this rank's experts

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        w1, w2, w3 = (self._local(n) for n in EXPERT_WEIGHTS)
        h = F.silu(self._grouped_mm(A=x, B_t=w1.bfloat16().transpose(-2, -1), offs=offs))
        h = h * self._grouped_mm(A=x, B_t=w3.bfloat16().transpose(-2, -1), offs=offs)
        return self._grouped_mm(A=h, B_t=w2.bfloat16().transpose(-2, -1), offs=offs)

    def _grouped_mm(self, *, A, B_t, offs):
        return torch._grouped_mm(A, B_t, offs=offs)


class MoE(nn.Module):
    """Router (top-k of a softmax over the experts this rank computes), token sort, experts, combine."""

    def __init__(self, experts: int, dim: int, hidden: int, top_k: int, local_experts: int | None = None):
        super().__init__()
        self.local_experts = local_experts or experts
        self.top_k = min(top_k, self.local_experts)
        self.router = nn.Linear(dim, self.local_experts, bias=False)
        self.experts = GroupedExperts(experts, dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        weights, chosen = self.router(x.float()).softmax(-1).topk(self.top_k, dim=-1)
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.local_experts)
        routed = x.bfloat16()[order // self.top_k]
        out = self.experts(routed, counts) * weights.reshape(-1)[order, None].to(torch.bfloat16)
        return torch.zeros(tokens, x.shape[1], dtype=out.dtype, device=x.device).index_add_(0, order // self.top_k, out)


def convert(model: MoE, variant: str) -> MoE:
    """``variant``: ``"bf16"`` / ``"fp32"`` experts, or a recipe name (FP8 experts, the router stays
    high precision); call before sharding."""
    import dtensor_fp8 as d
    from dtensor_fp8.grouped_mm import experts_grouped_mm

    if variant in ("bf16", "fp32"):
        model.experts.to(torch.bfloat16 if variant == "bf16" else torch.float32)
        return model
    d.quantize_module_(model, d.RECIPES[variant], filter_fn=lambda m, fqn: False,
                       experts=lambda m, fqn: EXPERT_WEIGHTS if isinstance(m, GroupedExperts) else ())
    model.experts._grouped_mm = experts_grouped_mm.__get__(model.experts)
    return model


def place_experts(model: MoE, mesh, layout: str) -> MoE:
    """Expert parallelism (``layout="ep_fsdp"``): each expert weight becomes a DTensor ``Shard(0)``
    over ``mesh["ep"]``, as torchtitan's ``ExpertParallel`` distributes it (whole experts per rank;
    on the meta device nothing is allocated); a no-op for ``"fsdp"``. Call after :func:`convert`
    (FP8 parameters are in place before their weights are sharded) and before
    :func:`fully_shard_experts`.

    Example:
        >>> place_experts(model, init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "efsdp")), "ep_fsdp")
    """
    from torch.distributed.tensor import Shard, distribute_tensor

    from dtensor_fp8 import QuantizedTensor
    from dtensor_fp8.placement import distribute_quantized

    if layout == "ep_fsdp":
        for name in EXPERT_WEIGHTS:
            w = getattr(model.experts, name)
            dt = distribute_quantized(w, mesh["ep"], [Shard(0)]) if isinstance(w, QuantizedTensor) else \
                distribute_tensor(w.data, mesh["ep"], [Shard(0)])
            setattr(model.experts, name, nn.Parameter(dt, requires_grad=w.requires_grad))
    return model


def fully_shard_experts(model: MoE, mesh, layout: str) -> MoE:
    """FSDP2 over the experts: the whole ``mesh`` (``"fsdp"``) or its ``efsdp`` dim (``"ep_fsdp"``,
    torchtitan's FSDP of the EP region). The router (``dim x experts``, under 0.1 % of the layer)
    stays a plain replicated parameter, so every all-gather of a step is an expert weight's."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(model.experts, mesh=mesh if layout == "fsdp" else mesh["efsdp"], reshard_after_forward=True)
    return model


def init_ranks(rank: int, world: int, store: str, device_type: str) -> torch.device:
    """This rank's process group and device."""
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=rank, world_size=world,
                            store=dist.FileStore(store, world), timeout=timedelta(seconds=600))
    return device


def mesh_for(layout: str, world: int, ep: int, device_type: str):
    from torch.distributed.device_mesh import init_device_mesh

    if layout == "fsdp":
        return init_device_mesh(device_type, (world,), mesh_dim_names=("efsdp",))
    return init_device_mesh(device_type, (ep, world // ep), mesh_dim_names=("ep", "efsdp"))


def build(variant: str, dims, layout: str, mesh, ep: int, device: torch.device, seed: int = 0):
    """The layer built as a model larger than a rank: meta device, expert parallelism, quantize,
    FSDP2, ``to_empty``, init on each rank's shards, optimizer (FP8: its masters and bytes are made
    here). Returns ``(model, optimizer)``."""
    import dtensor_fp8 as d

    experts, dim, hidden, top_k = dims
    with torch.device("meta"):
        model = MoE(experts, dim, hidden, top_k, local_experts=experts // ep)
    convert(model, variant)
    place_experts(model, mesh, layout)
    fully_shard_experts(model, mesh, layout)
    model.to_empty(device=device)
    torch.manual_seed(seed)
    model.router.reset_parameters()  # replicated: the same on every rank
    torch.manual_seed(seed + 1 + dist.get_rank(group=dist.group.WORLD))
    model.experts.init_weights()  # each rank's own shards
    if variant in ("bf16", "fp32"):
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-3)


def refusal(variant: str, dims) -> str | None:
    """Why ``variant`` cannot quantize these expert shapes (``None``: it can)."""
    import dtensor_fp8 as d

    if variant in ("bf16", "fp32"):
        return None
    experts, dim, hidden, _ = dims
    try:
        for shape in ((experts, hidden, dim), (experts, dim, hidden)):
            d.per_expert(d.RECIPES[variant], shape)
    except d.RecipeError as e:
        return str(e)
    return None
