"""A pretrained high-precision checkpoint into a sharded FP8 model built on the meta device, each
rank reading its shards (``load_hp_checkpoint``): from a DCP directory and from a Hugging Face
safetensors directory (``HuggingFaceStorageReader``), on real gloo ranks and real files.

The FP8 bytes must equal quantizing the checkpoint's weights, the masters must be those weights,
and every other parameter must load exactly.
"""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dtensor_fp8 as d
from conftest import assert_bytes_equal
from dist_utils import DEVICE, WORLD_SIZES

transformers = pytest.importorskip("transformers")
from test_hf_llama import _config  # noqa: E402  (needs transformers)

RECIPE = "mxfp8"
LAYERS = "model.layers."


def _meta_llama(recipe):
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(_config())
    d.quantize_module_(model, recipe, filter_fn=lambda m, fqn: fqn.startswith(LAYERS))
    mesh = init_device_mesh(DEVICE, (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=DEVICE)
    # transformers' non-persistent buffers (the rotary inv_freq) are not in any checkpoint: recompute
    # them after to_empty, as with any meta-built transformers model.
    rotary = model.model.rotary_emb
    inv_freq, _ = rotary.compute_default_rope_parameters(rotary.config)
    for buffer in (rotary.inv_freq, rotary.original_inv_freq):
        buffer.copy_(inv_freq)
    return model


def _load(source, kind):
    recipe = d.RECIPES[RECIPE]
    model = _meta_llama(recipe)
    if kind == "dcp":
        d.load_hp_checkpoint(model, source)
    else:
        d.load_hp_checkpoint(model, storage_reader=dcp.HuggingFaceStorageReader(source))
    opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-3)
    want = transformers.LlamaForCausalLM.from_pretrained(source.replace("/dcp", "/hf"), torch_dtype=torch.float32).state_dict()
    fp8 = 0
    for name, p in model.named_parameters():
        local = p.to_local()
        if isinstance(local, d.QuantizedTensor):
            fp8 += 1
            full, q = p.full_tensor(), d.quantize(want[name], recipe)
            for usage, plane in q.planes.items():
                assert_bytes_equal(full.planes[usage].data, plane.data, f"{name}/{usage}")
                assert_bytes_equal(full.planes[usage].scale_inv, plane.scale_inv, f"{name}/{usage}/scale")
            assert torch.equal(opt.masters[name].full_tensor(), want[name]), name
        else:
            assert torch.equal(p.full_tensor(), want[name]), name
    tokens = torch.randint(256, (2, 16))
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    opt.step()
    return fp8, float(loss)


def _write_sources(root):
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(_config())
    model.save_pretrained(f"{root}/hf")  # safetensors
    dcp.save(model.state_dict(), checkpoint_id=f"{root}/dcp", no_dist=True)


@pytest.mark.skipif(2 not in WORLD_SIZES, reason="needs 2 ranks")
@pytest.mark.parametrize("kind", ["dcp", "hf"])
def test_pretrained_hp_checkpoint_loads_shard_by_shard_into_a_meta_built_fp8_model(pools, tmp_path, kind):
    root = str(tmp_path)
    _write_sources(root)
    results = pools[2].run(_load, f"{root}/{kind}", kind)
    assert results[0][0] == 14 and results[0] == results[1]
