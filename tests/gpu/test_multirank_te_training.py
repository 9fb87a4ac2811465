"""Training and DCP checkpoints of TE modules on dtensor_fp8 parameters with real shards: world
sizes 2 and 4 on one GPU, every rank on ``cuda:0`` over gloo (see test_multirank_te_modules.py).

1. A stack of two te.TransformerLayer trains 20 steps under ``fully_shard`` +
   ``MasterWeightOptimizer`` (AdamW) at world sizes 1, 2 and 4 on the same global batch (each rank
   its slice): the losses match world 1 to the tolerance stated at ``LOSS_RTOL``, and after every
   optimizer step each per-tensor scale is identical on every rank.
2. DCP: a TransformerLayer sharded over 2 ranks, trained 2 steps, saved with ``dcp.save``; loaded
   with ``dcp.load`` into a fresh one at world sizes 1 and 4: every FP8 plane (data and scales)
   bit-exact, TE's extra state (delayed scaling's amax histories and scales) identical, and the
   next forward bit-equal to the saved model's.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    te = pytest.importorskip("transformer_engine.pytorch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: multi-rank TE module tests need a GPU", allow_module_level=True)

import dtensor_fp8 as d  # noqa: E402
from dtensor_fp8 import te as dte  # noqa: E402
from test_multirank_te_modules import (  # noqa: E402
    BF16, GEMM_NAMES, LAYER_HIDDEN, MX_REASON, RECIPES, WORLDS, fill_, fp8_params, fresh_te_state, transformer_layer,
)

SEQ, BATCH, LAYERS, STEPS, LR = 256, 4, 2, 20, 2e-4
TRAIN_NAMES = ["delayed", "current", "block2d"]
#: |loss(world N) - loss(world 1)| / loss(world 1), at every one of the 20 steps. Both runs see the
#: same global batch; world N splits it over its ranks, so what differs is only where a sum is
#: split: each rank's GEMMs over a quarter or half of the tokens (other cuBLAS tilings), the bf16
#: gradient reduce-scatter (another summation order), and, for current scaling, the activations'
#: per-tensor scales, which each rank takes from its own slice (TE's current-scaling quantizers do
#: not reduce amaxes across data-parallel ranks; delayed scaling all-reduces them, 2-D blockwise
#: activations use 1x128 blocks within a token). Once a master weight crosses an FP8 rounding
#: boundary in one run and not the other, that weight differs by one FP8 step, and AdamW's
#: normalized updates carry such differences on: the losses drift apart slowly, not at FP8
#: resolution at step 0.
LOSS_RTOL = 1e-2


# ---- 1. 20 training steps against world 1 -------------------------------------------------------
def _stack(name):
    layers = [fill_(transformer_layer(layer_number=i + 1), seed=10 + i) for i in range(LAYERS)]
    model = nn.Sequential(*layers)
    dte.quantize_te_module_(model, RECIPES[name][0])
    return model


def _batch():
    """The global batch, (seq, batch, hidden): the same every step (the loss must go down)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SEQ, BATCH, LAYER_HIDDEN, generator=g)
    target = torch.randn(SEQ, BATCH, LAYER_HIDDEN, generator=g)
    return x.to("cuda", BF16), target.to("cuda", BF16)


def _per_tensor_scales(model) -> tuple[list[str], torch.Tensor]:
    names, scales = [], []
    for name, _, local in fp8_params(model):
        for usage, plane in local.planes.items():
            if plane.scale_inv.numel() == 1:  # one scale for the whole tensor
                names.append(f"{name}/{usage}")
                scales.append(plane.scale_inv.float().reshape(1))
    return names, (torch.cat(scales) if scales else torch.zeros(0, device="cuda"))


