"""QuantizedTensor behaviour on one process, for all five recipes.

Expected values come from the planes' raw bytes (uint8 views) and from an independent dequantize
written here (``fp8.float() * scale_inv`` broadcast with ``repeat_interleave`` over the block
shape), never from the op under test.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

import dtensor_fp8 as d

RECIPES = {
    "delayed": d.DelayedScaling(),
    "current": d.CurrentScaling(),
    "mxfp8": d.MXFP8(),
    "block1d": d.Blockwise(block_dims=1),
    "block2d": d.Blockwise(block_dims=2),
}
# Size of a scaling block along dim 0 of each stored plane (None: one scale spans the dim).
DIM0_BLOCK = {
    "delayed": {"rowwise": None},
    "current": {"rowwise": None},
    "mxfp8": {"rowwise": 1, "columnwise": 32},
    "block1d": {"rowwise": 1, "columnwise": 128},
    "block2d": {"rowwise": 128},
}
# Independent block shapes (rows, cols) per plane, from TE's recipes (None: whole dim).
BLOCKS = {
    "delayed": {"rowwise": (None, None)},
    "current": {"rowwise": (None, None)},
    "mxfp8": {"rowwise": (1, 32), "columnwise": (32, 1)},
    "block1d": {"rowwise": (1, 128), "columnwise": (128, 1)},
    "block2d": {"rowwise": (128, 128)},
}
ALIGN = {"delayed": 64, "current": 64, "mxfp8": 32, "block1d": 128, "block2d": 128}

params = pytest.mark.parametrize("name", list(RECIPES))


def make(name, shape=(256, 192), seed=0, dtype=torch.float32, **kw):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    # per-row magnitude variation: makes 32x1 / 128x1 columnwise scales differ from 1x32 / 1x128 rowwise
    x = x * torch.exp2(torch.randint(-6, 7, (*x.shape[:-1], 1), generator=g).float())
    x = x.to(dtype)
    if name == "delayed":
        kw.setdefault("scale", torch.tensor(4.0))
    return x, d.quantize(x, RECIPES[name], **kw)


def u8(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes, shape (*t.shape[:-1], -1). Goes through a flat copy because a "contiguous" tensor
    with a size-1 last dim may still have stride(-1) != 1, which view(uint8) rejects."""
    flat = t.contiguous().reshape(-1).view(torch.uint8)
    return flat.reshape(*t.shape[:-1], t.shape[-1] * t.element_size()) if t.dim() else flat


def plane_bytes(q) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {u: (u8(p.data), u8(p.scale_inv)) for u, p in q.planes.items()}


def assert_same_bytes(a, b):
    pa, pb = plane_bytes(a), plane_bytes(b)
    assert set(pa) == set(pb)
    for u in pa:
        assert torch.equal(pa[u][0], pb[u][0]), f"{u} data differs"
        assert torch.equal(pa[u][1], pb[u][1]), f"{u} scale_inv differs"


def cat_planes(name, pieces):
    """Concatenate the pieces' planes by hand: data rows; scale rows of dim-0 blocks, or the shared
    per-tensor scale (which must be identical on every piece)."""
    out = {}
    for u in pieces[0].planes:
        data = torch.cat([u8(p.planes[u].data) for p in pieces], 0)
        scales = [u8(p.planes[u].scale_inv) for p in pieces]
        if DIM0_BLOCK[name][u] is None:
            assert all(torch.equal(s, scales[0]) for s in scales)
            scale = scales[0]
        else:
            scale = torch.cat(scales, 0)
        out[u] = (data, scale)
    return out


def ref_dequant(plane, rows_cols) -> torch.Tensor:
    """fp8 value * per-block scale_inv, in fp32 (exact: both factors are fp32, the product of an
    fp8 value (<= 4 significant bits) and an fp32 scale fits fp32 unless it under/overflows)."""
    data = plane.data.float()
    s = plane.scale_inv.float()
    m, k = data.shape
    br, bc = rows_cols
    s = s.expand(m, -1) if br is None else s.repeat_interleave(br, 0)[:m]
    s = s.expand(-1, k) if bc is None else s.repeat_interleave(bc, 1)[:, :k]
    return data * s.expand(m, k)


