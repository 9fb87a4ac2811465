"""FP8 GEMMs of ``F.linear`` with dtensor_fp8 weights on the GPU (dtensor_fp8/gemm.py).

1. Operands: every FP8 GEMM's operands are byte-equal to what the recipes' reference gives for
   the same activations / gradients (the kernels used on the way are Triton's or TE's), the weight
   operands are the weight's own planes (fprop: the rowwise plane's storage; dgrad: the transpose
   cache or the columnwise plane, transposed), and each output equals the fp32 product of the
   dequantized operands up to the output's rounding (a scale read from the wrong block would not).
2. TE: outputs and gradients agree with ``te.Linear`` on the same weights and recipe, to TE's own
   tolerance for FP8 GEMMs (TE tests/pytorch/utils.py ``quantization_tols``: rtol 0.125,
   atol 0.0675, used by tests/pytorch/test_fusible_ops.py ``_test_basic_linear``), relative to
   each tensor's largest magnitude.
3. Training: 20 steps of a two-layer MLP, ours (FP32 masters, MasterWeightOptimizer) against
   te.Linear with FP32 parameters (TE quantizes them every forward: the same as requantizing
   from an FP32 master), same data and SGD: the losses agree to 2 % at every step and the final
   weights to 2 % (relative Frobenius norm).
4. MXFP8 before sm_100: the emulated linear runs and says so once, with the reason.
5. A piece of a weight starting inside its blocks (a tensor-parallel shard): padded operands.

Needs CUDA; TE for 2 and 3 (skipped without it).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: FP8 GEMM tests need a GPU", allow_module_level=True)

from conftest import assert_bytes_equal  # noqa: E402

import dtensor_fp8 as d  # noqa: E402
from dtensor_fp8 import gemm  # noqa: E402
from dtensor_fp8.formats import te_kernels  # noqa: E402

CC = torch.cuda.get_device_capability()
DEV = torch.device("cuda")
RECIPES = {"delayed": d.DelayedScaling(), "current": d.CurrentScaling(), "block2d": d.Blockwise(block_dims=2),
           "block1d": d.Blockwise(block_dims=1), "mxfp8": d.MXFP8()}
T, M, K = 512, 384, 768  # tokens, out_features, in_features: multiples of 128
#: How eager CUDA ``scaled_mm`` refuses a block scale with the wrong strides: ``TORCH_CHECK_VALUE``
#: in ScaledBlas.cpp, a ValueError (torch 2.11 on an H200, issue 41), whose message names scale_a's
#: strides ("scale_a must have strides (1, ...)" against a 128x128 B, "scale_a strides must be
#: (1, M)" against a 1x128 B); RuntimeError where a torch checks it with a plain ``TORCH_CHECK``.
SCALE_STRIDE_REFUSAL = (ValueError, RuntimeError)
SCALE_A_STRIDES = r"scale_a (must have strides|strides must be)"


def _te():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import transformer_engine.pytorch as te
            from transformer_engine.common import recipe as te_recipe
        except Exception as e:  # noqa: BLE001
            pytest.skip(f"Transformer Engine does not import: {e}")
    return te, te_recipe


def _te_recipe(name):
    _, r = _te()
    return {"delayed": lambda: r.DelayedScaling(), "current": lambda: r.Float8CurrentScaling(),
            "block2d": lambda: r.Float8BlockScaling(), "block1d": lambda: r.Float8BlockScaling(w_block_scaling_dim=1),
            "mxfp8": lambda: r.MXFP8BlockScaling()}[name]()


def _inputs(seed, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    # Rows of very different magnitudes: block scales differ, so a scale read from the wrong block shows.
    w = torch.randn(M, K, device="cuda", generator=g) * torch.logspace(-2, 1, M, device="cuda")[:, None]
    x = torch.randn(T, K, device="cuda", generator=g) * torch.logspace(-1, 1, K, device="cuda")
    dy = torch.randn(T, M, device="cuda", generator=g) * 1e-2
    return w.to(dtype), x.to(dtype), dy.to(dtype)


def _fp8_gemms_here(name):
    # Asked in the mode the tests run their GEMMs in: conftest turns FP8 GEMMs off by default, and
    # asking outside fp8_gemms("auto") skipped every test here with that reason.
    with gemm.fp8_gemms("auto"):
        reason = gemm.unsupported_reason(torch.empty(T, K, device="cuda", dtype=torch.bfloat16),
                                         d.quantize(torch.zeros(M, K, device="cuda"), RECIPES[name]))
    if reason is not None:
        pytest.skip(f"{name}: no FP8 GEMMs on this device: {reason}")


def _dequant(op: gemm.Operand) -> torch.Tensor:
    """fp32 values of a GEMM operand from its bytes and block scales (any block shape)."""
    data = op.data.float()
    s = op.scale_inv.float()
    rows, k = data.shape
    br = rows if op.block.rows is None else op.block.rows
    bk = k if op.block.cols is None else op.block.cols
    return data * s.repeat_interleave(br, 0)[:rows].repeat_interleave(bk, 1)[:, :k]


@pytest.mark.parametrize("name", list(RECIPES))
def test_operands_are_the_recipes_bytes_and_outputs_their_product(name):
    _fp8_gemms_here(name)
    recipe = RECIPES[name]
    w, x, dy = _inputs(0)
    q = d.quantize(w, recipe).requires_grad_(True)
    xg = x.clone().requires_grad_(True)
    with gemm.fp8_gemms("auto"), gemm.recording() as log:
        y = F.linear(xg, q)
        y.backward(dy)
    assert [e["gemm"] for e in log] == ["fprop", "dgrad", "wgrad"]
    ops = {e["gemm"]: e for e in log}
    g = recipe.gemm_recipe()
    with te_kernels.reference_only():
        xq, _ = g.input.quantize_operand(x, rowwise=True, columnwise=True, state=g.input.operand_state(DEV))
        dyq, _ = g.grad.quantize_operand(dy, rowwise=True, columnwise=True, state=g.grad.operand_state(DEV))

    def same(op_side, plane, contract_dim, what):
        data = plane.data if contract_dim == 1 else plane.data.t()
        scale = plane.scale_inv if contract_dim == 1 else plane.scale_inv.t()
        assert_bytes_equal(op_side.data, data.contiguous(), f"{name}/{what}/data")
        assert_bytes_equal(op_side.scale_inv.contiguous(), scale.contiguous(), f"{name}/{what}/scale_inv")

    same(ops["fprop"]["a"], xq["rowwise"], 1, "fprop.a")
    same(ops["dgrad"]["a"], dyq["rowwise"], 1, "dgrad.a")
    same(ops["wgrad"]["a"], dyq["columnwise"], 0, "wgrad.a")
    same(ops["wgrad"]["b"], xq["columnwise"], 0, "wgrad.b")
    wrow = q.plane("rowwise")
    assert ops["fprop"]["b"].data.data_ptr() == wrow.data.data_ptr(), "fprop must read the weight's plane as stored"
    same(ops["dgrad"]["b"], q.plane("columnwise"), 0, "dgrad.b")
    assert q.transpose_cache is None
    # Outputs: the fp32 product of the dequantized operands, up to the output's bf16 rounding and
    # the accumulation (fast accumulation in fprop for per-tensor recipes, as TE).
    for gm, got in (("fprop", y), ("dgrad", xg.grad), ("wgrad", q.grad)):
        e = ops[gm]
        ref = _dequant(e["a"]) @ _dequant(e["b"]).t()
        err = ((got.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, f"{name}/{gm}: relative error {err:.2e} against the dequantized operands' product"


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_agrees_with_te_linear(name, bias):
    """Same weights, same recipe: ours vs te.Linear (TE quantizes the same high-precision weight
    itself, to our bytes: tests/test_formats_golden.py)."""
    _fp8_gemms_here(name)
    te, _ = _te()
    recipe = RECIPES[name]
    w, x, dy = _inputs(1)
    b = torch.randn(M, device="cuda", dtype=torch.bfloat16) if bias else None
    layer = te.Linear(K, M, bias=bias, params_dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        layer.weight.copy_(w)
        if bias:
            layer.bias.copy_(b)
    xt = x.clone().requires_grad_(True)
    with te.autocast(enabled=True, recipe=_te_recipe(name)):
        yt = layer(xt)
    yt.backward(dy)
    # TE's first delayed-scaling cast of a weight uses scale 1; ours seeds it from the weight's amax
    # (quantize_module_'s rule): give TE's scale so both GEMMs read the same weight bytes.
    q = d.quantize(w, recipe, **({"scale": 1.0} if name == "delayed" else {})).requires_grad_(True)
    bo = b.clone().requires_grad_(True) if bias else None
    xo = x.clone().requires_grad_(True)
    with gemm.fp8_gemms("auto"), gemm.recording() as log:
        yo = F.linear(xo, q, bo)
        yo.backward(dy)
    assert len(log) == 3
    pairs = [("y", yo, yt), ("dx", xo.grad, xt.grad), ("dw", q.grad, layer.weight.grad)]
    if bias:
        pairs.append(("db", bo.grad, layer.bias.grad))
    for what, ours, theirs in pairs:
        s = theirs.float().abs().max()
        rel = ((ours.float() - theirs.float()).norm() / theirs.float().norm()).item()
        print(f"{name}/{what}: relative difference to te.Linear {rel:.2e}")
        torch.testing.assert_close(ours.float() / s, theirs.float() / s, rtol=0.125, atol=0.0675,
                                   msg=f"{name}/{what}: rel. Frobenius diff {rel:.2e}")


def _mlp_data(steps, tokens=256, dim=256, seed=5):
    """Batches of a learnable task: targets are one fixed linear map of the inputs (random targets
    would leave nothing to learn, and a loss that cannot fall)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    mapping = torch.randn(dim, dim, device="cuda", generator=g) / dim ** 0.5
    xs = [torch.randn(tokens, dim, device="cuda", generator=g) for _ in range(steps)]
    return [(x, x @ mapping) for x in xs]


