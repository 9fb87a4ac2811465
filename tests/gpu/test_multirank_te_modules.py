"""TE modules on dtensor_fp8 parameters under ``fully_shard`` with real shards: world sizes 2 and 4
on one GPU, every rank on ``cuda:0`` over gloo (``tests/dist_utils.py``, backend ``gloo-cuda``).

At world size 1 FSDP2 shards nothing and every "gather" is a local copy; here the FP8 planes are
really sharded, all-gathered (forward: rowwise, backward: columnwise), re-pointed into TE's
tensors, and the gradients reduce-scattered. Checked against the same code at world size 1 (a
one-rank pool: same weights, same inputs, same kernels):

1. te.Linear / LayerNormLinear / LayerNormMLP / TransformerLayer, delayed, current and 2-D
   blockwise (and MXFP8 on sm_100+): forward output, input gradient and every parameter's
   gradient bit-equal to world size 1 (see [Note: why world N is bit-equal to world 1]); the
   bytes each rank hands to the all-gather in forward and in backward equal the FP8 bytes of its
   shards plus their block scales (plus the bf16 shards of the high-precision parameters).
2. MXFP8 gathers through the reference recipe (TE's MXFP8 kernels need sm_100+): the gathered
   ``MXFP8Tensor`` holds exactly the planes of the full weight's quantization, one direction or
   both, and moves only those bytes.

[Note: why world N is bit-equal to world 1]
Every rank runs the same full input (no batch split): the gathered FP8 weights are byte for byte
the world-1 weights, so each rank's forward, input gradient and local (unreduced) weight gradient
are world 1's, given deterministic kernels (``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` for the
attention backward). Delayed scaling all-reduces activation amaxes over the world (TE's default
group): a MAX, exact in any order. What remains is the gradient reduce-scatter, which averages N
identical bf16 gradients: in bf16, 3x (a partial sum at world 4) needs a bit more than bf16 has,
so the sum would depend on gloo's order. With ``MixedPrecisionPolicy(reduce_dtype=float32)`` the
sum of up to 4 identical bf16 values is exact in fp32 in any order, the division by N is exact,
and the cast back to bf16 returns the value: the reduced gradient is bit-equal to world 1's.
(The 20-step training test of test_multirank_te_training.py uses the default bf16 reduction and
split batches, with a tolerance.)
"""

from __future__ import annotations

import math
import os
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

from transformer_engine.common import recipe as te_recipe  # noqa: E402

import dtensor_fp8 as d  # noqa: E402
from conftest import assert_bytes_equal  # noqa: E402
from dist_utils import CollectiveBytes  # noqa: E402
from dtensor_fp8 import te as dte  # noqa: E402

BF16 = torch.bfloat16
CC = torch.cuda.get_device_capability()
MX_REASON = (f"TE's MXFP8 kernels are compiled for sm_100+ only; this device is sm_{CC[0]}{CC[1]} "
             "(TE's MXFP8 quantize writes nothing and its GEMMs raise here)")
WORLDS = [2, 4]

#: recipe name -> (our recipe, the te.autocast recipe that matches it)
RECIPES = {
    "delayed": (d.DelayedScaling(), lambda: te_recipe.DelayedScaling()),
    "current": (d.CurrentScaling(), lambda: te_recipe.Float8CurrentScaling()),
    "block2d": (d.Blockwise(block_dims=2), lambda: te_recipe.Float8BlockScaling()),
    "mxfp8": (d.MXFP8(), lambda: te_recipe.MXFP8BlockScaling()),
}
#: recipes whose TE GEMMs run on this device
GEMM_NAMES = [n for n in RECIPES if n != "mxfp8" or CC >= (10, 0)]
KINDS = ["Linear", "LayerNormLinear", "LayerNormMLP", "TransformerLayer"]
# Every FP8 weight has 128 x k rows per rank at world 4 (whole 128x128 blocks); every 1-D
# parameter splits evenly.
HIDDEN, FFN = 1024, 2048
LAYER_HIDDEN, LAYER_FFN, LAYER_HEADS = 512, 2048, 8


