"""Hugging Face accelerate's FSDP2 plugin driving a model with FP8 weights, in accelerate's idiom
(``Accelerator.prepare``, ``accelerator.backward``, ``save_state`` / ``load_state``,
``get_state_dict`` + ``save_pretrained``), on 2 gloo ranks with a tiny ``LlamaForCausalLM``.

On the CPU accelerate picks DDP whatever the plugin says; its FSDP2 code path is taken here by
setting the distributed type after construction, as accelerate's own tests do
(``accelerator.state.distributed_type = DistributedType.FSDP``, and PartialState's, which
accelerate re-reads), with an FSDP2 plugin.

What had gone wrong: ``prepare`` re-maps the optimizer's parameters by ``data_ptr()``, and every
FP8 parameter reports 0 (a wrapper tensor without storage), so the 14 FP8 weights collapsed onto
one in ``param_groups``; in accelerate's order (optimizer first) the masters also belonged to the
parameters ``prepare`` replaced. ``MasterWeightOptimizer.follow_model()``, called by ``step``,
``zero_grad``, ``state_dict`` and ``load_state_dict`` (``save_state`` / ``load_state`` right after
``prepare`` work), or by the user before reading ``masters`` / ``state``, re-derives its groups by FQN and
follows replaced parameters (dtensor_fp8/optim_follow.py explains why not a non-zero
``data_ptr()``: torch takes 0 to mean a wrapper without storage, in ``deepcopy`` and pickling).

accelerate and lightning are test extras (``pip install -e ".[test,frameworks]"``).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from packaging.version import Version
from torch.distributed.fsdp import fully_shard

import dtensor_fp8 as d
from dtensor_fp8._compat import dtensor_local
from dist_utils import WORLD_SIZES
from test_hf_llama import FP8_WEIGHTS, _config, _global_mean, _snapshot, _tokens

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")
#: pyproject's ``frameworks`` extra: with 1.15 (the GPU image of issue 41) the FSDP2 plugin's
#: ``transformer_based_wrap`` did not find the model's decoder-layer class.
MIN_ACCELERATE = "1.16"
if Version(accelerate.__version__) < Version(MIN_ACCELERATE):
    pytest.skip(f"needs accelerate>={MIN_ACCELERATE} (pyproject's frameworks extra), found {accelerate.__version__}: "
                f"pip install 'accelerate>={MIN_ACCELERATE},<2'", allow_module_level=True)

RECIPE = "mxfp8"  # two planes, 32-row blocks: the recipe where a wrong plane or a lost shard shows most
LR = 2e-3


def _accelerator(mixed_precision: str = "no", state_dict_type: str | None = None):
    """An ``Accelerator`` on the FSDP2 code path over the ranks' process group (see the docstring);
    ``state_dict_type``: the plugin's (None: accelerate's default for FSDP2, ``SHARDED_STATE_DICT``)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    world, rank = dist.get_world_size(), dist.get_rank()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    AcceleratorState._reset_state(reset_partial_state=True)  # one accelerator per task in a rank's life
    GradientState._reset_state()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            state_dict_type=state_dict_type)
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
    # Both shared states: AcceleratorState() re-reads PartialState's (as accelerate sets it itself).
    accelerator.state.distributed_type = PartialState().distributed_type = DistributedType.FSDP
    if mixed_precision != "no":
        plugin.set_mixed_precision(mixed_precision)
    accelerator.state.fsdp_plugin = plugin
    assert accelerator.is_fsdp2
    return accelerator


def _prepared(order: str, recipe: str = RECIPE, seed: int = 0, mixed_precision: str = "no",
              state_dict_type: str | None = None):
    """``order``: "accelerate" (quantize, optimizer, ``prepare`` shards: accelerate's own order),
    "library" (quantize, ``fully_shard``, optimizer, ``prepare``: dtensor_fp8's documented order),
    or "plain" (the model without FP8, torch AdamW, accelerate's order: the reference)."""
    accelerator = _accelerator(mixed_precision, state_dict_type)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(_config())
    if order != "plain":
        d.quantize_module_(model, d.RECIPES[recipe], filter_fn=lambda m, fqn: fqn.startswith("model.layers."))
    if order == "library":
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    if order == "plain":
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
    else:
        opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=LR)
    model, opt = accelerator.prepare(model, opt)
    return accelerator, model, opt