@pytest.mark.parametrize("name", ["delayed", "current", "block2d", "block1d"])
def test_twenty_training_steps_match_te(name):
    _fp8_gemms_here(name)
    te, _ = _te()
    dim, hidden, steps, lr = 256, 1024, 20, 0.1
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(dim, hidden, bias=False), nn.GELU(), nn.Linear(hidden, dim, bias=False)).cuda()
    # TE: FP32 parameters, quantized by TE at every forward (the weight's "master" is the parameter).
    tel = [te.Linear(dim, hidden, bias=False, params_dtype=torch.float32, device="cuda"),
           te.Linear(hidden, dim, bias=False, params_dtype=torch.float32, device="cuda")]
    with torch.no_grad():
        tel[0].weight.copy_(ref[0].weight)
        tel[1].weight.copy_(ref[2].weight)
    te_model = nn.Sequential(tel[0], nn.GELU(), tel[1])
    te_opt = torch.optim.SGD(te_model.parameters(), lr=lr)
    ours = d.quantize_module_(ref, RECIPES[name])
    opt = d.MasterWeightOptimizer(ours, torch.optim.SGD, lr=lr)
    te_losses, losses = [], []
    recipe_te = _te_recipe(name)
    with gemm.fp8_gemms("auto"), gemm.recording() as log:
        for x, target in _mlp_data(steps, dim=dim):
            with te.autocast(enabled=True, recipe=recipe_te):
                out = te_model(x)
            loss = (out - target).pow(2).mean()
            loss.backward()
            te_opt.step()
            te_opt.zero_grad()
            te_losses.append(loss.item())
            loss = (ours(x) - target).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    # Every GEMM of our model is an FP8 GEMM: forward and weight gradient of both layers, input
    # gradient of the second only (the model's input needs no gradient, so autograd skips the first).
    kinds = [entry["gemm"] for entry in log]
    assert (kinds.count("fprop"), kinds.count("dgrad"), kinds.count("wgrad"), len(kinds)) == (2 * steps, steps, 2 * steps, 5 * steps)
    print(f"{name}: losses ours {losses[0]:.5f} -> {losses[-1]:.5f}, TE {te_losses[0]:.5f} -> {te_losses[-1]:.5f}")
    assert losses[-1] < losses[0], losses
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(te_losses), rtol=0.02, atol=0)
    masters = [opt.masters["0.weight"], opt.masters["2.weight"]]
    for m, t in zip(masters, (tel[0].weight, tel[1].weight)):
        rel = ((m.float() - t.float()).norm() / t.float().norm()).item()
        print(f"{name}: final weight relative difference {rel:.2e}")
        assert rel < 0.02, rel


