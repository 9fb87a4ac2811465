"""The optimizer step's requantization replayed as a CUDA graph (``master._GraphedRequantize``)
writes what the eager step writes, byte for byte, on a CUDA device.

Two :class:`MasterWeightOptimizer` over two copies of the same model, one with
``cuda_graph=True`` and one with ``cuda_graph=False``, get the same gradients for several steps;
after each step every FP8 plane (data and scale_inv) and every delayed-scaling state must be
byte-identical between them, the graphed one must really have replayed a graph, and no plane may
have moved (the graph writes into the weights' storage). Then the graphed optimizer loads the
eager one's state dict (new scaling-state tensors): its graph must follow the new tensors, not
write into the old ones. Runs for every recipe (MXFP8 through the reference recipe on sm_90).
"""

from __future__ import annotations

import copy
import gc
import warnings

import pytest
import torch
from torch import nn

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: CUDA graphs need one", allow_module_level=True)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("transformer_engine.pytorch")

from conftest import assert_bytes_equal  # noqa: E402

import dtensor_fp8 as d  # noqa: E402

SHAPES = [(640, 1024), (1024, 256), (256, 512)]


def _model(recipe):
    torch.manual_seed(0)
    layers = [nn.Linear(k, m, bias=False, device="cuda") for m, k in SHAPES]
    with torch.no_grad():
        for i, layer in enumerate(layers):
            layer.weight.mul_(10.0 ** (i - 1))  # different magnitudes: different scales per weight
    return d.quantize_module_(nn.Sequential(*layers), recipe)


def _planes(model):
    return {(n, u): pl for n, p in model.named_parameters() for u, pl in p.planes.items()}


def _assert_same(a_model, b_model, a_opt, b_opt, what):
    for key, pa in _planes(a_model).items():
        pb = _planes(b_model)[key]
        assert_bytes_equal(pa.data, pb.data, f"{what}/{key}/data")
        assert_bytes_equal(pa.scale_inv, pb.scale_inv, f"{what}/{key}/scale_inv")
    assert a_opt.scaling_states.keys() == b_opt.scaling_states.keys()
    for key, state in a_opt.scaling_states.items():
        for field, t in state.items():
            assert_bytes_equal(t, b_opt.scaling_states[key][field], f"{what}/{key}/{field}")


def _step(models_opts, step):
    g = torch.Generator(device="cuda").manual_seed(step)
    grads = [torch.randn(m, k, device="cuda", generator=g) * (1 + step) for m, k in SHAPES]
    for model, opt in models_opts:
        for p, grad in zip(model.parameters(), grads):
            p.grad = grad.to(p.dtype)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("master_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(d.RECIPES))
def test_graphed_requantize_matches_eager(name, master_dtype):
    recipe = d.RECIPES[name]
    graphed, eager = _model(recipe), _model(recipe)
    g_opt = d.MasterWeightOptimizer(graphed, torch.optim.Adam, lr=1e-2, master_dtype=master_dtype, fused=True)
    e_opt = d.MasterWeightOptimizer(eager, torch.optim.Adam, lr=1e-2, master_dtype=master_dtype, fused=True,
                                    cuda_graph=False)
    ptrs = {k: (p.data.data_ptr(), p.scale_inv.data_ptr()) for k, p in _planes(graphed).items()}
    for step in range(5):
        _step([(graphed, g_opt), (eager, e_opt)], step)
        _assert_same(graphed, eager, g_opt, e_opt, f"{name}/step{step}")
    assert g_opt._requantize.disabled_reason is None, g_opt._requantize.disabled_reason
    assert g_opt._requantize.replays == 4, g_opt._requantize.replays  # step 0 runs eagerly
    assert e_opt._requantize.replays == 0
    assert {k: (p.data.data_ptr(), p.scale_inv.data_ptr()) for k, p in _planes(graphed).items()} == ptrs

    # A loaded checkpoint: masters and scaling states are copied into the optimizer's own tensors
    # (their storage is kept), so the graph stays valid and replays on the loaded values; a graph
    # over stale tensors would part from the eager run.
    scaling_ptrs = {k: [t.data_ptr() for t in s.values()] for k, s in g_opt.scaling_states.items()}
    g_opt.load_state_dict(copy.deepcopy(e_opt.state_dict()))
    assert {k: [t.data_ptr() for t in s.values()] for k, s in g_opt.scaling_states.items()} == scaling_ptrs
    for step in range(5, 8):
        _step([(graphed, g_opt), (eager, e_opt)], step)
        _assert_same(graphed, eager, g_opt, e_opt, f"{name}/after-load/step{step}")
    assert g_opt._requantize.replays == 4 + 3, g_opt._requantize.replays


def test_a_graph_freed_by_the_garbage_collector_during_capture_leaves_the_capture_valid(monkeypatch):
    """Another CUDA graph kept alive only by a reference cycle becomes garbage the moment the
    requantization's capture begins, and the collector runs at every allocation: were it to run
    inside the capture, that graph's destruction (forbidden while capturing) would invalidate it,
    turning the graphs off (seen in the GPU suite of 2026-12-06 when an earlier test's graph was
    collected there)."""
    model = _model(d.RECIPES["current"])
    opt = d.MasterWeightOptimizer(model, torch.optim.Adam, lr=1e-2, fused=True)
    _step([(model, opt)], 0)  # eager: the first step with new tensors

    cycle = {}
    cycle["self"], cycle["graph"] = cycle, torch.cuda.CUDAGraph()
    with torch.cuda.graph(cycle["graph"]):
        torch.ones(4, device="cuda").mul_(2)
    holder = [cycle]
    del cycle
    begin = torch.cuda.CUDAGraph.capture_begin

    def capture_begin(self, *args, **kwargs):  # from here on the cycle is garbage
        begin(self, *args, **kwargs)
        holder.clear()

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", capture_begin)
    threshold = gc.get_threshold()
    gc.set_threshold(1)  # a collection at every allocation of a tracked object
    try:
        _step([(model, opt)], 1)  # captures, then replays
    finally:
        gc.set_threshold(*threshold)
    assert not holder
    assert opt._requantize.disabled_reason is None, opt._requantize.disabled_reason
    assert opt._requantize.replays == 1
    gc.collect()  # the cycle's graph goes now, outside any capture
