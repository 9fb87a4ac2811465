"""Per-expert quantization of 3-D MoE weights ``[E, out, in]`` (formats/experts.py): for every
recipe, the 3-D weight's planes are byte for byte the stack of each expert's own 2-D ``quantize``."""

from __future__ import annotations

import pytest
import torch

import dtensor_fp8 as d
from dtensor_fp8.formats.base import COLUMNWISE, ROWWISE, BlockShape

from conftest import assert_bytes_equal

RECIPES = dict(d.RECIPES)
RECIPES["current_e5m2_pow2"] = d.CurrentScaling(torch.float8_e5m2, force_pow_2_scales=True)
RECIPES["blockwise1d_e5m2"] = d.Blockwise(block_dims=1, fp8_dtype=torch.float8_e5m2)
RECIPES["mxfp8_e5m2"] = d.MXFP8(torch.float8_e5m2)


def experts_weight(shape, dtype=torch.bfloat16, seed=0):
    """Experts with magnitudes 10^(e-2) apart, outliers, a zero block and a NaN: per-expert scales
    differ from one whole-tensor scale, so a codec that shares scales across experts fails."""
    g = torch.Generator().manual_seed(seed)
    e = shape[0]
    w = torch.randn(shape, generator=g) * torch.logspace(-2, e - 3, e).reshape(-1, 1, 1)
    w[0, 0, 0] = 900.0
    if e > 1:
        w[1, :32, :32] = 0.0
    if e > 2:
        w[2, 5, 7] = float("nan")
    return w.to(dtype)


SHAPES = [(4, 256, 384), (3, 64, 160), (2, 96, 256)]  # out: block multiple, below a 128 block


def _expert_rows_of_scale(plane2d_scale, e, experts):
    rows = plane2d_scale.shape[0] // experts
    return plane2d_scale[e * rows:(e + 1) * rows]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_planes_are_stacked_per_expert_quantize(name, shape):
    base = RECIPES[name]
    if isinstance(base, d.MXFP8) and shape[2] % 32:
        pytest.skip("MXFP8 needs 32-multiples")
    w = experts_weight(shape)
    q = d.quantize(w, d.per_expert(base, w.shape))
    assert q.shape == w.shape and q.dtype == w.dtype and isinstance(q.recipe, d.PerExpert)
    dq = q.dequantize(torch.float32)
    for usage in (ROWWISE, COLUMNWISE):
        plane = q.plane(usage)
        m = shape[1]
        for e in range(shape[0]):
            ref = d.quantize(w[e], base).plane(usage)
            assert_bytes_equal(plane.data[e * m:(e + 1) * m], ref.data, f"{name} {usage} data of expert {e}")
            assert_bytes_equal(_expert_rows_of_scale(plane.scale_inv, e, shape[0]), ref.scale_inv,
                               f"{name} {usage} scale_inv of expert {e}")
            want = d.quantize(w[e], base).dequantize(torch.float32, usage)
            got = q.dequantize(torch.float32, usage)[e]
            assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), f"{name} {usage} dequantize of expert {e}"
    assert dq.shape == w.shape


@pytest.mark.parametrize("name", ["delayed", "current", "blockwise2d"])
def test_whole_tensor_quantize_differs(name):
    """The control: the same 3-D weight quantized as one (TE's flattened) tensor has other scales,
    so the byte comparison above can fail."""
    w = experts_weight((4, 64, 256))
    per = d.quantize(w, d.per_expert(RECIPES[name], w.shape)).plane(ROWWISE)
    whole = d.quantize(w, RECIPES[name]).plane(ROWWISE)
    assert per.scale_inv.shape != whole.scale_inv.shape or not torch.equal(per.scale_inv, whole.scale_inv)


def test_delayed_given_scales_per_expert():
    w = experts_weight((3, 64, 128))
    scales = torch.tensor([0.5, 4.0, 64.0])
    q = d.quantize(w, d.per_expert(d.DelayedScaling(), w.shape), scale=scales)
    for e in range(3):
        ref = d.quantize(w[e], d.DelayedScaling(), scale=scales[e])
        assert_bytes_equal(q.plane(ROWWISE).data[e * 64:(e + 1) * 64], ref.plane(ROWWISE).data, f"expert {e}")
        assert_bytes_equal(q.plane(ROWWISE).scale_inv[e], ref.plane(ROWWISE).scale_inv[0])
    one = d.quantize(w, d.per_expert(d.DelayedScaling(), w.shape), scale=2.0)
    assert torch.equal(one.plane(ROWWISE).scale_inv, torch.full((3, 1), 0.5))
    with pytest.raises(d.RecipeError, match="2 values for 3 experts"):
        d.quantize(w, d.per_expert(d.DelayedScaling(), w.shape), scale=torch.ones(2))


def test_block_geometry_and_refusals():
    assert d.per_expert(d.CurrentScaling(), (8, 96, 64)).block_shape(ROWWISE) == BlockShape(96, None)
    assert d.per_expert(d.Blockwise(block_dims=2), (8, 256, 64)).block_shape(ROWWISE) == BlockShape(128, 128)
    assert d.per_expert(d.Blockwise(block_dims=2), (8, 64, 64)).block_shape(COLUMNWISE) == BlockShape(64, 128)
    assert d.per_expert(d.MXFP8(), (8, 64, 64)).block_shape(COLUMNWISE) == BlockShape(32, 1)
    with pytest.raises(d.RecipeError, match=r"192 output rows per expert.*pad the expert's output dim to 256"):
        d.per_expert(d.Blockwise(block_dims=2), (4, 192, 128))
    with pytest.raises(d.RecipeError, match="3-D"):
        d.per_expert(d.MXFP8(), (192, 128))
    with pytest.raises(d.RecipeError, match="mxfp8"):  # the base recipe's own shape rule, per expert
        d.quantize(torch.randn(2, 48, 64), d.per_expert(d.MXFP8(), (2, 48, 64)))
    with pytest.raises(d.RecipeError, match="expects a 3-D expert weight"):
        d.quantize(torch.randn(2, 64, 64), d.per_expert(d.MXFP8(), (2, 32, 64)))
    with pytest.raises(d.RecipeError, match="no tensor class for a 3-D weight"):
        d.te_layout(d.quantize(torch.randn(2, 64, 64), d.per_expert(d.MXFP8(), (2, 64, 64))))


def test_two_d_recipes_unchanged_by_a_per_expert_one():
    """The 2-D path is the base recipe itself: quantizing with it before and after a per-expert
    quantization gives the same bytes (no shared state), and an E=1 weight equals the 2-D weight."""
    w = experts_weight((1, 128, 256), dtype=torch.float32)
    for name in ("delayed", "mxfp8", "blockwise1d"):
        base = RECIPES[name]
        before = d.quantize(w[0], base).plane(ROWWISE)
        q = d.quantize(w, d.per_expert(base, w.shape)).plane(ROWWISE)
        after = d.quantize(w[0], base).plane(ROWWISE)
        assert_bytes_equal(before.data, after.data)
        assert_bytes_equal(q.data, before.data)
        assert_bytes_equal(q.scale_inv, before.scale_inv)
