"""Real Transformer Engine modules on dtensor_fp8 parameters (``dtensor_fp8/te.py``), on the GPU.

Runs only where ``transformer_engine.pytorch`` imports and CUDA is visible (the H200 machine).

1. Adapter: ``to_te_tensor`` shares our FP8 bytes (data_ptr), builds TE's padded / transposed
   buffers equal to what TE's own quantizer makes, round-trips through ``from_te_tensor``; TE's
   dequantize equals ours bitwise; a te.Linear forward + backward on the TE view gives the same
   output and input gradient, bitwise, as te.Linear quantizing the same high-precision weight itself.
2. FSDP2 (1 rank over NCCL): te.Linear / LayerNormLinear / LayerNormMLP with dtensor_fp8 weights
   under ``fully_shard`` give bitwise the outputs/gradients of the same modules on unsharded TE
   views; a stack of TransformerLayers trains 20 steps with MasterWeightOptimizer, weights stay
   FP8 shards, and the loss tracks TE's own non-FSDP run with the same recipe.
MXFP8: TE's MXFP8 kernels need sm_100+; on sm_90 the conversion and the FSDP gathers run through
our recipe and the TE GEMM/dequantize checks are skipped with that reason.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    te = pytest.importorskip("transformer_engine.pytorch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: TE module tests need a GPU", allow_module_level=True)

from transformer_engine.common import recipe as te_recipe  # noqa: E402
from transformer_engine.pytorch.quantized_tensor import QuantizedTensor as TEQuantizedTensor  # noqa: E402

import dtensor_fp8 as d  # noqa: E402
from dtensor_fp8 import te as dte  # noqa: E402
from nccl_mesh import mesh  # noqa: E402, F401  (the fixture)

DEV = torch.device("cuda")
CC = torch.cuda.get_device_capability()
MX_REASON = (f"TE's MXFP8 kernels are compiled for sm_100+ only; this device is sm_{CC[0]}{CC[1]} "
             "(TE's MXFP8 quantize writes nothing and its dequantize/GEMM raise here)")
BF16 = torch.bfloat16


def _recipes():
    return {
        "delayed": (d.DelayedScaling(), lambda: te_recipe.DelayedScaling()),
        "current": (d.CurrentScaling(), lambda: te_recipe.Float8CurrentScaling()),
        "block1d": (d.Blockwise(block_dims=1), lambda: te_recipe.Float8BlockScaling(w_block_scaling_dim=1)),
        "block2d": (d.Blockwise(block_dims=2), lambda: te_recipe.Float8BlockScaling()),
        "mxfp8": (d.MXFP8(), lambda: te_recipe.MXFP8BlockScaling()),
    }


RECIPES = _recipes()
NAMES = list(RECIPES)
GEMM_NAMES = [n for n in NAMES if n != "mxfp8" or CC >= (10, 0)]


def _skip_mx(name):
    if name == "mxfp8" and CC < (10, 0):
        pytest.skip(MX_REASON)


def _u8(t):
    return t.contiguous().view(torch.uint8)


def _weight(m, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(m, k, generator=g) * 0.05
    w[::97] *= 30  # outliers in some rows
    return w.to(BF16).to(DEV)


def _valid(name, t, m, k, recipe):
    cd = lambda a, b: -(-a // b)  # noqa: E731
    if isinstance(recipe, d.Blockwise):
        reg = ({"_rowwise_scale_inv": (cd(k, 128), m), "_columnwise_scale_inv": (cd(m, 128), k)} if recipe.block_dims == 1
               else {"_rowwise_scale_inv": (cd(m, 128), cd(k, 128)), "_columnwise_scale_inv": (cd(k, 128), cd(m, 128))})
    elif isinstance(recipe, d.MXFP8):
        reg = {"_rowwise_scale_inv": (m, k // 32), "_columnwise_scale_inv": (m // 32, k)}
    else:
        reg = {}
    r = reg.get(name)
    return t if r is None else t[: r[0], : r[1]]


# ---- 1. adapter ---------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(256, 512), (384, 640), (1024, 1024)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", NAMES)
def test_to_te_tensor_zero_copy_and_round_trip(name, shape):
    recipe, _ = RECIPES[name]
    q = d.quantize(_weight(*shape), recipe)
    t = dte.to_te_tensor(q)
    assert isinstance(t, TEQuantizedTensor) and tuple(t.shape) == shape and t.dtype == BF16
    # zero copy where layouts agree
    if isinstance(recipe, (d.DelayedScaling, d.CurrentScaling)):
        assert t._data.data_ptr() == q.plane("rowwise").data.data_ptr()
        assert t._scale_inv.data_ptr() == q.plane("rowwise").scale_inv.data_ptr()
        assert t._transpose is not None and not t._transpose_invalid
    else:
        assert t._rowwise_data.data_ptr() == q.plane("rowwise").data.data_ptr()
        if isinstance(recipe, d.MXFP8):
            assert t._columnwise_data.data_ptr() == q.plane("columnwise").data.data_ptr()
    # round trip: same planes, and the rowwise bytes still shared
    back = dte.from_te_tensor(t)
    assert back.recipe == recipe and back.usages == q.usages
    for u, p in q.planes.items():
        assert torch.equal(_u8(back.planes[u].data), _u8(p.data)), u
        assert torch.equal(_u8(back.planes[u].scale_inv), _u8(p.scale_inv)), u
    assert back.plane("rowwise").data.data_ptr() == q.plane("rowwise").data.data_ptr()


@pytest.mark.parametrize("name", NAMES)
def test_te_buffers_equal_te_quantizer(name):
    """Our TE view has TE's own buffers byte for byte (valid regions of padded scales)."""
    _skip_mx(name)
    recipe, _ = RECIPES[name]
    w = _weight(384, 640, 1)
    q = d.quantize(w, recipe)
    t = dte.to_te_tensor(q)
    # Delayed scaling: TE's quantizer with our tensor's (seeded) scale; the others ignore it.
    quantizer = dte.te_quantizer(recipe, device=DEV, scale_inv=q.plane("rowwise").scale_inv)
    with torch.no_grad():
        ref = quantizer(w)
    if hasattr(ref, "_transpose_invalid") and (ref._transpose is None or ref._transpose_invalid):
        ref._create_transpose()
    assert type(t).__name__ == recipe.te_binding.tensor_class
    for n in recipe.te_binding.names:
        a, b = getattr(t, n), getattr(ref, n)
        assert (a is None) == (b is None), n
        if a is None:
            continue
        assert tuple(a.shape) == tuple(b.shape), (n, a.shape, b.shape)
        assert torch.equal(_u8(_valid(n, a, 384, 640, recipe)), _u8(_valid(n, b, 384, 640, recipe))), n
    # TE -> ours: a TE-made tensor converts to exactly our quantization
    q_te = dte.from_te_tensor(ref)
    q = d.quantize(w, recipe)
    for u, p in q.planes.items():
        assert torch.equal(_u8(q_te.planes[u].data), _u8(p.data)), u
        assert torch.equal(_u8(q_te.planes[u].scale_inv), _u8(p.scale_inv)), u


