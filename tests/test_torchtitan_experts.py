"""torchtitan 0.3's MoE models with FP8 routed-expert weights
(``FP8ParameterConverter.Config(targets="experts" | "both")``, integrations/torchtitan_experts.py)
through torchtitan's own setup (tests/torchtitan_moe.py's ``MoERun``): DeepSeek-V3's debug model and
Qwen3's MoE debug config, one MoE layer with the fewest routed experts torchtitan runs at every
layout (``FEWEST_EXPERTS``), at each layout -- FSDP2 over 2 and over 4 gloo ranks, EP 2 x FSDP2 2
(torchtitan's ``ep`` mesh dim shards the experts, FSDP2 shards them again over ``efsdp``), PP 2 x
FSDP2 2 (``pipeline_llm``, 1F1B) -- with every recipe; the converter's targets switch; the refusal of
FSDP over more ranks than experts.

Cost (CI runs this on 2 cores): one pool call per (family, layout) builds the run with bf16 experts
once, then every recipe's run in the same rank processes; 3 steps each."""

from __future__ import annotations

import pytest
import torch

import dtensor_fp8 as d
from dist_utils import WORLD_SIZES, RankPool

if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 14):
    pytest.skip(f"torchtitan 0.3 needs torch >= 2.14 (this is {torch.__version__})", allow_module_level=True)
pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e '.[torchtitan]', see pyproject)")

from torchtitan_moe import FEWEST_EXPERTS, MOE_LAYERS, ROUTED, MoERun, differing  # noqa: E402

STEPS = 3
#: layout -> (world size, MoERun's parallelism arguments)
LAYOUTS = {"fsdp2": (2, {}), "fsdp4": (4, {}), "ep2_fsdp2": (4, {"ep": 2}), "pp2_fsdp2": (4, {"pp": 2})}
#: the layout whose runs also resume from a checkpoint (the one whose expert DTensors have most mesh dims)
RESUMED = "ep2_fsdp2"


