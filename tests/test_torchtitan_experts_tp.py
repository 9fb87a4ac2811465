"""torchtitan 0.3's DeepSeek-V3 debug model with FP8 routed experts under its tensor parallelism, at 4
gloo ranks through ``parallelize_deepseekv3`` (tests/torchtitan_moe.py sets the runs up):

* TP 2 x FSDP2 2 (``tensor_parallel_degree=2``, no EP): torchtitan shards the routed experts on its
  ``tp`` mesh dim, ``w1`` / ``w3`` ``Shard(1)`` and ``w2`` ``Shard(2)``
  (``models/common/moe_sharding.py``), then FSDP2 shards them over the experts on ``fsdp``; each TP
  rank's grouped GEMMs run on its pieces (``ops/expert_rows.py``);
* EP 2 x TP 2 (``expert_parallel_degree=2``): torchtitan 0.3 has no separate expert-TP degree; with
  EP on, the MoE layers reuse the ``tp`` dim for tokens and shard the experts over ``ep`` only
  (``Shard(0)``, FSDP2 over ``efsdp = fsdp * tp / ep``), while the dense layers stay TP-sharded.

Either way: every routed expert weight is FP8 after parallelization and training, gathered planes
equal per-expert ``quantize`` of the gathered master as uint8, losses within 1 % of bf16 experts."""

from __future__ import annotations

import pytest
import torch

from dist_utils import WORLD_SIZES

if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 14):
    pytest.skip(f"torchtitan 0.3 needs torch >= 2.14 (this is {torch.__version__})", allow_module_level=True)
pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e '.[torchtitan]', see pyproject)")

from torchtitan_moe import MOE_LAYERS, ROUTED, MoERun  # noqa: E402

pytestmark = pytest.mark.skipif(4 not in WORLD_SIZES, reason="the suite runs without world size 4")


def _side_by_side(recipes, ep, steps=3):
    out = {"bf16": MoERun("deepseek_v3", None, ep=ep, tp=2).train(range(steps))}
    for recipe in recipes:
        run = MoERun("deepseek_v3", recipe, ep=ep, tp=2)
        before = run.unlike_per_expert_quantize()
        losses = run.train(range(steps))
        out[recipe] = {"parallelized": run.parallelized, "fp8_after": run.fp8_weights(), "losses": losses,
                       "unlike_before": before, "unlike_after": run.unlike_per_expert_quantize(),
                       "layout": {n.split(".")[-1]: {m: getattr(pl, "dim", None) for m, pl in zip(p.device_mesh.mesh_dim_names, p.placements)}
                                  for n, p in run.routed().items()}}
    return out


#: the tensor dim each routed expert weight is sharded along on the mesh dim of torchtitan's choice per layout
EXPECTED = {1: ("tp", {"w1_EFD": 1, "w2_EDF": 2, "w3_EFD": 1}), 2: ("ep", {"w1_EFD": 0, "w2_EDF": 0, "w3_EFD": 0})}


@pytest.mark.parametrize("ep,recipes", [(1, ["current", "mxfp8"]), (2, ["blockwise1d"])])
def test_tp_fp8_experts_train_like_bf16(pools, ep, recipes):
    out = pools[4].run(_side_by_side, recipes, ep)
    bf16 = out[0]["bf16"]
    dim, placements = EXPECTED[ep]
    for recipe in recipes:
        r = out[0][recipe]
        assert all(o[recipe]["losses"] == r["losses"] for o in out)
        assert len(r["parallelized"]) == 3 * MOE_LAYERS and all(ROUTED in n for n in r["parallelized"])
        assert set(r["fp8_after"]) == set(r["parallelized"])
        assert {n: lay[dim] for n, lay in r["layout"].items()} == placements, r["layout"]
        for o in out:
            assert o[recipe]["unlike_before"] == [] and o[recipe]["unlike_after"] == []
        for a, b in zip(r["losses"], bf16):
            assert abs(a - b) <= 0.01 * b, (recipe, r["losses"], bf16)