def _train(accelerator, model, opt, steps: int, start: int = 0) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        x = _tokens(step)
        loss = model(input_ids=x, labels=x).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(_global_mean(loss.item()))
    return losses


def _held_once(model, opt) -> dict:
    held = [p for g in opt.param_groups for p in g["params"]]
    fp8 = [p for p in model.parameters() if isinstance(p.to_local(), d.QuantizedTensor)]
    return {"held": len(held), "distinct": len({id(p) for p in held}), "params": len(list(model.parameters())),
            "all": {id(p) for p in held} == {id(p) for p in model.parameters()}, "fp8": len(fp8)}


def _train_orders():
    out = {}
    for order in ("plain", "accelerate", "library"):
        accelerator, model, opt = _prepared(order)
        collapsed = _held_once(model, opt)  # param_groups is a plain read: what prepare left there
        if order != "plain":  # what step() would do first; the snapshot reads masters, which follow nothing
            opt.optimizer.follow_model()
        right_after_prepare = {**_held_once(model, opt), "collapsed": collapsed}
        before = _snapshot(model, opt.optimizer)
        out[order] = {**right_after_prepare, "losses": _train(accelerator, model, opt, 4)}
        out[order]["after"] = _held_once(model, opt)
        after = _snapshot(model, opt.optimizer)
        out[order]["unchanged"] = sorted(k for k in before if k.endswith("/rowwise") and torch.equal(before[k], after[k]))
    return out


def test_prepare_in_either_order_trains_like_the_model_without_fp8(pools):
    """Right after ``prepare`` (accelerate's ``param_groups`` re-mapping by ``data_ptr()`` has
    collapsed the FP8 weights: 21 entries, 8 distinct), once followed, and through training, the optimizer's
    ``param_groups`` hold every parameter of the sharded model exactly once; every FP8 weight
    changes; both orders give the
    same losses (the masters start from the same high-precision init), each within 1 % of the
    model without FP8: the FP8 rounding of the weights moved them by at most 0.1 % when measured."""
    out = pools[WORLD_SIZES[0]].run(_train_orders)[0]
    ref = out["plain"]["losses"]
    assert ref[-1] < 0.95 * ref[0], ref
    for order in ("accelerate", "library"):
        r = out[order]
        assert r["collapsed"]["distinct"] < r["collapsed"]["held"] == r["held"], (order, r)  # prepare's data_ptr() map
        for held in (r, r["after"]):
            assert held["held"] == held["distinct"] == held["params"] and held["all"], (order, r)
        assert r["fp8"] == FP8_WEIGHTS, (order, r)
        assert r["unchanged"] == [], (order, r["unchanged"])
        for a, b in zip(r["losses"], ref):
            assert abs(a - b) <= 0.01 * b, (order, r["losses"], ref)
    assert out["accelerate"]["losses"] == out["library"]["losses"]


def _save_and_go_on(root, state_dict_type):
    accelerator, model, opt = _prepared("accelerate", state_dict_type=state_dict_type)
    _train(accelerator, model, opt, 2)
    accelerator.save_state(root)
    written = sorted(os.listdir(root))  # which of accelerate's two formats save_state wrote
    losses = _train(accelerator, model, opt, 2, start=2)
    return losses, _snapshot(model, opt.optimizer), written


def _resume(root, state_dict_type):
    # another init: all must come from the files
    accelerator, model, opt = _prepared("accelerate", seed=1, state_dict_type=state_dict_type)
    accelerator.load_state(root)
    losses = _train(accelerator, model, opt, 2, start=2)
    return losses, _snapshot(model, opt.optimizer), None