# ---- slicing / split / chunk / cat --------------------------------------------------------------------------
@params
def test_split_chunk_slice_at_block_boundaries(name):
    step = ALIGN[name]
    x, q = make(name, shape=(4 * step, 192))
    original = plane_bytes(q)
    for pieces in (
        torch.split(q, step),
        torch.chunk(q, 2),
        [q[: 2 * step], q[2 * step :]],
        [q.narrow(0, 0, step), q.narrow(0, step, q.shape[0] - step)],
        torch.split(q, [step, 2 * step, step]),
        torch.split(q, [0, 3 * step, step]),  # an empty piece
    ):
        assert all(isinstance(p, d.QuantizedTensor) for p in pieces)
        assert sum(p.shape[0] for p in pieces) == q.shape[0]
        for p in pieces:
            assert p.shape[1:] == q.shape[1:] and p.usages == q.usages
        got = cat_planes(name, pieces)
        for u, (data, scale) in original.items():
            assert torch.equal(got[u][0], data), u
            assert torch.equal(got[u][1], scale), u
        # and the library's own torch.cat puts them back bit for bit
        assert_same_bytes(torch.cat(list(pieces), 0), q)


@pytest.mark.parametrize("name", ["mxfp8", "block1d", "block2d"])
def test_dim0_pieces_inside_blocks_keep_every_touched_block(name):
    """Rows cut inside a block (a shard of FSDP2 at any degree): each piece holds the scale of every
    block it touches and its block phase; the pieces dequantize and concatenate to the whole, byte
    for byte (a shared block's scale kept once)."""
    _, q = make(name)
    for pieces in ([q[:40], q[40:]], list(torch.split(q, 40)), [q.narrow(0, 0, 40), q.narrow(0, 40, 216)]):
        assert pieces[1].phase[0] == 40 % q.recipe.phase_period(0)
        whole = torch.cat(pieces)
        for usage, plane in q.planes.items():
            assert torch.equal(whole.planes[usage].data.view(torch.uint8), plane.data.view(torch.uint8))
            assert torch.equal(whole.planes[usage].scale_inv.view(torch.uint8), plane.scale_inv.view(torch.uint8))
        for usage in q.usages:
            assert torch.equal(torch.cat([p.dequantize(torch.float32, usage) for p in pieces]),
                               q.dequantize(torch.float32, usage))


@pytest.mark.parametrize("name", ["mxfp8", "block1d", "block2d"])
def test_dim1_pieces_inside_blocks_keep_every_touched_block(name):
    """Columns cut inside a block (a row-parallel TP shard at any degree, issue 52): as along dim 0,
    each piece holds the scale of every block it touches and its block phase along dim 1; the
    pieces dequantize and concatenate to the whole, byte for byte. Before TP shards could split
    blocks these cuts raised."""
    _, q = make(name)
    for pieces in ([q[:, :40], q[:, 40:]], list(torch.split(q, 40, dim=1)), [q.narrow(1, 0, 40), q.narrow(1, 40, 152)]):
        assert pieces[1].phase[1] == 40 % q.recipe.phase_period(1)
        whole = torch.cat(pieces, dim=1)
        for usage, plane in q.planes.items():
            assert torch.equal(whole.planes[usage].data.view(torch.uint8), plane.data.view(torch.uint8))
            assert torch.equal(whole.planes[usage].scale_inv.view(torch.uint8), plane.scale_inv.view(torch.uint8))
        for usage in q.usages:
            assert torch.equal(torch.cat([p.dequantize(torch.float32, usage) for p in pieces], dim=1),
                               q.dequantize(torch.float32, usage))


@pytest.mark.parametrize("name", ["mxfp8", "block1d", "block2d"])
def test_cat_rejects_ragged_inner_piece(name):
    _, q = make(name)
    n = ALIGN[name] + ALIGN[name] // 2  # ends inside a block
    with pytest.raises(d.RecipeError):
        torch.cat([q[:n], q])