# ---- shared with test_multirank_te_training.py (runs on the ranks) ----------------------------------
def fresh_te_state() -> None:
    """Each task starts from TE's initial global FP8 state (the rank processes outlive tests) and
    with deterministic attention kernels (read when a TE attention module is built)."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    FP8GlobalStateManager.reset()
    os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"


@torch.no_grad()
def fill_(module: nn.Module, seed: int) -> nn.Module:
    """Deterministic parameter values from a CPU generator (whatever TE's init drew): weights
    ~N(0, 0.02^2) with some rows 30x larger, layer-norm weights around 1, biases small."""
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        values = torch.randn(p.shape, generator=g)
        if p.dim() == 2:
            values = values * 0.02
            values[::97] *= 30
        elif "layer_norm_weight" in name:
            values = 1 + 0.1 * values
        else:
            values = 0.02 * values
        p.copy_(values.to(p.dtype))
    return module


def transformer_layer(layer_number: int = 1) -> nn.Module:
    return te.TransformerLayer(LAYER_HIDDEN, LAYER_FFN, LAYER_HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                               fuse_qkv_params=True, params_dtype=BF16, device="cuda",
                               self_attn_mask_type="causal", layer_number=layer_number)


def build(kind: str, seed: int = 0) -> nn.Module:
    if kind == "Linear":
        module = te.Linear(HIDDEN, FFN, bias=True, params_dtype=BF16, device="cuda")
    elif kind == "LayerNormLinear":
        module = te.LayerNormLinear(HIDDEN, FFN, bias=True, params_dtype=BF16, device="cuda")
    elif kind == "LayerNormMLP":
        module = te.LayerNormMLP(HIDDEN, FFN, bias=True, params_dtype=BF16, device="cuda")
    elif kind == "TransformerLayer":
        module = transformer_layer()
    else:
        raise KeyError(kind)
    return fill_(module, seed)


def io_shapes(kind: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(input, output) shapes; TransformerLayer takes (seq, batch, hidden)."""
    if kind == "TransformerLayer":
        return (128, 2, LAYER_HIDDEN), (128, 2, LAYER_HIDDEN)
    return (2, 256, HIDDEN), (2, 256, HIDDEN if kind == "LayerNormMLP" else FFN)


def fp8_params(module: nn.Module):
    """``(name, parameter, local QuantizedTensor)`` of the module's FP8 parameters (DTensors)."""
    out = []
    for name, p in module.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if isinstance(local, d.QuantizedTensor):
            out.append((name, p, local))
    return out


def expected_sent_bytes(shapes, name: str, world: int, usages: tuple[str, ...]) -> int:
    """Bytes one rank hands to one FSDP2 all-gather of a group with these parameters (written
    from the recipes' byte layouts, independently of fsdp.py): per FP8 weight its shard's FP8
    bytes per gathered plane, plus the plane's block scales where blocks lie along dim 0 (per-tensor
    scales are identical on every rank and not sent), padded to the larger of the two planes'
    scale grids; per high-precision parameter its (padded) bf16 shard."""
    planes = {"mxfp8": len(usages)}.get(name, 1)  # per-tensor and 128x128: one stored plane serves both
    total = 0
    for shape, is_fp8 in shapes:
        rows, rest = -(-shape[0] // world), math.prod(shape[1:])
        if not is_fp8:
            total += rows * rest * 2
            continue
        scales = {"block2d": -(-rows // 128) * -(-rest // 128) * 4,  # fp32, one per 128x128 block
                  "mxfp8": rows * rest // 32}.get(name, 0)  # E8M0 bytes: (rows, K/32) == (rows/32, K)
        total += planes * (rows * rest + scales)
    return total


# ---- 1. forward and backward bit-equal to world size 1 ----------------------------------------------
def _forward_backward(name):
    """Every kind of TE module, sharded over the world: output, input gradient, gradients (full,
    rank 0 only) and the bytes moved by the all-gathers of forward and backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    fresh_te_state()
    recipe, make_recipe = RECIPES[name]
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cuda", (world,))
    out = {}
    for i, kind in enumerate(KINDS):
        module = build(kind, seed=i)
        shapes = [(tuple(p.shape), p.dim() == 2) for p in module.parameters()]
        dte.quantize_te_module_(module, recipe)
        # A non-root group that reshards after forward: a forward gather (rowwise) and a backward
        # gather (columnwise). fp32 reduction: see the note at the top.
        fully_shard(module, mesh=mesh, reshard_after_forward=True,
                    mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
        root = fully_shard(nn.Sequential(module), mesh=mesh)
        in_shape, out_shape = io_shapes(kind)
        g = torch.Generator().manual_seed(100 + i)
        x = torch.randn(in_shape, generator=g).to("cuda", BF16).requires_grad_(True)
        dy = torch.randn(out_shape, generator=g).to("cuda", BF16)
        with CollectiveBytes() as fwd:
            with te.autocast(enabled=True, recipe=make_recipe()):
                y = root(x)
        with CollectiveBytes() as bwd:
            y.backward(dy)
        for pname, p, local in fp8_params(module):  # still FP8 shards after a step of both directions
            assert all(pl.data.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for pl in local.planes.values()), pname
        grads = {pname: p.grad.full_tensor().cpu() for pname, p in root.named_parameters()}
        out[kind] = {"y": y.detach().cpu(), "dx": x.grad.cpu(), "grads": grads if rank == 0 else None,
                     "shapes": shapes, "fwd": fwd.calls, "bwd": bwd.calls}
    return out


_WORLD_1: dict[str, dict] = {}


def _world_1(pools, name):
    """The world-size-1 run of ``name`` (computed once per session)."""
    if name not in _WORLD_1:
        _WORLD_1[name] = pools[1].run(_forward_backward, name)[0]
    return _WORLD_1[name]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", GEMM_NAMES)
def test_te_modules_bit_equal_to_world_1_and_move_fp8_bytes(gloo_cuda_pools, name, world):
    ref = _world_1(gloo_cuda_pools, name)
    results = gloo_cuda_pools[world].run(_forward_backward, name)
    for kind in KINDS:
        r1 = ref[kind]
        # the reference itself is a real result (else equality would show nothing)
        for what, t in [("output", r1["y"]), ("input gradient", r1["dx"]), *r1["grads"].items()]:
            t = t.float()
            assert torch.isfinite(t).all() and t.abs().max() > 0, f"{name} {kind} world 1: {what} is zero or not finite"
        for rank, r in enumerate(results):
            what = f"{name} {kind} world {world} rank {rank}"
            assert_bytes_equal(r[kind]["y"], r1["y"], f"{what}: forward output")
            assert_bytes_equal(r[kind]["dx"], r1["dx"], f"{what}: input gradient")
        grads = results[0][kind]["grads"]
        assert grads.keys() == r1["grads"].keys()
        for pname, grad in grads.items():
            assert_bytes_equal(grad, r1["grads"][pname], f"{name} {kind} world {world}: gradient of {pname}")
        # Bytes at the collective: one all-gather per direction, uint8, of FP8 shards + block scales.
        shapes = results[0][kind]["shapes"]
        for direction, usages in (("fwd", ("rowwise",)), ("bwd", ("columnwise",))):
            expected = expected_sent_bytes(shapes, name, world, usages)
            for rank, r in enumerate(results):
                calls = r[kind][direction]
                assert [(dt, sent, recv) for dt, sent, recv in calls] == [(torch.uint8, expected, expected * world)], (
                    f"{name} {kind} world {world} rank {rank} {direction}: {calls}, expected one uint8 gather of "
                    f"{expected} bytes")
        bf16 = sum(math.prod(s) for s, _ in shapes) * 2 // world
        print(f"{name} {kind} world {world}: {expected} bytes per rank per direction (bf16 FSDP2: {bf16})")


# ---- 2. MXFP8 gathers through the reference recipe --------------------------------------------------
def _mxfp8_gathers(reshard_after_forward):
    """LayerNormMLP with MXFP8 weights, sharded: ``unshard()`` (the forward gather, or both planes
    when the group keeps its weights after forward) against the full weights' quantization."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fresh_te_state()
    world = dist.get_world_size()
    module = build("LayerNormMLP")
    full = {n: d.quantize(p.detach(), d.MXFP8()) for n, p in module.named_parameters() if p.dim() == 2}
    shapes = [(tuple(p.shape), p.dim() == 2) for p in module.parameters()]
    dte.quantize_te_module_(module, d.MXFP8())
    fully_shard(module, mesh=init_device_mesh("cuda", (world,)), reshard_after_forward=reshard_after_forward)
    with CollectiveBytes() as counted:
        module.unshard()
    problems, served = [], set()
    for n, p in module.named_parameters():
        if p.dim() != 2:
            continue
        if type(p).__name__ != "MXFP8Tensor":
            problems.append(f"{n}: unsharded parameter is a {type(p).__name__}")
            continue
        gathered = dte.from_te_tensor(p)
        served |= {u for u in ("rowwise", "columnwise") if getattr(p, f"_{u}_data") is not None}
        for u in gathered.usages:
            got, ref = gathered.plane(u), full[n].plane(u)
            for part in ("data", "scale_inv"):
                a, b = getattr(got, part).contiguous().view(torch.uint8), getattr(ref, part).contiguous().view(torch.uint8)
                if a.shape != b.shape or not torch.equal(a, b):
                    problems.append(f"{n} {u} {part}: differs from the full weight's quantization")
    module.reshard()
    return problems, sorted(served), counted.calls, shapes


@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["forward_gather", "both_planes"])
@pytest.mark.parametrize("world", WORLDS)
def test_mxfp8_gathers_through_reference_recipe(gloo_cuda_pools, world, reshard_after_forward):
    usages = ("rowwise",) if reshard_after_forward else ("rowwise", "columnwise")
    for rank, (problems, served, calls, shapes) in enumerate(gloo_cuda_pools[world].run(_mxfp8_gathers, reshard_after_forward)):
        assert not problems, f"rank {rank}: {problems}"
        assert tuple(served) == tuple(sorted(usages)), (rank, served)
        expected = expected_sent_bytes(shapes, "mxfp8", world, usages)
        assert calls == [(torch.uint8, expected, expected * world)], (rank, calls, expected)
    if CC < (10, 0):
        print("MXFP8 gathers checked; TE GEMMs not run: " + MX_REASON)