def _train(name):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fresh_te_state()
    _, make_recipe = RECIPES[name]
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _stack(name)
    mesh = init_device_mesh("cuda", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=LR)
    x, target = _batch()
    per_rank = BATCH // world
    rows = slice(rank * per_rank, (rank + 1) * per_rank)  # this rank's sequences
    x, target = x[:, rows].contiguous(), target[:, rows].contiguous()
    losses, scale_mismatches, n_scales = [], [], 0
    for step in range(STEPS):
        with te.autocast(enabled=True, recipe=make_recipe()):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), target.float())
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # every rank's slice has the same size: the mean of the means
        losses.append(total.item() / world)
        names, scales = _per_tensor_scales(model)
        n_scales = len(names)
        if names:  # every rank's per-tensor scales, bit for bit
            everyone = [torch.empty_like(scales) for _ in range(world)]
            dist.all_gather(everyone, scales)
            for r, other in enumerate(everyone):
                differ = (other.view(torch.int32) != scales.view(torch.int32)).nonzero().flatten().tolist()
                scale_mismatches += [f"step {step}: {names[i]} rank {rank} vs rank {r}" for i in differ]
    for pname, p, local in fp8_params(model):
        assert all(pl.data.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for pl in local.planes.values()), pname
    return losses, scale_mismatches, n_scales


_REFERENCE: dict[str, list[float]] = {}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", TRAIN_NAMES)
def test_training_matches_world_1(gloo_cuda_pools, name, world, record_property):
    if name not in _REFERENCE:
        _REFERENCE[name] = gloo_cuda_pools[1].run(_train, name)[0][0]
    ref = _REFERENCE[name]
    results = gloo_cuda_pools[world].run(_train, name)
    losses = results[0][0]
    assert all(r[0] == losses for r in results), "ranks disagree on the all-reduced loss"
    for rank, (_, mismatches, n_scales) in enumerate(results):
        assert not mismatches, f"per-tensor scales differ between ranks after optimizer steps: {mismatches[:10]}"
        if name in ("delayed", "current"):
            assert n_scales == 4 * 2 * 1, (rank, n_scales)  # qkv, proj, fc1, fc2 per layer, one plane each
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, ref)]
    line = (f"{name} world {world}: losses {['%.5f' % v for v in losses]}\n"
            f"{name} world 1: losses {['%.5f' % v for v in ref]}\nmax rel diff {max(rel):.3e} (step {rel.index(max(rel))})")
    print(line)
    record_property("losses", line)
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0], line
    assert max(rel) < LOSS_RTOL, line


# ---- 2. DCP: save at world 2, load at world 1 and 4 ---------------------------------------------------
DCP_NAMES = ["delayed", "current", "block2d", "mxfp8"]
UNSAFE_PICKLE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"


def _can_forward(name) -> bool:
    return name in GEMM_NAMES


def _dcp_model(name, seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(fill_(transformer_layer(), seed=seed))
    dte.quantize_te_module_(model, RECIPES[name][0])
    fully_shard(model, mesh=init_device_mesh("cuda", (dist.get_world_size(),)))
    return model


def _probe_input():
    g = torch.Generator().manual_seed(11)
    return torch.randn(128, 2, LAYER_HIDDEN, generator=g).to("cuda", BF16)


def _snapshot(model, name):
    """Full FP8 planes (gathered; bytes on the CPU), TE extra states (bytes), and the next
    forward's output on a fixed input (no gradient: TE's scaling state is left as it is)."""
    planes = {}
    for pname, p, local in fp8_params(model):
        for usage in local.usages:
            full = d.for_usage(p, usage).full_tensor().plane(usage)
            planes[f"{pname}/{usage}/data"] = full.data.contiguous().view(torch.uint8).cpu()
            planes[f"{pname}/{usage}/scale_inv"] = full.scale_inv.contiguous().view(torch.uint8).cpu()
    extra = {k: bytes(v.cpu().numpy().tobytes()) for k, v in model.state_dict().items() if k.endswith("_extra_state")}
    y = None
    if _can_forward(name):
        with torch.no_grad(), te.autocast(enabled=True, recipe=RECIPES[name][1]()):
            y = model(_probe_input()).cpu()
    return planes, extra, y


def _dcp_save(name, path):
    import torch.distributed.checkpoint as dcp

    fresh_te_state()
    model = _dcp_model(name, seed=0)
    if _can_forward(name):  # two steps: trained weights, and a TE scaling state to save
        opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, lr=LR)
        x = _probe_input()
        for _ in range(2):
            with te.autocast(enabled=True, recipe=RECIPES[name][1]()):
                model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    dcp.save(model.state_dict(), checkpoint_id=path)
    return _snapshot(model, name)


