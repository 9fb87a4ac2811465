"""``scale_slots.py``: what each rank sends of a plane's block scales in an FSDP2 gather, and how
the gathered slots become the whole weight's grid. The routes are checked here on the grids
themselves (every rank's touched rows cut from a random full grid, sent, padded to the slot,
concatenated in rank order as ``all_gather_into_tensor`` does); ``test_split_blocks.py`` checks
the same routes through real FSDP2 gathers, byte for byte."""

import pytest
import torch

import dtensor_fp8 as d
from dtensor_fp8.formats.planes import BlockShape
from dtensor_fp8.scale_slots import scale_route, scale_slot_numel

# (block, world, rows per shard, cols): 1x128's and MXFP8's column planes, 128x128, MXFP8's rows;
# whole blocks, 1/2 .. 1/128 of a block per shard, 3.5 blocks per shard, a non-integral share.
CASES = [
    (BlockShape(128, 1), 4, 64, 256), (BlockShape(128, 1), 64, 16, 4096), (BlockShape(128, 1), 1024, 1, 512),
    (BlockShape(128, 1), 2, 448, 384), (BlockShape(128, 1), 3, 448, 256), (BlockShape(32, 1), 8, 16, 96),
    (BlockShape(128, 128), 4, 64, 256), (BlockShape(128, 128), 16, 16, 256), (BlockShape(128, 128), 6, 448, 512),
    (BlockShape(1, 32), 4, 16, 64), (BlockShape(128, 1), 4, 128, 64), (BlockShape(128, 1), 64, 9, 7168),
    (BlockShape(128, 128), 256, 14, 4096), (BlockShape(128, 128), 7, 100, 384),
]


def _local_grid(full: torch.Tensor, block, rank: int, rows: int) -> torch.Tensor:
    b = block.extent(0)
    first, last = (rank * rows) // b, ((rank + 1) * rows - 1) // b
    return full[first : last + 1]


@pytest.mark.parametrize("block, world, rows, cols", CASES, ids=str)
def test_gathered_slots_are_the_whole_grid(block, world, rows, cols):
    full_shape = block.grid((world * rows, cols))
    full = torch.randn(full_shape).abs() + 0.5
    routes = [scale_route(block, world, rows, cols, (0, 0), r) for r in range(world)]
    slot = max(r.numel for r in routes)
    assert len({r.numel for r in routes}) == 1, "every rank must size the slot alike"
    sent = []
    for r, route in enumerate(routes):
        piece = route.send(_local_grid(full, block, r, rows))
        assert piece.numel() <= slot
        sent.append(torch.cat([piece, piece.new_zeros(slot - piece.numel())]))
    gathered = torch.cat(sent)
    assert torch.equal(routes[0].assemble(gathered, slot).view(torch.int32), full.view(torch.int32))
    if routes[0].kind == "stripes":  # every scale crosses once: the slots hold one copy of the grid
        assert sum(route.span[1] for route in routes) == full.numel()
        # equal shares where every shard holds a whole number of scales; otherwise a stripe is at
        # most one scale longer than another's, but for a last block the shards fill in part
        pad = world * slot - full.numel()
        if (rows * full_shape[1]) % block.extent(0) == 0 and (world * rows) % block.extent(0) == 0:
            assert pad == 0
        else:
            assert pad < world * max(1, full_shape[1] * rows // block.extent(0)) + world


def test_split_blocks_send_each_scale_once_on_llama3_shapes():
    """1024-row K/V projections (Llama3) at 64-way FSDP: 16-row shards, 8 ranks per 128-row block.
    The column planes of 1x128 and MXFP8 send 1/8 and 1/2 of a grid row per rank, not a whole row."""
    for recipe, stripe in ((d.Blockwise(block_dims=1), 4096 // 8), (d.MXFP8(), 4096 // 2)):
        route = scale_route(recipe.block_shape("columnwise"), 64, 16, 4096, (0, 0), rank=5)
        assert (route.kind, route.numel) == ("stripes", stripe)
        # the slot is the larger of both planes' needs; the rowwise grid of 16 rows is as large
        assert scale_slot_numel(recipe, 16, 4096, 64) == stripe


def test_uneven_shards_send_whole_rows():
    """A shard past the weight's end holds padding only: it cannot know a shared block's scale, so
    uneven dims send the touched rows."""
    assert scale_route(BlockShape(128, 1), 4, 64, 256, (0, 0), 0, even=False).kind == "first rows"
    assert scale_route(BlockShape(128, 128), 16, 16, 256, (0, 0), 0).kind == "stripes"   # 16 * 2 / 128 scales each