@pytest.mark.parametrize("state_dict_type", [None, "FULL_STATE_DICT"])
def test_save_state_and_load_state_resume_exactly(pools, tmp_path, state_dict_type):
    """``save_state`` after 2 steps, ``load_state`` into a differently initialized model and
    optimizer: the next 2 losses, every FP8 plane, master and high-precision weight bit-identical
    to the uninterrupted run. With accelerate's default for FSDP2 (``SHARDED_STATE_DICT``: DCP),
    and with ``FULL_STATE_DICT``, whose model file is rank 0's ``get_model_state_dict`` under the
    same options ``get_state_dict`` passes (full, cpu_offload, broadcast_from_rank0): it resumes
    exactly only because that call keeps each FP8 weight's planes (see the export tests)."""
    root = str(tmp_path / "state")
    expected = pools[WORLD_SIZES[0]].run(_save_and_go_on, root, state_dict_type)
    resumed = pools[WORLD_SIZES[0]].run(_resume, root, state_dict_type)
    model_file = "pytorch_model_fsdp.bin" if state_dict_type == "FULL_STATE_DICT" else "pytorch_model_fsdp_0"
    assert model_file in expected[0][2], expected[0][2]  # torch.save of the full state dict, or DCP's folder
    for (losses, snap, _), (r_losses, r_snap, _) in zip(expected, resumed):
        assert r_losses == losses
        assert snap.keys() == r_snap.keys() and any(k.endswith("/master") for k in snap)
        for key in snap:
            assert torch.equal(snap[key], r_snap[key]), key


def _export(out_dir):
    accelerator, model, opt = _prepared("accelerate")
    _train(accelerator, model, opt, 2)
    with d.high_precision_state_dict(torch.bfloat16):
        state_dict = accelerator.get_state_dict(model)  # full tensors, on rank 0 (cpu_offload)
    with d.high_precision_state_dict(torch.float32, optimizer=opt):  # accelerate's wrapper of the optimizer
        from_masters = accelerator.get_state_dict(model)
    masters = {n: m.full_tensor() for n, m in opt.optimizer.masters.items()}
    masters_exported = dist.get_rank() != 0 or (
        len(masters) == FP8_WEIGHTS and all(torch.equal(from_masters[n], m) for n, m in masters.items()))
    kinds = sorted({f"{type(v).__name__} {v.dtype}" for v in state_dict.values()})
    keys = sorted(state_dict)  # save_pretrained empties the dict it is given
    accelerator.unwrap_model(model).save_pretrained(out_dir, state_dict=state_dict,
                                                    is_main_process=accelerator.is_main_process)
    accelerator.wait_for_everyone()
    x = _tokens(99)
    with torch.no_grad():
        logits = model(input_ids=x).logits
    return x, logits.float(), keys, kinds, masters_exported, _dequantized_shards(model)


