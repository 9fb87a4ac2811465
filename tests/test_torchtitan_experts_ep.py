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

from torchtitan_moe import MOE_LAYERS, ROUTED, MoERun, differing  # noqa: E402

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


def _resume(recipe, ep, root):
    first = MoERun("deepseek_v3", recipe, ep=ep, ckpt_dir=root)
    first.train(range(1))
    assert first.checkpointer.save(curr_step=1)
    losses = first.train(range(1, 3))
    expected = first.snapshot()
    first.checkpointer.close()
    resumed = MoERun("deepseek_v3", recipe, ep=ep, ckpt_dir=root)
    assert resumed.checkpointer.load(step=1)
    again = resumed.train(range(1, 3))
    got = resumed.snapshot()
    resumed.checkpointer.close()
    return {"losses": losses, "again": again, "differ": differing(expected, got), "n": len(expected)}


def test_ep_resume_through_torchtitans_checkpointer_is_bit_exact(pools, tmp_path):
    """EP 2 x FSDP2 2: torchtitan's ``CheckpointManager`` saves and loads the FP8 expert weights
    (each expert weight's planes flattened into tensors by the experts' state-dict hooks), their
    masters and the optimizer state; the resumed steps equal the uninterrupted ones byte for byte."""
    for r in pools[4].run(_resume, "delayed", 2, str(tmp_path)):
        assert r["differ"] == [] and r["n"] > 3 * MOE_LAYERS * 3, r["differ"][:8]
        assert r["again"] == r["losses"], r


def _save_fsdp(recipe, root):
    run = MoERun("deepseek_v3", recipe, ep=1, ckpt_dir=root)
    run.train(range(2))
    assert run.checkpointer.save(curr_step=2)
    run.checkpointer.close()
    return run.full_experts()


def _load_ep(recipe, root):
    run = MoERun("deepseek_v3", recipe, ep=2, ckpt_dir=root)
    assert run.checkpointer.load(step=2)
    out = run.full_experts()
    run.checkpointer.close()
    return out


def test_fsdp_two_ranks_checkpoint_loads_at_ep_x_fsdp_four_ranks_exactly(pools, tmp_path):
    """Saved by FSDP2 over 2 ranks (each holding 4 whole experts of each weight), loaded by EP 2 x
    FSDP2 2 over 4 (each holding 2): every expert weight's gathered planes and master are the
    saved ones byte for byte."""
    if 2 not in WORLD_SIZES:
        pytest.skip("2 ranks")
    saved = pools[2].run(_save_fsdp, "blockwise1d", str(tmp_path))[0]
    for loaded in pools[4].run(_load_ep, "blockwise1d", str(tmp_path)):
        assert set(loaded) == set(saved) and len(saved) == 3 * MOE_LAYERS * 5  # 2 planes + scales, and the master
        assert differing(saved, loaded) == []
