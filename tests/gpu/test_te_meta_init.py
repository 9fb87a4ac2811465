"""TE modules built on the meta device, converted to dtensor_fp8 parameters, sharded and
initialized by TE's own ``reset_parameters()`` on each rank's shards (the torchtitan / Megatron-FSDP
flow), with and without TE's ``quantized_model_init(preserve_high_precision_init_val=True)``.

Runs only where ``transformer_engine.pytorch`` imports and CUDA is visible (the H200 machine).
What it checks: the FP8 bytes after the optimizer's ``finish_init_`` are what quantizing the
initialized high-precision values gives, the masters are those values, and a few training steps
under TE's autocast lower the loss.
"""

from __future__ import annotations

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

import dtensor_fp8 as d  # noqa: E402
from dtensor_fp8 import te as dte  # noqa: E402
from nccl_mesh import mesh  # noqa: E402, F401  (the fixture)

DEV = torch.device("cuda")
BF16 = torch.bfloat16
HIDDEN, FFN, HEADS, LAYERS, SEQ, BATCH = 256, 1024, 4, 2, 128, 2
RECIPES = {
    "delayed": (d.DelayedScaling(), te_recipe.DelayedScaling),
    "current": (d.CurrentScaling(), te_recipe.Float8CurrentScaling),
    "block2d": (d.Blockwise(block_dims=2), te_recipe.Float8BlockScaling),
}




def _meta_stack(make_recipe, te_fp8_init: bool):
    layers = []
    with torch.device("meta"):
        for i in range(LAYERS):
            kwargs = dict(hidden_dropout=0.0, attention_dropout=0.0, fuse_qkv_params=True, params_dtype=BF16,
                          self_attn_mask_type="causal", layer_number=i + 1, device="meta")
            if te_fp8_init:
                with te.quantized_model_init(enabled=True, recipe=make_recipe(), preserve_high_precision_init_val=True):
                    layers.append(te.TransformerLayer(HIDDEN, FFN, HEADS, **kwargs))
            else:
                layers.append(te.TransformerLayer(HIDDEN, FFN, HEADS, **kwargs))
    return nn.Sequential(*layers)


@pytest.mark.parametrize("te_fp8_init", [False, True], ids=["plain", "quantized_model_init"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_te_layers_built_on_meta_init_their_shards(mesh, name, te_fp8_init):
    from torch.distributed.fsdp import fully_shard

    recipe, make_recipe = RECIPES[name]
    model = _meta_stack(make_recipe, te_fp8_init)
    dte.quantize_te_module_(model, recipe)
    fp8 = {n: p for n, p in model.named_parameters() if isinstance(p, d.QuantizedTensor)}
    assert len(fp8) == 4 * LAYERS and all(p.bytes_pending for p in fp8.values())
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=DEV)
    torch.manual_seed(0)
    for module in model.modules():
        if isinstance(module, te.module.base.TransformerEngineBaseModule):
            module.reset_parameters()  # TE's own init, on the shard's pending values
    values = {n: p.to_local().hp_init.clone() for n, p in model.named_parameters()
              if isinstance(p.to_local(), d.QuantizedTensor)}
    assert set(values) == set(fp8)
    opt = d.MasterWeightOptimizer(model, torch.optim.Adam, lr=1e-3)
    for n, hp in values.items():
        p = dict(model.named_parameters())[n]
        want = d.quantize(hp, recipe)
        got = p.to_local()
        for usage, plane in want.planes.items():
            assert torch.equal(got.planes[usage].data.view(torch.uint8), plane.data.view(torch.uint8)), (n, usage)
            assert torch.equal(got.planes[usage].scale_inv.view(torch.uint8), plane.scale_inv.view(torch.uint8)), n
        assert torch.equal(opt.masters[n].to_local(), hp.float()), n
    g = torch.Generator(device=DEV).manual_seed(7)
    x = torch.randn(SEQ, BATCH, HIDDEN, device=DEV, dtype=BF16, generator=g)
    target = torch.randn(SEQ, BATCH, HIDDEN, device=DEV, dtype=BF16, generator=g)
    losses = []
    for _ in range(5):
        with te.autocast(enabled=True, recipe=make_recipe()):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), target.float())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