def _dequantized_shards(model) -> dict:
    """Each FP8 weight's rows on this rank (FSDP2's even Shard(0)) and their values, dequantized
    by the weight's own codec from its local rowwise plane: what the export must have written."""
    out = {}
    for name, p in accelerate.utils.extract_model_from_parallel(model).named_parameters():
        local = dtensor_local(p)
        if isinstance(local, d.QuantizedTensor):
            assert [str(pl) for pl in p.placements] == ["S(0)"], p.placements
            first = p.device_mesh.get_local_rank() * -(-p.shape[0] // p.device_mesh.size())
            out[name] = (first, local.dequantize(torch.bfloat16, usage="rowwise"))
    return out


def test_get_state_dict_and_save_pretrained_write_a_standard_model(pools, tmp_path):
    """Under ``dtensor_fp8.high_precision_state_dict``, ``accelerator.get_state_dict`` holds bf16
    tensors under the unquantized model's keys; ``save_pretrained`` writes them and
    ``from_pretrained`` (a plain ``LlamaForCausalLM``) gives the FP8 model's logits to bf16
    precision (the other weights are rounded to bf16); each loaded FP8 weight equals, row for row,
    its rank's rowwise plane dequantized by its codec (MXFP8's E4M3 values times power-of-two
    scales are exact in bf16). With
    ``optimizer=opt`` (accelerate's wrapper) and fp32 it holds the masters, exactly."""
    out_dir = str(tmp_path / "hf")
    ranks = pools[WORLD_SIZES[0]].run(_export, out_dir)
    x, logits, keys, kinds, masters_exported, _ = ranks[0]
    assert masters_exported  # optimizer=opt: the FP32 masters themselves, exactly
    assert keys == sorted(transformers.LlamaForCausalLM(_config()).state_dict())
    assert kinds == ["Tensor torch.bfloat16", "Tensor torch.float32"], kinds  # FP8 weights bf16, the rest as trained
    loaded = transformers.LlamaForCausalLM.from_pretrained(out_dir, torch_dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and type(p) is torch.nn.Parameter for p in loaded.parameters())
    weights = dict(loaded.named_parameters())
    shards = [(name, first, values) for r in ranks for name, (first, values) in r[-1].items()]
    assert len(shards) == FP8_WEIGHTS * len(ranks)
    for name, first, values in shards:  # every row of every FP8 weight: its dequantized FP8 value, exactly
        assert torch.equal(weights[name][first:first + len(values)], values), name
    with torch.no_grad():
        got = loaded(input_ids=x).logits.float()
    assert (got - logits).norm() / logits.norm() < 2e-2


def _export_without_the_line(root, out_dir):
    """``get_state_dict`` + ``save_pretrained`` as accelerate documents them, without
    ``high_precision_state_dict``, next to what ``save_state`` under ``FULL_STATE_DICT`` writes."""
    accelerator, model, opt = _prepared("accelerate", state_dict_type="FULL_STATE_DICT")
    _train(accelerator, model, opt, 2)
    accelerator.save_state(root)
    state_dict = accelerator.get_state_dict(model)
    fp8 = sorted(k for k, v in state_dict.items() if isinstance(v, dict))
    same = True
    if accelerator.is_main_process:  # the full state dict is on rank 0 (cpu_offload)
        saved = torch.load(os.path.join(root, "pytorch_model_fsdp.bin"), weights_only=True)
        flat = lambda sd: {(k, n): t for k, v in sd.items() for n, t in (v.items() if isinstance(v, dict) else [("", v)])}
        a, b = flat(state_dict), flat(saved)
        same = a.keys() == b.keys() and all(
            torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)
    failure = None
    try:
        accelerator.unwrap_model(model).save_pretrained(out_dir, state_dict=state_dict,
                                                        is_main_process=accelerator.is_main_process)
    except Exception as err:  # noqa: BLE001  (reported to the test)
        frame = err.__traceback__
        while frame.tb_next is not None:
            frame = frame.tb_next
        failure = (type(err).__name__, str(err), frame.tb_frame.f_code.co_filename)
    accelerator.wait_for_everyone()
    return fp8, same, failure


def test_get_state_dict_without_the_line_is_the_checkpoint_and_save_pretrained_fails(pools, tmp_path):
    """Why the export needs its one line (docs/README.md, accelerate): without
    ``high_precision_state_dict``, ``get_state_dict`` returns on rank 0 exactly what
    ``save_state`` under ``FULL_STATE_DICT`` writes for the model (the same torch call with the same
    options; every FP8 weight a plain dict of full planes, which that resume needs), and
    ``save_pretrained`` fails in huggingface_hub at the first FP8 entry's ``.device``. Should a
    torch / transformers / huggingface_hub release change either, this fails, and the
    documented reasons must be re-examined."""
    ranks = pools[WORLD_SIZES[0]].run(_export_without_the_line, str(tmp_path / "state"), str(tmp_path / "hf"))
    fp8, same, failure = ranks[0]
    assert len(fp8) == FP8_WEIGHTS and same, (fp8, same)
    assert all(r[0] == [] and r[2] is None for r in ranks[1:]), ranks[1:]  # other ranks: an empty dict, nothing written
    kind, message, where = failure
    assert kind == "AttributeError" and message == "'dict' object has no attribute 'device'", failure
    assert where.endswith(os.path.join("huggingface_hub", "serialization", "_torch.py")), failure
    assert not os.path.exists(tmp_path / "hf" / "model.safetensors")
