"""torchtitan 0.3 from a pretrained checkpoint to a served model, with dtensor_fp8's converter
(dtensor_fp8/integrations/torchtitan.py, torchtitan_checkpoint.py), through torchtitan's own
config, ``parallelize_llama``, optimizers container and ``CheckpointManager`` machinery as
tests/test_torchtitan.py drives them (see its docstring for what differs from its trainer):

* ``initial_load_path`` of a bf16 checkpoint written by the same config without the converter,
  into an FP8 run through ``FP8CheckpointManager`` (FSDP on 2 ranks, TP x FSDP on 4);
* the final model-only save: masters in ``export_dtype``, DCP or Hugging Face safetensors;
* misuse refused or warned at config / build time: two FP8 converters, a ``filter_fqns`` entry
  that matches nothing, torchtitan's own optimizers container over FP8 weights (in
  tests/test_torchtitan.py's optimizer test).
"""

import pytest
import torch

import dtensor_fp8 as d
from dist_utils import WORLD_SIZES
from test_torchtitan import (  # noqa: F401  (skips this module as test_torchtitan skips itself)
    LINEARS,
    VOCAB,
    FP8ParameterConverter,
    _bytes,
    _model_config,
    _Run,
)

import torch.distributed as dist  # noqa: E402

from dtensor_fp8._compat import dtensor_local  # noqa: E402


# ---- from a pretrained high-precision checkpoint: torchtitan's initial_load_path into an FP8 run ---------
FP8_LOAD_RECIPE = "mxfp8"


def _ac():
    """torchtitan's default activation checkpointing (its debug config's): the parameters' names
    then hold ``_checkpoint_wrapped_module.``, the state dict's keys do not."""
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    return SelectiveAC.Config()


def _canonical(name):  # a MasterWeightOptimizer's FQNs leave out the wrapper's component
    return name.replace("_checkpoint_wrapped_module.", "")


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _initial_load(tp, root, hf=False):
    """The bf16 run of the same config without the converter writes its final model-only save
    (torchtitan's, ``export_dtype="bfloat16"``); the same bf16 config restarted from it
    (``initial_load_path``, torchtitan's own load) and the FP8 run started from it through
    ``FP8CheckpointManager``: the FP8 run's first losses, its FP8 bytes against quantizing the
    values, its masters; then the all-or-nothing refusal of a checkpoint that lacks a weight.
    ``hf``: the same through Hugging Face safetensors (``last_save_in_hf``, ``initial_load_in_hf``)."""
    from torchtitan.components.checkpoint import CheckpointManager

    from dtensor_fp8.integrations.torchtitan import FP8CheckpointManager

    writer = _Run(None, tp, "spmd_types", ac=_ac(), ckpt_dir=f"{root}/bf16", checkpoint=CheckpointManager.Config(
        enable=True, export_dtype="bfloat16", keep_latest_k=0, last_save_in_hf=hf))
    writer.train(range(1))
    assert writer.checkpointer.save(curr_step=1, last_step=True)
    path = f"{root}/bf16/checkpoint/step-1"
    reference = _Run(None, tp, "spmd_types", ac=_ac(), ckpt_dir=f"{root}/ref", checkpoint=CheckpointManager.Config(
        enable=True, initial_load_path=path, initial_load_in_hf=hf))
    assert reference.checkpointer.load()
    values = {n: _full(p).detach().clone() for n, p in reference.model.named_parameters()}
    run = _Run(FP8_LOAD_RECIPE, tp, "spmd_types", ac=_ac(), ckpt_dir=f"{root}/fp8",
               checkpoint=FP8CheckpointManager.Config(enable=True, initial_load_path=path, initial_load_in_hf=hf))
    assert run.checkpointer.load()
    recipe, masters = d.RECIPES[FP8_LOAD_RECIPE], run.optimizers.optimizers[0].masters
    fp8, differ = 0, []
    for name, p in run.model.named_parameters():
        if isinstance(dtensor_local(p), d.QuantizedTensor):
            fp8 += 1
            full, want = _full(p), d.quantize(values[name].float(), recipe)
            differ += [f"{name}/{u}" for u, plane in want.planes.items()
                       if not (torch.equal(_bytes(full.planes[u].data), _bytes(plane.data))
                               and torch.equal(_bytes(full.planes[u].scale_inv), _bytes(plane.scale_inv)))]
            master = _full(masters[_canonical(name)])
            differ += [f"{name}/master"] if not torch.equal(master, values[name].float()) else []
        elif not torch.equal(_full(p), values[name]):
            differ.append(name)
    out = {"fp8": fp8, "differ": differ, "losses": run.train(range(1, 3)), "reference": reference.train(range(1, 3))}
    if hf:
        for r in (writer, reference, run):
            r.checkpointer.close()
        return out

    # all or nothing: a checkpoint that lacks one weight changes nothing, naming it
    import torch.distributed.checkpoint as dcp

    lacking = f"{root}/lacking"
    sd = {k: v for k, v in writer.model.state_dict().items() if k != "layers.1.feed_forward.w2.weight"}
    dcp.save(sd, checkpoint_id=lacking, process_group=None)
    again = _Run(FP8_LOAD_RECIPE, tp, "spmd_types", ac=_ac(), ckpt_dir=f"{root}/fp8-again",
                 checkpoint=FP8CheckpointManager.Config(enable=True, initial_load_path=lacking))
    before = again.snapshot()
    try:
        again.checkpointer.load()
        out["refused"] = None
    except d.CheckpointError as err:
        out["refused"] = str(err)
    after = again.snapshot()
    out["changed"] = [k for k in before if not torch.equal(_bytes(before[k]), _bytes(after[k]))]
    for r in (writer, reference, run, again):
        r.checkpointer.close()
    return out


