"""torchtitan 0.3's Qwen3 MoE debug config (``model_registry("debugmodel_moe")``: experts of 768 x
256, top-8 routing; cut to one layer and 16 of its 64 experts) with FP8 routed experts, FSDP2 over 2 gloo ranks through
``parallelize_qwen3``, every recipe (tests/torchtitan_moe.py sets the runs up)."""

from __future__ import annotations

import functools

import pytest
import torch

import dtensor_fp8 as d
from dist_utils import WORLD_SIZES

if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 14):
    pytest.skip(f"torchtitan 0.3 needs torch >= 2.14 (this is {torch.__version__})", allow_module_level=True)
pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e '.[torchtitan]', see pyproject)")

from torchtitan_moe import MOE_LAYERS, ROUTED, MoERun  # noqa: E402

pytestmark = pytest.mark.skipif(2 not in WORLD_SIZES, reason="the suite runs without world size 2")
STEPS = 3


def _train(recipe):
    run = MoERun("qwen3", recipe)
    losses = run.train(range(STEPS))
    if recipe is None:
        return {"losses": losses}
    # delayed scaling's scale comes from its amax history, not from the master alone
    unlike = [] if recipe == "delayed" else run.unlike_per_expert_quantize()
    return {"losses": losses, "parallelized": run.parallelized, "fp8_after": run.fp8_weights(),
            "unlike": unlike, "gathered_unlike": [] if recipe == "delayed" else run.fsdp_gathered_unlike()}


@functools.cache
def _bf16_losses(pools):
    out = pools[2].run(_train, None)
    assert out[0] == out[1]
    return out[0]["losses"]


@pytest.mark.parametrize("recipe", list(d.RECIPES))
def test_qwen3_moe_fsdp_two_ranks_fp8_experts_train_like_bf16(pools, recipe):
    """Every routed expert weight FP8 after ``parallelize_qwen3`` and after training (per expert:
    ``PerExpert``); the gathered planes (DTensor's and FSDP2's) equal per-expert ``quantize`` of the
    master as uint8; the losses within 1 % of the same run with bf16 experts."""
    bf16 = _bf16_losses(pools)
    out = pools[2].run(_train, recipe)
    r = out[0]
    assert out[1]["losses"] == r["losses"]
    assert len(r["parallelized"]) == 3 * MOE_LAYERS and all(ROUTED in n for n in r["parallelized"]), r["parallelized"]
    assert all(v.startswith("PerExpert(") for v in r["parallelized"].values())
    assert r["fp8_after"] == r["parallelized"]
    for o in out:
        assert o["unlike"] == [] and o["gathered_unlike"] == [], (o["unlike"], o["gathered_unlike"])
    for a, b in zip(r["losses"], bf16):
        assert abs(a - b) <= 0.01 * b, (recipe, r["losses"], bf16)
