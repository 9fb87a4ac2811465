"""torchtitan 0.3's DeepSeek-V3 debug model with FP8 routed-expert weights
(``FP8ParameterConverter.Config(targets="experts" | "both")``, integrations/torchtitan_experts.py):
its config through ``model_registry``, the meta build, ``parallelize_deepseekv3`` (FSDP2 on 2 gloo
ranks), ``to_empty``, ``init_weights``, ``master_weight_adamw`` and training steps, as
tests/test_torchtitan.py drives the Llama3 debug model (the trainer itself imports ``datasets``)."""

from __future__ import annotations

import pytest
import torch

import dtensor_fp8 as d
from dist_utils import BACKEND, WORLD_SIZES, backend_spec

if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 14):
    pytest.skip(f"torchtitan 0.3 needs torch >= 2.14 (this is {torch.__version__})", allow_module_level=True)
pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e '.[torchtitan]', see pyproject)")

import torch.distributed as dist  # noqa: E402

from dtensor_fp8._compat import dtensor_local  # noqa: E402
from dtensor_fp8.integrations.torchtitan import FP8ParameterConverter, master_weight_adamw  # noqa: E402

SEQ, BATCH, VOCAB = 32, 2, 2048
MOE_LAYERS = 2  # of the debug model's 5 (6 layers, the first dense): the test keeps 3 layers


def _config(recipe: str | None, targets: str = "experts"):
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.deepseek_v3 import model_registry
    from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

    converters = None if recipe is None else [FP8ParameterConverter.Config(recipe=recipe, targets=targets,
                                                                           filter_fqns=["lm_head", "router"])]
    config = model_registry("debugmodel", converters=converters).model
    config.layers = config.layers[:1 + MOE_LAYERS]  # the dense first layer and MOE_LAYERS MoE layers (test time)
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_deepseek_v3_sharding_config(config, enable_sp=False, enable_ep=False)
    return config


def _train(recipe: str | None, targets: str = "experts", steps: int = 3):
    """FSDP2 over all ranks through parallelize_deepseekv3; the global mean losses and which
    parameters are FP8 (name -> recipe repr)."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims, utils as dist_utils
    from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3

    device = backend_spec(BACKEND).device
    parallel_dims_module.device_type = device
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor")
    training = TrainingConfig(local_batch_size=BATCH, seq_len=SEQ, mixed_precision_param="float32")
    dist_utils.set_spmd_backend("partial_dtensor")
    dims = ParallelDims.from_config(parallelism, dist.get_world_size())
    dims.build_mesh()
    with torch.device("meta"):
        model = _config(recipe, targets).build()
    model = parallelize_deepseekv3(model, parallel_dims=dims, training=training, parallelism=parallelism,
                                   compile_config=CompileConfig(), ac_config=None, dump_folder="")
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM (see test_torchtitan.py)
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    opt = (default_adamw if recipe is None else master_weight_adamw)(lr=1e-3).build(model_parts=[model])
    world, rank = dist.get_world_size(), dist.get_rank()
    losses = []
    for step in range(steps):
        tokens = torch.randint(0, VOCAB, (world * BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step % 2))
        mine = tokens[rank * BATCH:(rank + 1) * BATCH].to(device)
        logits = model(mine[:, :-1].contiguous(), positions=torch.arange(SEQ).expand(BATCH, SEQ).contiguous())
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), mine[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    fp8 = {n: repr(dtensor_local(p).recipe) for n, p in model.named_parameters()
           if isinstance(dtensor_local(p), d.QuantizedTensor)}
    return losses, fp8


@pytest.mark.parametrize("recipe", ["mxfp8"])
def test_fsdp_two_ranks_fp8_experts_train_like_bf16(pools, recipe):
    if 2 not in WORLD_SIZES:
        pytest.skip("2 ranks")
    bf16, none = pools[2].run(_train, None)[0]
    losses, fp8 = pools[2].run(_train, recipe, "experts")[0]
    assert not none
    assert len(fp8) == 3 * MOE_LAYERS and all("inner_experts.w" in n for n in fp8), sorted(fp8)
    assert all(r.startswith("PerExpert(") for r in fp8.values())
    assert losses[-1] < losses[0], losses
    # the same init and data: FP8 expert weights change the loss by FP8 rounding only
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(bf16), rtol=0.02, atol=0)


def test_converter_targets_switch():
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts

    def kinds(config):
        experts = [type(c).__qualname__ for _, c, *_ in config.traverse(GroupedExperts.Config)]
        linears = [type(c).__qualname__ for _, c, *_ in config.traverse(Linear.Config)]
        return experts, linears

    experts, linears = kinds(_config("mxfp8", "experts"))
    assert len(experts) == MOE_LAYERS and all("FP8Parameter" in e for e in experts)
    assert not any("FP8Parameter" in k for k in linears)
    experts, linears = kinds(_config("mxfp8", "dense"))
    assert not any("FP8Parameter" in e for e in experts) and any("FP8Parameter" in k for k in linears)
    experts, linears = kinds(_config("mxfp8", "both"))
    assert all("FP8Parameter" in e for e in experts) and any("FP8Parameter" in k for k in linears)
    with pytest.raises(d.RecipeError, match="targets must be"):
        _config("mxfp8", "all")


def _fewer_experts_than_ranks():
    from torchtitan_moe import MoERun

    # FSDP2's Shard(1) cuts whole blocks of the one expert here (the slicing accepts TP's such pieces:
    # ops/expert_rows.py); FSDP2's padded shard of a dim in between is refused
    with pytest.raises(d.RecipeError, match=r"like an FP8 weight of shape \(1, 256, 256\).*FSDP2's shard of a dim in "
                                            r"between.*Shard the experts \(dim 0\) instead, or keep this weight in high "
                                            r"precision\. In torchtitan, keep efsdp x ep .* at or below the number of "
                                            r"routed experts"):
        MoERun("deepseek_v3", "mxfp8", experts=1)


def test_fsdp_over_more_ranks_than_experts_is_refused_with_the_fix(pools):
    """torchtitan's ``fully_shard`` shards the experts' out rows (``Shard(1)``) when ``efsdp * ep``
    exceeds the expert count: refused when parallelized (FSDP2 would reassemble the planes by
    viewing them as the weight's shape), naming what to do."""
    if 2 not in WORLD_SIZES:
        pytest.skip("2 ranks")
    pools[2].run(_fewer_experts_than_ranks)