@pytest.mark.parametrize("world,tp,hf", [(2, 1, False), (2, 1, True), pytest.param(4, 2, False, marks=pytest.mark.skipif(
    4 not in WORLD_SIZES, reason="the suite runs without world size 4"))])
def test_initial_load_of_a_bf16_checkpoint_starts_the_fp8_run(pools, tmp_path, world, tp, hf):
    """torchtitan's ``initial_load_path`` of the bf16 run's final save, through
    ``FP8CheckpointManager`` (FSDP on 2 ranks; TP x FSDP on 4): every Linear weight's FP8 bytes
    equal quantizing the checkpoint's values, its master holds them exactly, every other parameter
    equals the bf16 run's; the first losses are the bf16 run's within FP8 rounding; a checkpoint
    lacking a weight is refused naming it, with nothing changed. ``hf``: the bf16 run's final save
    in Hugging Face safetensors (``last_save_in_hf``), loaded with ``initial_load_in_hf``."""
    for r in pools[world].run(_initial_load, tp, str(tmp_path), hf):
        assert r["fp8"] == LINEARS and r["differ"] == [], r["differ"][:8]
        for a, b in zip(r["losses"], r["reference"]):
            assert abs(a - b) <= 0.01 * b, (r["losses"], r["reference"])
        if hf:  # through torchtitan's Llama3 state-dict adapter: the same values, the same checks
            continue
        assert r["refused"] is not None and "layers.1.feed_forward.w2.weight" in r["refused"], r["refused"]
        assert r["changed"] == [], r["changed"][:8]


def _pipeline_initial_load(schedule, root):
    """pp=2 x dp=2: the bf16 pipeline's final save (each stage writes its part) starts the FP8
    pipeline through ``FP8CheckpointManager`` (each rank loads its model parts: two when
    interleaved); FP8 bytes = quantize(values) and masters = values on every rank's parts, and the
    first losses are the bf16 pipeline's (restarted from the same save) within 1 %."""
    from torchtitan.components.checkpoint import CheckpointManager

    from dtensor_fp8.integrations.torchtitan import FP8CheckpointManager
    from test_torchtitan import _PipelineRun

    writer = _PipelineRun(None, schedule, f"{root}/bf16", checkpoint=CheckpointManager.Config(
        enable=True, export_dtype="bfloat16", keep_latest_k=0))
    writer.train(range(1))
    assert writer.checkpointer.save(curr_step=1, last_step=True)
    dist.barrier()
    path = f"{root}/bf16/checkpoint/step-1"
    reference = _PipelineRun(None, schedule, f"{root}/ref", checkpoint=CheckpointManager.Config(
        enable=True, initial_load_path=path))
    assert reference.checkpointer.load()
    values = {n: _full(p).detach().clone() for part in reference.parts for n, p in part.named_parameters()}
    run = _PipelineRun(FP8_LOAD_RECIPE, schedule, f"{root}/fp8", checkpoint=FP8CheckpointManager.Config(
        enable=True, initial_load_path=path))
    assert run.checkpointer.load()
    recipe, fp8, differ = d.RECIPES[FP8_LOAD_RECIPE], 0, []
    masters = {k: v for o in run.optimizers.optimizers for k, v in o.masters.items()}
    for name, p in run._named_parameters():
        if isinstance(dtensor_local(p), d.QuantizedTensor):
            fp8 += 1
            full, want = _full(p), d.quantize(values[name].float(), recipe)
            differ += [f"{name}/{u}" for u, plane in want.planes.items()
                       if not torch.equal(_bytes(full.planes[u].data), _bytes(plane.data))]
            differ += [f"{name}/master"] if not torch.equal(_full(masters[name]), values[name].float()) else []
        elif not torch.equal(_full(p), values[name]):
            differ.append(name)
    out = {"fp8": fp8, "differ": differ, "losses": run.train(range(1, 3)), "reference": reference.train(range(1, 3))}
    for r in (writer, reference, run):
        r.checkpointer.close()
    return out


