"""torchtitan 0.3's DeepSeek-V3 debug model with FP8 routed experts under expert parallelism: EP 2 x
FSDP2 2 at 4 gloo ranks through ``parallelize_deepseekv3`` (torchtitan's ``ep`` mesh dim shards the
experts, FSDP2 shards them again over ``efsdp``), and its ``CheckpointManager`` resuming and
resharding them (tests/torchtitan_moe.py sets the runs up)."""

from __future__ import annotations

import pytest
import torch

from dist_utils import WORLD_SIZES

if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 14):
    pytest.skip(f"torchtitan 0.3 needs torch >= 2.14 (this is {torch.__version__})", allow_module_level=True)
pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e '.[torchtitan]', see pyproject)")

from torchtitan_moe import MOE_LAYERS, ROUTED, MoERun  # noqa: E402

pytestmark = pytest.mark.skipif(4 not in WORLD_SIZES, reason="the suite runs without world size 4")


def _ep_side_by_side(recipes, steps=3):
    out = {"bf16": MoERun("deepseek_v3", None, ep=2).train(range(steps))}
    for recipe in recipes:
        run = MoERun("deepseek_v3", recipe, ep=2)
        before = run.unlike_per_expert_quantize()
        losses = run.train(range(steps))
        out[recipe] = {"parallelized": run.parallelized, "fp8_after": run.fp8_weights(), "losses": losses,
                       "unlike_before": before, "unlike_after": run.unlike_per_expert_quantize(),
                       "gathered_unlike": run.fsdp_gathered_unlike(),
                       "mesh": {n: (p.device_mesh.mesh_dim_names, str(p.placements)) for n, p in run.routed().items()}}
    return out


def test_ep_x_fsdp_four_ranks_fp8_experts_train_like_bf16(pools):
    recipes = ["current", "mxfp8"]
    out = pools[4].run(_ep_side_by_side, recipes)
    bf16 = out[0]["bf16"]
    for recipe in recipes:
        r = out[0][recipe]
        assert all(o[recipe]["losses"] == r["losses"] for o in out)
        assert len(r["parallelized"]) == 3 * MOE_LAYERS and all(ROUTED in n for n in r["parallelized"])
        assert set(r["fp8_after"]) == set(r["parallelized"])
        for o in out:
            assert o[recipe]["unlike_before"] == [] and o[recipe]["unlike_after"] == []
            assert o[recipe]["gathered_unlike"] == []
        for a, b in zip(r["losses"], bf16):
            assert abs(a - b) <= 0.01 * b, (recipe, r["losses"], bf16)