@pytest.mark.parametrize("name", NAMES)
def test_te_dequantize_equals_ours(name):
    _skip_mx(name)
    recipe, _ = RECIPES[name]
    q = d.quantize(_weight(256, 512, 2), recipe)
    t = dte.to_te_tensor(q)
    with torch.no_grad():
        got = t.dequantize(dtype=torch.float32)
    assert torch.equal(got.view(torch.int32), q.dequantize(torch.float32).view(torch.int32))
    if not isinstance(recipe, d.MXFP8):  # columnwise-only view (what a backward gather makes)
        tc = dte.to_te_tensor(q, usages=("columnwise",))
        with torch.no_grad():
            got_c = tc.dequantize(dtype=torch.float32)
        assert torch.equal(got_c.view(torch.int32), q.columnwise_matrix(torch.float32).view(torch.int32))


def test_recipe_tables_agree_with_te():
    """Each recipe's declared TE binding names TE's real classes, its te_recipe_for is this file's
    TE recipe, and a tensor made by TE's quantizer reads back as the same recipe."""
    from dtensor_fp8.formats import te_import

    te_ns = te_import.load()
    for name, (recipe, make_recipe) in RECIPES.items():
        b = recipe.te_binding
        for cls in (b.tensor_class, b.storage_class, b.quantizer_class):
            assert getattr(te_ns, cls).__name__ == cls, (name, cls)
        ours, theirs = dte.te_recipe_for(recipe), make_recipe()
        assert type(ours) is type(theirs), (name, ours, theirs)
        if hasattr(theirs, "w_block_scaling_dim"):
            assert ours.w_block_scaling_dim == theirs.w_block_scaling_dim, name
        quantizer = dte.te_quantizer(recipe, device=DEV)
        if name == "mxfp8" and CC < (10, 0):
            t = quantizer.make_empty((256, 512), dtype=BF16, device=DEV)  # allocation only (no kernel here)
        else:
            with torch.no_grad():
                t = quantizer(_weight(256, 512, 4))
        assert dte.recipe_from_te(t) == recipe, (name, dte.recipe_from_te(t))


