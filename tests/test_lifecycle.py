"""An FP8 weight's lifecycle (``dtensor_fp8/lifecycle.py``) on weights the library builds: the meta flow
(``quantize_module_`` on meta, ``to_empty``, the user's init, ``finish_init_``) and the loads between
two optimizer steps move it through its states, and a transition from a state it does not leave from
is refused with the states named."""

import copy
import io

import pytest
import torch
from torch import nn

import dtensor_fp8 as d
from dtensor_fp8.lifecycle import BytesState, LifecycleError, LoadedSinceStep

RECIPE = d.RECIPES["mxfp8"]


def _meta_layer() -> nn.Linear:
    with torch.device("meta"):
        layer = nn.Linear(256, 128, bias=False)
    return d.quantize_module_(layer, RECIPE)


def _lifecycle(layer: nn.Linear):
    return layer.weight.param_state.lifecycle


def test_the_meta_flow_moves_through_the_bytes_states():
    layer = _meta_layer()
    assert _lifecycle(layer).bytes_state is BytesState.META and layer.weight.bytes_pending
    layer.to_empty(device="cpu")
    assert _lifecycle(layer).bytes_state is BytesState.ALLOCATED and layer.weight.bytes_pending
    with pytest.raises(d.RecipeError, match="never written after"):  # ALLOCATED: it would train from zeros
        d.finish_init_(layer)
    nn.init.normal_(layer.weight, std=0.02)
    assert _lifecycle(layer).bytes_state is BytesState.INIT_WRITTEN
    with torch.no_grad():
        layer.weight.copy_(torch.randn(128, 256))  # a second write of the init stays there
    assert _lifecycle(layer).bytes_state is BytesState.INIT_WRITTEN
    assert d.finish_init_(layer) == ["weight"]
    assert _lifecycle(layer).bytes_state is BytesState.MADE and not layer.weight.bytes_pending
    assert d.finish_init_(layer) == []  # nothing pending: nothing moves


def test_an_init_on_the_meta_device_is_written_again_after_to_empty():
    layer = _meta_layer()
    nn.init.normal_(layer.weight)  # on meta: the values it wrote were never allocated
    assert _lifecycle(layer).bytes_state is BytesState.INIT_WRITTEN
    layer.to_empty(device="cpu")
    assert _lifecycle(layer).bytes_state is BytesState.ALLOCATED


def test_a_weight_quantized_from_values_is_made():
    layer = d.quantize_module_(nn.Linear(256, 128, bias=False), RECIPE)
    lifecycle = _lifecycle(layer)
    assert lifecycle.bytes_state is BytesState.MADE and lifecycle.loaded_since_step is LoadedSinceStep.NOTHING


@pytest.mark.parametrize("transition,state", [
    ("mark_to_empty", "MADE"), ("mark_init_written", "MADE"),
])
def test_a_made_weight_refuses_the_meta_transitions(transition, state):
    lifecycle = _lifecycle(d.quantize_module_(nn.Linear(256, 128, bias=False), RECIPE))
    with pytest.raises(LifecycleError, match=rf"{transition} of an FP8 weight whose bytes are {state}: legal only from"):
        getattr(lifecycle, transition)()
    assert lifecycle.bytes_state is BytesState.MADE  # refused: nothing moved


def test_bytes_are_made_only_from_written_values():
    layer = _meta_layer()
    with pytest.raises(LifecycleError, match="mark_made of an FP8 weight whose bytes are META: legal only from "
                                             "INIT_WRITTEN. finish_init_ makes"):
        _lifecycle(layer).mark_made()
    layer.to_empty(device="cpu")
    with pytest.raises(LifecycleError, match="mark_made of an FP8 weight whose bytes are ALLOCATED"):
        _lifecycle(layer).mark_made()
    with pytest.raises(LifecycleError, match="mark_built_on_meta of an FP8 weight whose bytes are ALLOCATED: legal "
                                             "only from MADE"):
        _lifecycle(layer).mark_built_on_meta()
    assert _lifecycle(layer).bytes_state is BytesState.ALLOCATED


def test_a_copy_of_pending_values_counts_as_their_init():
    source = _meta_layer()
    source.to_empty(device="cpu")
    nn.init.normal_(source.weight)
    target = d.quantize_module_(nn.Linear(256, 128, bias=False), RECIPE)
    with torch.no_grad():
        target.weight.copy_(source.weight)  # another owner's pending values: target's bytes are made from them
    assert _lifecycle(target).bytes_state is BytesState.INIT_WRITTEN
    assert torch.equal(target.weight.hp_init, source.weight.hp_init)
    assert d.finish_init_(target) == ["weight"] and _lifecycle(target).bytes_state is BytesState.MADE


def test_loads_between_two_steps():
    torch.manual_seed(0)
    layer = d.quantize_module_(nn.Linear(256, 128, bias=False), RECIPE)
    opt = d.MasterWeightOptimizer(layer, torch.optim.SGD, lr=0.1)
    lifecycle = _lifecycle(layer)
    other = d.quantize_module_(nn.Linear(256, 128, bias=False), RECIPE)
    layer.load_state_dict(other.state_dict())  # FP8 bytes of a checkpoint's entry
    assert lifecycle.loaded_since_step is LoadedSinceStep.BYTES and lifecycle.master_follows_loaded_bytes
    opt.load_state_dict(opt.state_dict())  # the optimizer's master too: it stands
    assert lifecycle.loaded_since_step == LoadedSinceStep.BYTES | LoadedSinceStep.MASTER
    assert not lifecycle.master_follows_loaded_bytes
    layer.weight.grad = torch.zeros(128, 256)
    opt.step()
    assert lifecycle.loaded_since_step is LoadedSinceStep.NOTHING
    layer.load_state_dict(other.state_dict())
    with torch.no_grad():
        layer.weight.copy_(torch.randn(128, 256))  # new values: the master took them, the load is forgotten
    assert lifecycle.loaded_since_step is LoadedSinceStep.NOTHING


def _saved_and_loaded(module: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_a_copy_keeps_the_bytes_state_and_forgets_the_loads():
    layer = _meta_layer()
    layer.to_empty(device="cpu")
    for copied in (copy.deepcopy(layer), _saved_and_loaded(layer)):
        assert _lifecycle(copied).bytes_state is BytesState.ALLOCATED
        assert _lifecycle(copied) is not _lifecycle(layer)
        with pytest.raises(d.RecipeError, match="never written after"):
            d.finish_init_(copied)
    made = d.quantize_module_(nn.Linear(256, 128, bias=False), RECIPE)
    d.MasterWeightOptimizer(made, torch.optim.SGD, lr=0.1)
    _lifecycle(made).mark_bytes_loaded()
    twin = copy.deepcopy(made)
    assert _lifecycle(twin).bytes_state is BytesState.MADE
    assert _lifecycle(twin).loaded_since_step is LoadedSinceStep.NOTHING  # the copy has no master to follow


def test_a_record_pickled_with_the_old_flags_loads():
    record = d.quantize(torch.randn(128, 256), RECIPE).param_state
    state = record.__getstate__()
    del state["lifecycle"]
    for flags, expected in [((False, None), BytesState.MADE), ((True, None), BytesState.META),
                            ((True, False), BytesState.ALLOCATED), ((True, True), BytesState.INIT_WRITTEN)]:
        old = type(record).__new__(type(record))
        old.__setstate__({**state, "bytes_pending": flags[0], "init_written": flags[1]})
        assert old.lifecycle.bytes_state is expected, flags