def test_cat_rejects_different_per_tensor_scales():
    _, a = make("current", seed=1)
    _, b = make("current", seed=2)
    with pytest.raises(d.RecipeError):
        torch.cat([a, b])


@params
def test_new_zeros_narrow_copy_reproduces_bytes(name):
    """What FSDP2 does for a padded shard: new_zeros(padded) -> narrow(0, 0, n) -> copy_(shard)."""
    _, q = make(name)
    n = q.shape[0]
    pad_to = n + (2 * ALIGN[name] if name not in ("delayed", "current") else 5)
    buf = q.new_zeros((pad_to, q.shape[1]))
    assert isinstance(buf, d.QuantizedTensor) and tuple(buf.shape) == (pad_to, q.shape[1])
    for p in buf.planes.values():
        assert not u8(p.data).any()
    buf.narrow(0, 0, n).copy_(q)
    assert_same_bytes(buf[:n], q)
    for u, p in buf.planes.items():
        assert not u8(p.data)[n:].any(), f"{u}: padding rows not zero"


@params
def test_constant_pad_then_slice_back(name):
    _, q = make(name)
    n = q.shape[0]
    extra = ALIGN[name] if name not in ("delayed", "current") else 3
    padded = F.pad(q, (0, 0, 0, extra))
    assert isinstance(padded, d.QuantizedTensor) and tuple(padded.shape) == (n + extra, q.shape[1])
    assert_same_bytes(padded[:n], q)
    for p in padded.planes.values():
        assert not u8(p.data)[n:].any()
    with pytest.raises(d.RecipeError):
        F.pad(q, (0, 0, 1, 0))  # padding at the front would shift every block


@params
def test_clone_detach_to(name):
    _, q = make(name)
    det = q.detach()
    assert isinstance(det, d.QuantizedTensor)
    for u in q.planes:
        assert det.planes[u].data.data_ptr() == q.planes[u].data.data_ptr()
        assert det.planes[u].scale_inv.data_ptr() == q.planes[u].scale_inv.data_ptr()
    cl = q.clone()
    assert isinstance(cl, d.QuantizedTensor)
    assert_same_bytes(cl, q)
    before = plane_bytes(q)
    for u in q.planes:
        assert cl.planes[u].data.data_ptr() != q.planes[u].data.data_ptr()
        u8(cl.planes[u].data).fill_(0)  # writing into the clone leaves the original intact
        u8(cl.planes[u].scale_inv).fill_(0)
    assert all(torch.equal(before[u][0], u8(q.planes[u].data)) for u in q.planes)
    assert all(torch.equal(before[u][1], u8(q.planes[u].scale_inv)) for u in q.planes)
    for moved in (q.to("cpu"), q.to("cpu", copy=True), q.cpu()):
        assert isinstance(moved, d.QuantizedTensor) and moved.device.type == "cpu"
        assert moved.dtype == q.dtype and moved.usages == q.usages
        assert_same_bytes(moved, q)


@params
def test_unsupported_op_raises(name):
    _, q = make(name)
    for bad in (lambda: torch.add(q, q), lambda: q * 2, lambda: q.sum(), lambda: torch.relu(q)):
        with pytest.raises(NotImplementedError) as e:
            bad()
        assert "never silently dequantized" in str(e.value), str(e.value)


# ---- usages -----------------------------------------------------------------------------------------------
@params
def test_with_usages_holds_one_direction(name):
    _, q = make(name)
    fwd = q.with_usages("rowwise")
    assert fwd.usages == ("rowwise",)
    assert set(fwd.planes) == {"rowwise"}
    assert len(fwd.inner_tensors()) == 2  # one data + one scale_inv
    assert torch.equal(u8(fwd.plane("rowwise").data), u8(q.plane("rowwise").data))
    with pytest.raises(d.RecipeError, match="columnwise"):
        fwd.plane("columnwise")
    with pytest.raises(d.RecipeError):
        fwd.dequantize(torch.float32, "columnwise")
    with pytest.raises(d.RecipeError):
        fwd.columnwise_matrix(torch.float32)
    assert fwd.create_transpose_cache() is None
    bwd = q.with_usages("columnwise")
    assert bwd.usages == ("columnwise",)
    expected_stored = {"rowwise"} if name in ("delayed", "current", "block2d") else {"columnwise"}
    assert set(bwd.planes) == expected_stored
    with pytest.raises(d.RecipeError, match="rowwise"):
        bwd.plane("rowwise")
    fwd_only = d.quantize(torch.randn(256, 192), RECIPES[name], columnwise=False,
                          **({"scale": 2.0} if name == "delayed" else {}))
    assert fwd_only.usages == ("rowwise",) and set(fwd_only.planes) == {"rowwise"}