@pytest.mark.skipif(4 not in WORLD_SIZES, reason="the suite runs without world size 4")
@pytest.mark.parametrize("schedule", ["Interleaved1F1B"])
def test_initial_load_of_a_bf16_checkpoint_starts_a_pipeline_fp8_run(pools, tmp_path, schedule):
    out = pools[4].run(_pipeline_initial_load, schedule, str(tmp_path))
    assert sum(r["fp8"] for r in out) == 2 * LINEARS  # each stage's weights on its two dp ranks
    for r in out:
        assert r["differ"] == [], r["differ"][:8]
        for a, b in zip(r["losses"], r["reference"]):
            assert abs(a - b) <= 0.01 * b, (r["losses"], r["reference"])

# ---- misuse at config / build time: two FP8 converters, a filter that matches nothing ---------------
def _registry_config(converters):
    from torchtitan.models.llama3 import model_registry

    return model_registry("debugmodel", converters=converters).model


def test_a_second_fp8_converter_before_this_one_is_refused_at_config_time():
    """FP8ParameterConverter over a config an FP8 converter already converted (itself again here;
    torchtitan's float8 converter in the torchao test below) refuses, naming "use one FP8
    converter"; the config is left as the first converter made it."""
    config = _registry_config([FP8ParameterConverter.Config(recipe="mxfp8", filter_fqns=["lm_head"])])
    with pytest.raises(d.RecipeError, match=r"(?s)30 Linear layers were already converted.*FP8ParameterLinear.*"
                                            r"use one FP8 converter"):
        FP8ParameterConverter.Config(recipe="blockwise2d").build().convert(config)


def test_a_filter_fqns_entry_that_matches_nothing_warns():
    """``filter_fqns=["output"]`` (the head's name in torchtitan <= 0.2) keeps nothing in high
    precision: a warning names the entry and the model's names; a matching entry gives none."""
    with pytest.warns(UserWarning, match=r"(?s)filter_fqns entry 'output' matches no Linear layer.*'lm_head'"):
        _registry_config([FP8ParameterConverter.Config(recipe="mxfp8", filter_fqns=["output"])])
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _registry_config([FP8ParameterConverter.Config(recipe="mxfp8", filter_fqns=["lm_head"])])


def _float8_converter():
    pytest.importorskip("torchao", reason="torchtitan's Float8LinearConverter needs torchao")
    from torchtitan.components.quantization import Float8LinearConverter

    return Float8LinearConverter.Config(emulate=True)


def test_torchtitans_float8_converter_and_this_one_are_refused_in_either_order():
    """torchtitan's ``Float8LinearConverter`` (torchao, emulated on CPU) with FP8ParameterConverter:
    before it, refused at config time; after it (it swaps every Linear config, FP8 ones too,
    keeping their ``param_init``), refused at ``init_weights``, before any step: "use one FP8
    converter" both ways."""
    float8 = _float8_converter()
    ours = FP8ParameterConverter.Config(recipe="mxfp8", filter_fqns=["lm_head"])
    with pytest.raises(d.RecipeError, match=r"(?s)already converted by another FP8 converter.*Float8Linear.*"
                                            r"use one FP8 converter"):
        _registry_config([float8, ours])
    config = _registry_config([ours, float8])
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    with pytest.raises(d.RecipeError, match=r"(?s)FP8ParameterConverter\(recipe='mxfp8'\) converted this Linear.*"
                                            r"use one FP8 converter"), torch.no_grad():
        model.init_weights(buffer_device=None)


