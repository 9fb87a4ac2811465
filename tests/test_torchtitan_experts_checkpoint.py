"""torchtitan 0.3's DeepSeek-V3 debug model with FP8 routed experts resharded through its
``CheckpointManager`` (DCP on disk), every recipe: saved by FSDP2 over 2 ranks, loaded by EP 2 x
FSDP2 2 over 4; saved by EP 4 over 4 ranks, loaded by FSDP2 over 2 (tests/torchtitan_moe.py sets the
runs up; resuming at the same layout is tests/test_torchtitan_experts.py's, at EP 2 x FSDP2 2).

One family carries the reshard: both shard their expert weights along whole experts (dim 0) at
these layouts, so what a reshard moves -- whole experts' planes, scales and masters between ranks
-- does not depend on the expert's shape (DeepSeek-V3's 256 x 256 or Qwen3's 768 x 256), which the
per-expert codec and the layout matrix cover; DeepSeek-V3's experts are the smaller ones."""

from __future__ import annotations

import pytest
import torch

import dtensor_fp8 as d
from dist_utils import WORLD_SIZES

if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 14):
    pytest.skip(f"torchtitan 0.3 needs torch >= 2.14 (this is {torch.__version__})", allow_module_level=True)
pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e '.[torchtitan]', see pyproject)")

from torchtitan_moe import FEWEST_EXPERTS, MOE_LAYERS, MoERun, differing  # noqa: E402

pytestmark = pytest.mark.skipif(not {2, 4} <= set(WORLD_SIZES), reason="the suite runs without world sizes 2 and 4")
FAMILY = "deepseek_v3"
SAVED_AT = 1  # a step moves the weights off their init: a load that did nothing would not match


def _save_every_recipe(root: str, parallelism: dict) -> dict:
    """Each recipe's run at ``parallelism``, trained ``SAVED_AT`` steps and saved; its routed expert
    weights gathered (planes, scales, masters)."""
    out = {}
    for recipe in d.RECIPES:
        run = MoERun(FAMILY, recipe, ckpt_dir=f"{root}/{recipe}", experts=FEWEST_EXPERTS[FAMILY], **parallelism)
        run.train(range(SAVED_AT))
        assert run.checkpointer.save(curr_step=SAVED_AT)
        run.checkpointer.close()
        out[recipe] = run.full_experts()
    return out


def _load_every_recipe(root: str, parallelism: dict) -> dict:
    """Each recipe's fresh run at ``parallelism`` loaded from ``root``; its routed expert weights gathered."""
    out = {}
    for recipe in d.RECIPES:
        run = MoERun(FAMILY, recipe, ckpt_dir=f"{root}/{recipe}", experts=FEWEST_EXPERTS[FAMILY], **parallelism)
        assert run.checkpointer.load(step=SAVED_AT)
        out[recipe] = run.full_experts()
        run.checkpointer.close()
    return out


def _assert_loaded_as_saved(saved: dict, loaded_per_rank: list) -> None:
    for recipe in d.RECIPES:
        planes = len(d.quantize(torch.ones(128, 128), d.RECIPES[recipe]).planes)
        # each expert weight: its planes, their scales, and its master
        assert len(saved[recipe]) == 3 * MOE_LAYERS * (2 * planes + 1), (recipe, sorted(saved[recipe]))
        for loaded in loaded_per_rank:
            assert differing(saved[recipe], loaded[recipe]) == [], recipe


@pytest.mark.parametrize(("saved_by", "loaded_by"), [
    ((2, {}), (4, {"ep": 2})),  # FSDP2 over 2 ranks (2 whole experts each) -> EP 2 x FSDP2 2 (1 each)
    ((4, {"ep": 4}), (2, {})),  # EP 4 (1 expert each, efsdp 1) -> FSDP2 over 2 ranks
], ids=["fsdp2_to_ep2_fsdp2", "ep4_to_fsdp2"])
def test_reshard_through_torchtitans_checkpointer_is_exact_every_recipe(pools, tmp_path, saved_by, loaded_by):
    """Saved at one layout after a step, loaded by a fresh run at another: every expert weight's
    gathered planes, scales and master equal the saved ones byte for byte."""
    saved = pools[saved_by[0]].run(_save_every_recipe, str(tmp_path), saved_by[1])[0]
    _assert_loaded_as_saved(saved, pools[loaded_by[0]].run(_load_every_recipe, str(tmp_path), loaded_by[1]))