@contextlib.contextmanager
def _unsafe_pickle_allowed():
    """TE 2.20 refuses to unpickle delayed-scaling extra state unless the user opts in (a pickle can
    run code); our own checkpoint is trusted."""
    before = os.environ.get(UNSAFE_PICKLE_ENV)
    os.environ[UNSAFE_PICKLE_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[UNSAFE_PICKLE_ENV]
        else:
            os.environ[UNSAFE_PICKLE_ENV] = before


def _dcp_load(name, path):
    import torch.distributed.checkpoint as dcp

    fresh_te_state()
    model = _dcp_model(name, seed=1)  # other values everywhere
    state = model.state_dict()
    # TE's extra state is a byte string whose length differs between a fresh and a trained module
    # (empty before the first FP8 forward); DCP loads a tensor only into one of the saved size.
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for key in [k for k in state if k.endswith("_extra_state")]:
        state[key] = torch.empty(tuple(saved[key].size), dtype=saved[key].properties.dtype)
    dcp.load(state, checkpoint_id=path)
    with _unsafe_pickle_allowed():
        model.load_state_dict(state)
    return _snapshot(model, name)


def _decoded(blob: bytes):
    """TE's extra state: empty (stateless recipes, or before any FP8 forward) or a pickled dict."""
    return {} if not blob else pickle.loads(blob)  # noqa: S301  (written by this test)


def _assert_same_extra_state(got: bytes, saved: bytes, what: str) -> None:
    a, b = _decoded(got), _decoded(saved)
    assert a.keys() == b.keys(), (what, sorted(a), sorted(b))
    for key in b:
        if isinstance(b[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8)), (what, key)
        elif key == "extra_fp8_variables":  # what the saved module had; the loaded one may add its own
            assert all(a[key].get(k) == v for k, v in b[key].items()), (what, key, a[key], b[key])
        else:
            assert a[key] == b[key], (what, key, a[key], b[key])


@pytest.mark.parametrize("name", DCP_NAMES)
def test_dcp_save_world_2_load_world_1_and_4(gloo_cuda_pools, tmp_path, name):
    path = str(tmp_path / "ckpt")
    saved = gloo_cuda_pools[2].run(_dcp_save, name, path)
    planes, extra, y = saved[0]
    assert planes and all(s[0].keys() == planes.keys() for s in saved)
    for s in saved[1:]:  # the replicated view of the model is the same on both ranks
        assert all(torch.equal(s[0][k], planes[k]) for k in planes) and s[1].keys() == extra.keys()
        for key, blob in extra.items():
            _assert_same_extra_state(s[1][key], blob, f"{name} saved, rank 1 vs rank 0: {key}")
    if name == "delayed":  # the stateful recipe: TE saved the GEMM modules' amax histories and scales
        gemm_modules = [k for k in extra if any(m in k for m in ("layernorm_qkv", "proj", "layernorm_mlp"))]
        assert len(gemm_modules) == 3, sorted(extra)
        assert all("amax_history_fwd" in _decoded(extra[k]) for k in gemm_modules), {k: len(v) for k, v in extra.items()}
    for world in (1, 4):
        for rank, (got_planes, got_extra, got_y) in enumerate(gloo_cuda_pools[world].run(_dcp_load, name, path)):
            what = f"{name} loaded at world {world} rank {rank}"
            assert got_planes.keys() == planes.keys(), what
            for key, ref in planes.items():
                assert torch.equal(got_planes[key], ref), f"{what}: {key} differs from the saved bytes"
            assert got_extra.keys() == extra.keys(), what
            for key, blob in extra.items():
                _assert_same_extra_state(got_extra[key], blob, f"{what}: {key}")
            if y is not None:
                assert torch.equal(got_y.view(torch.int16), y.view(torch.int16)), \
                    f"{what}: next forward differs, max {(got_y.float() - y.float()).abs().max()}"
    if not _can_forward(name):
        print(f"{name}: planes checked; TE forward not run: " + MX_REASON)