@pytest.mark.parametrize("name", NAMES)
def test_shard_view_follows_the_shard(name):
    """The one-rank FSDP hook (TEUnshardedView.from_shard): the TE tensor views the shard's own
    bytes (no copy) where the binding says it can, is re-pointed per direction, sees an in-place
    rewrite of the shard, and follows planes replaced by new tensors."""
    recipe, _ = RECIPES[name]
    view = dte.FSDP_TE_VIEW
    q = d.quantize(_weight(256, 512, 5), recipe)
    if name == "block1d":  # TE stores 1x128 rowwise scales transposed: a copy, so FSDP gathers (copies) them
        assert not view.views_shard(q)
        return
    assert view.views_shard(q), f"{name}: a (256, 512) weight needs no padded rowwise scale"
    t, inner = view.from_shard(q, ("rowwise",), BF16, None)
    assert inner == ()
    row_name = recipe.te_binding.buffers[0].name  # _data / _rowwise_data
    assert getattr(t, row_name).data_ptr() == q.plane("rowwise").data.data_ptr()
    for usages in [("columnwise",), ("rowwise",), ("rowwise", "columnwise")]:
        assert view.from_shard(q, usages, BF16, t) is None
        expected = dte.te_buffers(q, usages)
        for n, want in expected.items():
            got = getattr(t, n)
            assert (got is None) == (want is None), (usages, n)
            if want is not None:
                assert torch.equal(_u8(_valid(n, got, 256, 512, recipe)), _u8(_valid(n, want, 256, 512, recipe))), (usages, n)
        assert t._quantizer.rowwise_usage == ("rowwise" in usages) and t._quantizer.columnwise_usage == ("columnwise" in usages)
    # an optimizer step rewrites the shard in place: the TE tensor's rowwise bytes are the shard's
    fresh = d.quantize(_weight(256, 512, 6), recipe)
    for u, p in q.planes.items():
        p.data.copy_(fresh.planes[u].data)
        p.scale_inv.copy_(fresh.planes[u].scale_inv)
    view.from_shard(q, ("rowwise",), BF16, t)
    assert torch.equal(_u8(getattr(t, row_name)), _u8(fresh.plane("rowwise").data).reshape(getattr(t, row_name).shape))
    # planes replaced by other tensors (a checkpoint load): the next gather views the new ones
    q.repoint_(fresh.planes, fresh.usages)
    view.from_shard(q, ("rowwise",), BF16, t)
    assert getattr(t, row_name).data_ptr() == fresh.plane("rowwise").data.data_ptr()


def _run_linear(lin, x, dy, make_recipe):
    x = x.clone().requires_grad_(True)
    with te.autocast(enabled=True, recipe=make_recipe()):
        y = lin(x)
    y.backward(dy)
    return y.detach(), x.grad.detach()