def test_mxfp8_before_sm100_warns_once_and_runs_emulated():
    if CC >= (10, 0):
        pytest.skip("sm_100+: MXFP8 runs FP8 GEMMs (test_operands_... covers it)")
    gemm._warned.clear()
    w, x, dy = _inputs(3)
    q = d.quantize(w, d.MXFP8())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with gemm.fp8_gemms("auto"), gemm.recording() as log:
            y = F.linear(x, q)
            F.linear(x, q)
    msgs = [str(s.message) for s in seen if "dtensor_fp8" in str(s.message)]
    assert len(msgs) == 1 and "sm_100" in msgs[0] and "emulated linear" in msgs[0], msgs
    assert log == []
    with gemm.fp8_gemms("off"):
        assert torch.equal(y, F.linear(x, q))


@pytest.mark.parametrize("name", ["block2d", "block1d"])
def test_row_major_1x128_scale_is_refused_in_eager(name):
    """torch checks block scales' strides in eager (from torch 2.14 its meta kernel checks shapes
    only, tests/test_gemm.py): the fprop operands as gemm.py lays them out (SCALE_LAYOUTS) run, and
    the same 1x128 activation scale in the recipe's own row-major layout is refused."""
    from dtensor_fp8.formats.scaled_mm import SCALE_LAYOUTS

    _fp8_gemms_here(name)
    recipe = RECIPES[name]
    w, x, _ = _inputs(4)
    q = d.quantize(w, recipe)
    g = recipe.gemm_recipe()
    xq, _ = g.input.quantize_operand(x, rowwise=True, columnwise=True, state=g.input.operand_state(DEV))
    a = gemm.operand(xq["rowwise"], g.input.block_shape("rowwise"), 1)
    b = gemm.operand(q.plane("rowwise"), recipe.block_shape("rowwise"), 1)
    la, lb = SCALE_LAYOUTS[a.block], SCALE_LAYOUTS[b.block]
    assert la.kind == "BlockWise1x128"
    sa, sb = la.scale(a.scale_inv, *a.data.shape, operand="a"), lb.scale(b.scale_inv, *b.data.shape, operand="b")
    S = F.ScalingType
    out = F.scaled_mm(a.data, b.data.t(), sa, S.BlockWise1x128, sb, getattr(S, lb.kind), output_dtype=torch.bfloat16)
    assert out.shape == (T, M)
    row_major = a.scale_inv.contiguous()
    assert row_major.shape == sa.shape and row_major.stride() != sa.stride()
    with pytest.raises(SCALE_STRIDE_REFUSAL, match=SCALE_A_STRIDES):
        F.scaled_mm(a.data, b.data.t(), row_major, S.BlockWise1x128, sb, getattr(S, lb.kind),
                    output_dtype=torch.bfloat16)