# ---- emulated linear ----------------------------------------------------------------------------------------
@params
@pytest.mark.parametrize("act_dtype", [torch.float32, torch.bfloat16])
def test_linear_reads_the_right_planes(name, act_dtype):
    _, q = make(name, shape=(256, 256), seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(8, 3, 256, generator=g).to(act_dtype).requires_grad_(True)
    grad = torch.randn(8, 3, 256, generator=g).to(act_dtype)
    w_row = ref_dequant(q.planes["rowwise"], BLOCKS[name]["rowwise"])
    col_usage = "columnwise" if "columnwise" in q.planes else "rowwise"
    w_col = ref_dequant(q.planes[col_usage], BLOCKS[name][col_usage])
    y = F.linear(x, q)
    assert torch.equal(y, F.linear(x.detach(), w_row.to(act_dtype)))
    y.backward(grad)
    assert torch.equal(x.grad, grad @ w_col.to(act_dtype))
    wrong = grad @ w_row.to(act_dtype)
    if name in ("mxfp8", "block1d"):
        assert not torch.equal(w_row, w_col)
        assert not torch.equal(x.grad, wrong), "input gradient does not tell the planes apart"
    else:
        assert torch.equal(x.grad, wrong)


@pytest.mark.parametrize("name", ["delayed", "current", "block2d"])
def test_transpose_cache(name):
    _, q = make(name, shape=(256, 384), seed=5)
    assert q.transpose_cache is None
    t = q.create_transpose_cache()
    assert t is not None and tuple(t.shape) == (384, 256) and t.is_contiguous()
    assert torch.equal(u8(t), u8(q.plane("rowwise").data).t().contiguous())
    assert q.create_transpose_cache() is t  # idempotent
    # the owner keeps it for whatever holds these planes: aliases see it without an op carrying it
    assert q.detach().transpose_cache is t and q.to(torch.bfloat16).transpose_cache is t
    assert q.param_state.gather.transpose[1] is t
    assert q[:128].transpose_cache is None  # other plane tensors (views of some rows): not theirs
    other = d.quantize(torch.randn(256, 384), RECIPES[name], **({"scale": 2.0} if name == "delayed" else {}))
    moved = q.detach().repoint_(other.planes)
    assert moved.transpose_cache is None and q.transpose_cache is t
    te = d.te_layout(q)
    key = "_transpose" if name != "block2d" else "_columnwise_data"
    assert torch.equal(te[key], u8(t))
    w_row = ref_dequant(q.planes["rowwise"], BLOCKS[name]["rowwise"])
    assert torch.equal(q.columnwise_matrix(torch.float32), w_row)
    q.detach().discard_transpose_cache()  # an alias drops the parameter's cache
    assert q.transpose_cache is None and q.param_state.gather.transpose is None
    q.create_transpose_cache()
    q.param_state.gather.start_gather()  # and the next gather does
    assert q.transpose_cache is None
    x = torch.randn(4, 384, requires_grad=True)
    grad = torch.randn(4, 256)
    F.linear(x, q).backward(grad)
    assert torch.equal(x.grad, grad @ w_row)
    # a cache that went stale would be detected: copy_ of new values must drop it
    q.create_transpose_cache()
    src = torch.randn(256, 384)
    q.copy_(src)
    assert q.transpose_cache is None


# ---- TE layout round trip ------------------------------------------------------------------------------------
SHAPES = {
    "delayed": [(17, 33), (256, 128), (3, 40, 24)],
    "current": [(1, 5), (130, 257), (2, 64, 96)],
    "mxfp8": [(32, 32), (96, 224), (2, 64, 96)],
    "block1d": [(200, 300), (1, 129), (128, 256), (3, 50, 140)],
    "block2d": [(200, 300), (129, 1), (256, 128), (3, 50, 140)],
}


@params
def test_te_layout_round_trip(name):
    recipe = RECIPES[name]
    for i, shape in enumerate(SHAPES[name]):
        _, q = make(name, shape=shape, seed=10 + i, dtype=torch.bfloat16)
        assert tuple(q.shape) == shape
        for view in (q, q.with_usages("rowwise"), q.with_usages("columnwise")):
            bufs = d.te_layout(view)
            planes = recipe.from_te_layout(bufs, shape)
            back = d.QuantizedTensor.from_planes(planes, recipe, shape, torch.bfloat16, view.usages)
            assert_same_bytes(back, view)
            again = d.te_layout(back)
            assert set(again) == set(bufs)
            for k in bufs:
                assert again[k].shape == bufs[k].shape and torch.equal(u8(again[k]), u8(bufs[k])), (shape, k)


def test_holds_tells_in_place_writes_from_replaced_planes():
    q = d.quantize(torch.randn(128, 128), d.RECIPES["current"])
    kept = q.plane_tensors()
    assert kept == d.QuantizedTensor.plane_tensors_of(q.planes) and q.holds(kept)
    q.planes["rowwise"].data.view(torch.uint8).zero_()  # an optimizer step writes in place: still held
    assert q.holds(kept)
    other = d.quantize(torch.randn(128, 128), d.RECIPES["current"])
    q.repoint_(other.planes, other.usages)  # replaced (a checkpoint load): no longer
    assert not q.holds(kept) and q.holds(other.plane_tensors())


# ---- lifecycle in the owner record (issue 38) ------------------------------------------------------------
def test_a_cast_and_its_aliases_read_what_the_source_holds_now():
    """``ops/copies.reads_from``: the owner keeps which tensor a same-device cast reads through to,
    keyed on its plane tensors, so an alias of the cast (which no op told) reads through as well."""
    from dtensor_fp8.ops.copies import reads_from

    _, w = make("mxfp8", shape=(128, 128), seed=7)
    cast = w.to(torch.bfloat16)
    alias = cast.detach()
    assert reads_from(cast) is w and reads_from(alias) is w and reads_from(cast.to(torch.float16)) is w
    _, other = make("mxfp8", shape=(128, 128), seed=8)
    w.repoint_(other.planes)  # FSDP2's backward gather re-points the unsharded weight
    assert reads_from(alias) is w and reads_from(w) is w
    alias.repoint_(make("mxfp8", shape=(128, 128), seed=9)[1].planes)  # a cast re-pointed itself: its own
    assert reads_from(alias) is alias and reads_from(cast) is w
    assert reads_from(make("mxfp8", shape=(128, 128))[1]) is not w  # a tensor made otherwise: itself


def test_the_values_plane_goes_where_the_fp8_planes_go():
    from dtensor_fp8.module import fp8_parameter_values

    q = fp8_parameter_values(torch.randn(256, 128), d.MXFP8())
    assert q.hp_init is not None and not q.bytes_pending
    top = q[:128]
    assert torch.equal(top.hp_init, q.hp_init[:128]) and torch.equal(q.detach().hp_init, q.hp_init)
    padded = torch.nn.functional.pad(top, (0, 0, 0, 32))
    assert torch.equal(padded.hp_init[:128], top.hp_init) and not padded.hp_init[128:].any()
    assert torch.equal(torch.cat([top, q[128:]]).hp_init, q.hp_init)
    with pytest.raises(d.RecipeError, match="hp_init of shape"):  # an op cannot drop it by omission
        q.rebuild({u: p for u, p in top.planes.items()}, shape=(128, 128))
    pending = fp8_parameter_values(torch.empty(256, 128, device="meta"), d.MXFP8())
    assert pending.bytes_pending and pending[:128].bytes_pending  # the owner's flag: one for all
    pending.param_state.lifecycle.mark_init_written()
    pending.param_state.lifecycle.mark_made()
    assert not pending[:128].bytes_pending