@pytest.mark.parametrize("name", GEMM_NAMES)
def test_te_linear_gemm_on_view_equals_te(name):
    """te.Linear fprop + dgrad on our TE view == te.Linear quantizing the same bf16 weight."""
    recipe, make_recipe = RECIPES[name]
    m, k, tokens = 512, 1024, 256
    w = _weight(m, k, 3)
    x = torch.randn(tokens, k, device=DEV, dtype=BF16)
    dy = torch.randn(tokens, m, device=DEV, dtype=BF16)
    ref = te.Linear(k, m, bias=False, params_dtype=BF16, device=DEV)
    with torch.no_grad():
        ref.weight.copy_(w)
    y_ref, dx_ref = _run_linear(ref, x, dy, make_recipe)
    ours = te.Linear(k, m, bias=False, params_dtype=BF16, device=DEV)
    # te.Linear quantizes its bf16 weight at TE's initial delayed scale, 1: ours must use the same.
    kw = {"scale": 1.0} if isinstance(recipe, d.DelayedScaling) else {}
    ours.weight = nn.Parameter(dte.to_te_tensor(d.quantize(w, recipe, **kw)), requires_grad=True)
    y, dx = _run_linear(ours, x, dy, make_recipe)
    assert torch.equal(y.view(torch.int16), y_ref.view(torch.int16)), f"fprop differs: max {((y - y_ref).abs().max())}"
    assert torch.equal(dx.view(torch.int16), dx_ref.view(torch.int16)), f"dgrad differs: max {((dx - dx_ref).abs().max())}"


# ---- 2. FSDP2 -------------------------------------------------------------------------------------


def _make_module(kind, seed=0):
    torch.manual_seed(seed)
    h, f = 1024, 2048
    if kind == "Linear":
        return te.Linear(h, f, bias=True, params_dtype=BF16, device=DEV)
    if kind == "LayerNormLinear":
        return te.LayerNormLinear(h, f, bias=True, params_dtype=BF16, device=DEV)
    if kind == "LayerNormMLP":
        return te.LayerNormMLP(h, f, bias=True, params_dtype=BF16, device=DEV)
    raise KeyError(kind)


def _te_view_module(module, recipe):
    """Non-FSDP reference: every 2-D weight replaced by a TE view of our quantization."""
    ref = copy.deepcopy(module)
    for sub in ref.modules():
        for pname, p in list(sub.named_parameters(recurse=False)):
            if p.dim() == 2:
                setattr(sub, pname, nn.Parameter(dte.to_te_tensor(d.quantize(p.detach(), recipe)), requires_grad=True))
    return ref


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
@pytest.mark.parametrize("name", GEMM_NAMES)
def test_te_module_under_fully_shard(mesh, name, kind, reshard):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    recipe, make_recipe = RECIPES[name]
    module = _make_module(kind)
    ref = _te_view_module(module, recipe)
    dte.quantize_te_module_(module, recipe)
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
    seen = []
    module.register_forward_pre_hook(lambda m, a: seen.extend(
        type(p).__name__ for p in m.parameters(recurse=False) if p.dim() == 2))
    x = torch.randn(2, 256, 1024, device=DEV, dtype=BF16)
    dy_shape = (2, 256, 1024 if kind == "LayerNormMLP" else 2048)
    dy = torch.randn(dy_shape, device=DEV, dtype=BF16)
    y, dx = _run_linear(module, x, dy, make_recipe)
    y_ref, dx_ref = _run_linear(ref, x, dy, make_recipe)
    assert seen and all(s in ("Float8Tensor", "Float8BlockwiseQTensor", "MXFP8Tensor") for s in seen), seen
    assert torch.equal(y.view(torch.int16), y_ref.view(torch.int16)), f"fprop max diff {(y - y_ref).abs().max()}"
    assert torch.equal(dx.view(torch.int16), dx_ref.view(torch.int16)), f"dgrad max diff {(dx - dx_ref).abs().max()}"
    ref_params = dict(ref.named_parameters())
    for pname, p in module.named_parameters():
        assert isinstance(p, DTensor)
        if p.dim() == 2:
            assert isinstance(p.to_local(), d.QuantizedTensor), pname  # sharded FP8 parameter kept
            g, g_ref = p.grad.to_local(), ref_params[pname].grad
            torch.testing.assert_close(g.float(), g_ref.float(), rtol=0, atol=0, msg=f"wgrad {pname}")


