"""A plain torch user's high-precision load into an FP8 model: ``load_state_dict`` and torch's
``set_model_state_dict`` of a bf16 / fp32 state dict refuse with an error naming the functions that
do it (``load_hp_state_dict``, ``load_hp_checkpoint``), and change nothing; those functions then
load the same state dict.
"""

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import set_model_state_dict

import dtensor_fp8 as d


def _pair():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    d.quantize_module_(model, d.RECIPES["mxfp8"])
    opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=1e-3)
    return plain, model, opt


def _snapshot(model):
    out = {}
    for name, p in model.named_parameters():
        if isinstance(p, d.QuantizedTensor):
            out.update({f"{name}/{u}": plane.data.view(torch.uint8).clone() for u, plane in p.planes.items()})
        else:
            out[name] = p.detach().clone()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_state_dict_of_high_precision_weights_names_the_loader(dtype):
    plain, model, opt = _pair()
    hp = {k: v.to(dtype) for k, v in plain.state_dict().items()}
    before = _snapshot(model)
    for load in (lambda: model.load_state_dict(hp), lambda: set_model_state_dict(model, hp)):
        with pytest.raises(d.RecipeError, match=r"(?s)0\.weight: the state dict holds a torch\.\w+ tensor for an FP8 "
                                                r"weight.*load_hp_state_dict\(model, state_dict, optimizer=opt\).*"
                                                r"load_hp_checkpoint"):
            load()
        after = _snapshot(model)
        assert all(torch.equal(v, after[k]) for k, v in before.items()) and len(before) == 6
    d.load_hp_state_dict(model, hp, optimizer=opt)
    assert torch.equal(opt.masters["0.weight"].detach(), hp["0.weight"].float())
