"""``python -m dtensor_fp8.benchmarks moe`` on tiny shapes: the expert all-gather bytes its table
reports, counted at the collectives on real ranks (FSDP2 over 2 ranks, expert parallelism 2 x FSDP2
2 over 4), are the bytes an independent count of the planes, scales and gathers gives, for bf16 and
every recipe; the table prints them and their ratio to bf16's."""

from __future__ import annotations

import math

import pytest

from dist_utils import BACKEND, WORLD_SIZES
from dtensor_fp8.benchmarks import moe
from dtensor_fp8.benchmarks.moe_model import scaled

DIMS = scaled("qwen3-moe", 16, 8)  # 8 experts, dim 256, hidden 96: every recipe takes it
TOKENS = 32
VARIANTS = ("bf16", "delayed", "current", "mxfp8", "blockwise1d", "blockwise2d")


def _scale_bytes_per_expert(variant: str, out: int, inn: int) -> list[int]:
    """Scale bytes of one expert's ``out x in`` matrix in each stored plane (the recipes' formats:
    TE's per-tensor fp32 scale, 128x128 fp32 blocks (one shared plane), 1x128 / 128x1 fp32 and
    1x32 / 32x1 E8M0 blocks (two planes); an expert's rows never share a block with the next's)."""
    rows128 = math.ceil(out / 128)
    return {"delayed": [4], "current": [4], "blockwise2d": [rows128 * math.ceil(inn / 128) * 4],
            "blockwise1d": [out * math.ceil(inn / 128) * 4, rows128 * inn * 4],
            "mxfp8": [out * (inn // 32), (out // 32) * inn]}[variant]


def expected_received(variant: str, ep: int, fsdp: int) -> int:
    """Bytes a rank receives from the all-gathers of one forward + backward: per expert weight, two
    gathers (``reshard_after_forward=True``) of ``fsdp`` equal shards of this EP rank's experts:
    bf16, 2 bytes an element; FP8, 1 byte an element plus a scale slot as large as the larger of
    the two planes' scales (FSDP2 sizes a weight's gathers alike, ``scale_slots.py``)."""
    experts, dim, hidden, _ = DIMS
    per_shard = experts // ep // fsdp
    total = 0
    for out, inn in ((hidden, dim), (dim, hidden), (hidden, dim)):  # w1, w2, w3
        if variant == "bf16":
            shard = per_shard * out * inn * 2
        else:
            shard = per_shard * (out * inn + max(_scale_bytes_per_expert(variant, out, inn)))
        total += 2 * fsdp * shard
    return total


def _check(pools, layout, world, ep, variants):
    rows = moe.add_ratios([moe.wire_row("qwen3-moe", DIMS, layout, world, ep, v,
                                        pools[world].run(moe.received_per_step, v, DIMS, layout, ep, TOKENS))
                           for v in variants])
    table = moe.wire_table(rows)
    bf16 = expected_received("bf16", ep, world // ep)
    for row in rows:
        want = expected_received(row["variant"], ep, world // ep)
        assert row["received_bytes_per_rank"] == [want] * world, (row["variant"], row["received_bytes_per_rank"], want)
        assert row["vs_bf16"] == want / bf16
        assert f"| {row['variant']} | {want / 2**20:.3f} | {want / bf16:.3f}x |" in table, table
        bound = moe.BOUNDS.get(row["variant"])
        assert bound is None or row["vs_bf16"] <= bound, row  # issue 48's bounds hold here too


def test_fsdp2_wire_bytes_are_the_independent_count(pools):
    if 2 not in WORLD_SIZES:
        pytest.skip("2 ranks")
    _check(pools, "fsdp", 2, 1, VARIANTS)


@pytest.mark.parametrize("variant", VARIANTS)
def test_ep_fsdp2_wire_bytes_are_the_independent_count(pools, variant):
    if 4 not in WORLD_SIZES or BACKEND == "nccl":
        pytest.skip("4 ranks")
    _check(pools, "ep_fsdp", 4, 2, ("bf16", variant) if variant != "bf16" else ("bf16",))