def test_mxfp8_gathers_through_reference(mesh):
    """MXFP8 weights of a TE module under fully_shard: the gathered unsharded parameter is an
    MXFP8Tensor over our recipe's bytes (TE's MXFP8 GEMM is not run on sm_90, see MX_REASON)."""
    from torch.distributed.fsdp import fully_shard

    module = _make_module("LayerNormMLP")
    full = {n: d.quantize(p.detach(), d.MXFP8()) for n, p in module.named_parameters() if p.dim() == 2}
    dte.quantize_te_module_(module, d.MXFP8())
    fully_shard(module, mesh=mesh, reshard_after_forward=False)  # one gather carries both planes
    module.unshard()
    for n, p in module.named_parameters():
        if p.dim() != 2:
            continue
        assert type(p).__name__ == "MXFP8Tensor", type(p)
        for u in ("rowwise", "columnwise"):
            assert torch.equal(getattr(p, f"_{u}_data"), _u8(full[n].plane(u).data)), (n, u)
            back = dte.from_te_tensor(p)
            assert torch.equal(_u8(back.plane(u).scale_inv), _u8(full[n].plane(u).scale_inv)), (n, u)
    module.reshard()
    if CC < (10, 0):
        pytest.skip("gathers checked; " + MX_REASON)


# ---- TransformerLayer stack, 20 steps ------------------------------------------------------------
HIDDEN, FFN, HEADS, SEQ, BATCH, LAYERS, STEPS, LR = 1024, 4096, 16, 512, 2, 2, 20, 2e-4
#: |loss_ours - loss_te| / loss_te at every step. Both runs start from the same TE FP8 params
#: (te.quantized_model_init) and FP32 masters from TE's preserved init values; both requantize
#: from the FP32 masters after each Adam step (TE: ``param.copy_(master)``, ours: our recipe, bit-exact
#: with TE's quantizer). Current and 2-D blockwise scales are a function of the master, so the
#: runs differ only by nondeterministic kernels; delayed scaling differs in when the scale
#: follows the amax (TE: at the next autocast from fp8_meta; ours: at the requantization).
LOSS_RTOL = 2e-2


def _stack(make_recipe, seed=0):
    torch.manual_seed(seed)
    with te.quantized_model_init(enabled=True, recipe=make_recipe(), preserve_high_precision_init_val=True):
        layers = [te.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                                      fuse_qkv_params=True, params_dtype=BF16, device=DEV,
                                      self_attn_mask_type="causal", layer_number=i + 1) for i in range(LAYERS)]
    return nn.Sequential(*layers)


def _data():
    g = torch.Generator(device=DEV).manual_seed(7)
    x = torch.randn(SEQ, BATCH, HIDDEN, device=DEV, dtype=BF16, generator=g)
    target = torch.randn(SEQ, BATCH, HIDDEN, device=DEV, dtype=BF16, generator=g)
    return x, target


def _loss(model, x, target, make_recipe):
    with te.autocast(enabled=True, recipe=make_recipe()):
        out = model(x)
    return torch.nn.functional.mse_loss(out.float(), target.float())


