"""The recipes' TE-kernel fast path (``dtensor_fp8/formats/te_kernels.py``) writes the bytes of
their pure-torch reference, on a CUDA device with Transformer Engine.

For every recipe with a fast path (per-tensor delayed / current, blockwise 1-D / 2-D) and every
input of ``test_te_parity.py`` (random with outliers and zero blocks; NaN / Inf / zero / tiny /
huge), each stored plane is quantized twice — fast path, then the reference under
``te_kernels.reference_only()`` — and FP8 data and scale_inv are compared as raw bytes. The
per-tensor amax, the cast with an amax reduced across shards (larger than the local one), and a
whole ``requantize_from_hp_`` (delayed scaling's amax history included) are compared the same way.
Each test first asserts the fast path is really taken, so a missing TE cannot turn it into a
comparison of the reference with itself.
"""

from __future__ import annotations

import warnings

import pytest
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("transformer_engine.pytorch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the TE-kernel fast path runs on CUDA only", allow_module_level=True)

from conftest import assert_bytes_equal  # noqa: E402
from test_te_parity import HP_DTYPES, RECIPES, SHAPES, _delayed_scale, _seed, _u8, make_input, special_input  # noqa: E402

import dtensor_fp8 as d  # noqa: E402
from dtensor_fp8.formats import te_kernels  # noqa: E402
from dtensor_fp8.requantize import requantize_from_hp_  # noqa: E402


def assert_planes_equal(fast: d.Plane, ref: d.Plane, what: str) -> None:
    for field in ("data", "scale_inv"):
        a, b = getattr(fast, field), getattr(ref, field)
        assert a.dtype == b.dtype, f"{what}.{field}: {a.dtype} vs {b.dtype}"
        assert_bytes_equal(a, b, f"{what}.{field}")


def _both(fn):
    """``(fast, reference)`` results of ``fn()``: TE's kernels only (the Triton path, which the
    recipes try first, is checked by tests/gpu/test_triton_gpu.py), then the reference."""
    with te_kernels.kernel_paths(te=True, triton=False):
        fast = fn()
    with te_kernels.reference_only():
        ref = fn()
    return fast, ref


def check_all_paths(name: str, x: torch.Tensor, seed: int) -> None:
    recipe = RECIPES[name][0]
    x2d = x.reshape(-1, x.shape[-1])
    assert te_kernels.takes_input(x2d), "the TE fast path is not taken here (TE import or CUDA problem)"
    scale = _delayed_scale(seed) if isinstance(recipe, d.DelayedScaling) else None
    for usage in recipe.stored_usages(True, True):
        what = f"{name}/{tuple(x.shape)}/{x.dtype}/{usage}"
        fast, ref = _both(lambda: recipe.quantize_plane(x2d, usage, scale=scale))
        assert_planes_equal(fast, ref, what)
        if recipe.spans_dim(usage, 0):  # per-tensor: the amax and the cast with a reduced amax
            amax_fast, amax_ref = _both(lambda: recipe.block_amax(x2d, usage))
            assert torch.equal(_u8(amax_fast.reshape(-1)), _u8(amax_ref.reshape(-1))), f"{what}: amax"
            reduced = amax_ref * 4 + 1  # another shard's larger amax
            fast, ref = _both(lambda: recipe.quantize_plane(x2d, usage, amax=reduced))
            assert_planes_equal(fast, ref, what + "/reduced_amax")


@pytest.mark.parametrize("dtype", list(HP_DTYPES), ids=list(HP_DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", list(RECIPES))
def test_fast_path_random(name, shape, dtype):
    seed = _seed("kernels", name, shape, dtype)
    check_all_paths(name, make_input(shape, HP_DTYPES[dtype], seed), seed)


@pytest.mark.parametrize("dtype", list(HP_DTYPES), ids=list(HP_DTYPES))
@pytest.mark.parametrize("case", ["nan_inf", "nan_only", "zeros", "tiny_huge"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_fast_path_special_values(name, case, dtype):
    check_all_paths(name, special_input(case, HP_DTYPES[dtype]), _seed("kernels", name, case, dtype))


@pytest.mark.parametrize("master_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["delayed_e4m3", "current_e4m3", "block1d_e4m3", "block2d_e4m3"])
def test_requantize_from_hp_matches_reference(name, master_dtype):
    """Three optimizer-step requantizations of three weights (one batch) from changing fp32 / bf16
    masters, fast vs reference: planes (and delayed scaling's history and scale, kept in each
    weight's owner record ``param_state``) byte-identical, and the fast path writes into the
    weights' existing storage."""
    recipe = RECIPES[name][0]
    g = torch.Generator(device="cuda").manual_seed(_seed("requant", name))
    ws = [torch.randn(640, 1024, device="cuda", generator=g) * (10.0 ** i) for i in range(3)]
    fast_qs, ref_qs = [d.quantize(w, recipe) for w in ws], [d.quantize(w, recipe) for w in ws]
    ptrs = [{u: (p.data.data_ptr(), p.scale_inv.data_ptr()) for u, p in q.planes.items()} for q in fast_qs]
    for step in range(3):
        hps = [(w * (1.5 ** step) + 0.01 * step).to(master_dtype) for w in ws]
        with te_kernels.kernel_paths(te=True, triton=False):
            requantize_from_hp_([(f"w{i}", q, hp) for i, (q, hp) in enumerate(zip(fast_qs, hps))])
        with te_kernels.reference_only():
            requantize_from_hp_([(f"w{i}", q, hp) for i, (q, hp) in enumerate(zip(ref_qs, hps))])
        for i, (fast_q, ref_q) in enumerate(zip(fast_qs, ref_qs)):
            for usage in fast_q.planes:
                assert_planes_equal(fast_q.planes[usage], ref_q.planes[usage], f"{name}/w{i}/step{step}/{usage}")
            fast_state, ref_state = fast_q.param_state.scaling.weight_entries(), ref_q.param_state.scaling.weight_entries()
            # delayed scaling keeps an amax history and a scale per plane; the other recipes none
            assert bool(fast_state) == isinstance(recipe, d.DelayedScaling), (name, sorted(fast_state))
            assert fast_state.keys() == ref_state.keys(), (name, sorted(fast_state), sorted(ref_state))
            for key in fast_state:
                assert torch.equal(_u8(fast_state[key]), _u8(ref_state[key])), f"{name}/w{i}/step{step}/{key}"
        assert [{u: (p.data.data_ptr(), p.scale_inv.data_ptr()) for u, p in q.planes.items()} for q in fast_qs] == ptrs
