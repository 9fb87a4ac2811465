"""torchtitan 0.3's default SPMD backend (``ParallelismConfig.spmd_backend="spmd_types"``) with FP8
routed experts: DeepSeek-V3's debug model under FSDP2 on 2 gloo ranks, through the same setup as the
``partial_dtensor`` runs (tests/torchtitan_moe.py). Under ``spmd_types`` torchtitan calls the model's
``parallelize`` even without TP / EP and shards over its ``dp_shard`` mesh dim
(``full_dtensor.resolve_fsdp_mesh``).

Expert parallelism under ``spmd_types`` is not run here: torchtitan's token dispatch there
(``spmd_types`` ``all_to_all`` of uneven splits, ``torch.distributed.all_to_all`` of a list) fails on
gloo, with bf16 experts too (``ProcessGroupGloo::alltoall: invalid tensor size``): gloo's list
all-to-all takes equal sizes only."""

from __future__ import annotations

import pytest
import torch

from dist_utils import WORLD_SIZES, RankPool

if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 14):
    pytest.skip(f"torchtitan 0.3 needs torch >= 2.14 (this is {torch.__version__})", allow_module_level=True)
pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e '.[torchtitan]', see pyproject)")

from torchtitan_moe import MOE_LAYERS, ROUTED, MoERun  # noqa: E402

RECIPE = "mxfp8"  # two stored planes: each gather's direction matters


def _fsdp_runs(steps=2):
    from torchtitan.distributed.utils import get_spmd_backend

    bf16 = MoERun("deepseek_v3", None, spmd_backend="spmd_types").train(range(steps))
    run = MoERun("deepseek_v3", RECIPE, spmd_backend="spmd_types")
    losses = run.train(range(steps))
    return {"bf16": bf16, "losses": losses, "backend": get_spmd_backend(), "parallelized": run.parallelized,
            "fp8_after": run.fp8_weights(), "gathered_unlike": run.fsdp_gathered_unlike(),
            "meshes": {n: p.device_mesh.mesh_dim_names for n, p in run.routed().items()}}


def test_spmd_types_fsdp2_two_ranks_fp8_experts_train_like_bf16():
    """Fresh rank processes of its own: torchtitan's ``spmd_types`` path resolves FSDP's mesh from
    state an earlier torchtitan setup in the same process leaves behind (after tests/test_torchtitan.py
    in a shared pool, ``fully_shard`` raised "Expected param's DTensor mesh to be the same mesh
    passed to fully_shard")."""
    if 2 not in WORLD_SIZES:
        pytest.skip("2 ranks")
    pool = RankPool(2)
    try:
        out = pool.run(_fsdp_runs)
    finally:
        pool.close()
    r = out[0]
    assert all(o["losses"] == r["losses"] for o in out)
    assert r["backend"] == "spmd_types"
    assert set(r["meshes"].values()) == {("dp_shard",)}, r["meshes"]  # the spmd_types path shards them
    assert len(r["parallelized"]) == 3 * MOE_LAYERS and all(ROUTED in n for n in r["parallelized"])
    assert set(r["fp8_after"]) == set(r["parallelized"])
    for o in out:  # the gathered planes are per-expert quantize of the master, byte for byte
        assert o["gathered_unlike"] == []
    for a, b in zip(r["losses"], r["bf16"], strict=True):
        assert abs(a - b) <= 0.01 * b, (r["losses"], r["bf16"])