# ---- the final model-only save: high-precision weights from the masters, DCP or Hugging Face -----------
def _final_save(root, export_dtype, hf):
    """An FP8 run's final model-only save through ``FP8CheckpointManager``; what it wrote, read
    back: through torchtitan's own initial load into the same config without FP8 (DCP), or the
    safetensors files (HF); with what it should hold (masters and plain weights in the dtype)."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.config import TORCH_DTYPE_MAP

    from dtensor_fp8.integrations.torchtitan import FP8CheckpointManager

    dtype = TORCH_DTYPE_MAP[export_dtype]
    run = _Run(FP8_LOAD_RECIPE, 1, "spmd_types", ac=_ac(), ckpt_dir=f"{root}/fp8",
               checkpoint=FP8CheckpointManager.Config(enable=True, keep_latest_k=0, export_dtype=export_dtype, last_save_in_hf=hf))
    run.train(range(2))
    masters = run.optimizers.optimizers[0].masters
    # torchtitan's layout (wq / wk / wv split from the fused QKV weight) of the same model without FP8
    plain = _Run(None, 1, "spmd_types", ac=_ac(), ckpt_dir=f"{root}/plain", checkpoint=CheckpointManager.Config(
        enable=True))
    with torch.no_grad():
        for name, p in plain.model.named_parameters():
            source = masters.get(_canonical(name), dict(run.model.named_parameters())[name])
            dtensor_local(p).copy_(dtensor_local(source).to(dtype))
    want = {k: _full(v).to(dtype) for k, v in plain.model.state_dict().items()}
    assert run.checkpointer.save(curr_step=2, last_step=True)
    dist.barrier()
    out = {"want": {k: v.clone() for k, v in want.items()}}
    if hf:
        import glob

        from safetensors.torch import load_file

        got = {}
        for f in sorted(glob.glob(f"{root}/fp8/checkpoint/step-2/*.safetensors")):
            got.update(load_file(f))
        out["hf"] = got
        out["hf_want"] = {k: v.contiguous() for k, v in plain.checkpointer.sd_adapter.to_hf(want).items()}
    else:
        torch.manual_seed(1)
        fresh = _Run(None, 1, "spmd_types", ac=_ac(), ckpt_dir=f"{root}/fresh", checkpoint=CheckpointManager.Config(
            enable=True, initial_load_path=f"{root}/fp8/checkpoint/step-2"))
        assert fresh.checkpointer.load()
        out["loaded"] = {k: _full(v) for k, v in fresh.model.state_dict().items()}
        fresh.checkpointer.close()
    run.checkpointer.close()
    plain.checkpointer.close()
    return out


@pytest.mark.parametrize("export_dtype", ["float32", "bfloat16"])
def test_final_model_only_save_writes_high_precision_weights_from_the_masters(pools, tmp_path, export_dtype):
    """torchtitan's default final save (``last_save_model_only=True``) through ``FP8CheckpointManager``:
    every FP8 weight's master in ``export_dtype`` under the model's own keys (no FP8 planes);
    torchtitan's initial load of it into the same config without FP8 gives exactly those weights."""
    out = pools[2].run(_final_save, str(tmp_path), export_dtype, False)[0]
    assert out["loaded"].keys() == out["want"].keys()
    assert not any(k.endswith(("_data", "_scale_inv", ".recipe")) for k in out["loaded"])
    differ = [k for k, v in out["want"].items() if not torch.equal(out["loaded"][k].to(v.dtype), v)]
    assert differ == [], differ[:8]


def test_final_save_in_hf_loads_into_transformers(pools, tmp_path):
    """``last_save_in_hf=True``: Hugging Face safetensors (the model's state-dict adapter) holding
    the masters in bf16; a transformers ``LlamaForCausalLM`` of the debug model's shape loads them
    strictly."""
    transformers = pytest.importorskip("transformers")
    out = pools[2].run(_final_save, str(tmp_path), "bfloat16", True)[0]
    got, want = out["hf"], out["hf_want"]
    assert got.keys() == want.keys()
    assert [k for k in want if not (got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k]))] == []
    attn = _model_config(None).layers[0].attention
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=got["model.embed_tokens.weight"].shape[1],
        intermediate_size=got["model.layers.0.mlp.gate_proj.weight"].shape[0], num_hidden_layers=6,
        num_attention_heads=attn.n_heads, num_key_value_heads=attn.n_kv_heads or attn.n_heads,
        tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.load_state_dict(got, strict=True)
