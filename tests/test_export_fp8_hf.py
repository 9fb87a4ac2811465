"""FP8 weights shipped as FP8 (``export_fp8_hf``): a transformers ``LlamaForCausalLM`` trained with
FP8 decoder weights under FSDP2 on 2 real gloo ranks, written in the Hugging Face FP8 layout
(float8_e4m3fn ``weight`` + float32 ``weight_scale_inv``: per 128x128 block for blockwise2d, per
tensor for the per-tensor recipes), then read back two ways: the safetensors files byte for byte
against the trained planes, and transformers' own ``from_pretrained`` (on CPU its FineGrainedFP8
quantizer dequantizes) against the model's dequantized weights.
"""

import glob
import json
import os

import pytest
import torch

import dtensor_fp8 as d
from conftest import assert_bytes_equal
from dist_utils import WORLD_SIZES

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers loads FP8 checkpoints through accelerate")
from test_hf_llama import FP8_WEIGHTS, _model  # noqa: E402  (needs transformers)


def _trained(recipe_name):
    model = _model(recipe_name)
    opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-3)
    tokens = torch.randint(256, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=tokens, labels=tokens).loss.backward()
    opt.step()
    return model


def _export_and_read(recipe_name, root):
    """Export on every rank; rank 0 reads the files and loads them with transformers."""
    import torch.distributed as dist

    model = _trained(recipe_name)
    out = f"{root}/out"
    quantization = d.export_fp8_hf(model, out)
    fp8, plain = {}, {}
    for name, p in model.named_parameters():
        full = p.full_tensor()
        if isinstance(full, d.QuantizedTensor):
            plane = full.planes["rowwise"]
            fp8[name] = (plane.data, plane.scale_inv, full.dequantize(torch.float32))
        else:
            plain[name] = full.detach()
    if dist.get_rank() != 0:
        return None
    from safetensors.torch import load_file

    files = sorted(glob.glob(f"{out}/*.safetensors"))
    saved = {}
    for f in files:
        saved.update(load_file(f))
    with open(f"{out}/config.json") as f:
        config = json.load(f)
    with open(f"{out}/model.safetensors.index.json") as f:
        index = json.load(f)
    loaded = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    return {"quantization": quantization, "config": config, "index": index, "files": [os.path.basename(f) for f in files],
            "saved": saved, "fp8": fp8, "plain": plain, "loaded": loaded, "partial": os.path.exists(f"{out}.partial")}


def _check_export(r, block):
    assert r["quantization"]["weight_block_size"] == block and r["quantization"]["quant_method"] == "fp8"
    assert r["config"]["quantization_config"] == r["quantization"]
    assert r["quantization"]["modules_to_not_convert"] == ["lm_head"]
    assert r["files"] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"] and not r["partial"]
    assert set(r["index"]["weight_map"]) == set(r["saved"])
    saved, loaded = r["saved"], r["loaded"]
    assert len(r["fp8"]) == FP8_WEIGHTS
    for name, (data, scale, values) in r["fp8"].items():
        weight, scale_inv = saved[name], saved[name + "_scale_inv"]
        assert weight.dtype == torch.float8_e4m3fn and scale_inv.dtype == torch.float32, name
        assert_bytes_equal(weight, data, name)  # the trained bytes, as they are
        assert_bytes_equal(scale_inv.reshape(scale.shape), scale, f"{name}_scale_inv")
        if block is None:
            assert scale_inv.dim() == 0, name
        else:
            assert tuple(scale_inv.shape) == (-(-data.shape[0] // 128), -(-data.shape[1] // 128)), name
        assert torch.equal(loaded[name], values), name  # transformers' dequantized weight = the model's
    for name, value in r["plain"].items():
        assert saved[name].dtype == torch.bfloat16 and torch.equal(saved[name], value.to(torch.bfloat16)), name
        assert torch.equal(loaded[name], value.to(torch.bfloat16).float()), name


@pytest.mark.skipif(2 not in WORLD_SIZES, reason="needs 2 ranks")
@pytest.mark.parametrize("recipe,block", [("blockwise2d", [128, 128]), ("current", None)])
def test_export_writes_the_trained_fp8_bytes_that_transformers_loads(pools, tmp_path, recipe, block):
    """2 ranks, FSDP2: each rank writes one of the two safetensors files; every FP8 weight's bytes
    and scales equal the trained rowwise plane's byte for byte (128x128 blocks, or a 0-d per-tensor
    scale); the head, embeddings and norms are bf16; transformers' ``from_pretrained`` loads the
    directory (its FP8 quantizer, dequantizing on CPU) to exactly the model's dequantized weights."""
    r = pools[2].run(_export_and_read, recipe, str(tmp_path))[0]
    _check_export(r, block)


def _refused(recipe_name, root):
    model = _trained(recipe_name)
    try:
        d.export_fp8_hf(model, f"{root}/out")
    except d.RecipeError as err:
        return str(err), os.path.exists(f"{root}/out") or os.path.exists(f"{root}/out.partial")
    return None, os.path.exists(f"{root}/out")


@pytest.mark.skipif(2 not in WORLD_SIZES, reason="needs 2 ranks")
@pytest.mark.parametrize("recipe,why", [("mxfp8", r"float8_e8m0fnu scale per 1x32 block"),
                                        ("blockwise1d", r"float32 scale per 1x128 block")])
def test_export_refuses_recipes_no_fp8_loader_reads(pools, tmp_path, recipe, why):
    """MXFP8 and 1x128 weights: refused on every rank, naming the weights, the scale layout and the
    fix; nothing is written."""
    for message, written in pools[2].run(_refused, recipe, str(tmp_path)):
        assert message is not None and not written
        assert "nothing was written" in message and "model.layers.0." in message, message
        assert why in message.replace("torch.", "") and "blockwise2d" in message, message