@pytest.mark.parametrize("name", ["block2d", "block1d", "mxfp8"])
def test_a_piece_starting_inside_blocks_runs_fp8_gemms_on_padded_operands(name):
    """A tensor-parallel piece of a weight that starts 64 rows (ColwiseParallel) or 64 columns
    (RowwiseParallel) into its blocks (16 for MXFP8's 32), run with ``F.linear`` on the piece itself
    (gemm.py's note on shards that start inside blocks): the weight operands are its FP8 bytes behind
    zero bytes up to the block boundary of every plane (``Recipe.gemm_front``: 1x128's rowwise plane
    is padded with whole rows too, so the GEMM's dims stay multiples of 128), the activation / gradient operands are the
    recipes' bytes of the input padded with zeros, and every output is the product of those
    operands with the padding's rows / columns cut off; the forward agrees with the emulated linear
    on the piece to the FP8 activations' rounding."""
    _fp8_gemms_here(name)
    from dtensor_fp8.ops.slicing import slice_quantized

    recipe = RECIPES[name]
    w, x, dy = _inputs(5)
    q = d.quantize(w, recipe)
    offset = 16 if name == "mxfp8" else 64
    for dim, start in ((0, offset), (1, offset)):
        piece = slice_quantized(q, dim, start, q.shape[dim]).requires_grad_(True)
        assert piece.phase[dim] == start
        xp = (x if dim == 0 else x[:, start:]).clone().requires_grad_(True)  # a leaf of its own each time
        dyp = (dy[:, start:] if dim == 0 else dy).contiguous()
        with gemm.fp8_gemms("auto"), gemm.recording() as log:
            y = F.linear(xp, piece)
            y.backward(dyp)
        assert [e["gemm"] for e in log] == ["fprop", "dgrad", "wgrad"], \
            f"{name} (dim {dim}): not the FP8 GEMMs: {[e['gemm'] for e in log]}"
        assert piece.grad is not None, f"{name} (dim {dim}): no weight gradient on the piece (leaf {piece.is_leaf})"
        ops = {e["gemm"]: e for e in log}
        # 1x128 / MXFP8: one plane's blocks are split (rowwise along K, columnwise along M), the other's not;
        # every GEMM pads to the largest front (gemm_front), so its dims stay multiples of 128
        assert any(any(recipe.usage_phase(u, piece.phase)) for u in ("rowwise", "columnwise"))
        front = recipe.gemm_front(piece.phase)
        assert front[dim] == start, front
        for gm, usage in (("fprop", "rowwise"), ("dgrad", "columnwise")):
            b = ops[gm]["b"].data.view(torch.uint8)
            stored = piece.plane(usage).data.view(torch.uint8)
            # the operand contracts dim 1 of its (rows, k) bytes: the plane, or its transpose for dgrad
            padded = b if gm == "fprop" else b.t()
            assert_bytes_equal(padded[front[0]:, front[1]:], stored, f"{name}/{gm}: the piece's bytes")
            assert not padded[: front[0]].any() and not padded[:, : front[1]].any(), f"{name}/{gm}: zero padding"
        cuts = {"fprop": (0, front[0]), "dgrad": (0, front[1]), "wgrad": (0, 0)}
        for gm, got in (("fprop", y), ("dgrad", xp.grad), ("wgrad", piece.grad)):
            e = ops[gm]
            ref = (_dequant(e["a"]) @ _dequant(e["b"]).t())[:, cuts[gm][1]:]
            assert ref.shape == got.shape, (gm, ref.shape, got.shape)
            err = ((got.float() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, f"{name}/{gm} (dim {dim}): relative error {err:.2e} against the padded operands' product"
        with gemm.fp8_gemms("off"):
            emulated = F.linear(xp.detach(), piece.detach()).float()
        err = ((y.detach().float() - emulated).norm() / emulated.norm()).item()
        assert err < 5e-2, f"{name} (dim {dim}): FP8 forward off the emulated one by {err:.2e}"
