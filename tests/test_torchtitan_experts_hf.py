"""torchtitan 0.3's DeepSeek-V3 debug model (and Qwen3 MoE's) with FP8 routed experts started from a Hugging Face
checkpoint (issue 48: "the HF state-dict adapter path still loads high-precision pretrained experts
into FP8 experts"): the bf16-experts run's final save in safetensors through the model's own
``state_dict_adapter`` (``last_save_in_hf``: per-expert keys ``model.layers.N.mlp.experts.E.
gate_proj.weight``, ...), loaded into the FP8 run by ``FP8CheckpointManager`` with
``initial_load_in_hf`` (the adapter's ``to_hf`` / ``from_hf`` around DCP's Hugging Face reader, each
rank reading its experts): every routed expert weight's planes equal per-expert ``quantize`` of the
Hugging Face values as uint8 and its master holds them exactly, FSDP2 at 2 ranks and EP 2 x FSDP2 2
at 4; the first losses are the bf16 run's (loaded by torchtitan's own ``CheckpointManager``) within 1 %."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import dtensor_fp8 as d
from dist_utils import WORLD_SIZES

if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 14):
    pytest.skip(f"torchtitan 0.3 needs torch >= 2.14 (this is {torch.__version__})", allow_module_level=True)
pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e '.[torchtitan]', see pyproject)")

from torchtitan_moe import MOE_LAYERS, MoERun  # noqa: E402


def _hf_keys(path: str) -> set[str]:
    """The tensor names of the safetensors files torchtitan's HF save wrote (their JSON headers)."""
    keys = set()
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            with open(os.path.join(path, f), "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                keys |= {k for k in json.loads(fh.read(n)) if k != "__metadata__"}
    return keys


def _hf_initial_load(family: str, recipe: str, ep: int, root: str):
    from torchtitan.components.checkpoint import CheckpointManager

    from dtensor_fp8.integrations.torchtitan import FP8CheckpointManager

    writer = MoERun(family, None, ep=ep, ckpt_dir=f"{root}/bf16", checkpoint=CheckpointManager.Config(
        enable=True, export_dtype="bfloat16", keep_latest_k=0, last_save_in_hf=True))
    writer.train(range(1))
    assert writer.checkpointer.save(curr_step=1, last_step=True)
    path = f"{root}/bf16/checkpoint/step-1"
    reference = MoERun(family, None, ep=ep, ckpt_dir=f"{root}/ref", checkpoint=CheckpointManager.Config(
        enable=True, initial_load_path=path, initial_load_in_hf=True))
    assert reference.checkpointer.load()
    values = {n: p.full_tensor().detach().clone() for n, p in reference.routed().items()}
    run = MoERun(family, recipe, ep=ep, ckpt_dir=f"{root}/fp8", checkpoint=FP8CheckpointManager.Config(
        enable=True, initial_load_path=path, initial_load_in_hf=True))
    with warnings.catch_warnings(record=True) as caught:  # Qwen3's adapter maps no HF key to expert_bias_E
        warnings.simplefilter("always")
        assert run.checkpointer.load()
    full, base, differ = run.full_experts(), d.RECIPES[recipe], []
    for n, value in values.items():
        want = d.quantize(value.float(), d.per_expert(base, value.shape))
        for usage, plane in want.planes.items():
            if not (torch.equal(full[f"{n}/{usage}"], plane.data.view(torch.uint8))
                    and torch.equal(full[f"{n}/{usage}_scale"], plane.scale_inv.contiguous().view(torch.uint8))):
                differ.append(f"{n}/{usage}")
        if not torch.equal(full[f"{n}/master"], value.float()):
            differ.append(f"{n}/master")
    out = {"warned": [str(w.message) for w in caught if "maps no Hugging Face key" in str(w.message)], "keys": sorted(k for k in _hf_keys(path) if ".mlp.experts." in k), "fp8": run.fp8_weights(),
           "routed": sorted(values), "differ": differ,
           "losses": run.train(range(1, 3)), "reference": reference.train(range(1, 3))}
    for r in (writer, reference, run):
        r.checkpointer.close()
    return out


@pytest.mark.parametrize("family,world,ep,recipe", [("deepseek_v3", 2, 1, "mxfp8"), ("deepseek_v3", 4, 2, "blockwise2d"),
                                                     ("qwen3", 2, 1, "current")])
def test_hf_pretrained_experts_load_into_fp8_experts(pools, tmp_path, family, world, ep, recipe):
    if world not in WORLD_SIZES:
        pytest.skip(f"the suite runs without world size {world}")
    for r in pools[world].run(_hf_initial_load, family, recipe, ep, str(tmp_path)):
        experts = {int(k.split(".")[5]) for k in r["keys"]}  # model.layers.N.mlp.experts.E.*
        assert len(r["keys"]) == 3 * MOE_LAYERS * len(experts) and len(experts) > 1, r["keys"][:6]
        assert all(k.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight")) for k in r["keys"])
        assert len(r["routed"]) == 3 * MOE_LAYERS and set(r["fp8"]) == set(r["routed"]), (r["fp8"], r["routed"])
        assert r["differ"] == [], r["differ"]
        # what torchtitan's own HF load leaves at its initial value is named (Qwen3: the routing bias)
        assert len(r["warned"]) == (family == "qwen3") and all("expert_bias_E" in w for w in r["warned"]), r["warned"]
        for a, b in zip(r["losses"], r["reference"]):
            assert abs(a - b) <= 0.01 * b, (r["losses"], r["reference"])