def _every_recipe(family: str, layout: str, root: str) -> dict:
    """The run with bf16 experts, then each recipe's: which weights are FP8 (parallelized, after
    training), losses, the gathered planes against per-expert ``quantize`` (before and after
    training, and what FSDP2 gathered for the grouped GEMMs); at ``RESUMED`` each recipe's run saves
    after its first step through ``CheckpointManager`` and a fresh run resumes from there."""
    kwargs = dict(LAYOUTS[layout][1], experts=FEWEST_EXPERTS[family])
    bf16 = MoERun(family, None, **kwargs)
    out = {"bf16": bf16.train(range(STEPS)), "routed": sorted(bf16.routed())}
    resume = layout == RESUMED
    for recipe in d.RECIPES:
        folder = f"{root}/{recipe}" if resume else None
        run = MoERun(family, recipe, ckpt_dir=folder, **kwargs)
        r = {"parallelized": run.parallelized, "unlike_before": run.unlike_per_expert_quantize()}
        if resume:
            r["losses"] = run.train(range(1))
            assert run.checkpointer.save(curr_step=1)
            r["losses"] += run.train(range(1, STEPS))
            expected = run.snapshot()
            run.checkpointer.close()
        else:
            r["losses"] = run.train(range(STEPS))
        r.update(fp8_after=run.fp8_weights(), unlike_after=run.unlike_per_expert_quantize(),
                 gathered_unlike=run.fsdp_gathered_unlike())
        if resume:
            resumed = MoERun(family, recipe, ckpt_dir=folder, **kwargs)
            assert resumed.checkpointer.load(step=1)
            r["resumed_losses"] = resumed.train(range(1, STEPS))
            r["resume_differ"] = differing(expected, resumed.snapshot())
            r["resumed_fp8_entries"] = sorted(k for k in expected if ROUTED in k)
            resumed.checkpointer.close()
        out[recipe] = r
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", list(FEWEST_EXPERTS))
def test_fp8_experts_train_like_bf16_every_recipe(pools, tmp_path, family, layout):
    """Every routed expert weight (and nothing else) is FP8 after parallelization and after
    training, per expert (``PerExpert``); the gathered planes (DTensor's, before and after
    training, and FSDP2's) equal per-expert ``quantize`` of the master as uint8 (delayed scaling:
    with the scales of its amax history); the losses within 1 % of the run with bf16 experts on
    the same layout. At EP 2 x FSDP2 2, resuming from the checkpoint after step 1 gives the same
    losses, FP8 bytes, scales, masters and optimizer state as the uninterrupted run, bit for bit."""
    world = LAYOUTS[layout][0]
    if world not in WORLD_SIZES:
        pytest.skip(f"the suite runs without world size {world}")
    if layout == RESUMED:
        # Fresh rank processes: after tests/test_torchtitan.py's Llama3 runs in the same pool, Qwen3's
        # resume (current scaling) came back with its dense layer-0 weights and their optimizer
        # state unlike the uninterrupted run's; in fresh processes it is bit-exact. Not diagnosed
        # yet (state one torchtitan setup leaves in the process): see the notes.
        pool = RankPool(world)
        try:
            out = pool.run(_every_recipe, family, layout, str(tmp_path))
        finally:
            pool.close()
    else:
        out = pools[world].run(_every_recipe, family, layout, str(tmp_path))
    routed = {n for o in out for n in o["routed"]}  # pipelined: each stage's own
    assert len(routed) == 3 * MOE_LAYERS and all(ROUTED in n for n in routed), sorted(routed)
    bf16 = out[0]["bf16"]
    assert all(o["bf16"] == bf16 for o in out) and len(bf16) == STEPS
    for recipe in d.RECIPES:
        losses = out[0][recipe]["losses"]
        for rank, o in enumerate(out):
            r = o[recipe]
            assert r["losses"] == losses, (recipe, rank)
            assert set(r["parallelized"]) == set(o["routed"]), (recipe, rank, r["parallelized"])
            assert all(v.startswith("PerExpert(") for v in r["parallelized"].values()), r["parallelized"]
            assert r["fp8_after"] == r["parallelized"], (recipe, rank)
            assert r["unlike_before"] == [] and r["unlike_after"] == [] and r["gathered_unlike"] == [], (recipe, rank, r)
            if layout == RESUMED:
                assert r["resume_differ"] == [], (recipe, rank, r["resume_differ"][:8])
                assert r["resumed_losses"] == losses[1:], (recipe, rank)
                # each of this rank's expert weights: its planes' bytes, scales and master
                assert len(r["resumed_fp8_entries"]) >= 3 * len(o["routed"]) and o["routed"], r["resumed_fp8_entries"]
        for a, b in zip(losses, bf16, strict=True):
            assert abs(a - b) <= 0.01 * b, (recipe, losses, bf16)


def _config(recipe: str, targets: str):
    """DeepSeek-V3's debug model config (5 MoE layers) through ``model_registry`` with the converter."""
    from torchtitan.models.deepseek_v3 import model_registry

    from dtensor_fp8.integrations.torchtitan import FP8ParameterConverter

    converter = FP8ParameterConverter.Config(recipe=recipe, targets=targets, filter_fqns=["lm_head", "router"])
    return model_registry("debugmodel", converters=[converter]).model


def test_converter_targets_switch():
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts

    def kinds(config):
        experts = [type(c).__qualname__ for _, c, *_ in config.traverse(GroupedExperts.Config)]
        linears = [type(c).__qualname__ for _, c, *_ in config.traverse(Linear.Config)]
        return experts, linears

    experts, linears = kinds(_config("mxfp8", "experts"))
    assert len(experts) == 5 and all("FP8Parameter" in e for e in experts)
    assert not any("FP8Parameter" in k for k in linears)
    experts, linears = kinds(_config("mxfp8", "dense"))
    assert not any("FP8Parameter" in e for e in experts) and any("FP8Parameter" in k for k in linears)
    experts, linears = kinds(_config("mxfp8", "both"))
    assert all("FP8Parameter" in e for e in experts) and any("FP8Parameter" in k for k in linears)
    with pytest.raises(d.RecipeError, match="targets must be"):
        _config("mxfp8", "all")


def _fewer_experts_than_ranks():
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
