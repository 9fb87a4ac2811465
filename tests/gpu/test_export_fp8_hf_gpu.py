"""``export_fp8_hf`` on a GPU: a transformers ``LlamaForCausalLM`` whose decoder weights trained one
step as FP8 parameters (128x128 blocks, and per tensor) is exported, and transformers loads the
directory onto the GPU through its own FP8 path (``FineGrainedFP8``: its ``FP8Linear`` modules
holding the exported bytes, its FP8 GEMMs): the loaded weights are the trained bytes, and, where
transformers can load its FP8 GEMM kernel, the logits are the dtensor_fp8 model's with its weights
dequantized, within FP8 activation rounding.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import dtensor_fp8 as d  # noqa: E402


def _config():
    return transformers.LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                                    tie_word_embeddings=False)


def _trained_and_served(tmp_path, recipe, block):
    """A Llama whose decoder weights trained one step as FP8 parameters, exported, and loaded back
    by transformers onto the GPU (its ``FP8Linear`` modules)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config()).cuda().to(torch.bfloat16)
    d.quantize_module_(model, d.RECIPES[recipe], filter_fn=lambda m, fqn: fqn.startswith("model.layers."))
    opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-3)
    tokens = torch.randint(256, (2, 32), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    model(input_ids=tokens, labels=tokens).loss.backward()
    opt.step()
    quantization = d.export_fp8_hf(model, str(tmp_path / "out"))
    assert quantization["weight_block_size"] == block
    served = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "out"), device_map="cuda",
                                                           dtype=torch.bfloat16)
    return model, served, tokens


@pytest.mark.parametrize("recipe,block", [("blockwise2d", [128, 128]), ("current", None)])
def test_transformers_fp8_modules_hold_the_trained_bytes(tmp_path, recipe, block):
    from transformers.integrations.finegrained_fp8 import FP8Linear

    model, served, _ = _trained_and_served(tmp_path, recipe, block)
    fp8_modules = {n: m for n, m in served.named_modules() if isinstance(m, FP8Linear)}
    trained = {n: p for n, p in model.named_parameters() if isinstance(p, d.QuantizedTensor)}
    assert len(fp8_modules) == len(trained) == 14
    for name, p in trained.items():
        module = fp8_modules[name.removesuffix(".weight")]
        plane = p.planes["rowwise"]
        assert module.weight.device.type == "cuda", name
        assert torch.equal(module.weight.view(torch.uint8), plane.data.view(torch.uint8)), name
        assert torch.equal(module.weight_scale_inv.reshape(plane.scale_inv.shape), plane.scale_inv), name


@pytest.mark.parametrize("recipe,block", [("blockwise2d", [128, 128]), ("current", None)])
def test_transformers_fp8_gemms_give_the_models_logits(tmp_path, recipe, block):
    # transformers 5.x fetches its FP8 GEMM kernel from the Hugging Face Hub through the `kernels`
    # package (integrations/finegrained_fp8.py): a machine without it (or offline) cannot run the
    # served model's forward at all; the bytes test above still runs there.
    pytest.importorskip("kernels", reason="transformers' FP8 GEMMs load through the `kernels` package (Hub)")
    model, served, tokens = _trained_and_served(tmp_path, recipe, block)
    with torch.no_grad():
        reference = transformers.LlamaForCausalLM(_config()).cuda().to(torch.bfloat16)
        reference.load_state_dict(d.export_hp_state_dict(model, torch.bfloat16, optimizer=None), strict=True)
        want = reference(input_ids=tokens).logits.float()
        got = served(input_ids=tokens).logits.float()
    error = ((got - want).norm() / want.norm()).item()
    assert error < 0.05, error  # FP8 activations (1x128 groups / per tensor) against bf16 ones