def _te_reference_losses(make_recipe):
    """TE's own FP8-parameter run without FSDP: quantized_model_init params, FP32 masters from
    get_high_precision_init_val(), Adam on the masters, ``param.copy_(master)`` (TE quantizes)."""
    model = _stack(make_recipe)
    x, target = _data()
    w8 = [p for p in model.parameters() if isinstance(p, TEQuantizedTensor)]
    masters = [nn.Parameter(p.get_high_precision_init_val().to(DEV).float().clone()) for p in w8]
    others = [p for p in model.parameters() if not isinstance(p, TEQuantizedTensor)]
    opt = torch.optim.Adam(masters + others, lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = _loss(model, x, target, make_recipe)
        loss.backward()
        for p, m in zip(w8, masters):
            m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for p, m in zip(w8, masters):
                p.copy_(m)
        opt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", ["delayed", "current", "block2d"])
def test_transformer_layers_train_under_fully_shard(mesh, name, record_property):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    recipe, make_recipe = RECIPES[name]
    model = _stack(make_recipe)
    te_params = {n: p for n, p in model.named_parameters() if isinstance(p, TEQuantizedTensor)}
    te_bytes = {n: dte.from_te_tensor(p) for n, p in te_params.items()}
    dte.quantize_te_module_(model, recipe)  # TE FP8 params -> ours (bytes kept, masters from TE's init vals)
    for n, q in te_bytes.items():
        ours = dict(model.named_parameters())[n]
        assert ours.recipe == recipe, (n, ours.recipe)
        assert torch.equal(_u8(ours.plane("rowwise").data), _u8(q.plane("rowwise").data)), n
    n_fp8 = sum(isinstance(p, d.QuantizedTensor) for p in model.parameters())
    assert n_fp8 == 4 * LAYERS  # qkv, proj, fc1, fc2
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = d.MasterWeightOptimizer(model, torch.optim.Adam, lr=LR)
    x, target = _data()
    losses = []
    for _ in range(STEPS):
        loss = _loss(model, x, target, make_recipe)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    for pname, p in model.named_parameters():
        assert isinstance(p, DTensor), pname
        if p.dim() == 2:
            local = p.to_local()
            assert isinstance(local, d.QuantizedTensor), pname
            assert all(pl.data.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for pl in local.planes.values())
    ref = _te_reference_losses(make_recipe)
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, ref)]
    line = f"{name}: ours {['%.5f' % v for v in losses]}\n{name}: te   {['%.5f' % v for v in ref]}\nmax rel {max(rel):.3e}"
    print(line)
    record_property("losses", line)
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0], "loss did not decrease"
    assert max(rel) < LOSS_RTOL, line


@pytest.mark.parametrize("name", [n for n in NAMES if n in ("delayed", "current", "block2d", "mxfp8")])
def test_te_module_dcp_round_trip(mesh, name, tmp_path):
    """FP8 weights of a sharded TE module save as plain planes through DCP and load back exactly
    into a freshly built module (the TE module's own extra state travels alongside)."""
    from torch.distributed.fsdp import fully_shard

    recipe, _ = RECIPES[name]
    module = _make_module("LayerNormMLP", seed=0)
    dte.quantize_te_module_(module, recipe)
    fully_shard(module, mesh=mesh)
    saved = {k: v for k, v in module.state_dict().items()}
    assert isinstance(saved["fc1_weight"], dict) and saved["fc1_weight"]["rowwise_data"].dtype == torch.uint8
    d.save_checkpoint({"model": module.state_dict()}, str(tmp_path), 1)
    fresh = _make_module("LayerNormMLP", seed=1)  # other values
    dte.quantize_te_module_(fresh, recipe)
    fully_shard(fresh, mesh=mesh)
    state = {"model": fresh.state_dict()}
    d.load_checkpoint(state, d.latest_checkpoint(str(tmp_path)))
    fresh.load_state_dict(state["model"])
    for pname, p in module.named_parameters():
        q, q2 = p.to_local(), dict(fresh.named_parameters())[pname].to_local()
        if isinstance(q, d.QuantizedTensor):
            for usage, plane in q.planes.items():
                assert torch.equal(_u8(plane.data), _u8(q2.planes[usage].data)), (pname, usage)
                assert torch.equal(_u8(plane.scale_inv), _u8(q2.planes[usage].scale_inv)), (pname, usage)
        else:
            assert torch.equal(q, q2), pname
