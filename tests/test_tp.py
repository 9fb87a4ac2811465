"""FP8 parameters on a 2-D (dp, tp) mesh: torch's tensor parallelism, then FSDP2 on dp (4 gloo ranks).

Every check compares against something computed independently: the same model under 1-D FSDP2
(dp=4, the path tests/test_fsdp.py validates against one process), or the two-layer reference of
tests/test_fsdp.py evaluated on full weights quantized on one rank.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard

import dtensor_fp8 as d
from conftest import assert_bytes_equal
from dist_utils import DEVICE, WORLD_SIZES, CollectiveBytes
from test_placement import RECIPES

WORLD = 4
DP, TP = 2, 2
# Every weight is (512, 512): dim 0 / (dp * tp) = 128 rows and dim 1 / tp = 256 columns are whole
# 128x128 / 1x128 / 32x1 blocks on the 2-D mesh, and 512 / 4 = 128 rows are whole blocks for the
# 1-D dp=4 reference too.
DIM = HIDDEN = 512
HEADS = 4
BATCH, SEQ = 8, 4
STEPS = 10

needs_4_ranks = pytest.mark.skipif(WORLD not in WORLD_SIZES, reason=f"needs {WORLD} ranks")


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


class Attention(nn.Module):
    """q, k, v column-parallel (heads split over tp), out row-parallel; fp32 softmax attention.
    Biases on q (column-parallel: Shard(0)) and out (row-parallel: Replicate) take the addmm path."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(DIM, DIM, bias=i == 0) for i in range(3))
        self.out = nn.Linear(DIM, DIM, bias=True)

    def forward(self, x):
        b, s, _ = x.shape
        # local heads: DIM / head_dim of them without TP, a tp-th of them with it
        q, k, v = (t.view(b, s, -1, DIM // HEADS).transpose(1, 2) for t in (self.q(x), self.k(x), self.v(x)))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(DIM // HEADS), dim=-1)
        return self.out((att @ v).transpose(1, 2).reshape(b, s, -1))


MODELS = {"mlp": MLP, "attention": Attention}
PLANS = {
    "mlp": {"w1": ColwiseParallel(), "w2": RowwiseParallel()},
    "attention": {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "out": RowwiseParallel()},
}
SPREAD = {"mlp": (-1, 1), "attention": (-0.5, 0.5)}


def _hp_model(kind, seed=0, alternating=False):
    torch.manual_seed(seed)
    model = MODELS[kind]()
    with torch.no_grad():
        for layer in model.children():
            m = layer.weight.shape[0]
            if alternating:
                # odd rows 2^-12 of even rows: a columnwise block (32x1, 128x1) mixes both, so the
                # odd rows fall to FP8's subnormal range there (errors of several %) while their own
                # rowwise blocks (1x32, 1x128) keep full FP8 precision: the planes differ visibly.
                layer.weight.mul_((2.0 ** -12) ** (torch.arange(m) % 2).float()[:, None])
            else:  # spread magnitudes per output row (attention: less, to keep softmax out of saturation)
                layer.weight.mul_(torch.logspace(*SPREAD[kind], m)[:, None])
    return model.to(DEVICE)


def _build(kind, recipe, mesh_kind, seed=0, alternating=False):
    """The model with FP8 weights on a 2-D (dp=2, tp=2) mesh, or under 1-D FSDP (dp=4)."""
    model = d.quantize_module_(_hp_model(kind, seed, alternating), recipe)
    if mesh_kind == "2d":
        mesh = init_device_mesh(DEVICE, (DP, TP), mesh_dim_names=("dp", "tp"))
        d.parallelize_module(model, mesh["tp"], PLANS[kind])
        dp_mesh = mesh["dp"]
    else:
        dp_mesh = init_device_mesh(DEVICE, (torch.distributed.get_world_size(),))
    for layer in model.children():
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model, dp_mesh


def _batch(kind, step):
    g = torch.Generator().manual_seed(100 + step % 2)  # two batches in turn: the loss must go down
    shape = (BATCH, DIM) if kind == "mlp" else (BATCH, SEQ, DIM)
    return torch.randn(shape, generator=g).to(DEVICE), torch.randn(shape, generator=g).to(DEVICE)


# ---- placements ---------------------------------------------------------------------------------
def _placements(recipe_name):
    recipe = RECIPES[recipe_name]
    hp = _hp_model("mlp")
    model, _ = _build("mlp", recipe, "2d")
    w1, w2 = model.w1.weight, model.w2.weight
    assert w1.placements == (_StridedShard(0, split_factor=TP), Shard(0)), w1.placements
    assert w2.placements == (Shard(0), Shard(1)), w2.placements
    for name, w in (("w1", w1), ("w2", w2)):
        local = w.to_local()
        assert isinstance(local, d.QuantizedTensor), type(local)
        # this rank's FP8 bytes are exactly its piece of quantize(full): one scale for the logical
        # tensor under per-tensor recipes, whole blocks otherwise
        full = d.quantize(getattr(hp, name).weight.detach(), recipe)
        gathered = d.for_usage(w, "rowwise").full_tensor()
        assert isinstance(gathered, d.QuantizedTensor)
        assert_bytes_equal(gathered.plane("rowwise").data, full.plane("rowwise").data, f"{name} data")
        assert_bytes_equal(gathered.plane("rowwise").scale_inv, full.plane("rowwise").scale_inv, f"{name} scale")
    # FP32 masters start from exactly this rank's piece of the high-precision init, also for the
    # _StridedShard placement of w1 (built by torch's distribute_tensor with the same placements)
    opt = d.MasterWeightOptimizer(model, torch.optim.SGD, lr=0.5)
    for name, m in opt.masters.items():
        assert m.placements == getattr(model, name.split(".")[0]).weight.placements
        assert torch.equal(m.detach().full_tensor(), getattr(hp, name.split(".")[0]).weight.detach().float()), name
    # after a step, the requantized shards are still exactly quantize(full master): one scale for
    # the logical tensor under per-tensor recipes (amax reduced over dp and tp), whole blocks otherwise
    x = torch.randn(BATCH, DIM, device=DEVICE)
    model(x).pow(2).mean().backward()
    opt.step()
    for name, m in opt.masters.items():
        w = getattr(model, name.split(".")[0]).weight
        if recipe.spans_dim("rowwise", 0) and recipe.spans_dim("rowwise", 1):  # per-tensor: same scale everywhere
            scales = [torch.empty_like(w.to_local().plane("rowwise").scale_inv) for _ in range(WORLD)]
            torch.distributed.all_gather(scales, w.to_local().plane("rowwise").scale_inv.contiguous())
            assert all(torch.equal(sc, scales[0]) for sc in scales), (name, scales)
        if isinstance(recipe, d.DelayedScaling):  # next scale from the amax history, not quantize()'s
            continue
        ref = d.quantize(m.detach().full_tensor(), recipe)
        got = d.for_usage(w, "rowwise", "columnwise").full_tensor()
        for usage in got.planes:
            assert_bytes_equal(got.planes[usage].data, ref.planes[usage].data, f"{name} {usage} after step")
            assert_bytes_equal(got.planes[usage].scale_inv, ref.planes[usage].scale_inv, f"{name} {usage} scale")
    return True


@needs_4_ranks
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_placements_compose_and_shards_are_pieces_of_the_full_tensor(pools, recipe_name):
    pools[WORLD].run(_placements, recipe_name)


# ---- direction: forward reads rowwise, the input gradient reads columnwise --------------------------------
def _reference_input_grad(full_weights, x, upstream, backward_usage):
    h = F.linear(x, full_weights[0].dequantize(x.dtype, "rowwise"))
    g = upstream @ full_weights[1].dequantize(x.dtype, backward_usage)
    g = g * (h > 0)
    return g @ full_weights[0].dequantize(x.dtype, backward_usage)


PLANES_DIFFER = ("mxfp8", "blockwise1d")  # recipes whose columnwise plane holds other values


def _direction(recipe_name):
    recipe = RECIPES[recipe_name]
    alternating = recipe_name in PLANES_DIFFER  # per-tensor recipes: one plane, transposed
    hp = _hp_model("mlp", alternating=alternating)
    full = [d.quantize(hp.w1.weight.detach(), recipe), d.quantize(hp.w2.weight.detach(), recipe)]
    model, _ = _build("mlp", recipe, "2d", alternating=alternating)
    torch.manual_seed(7)  # same x and upstream on every rank (tp ranks need replicated inputs)
    x = torch.randn(BATCH, DIM, device=DEVICE, requires_grad=True)
    upstream = torch.randn(BATCH, DIM, device=DEVICE)
    if alternating:
        upstream[:, 0::2] = 0  # dx of w2 then comes from w2's odd rows only, where the planes differ
    for _ in range(2):  # the second iteration reuses FSDP's all-gather buffers (the out= path)
        x.grad = None
        (model(x) * upstream).sum().backward()
        for w in (model.w1.weight, model.w2.weight):
            assert isinstance(w.to_local(), d.QuantizedTensor)
            assert type(w.grad.to_local()) is torch.Tensor and w.grad.dtype == torch.float32
    expected = _reference_input_grad(full, x.detach(), upstream, "columnwise")
    wrong = _reference_input_grad(full, x.detach(), upstream, "rowwise")
    err = (x.grad - expected).abs().max().item()
    # fp32 sums split over tp ranks (all-reduced partial products) differ from the one-process
    # GEMM in the last bits only; reading the wrong plane changes the result at FP8 resolution.
    scale = expected.abs().max().item()
    assert err <= 1e-5 * scale, (err, scale)
    return err, (wrong - expected).abs().max().item(), scale


@needs_4_ranks
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_backward_reads_the_columnwise_plane(pools, recipe_name):
    err, wrong_err, scale = pools[WORLD].run(_direction, recipe_name)[0]
    if recipe_name in PLANES_DIFFER:  # reading the rowwise plane in backward would be caught
        assert wrong_err > 1e-3 * scale > 100 * err, (wrong_err, err, scale)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_local_gemms_pick_the_plane_by_contraction_dim(recipe_name):
    """What DTensor runs on the local tensors: aten.t + mm/addmm, one process."""
    w = _hp_model("mlp", alternating=True).w1.weight.detach()  # (HIDDEN, DIM)
    q = d.quantize(w, RECIPES[recipe_name])
    row, col = q.dequantize(torch.float32, "rowwise"), q.dequantize(torch.float32, "columnwise")
    x, dy, bias = (torch.randn(*shape, device=w.device) for shape in ((4, DIM), (4, HIDDEN), (HIDDEN,)))
    wt = q.t()
    assert isinstance(wt, d.QuantizedTransposeView) and wt.shape == (DIM, HIDDEN)
    assert torch.equal(torch.mm(x, wt), x @ row.t())  # forward y = x W^T: contracts K
    assert torch.equal(torch.addmm(bias, x, wt), torch.addmm(bias, x, row.t()))
    assert torch.equal(torch.mm(q, x.t()), row @ x.t())  # also contracts K
    assert torch.equal(torch.mm(dy, wt.t()), dy @ col)  # input gradient dx = dy W: contracts M
    assert torch.equal(torch.mm(wt, dy.t()), col.t() @ dy.t())  # dx^T = W^T dy^T: contracts M
    assert q.transpose_cache is None  # the transpose cache does not outlive its one use
    with pytest.raises(NotImplementedError, match="transpose of a quantized weight"):
        wt + 1


def test_gemm_without_the_needed_plane_raises():
    """A GEMM that needs a plane the local tensor lacks raises instead of reading the other one."""
    w = d.quantize(_hp_model("mlp").w1.weight.detach(), d.MXFP8(), columnwise=False)
    torch.mm(torch.randn(4, DIM, device=w.device), w.t())  # forward: rowwise, present
    with pytest.raises(d.RecipeError, match="not 'columnwise'"):
        torch.mm(torch.randn(4, HIDDEN, device=w.device), w)  # dgrad: columnwise, absent


# ---- training parity with 1-D FSDP ---------------------------------------------------------------------
def _train(kind, recipe_name, mesh_kind):
    recipe = RECIPES[recipe_name]
    model, dp_mesh = _build(kind, recipe, mesh_kind, seed=3)
    opt = d.MasterWeightOptimizer(model, torch.optim.SGD, lr=0.05, momentum=0.9)
    dp, dp_rank = dp_mesh.size(), dp_mesh.get_local_rank()
    losses, grads = [], []
    for step in range(STEPS):
        x, target = _batch(kind, step)
        x, target = x.chunk(dp)[dp_rank], target.chunk(dp)[dp_rank]  # this dp rank's slice
        loss = (model(x) - target).pow(2).mean()
        loss.backward()
        if step in (0, STEPS - 1):
            grads.append({n: p.grad.full_tensor().cpu() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)  # every dp slice counted tp times: still the mean
        losses.append(total.item() / torch.distributed.get_world_size())
    masters = {n: m.detach().full_tensor().cpu() for n, m in opt.masters.items()}
    return losses, grads, masters


def _train_both(kind, recipe_name):
    return _train(kind, recipe_name, "1d"), _train(kind, recipe_name, "2d")


# [Tolerance] Both runs compute the same math from the same FP8 bytes in another fp32 summation
# order: the 2-D run adds partial products over tp (the row-parallel output and the column-parallel
# input gradient are all-reduced) and averages gradients over 2 dp ranks instead of 4. So step 0,
# before any requantization, agrees to fp32 rounding: measured <= 3e-6 of the largest gradient, we
# allow 1e-5. Later, when a master lands on the other side of an FP8 rounding boundary in one run,
# that weight quantizes one FP8 step apart (up to 2^-3 relative for E4M3) and feeds later steps --
# the mechanism and the bounds of tests/test_fsdp.py's parity test: 5e-3 absolute on masters
# (magnitude up to ~1; measured worst 4.3e-4, blockwise 2-D MLP) and 1e-3 relative on the loss
# (measured worst 1.2e-4). Last-step gradients: measured worst 4.9e-3 of the largest gradient
# (blockwise 2-D MLP), allowed 1e-2. A wrong plane, a wrong shard or a per-shard scale would show at
# step 0 already, at FP8 resolution (~6e-2), far above 1e-5. The attention block's weights are
# spread less than the MLP's (SPREAD) and both models see two fixed batches in turn: with saturated
# softmax and fresh random targets, last-bit differences grow chaotically within 10 steps in *any*
# two runs of different summation order, FP8 or not.
@needs_4_ranks
@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_2d_training_matches_1d_fsdp(pools, recipe_name, kind):
    (ref_losses, ref_grads, ref_masters), (losses, grads, masters) = pools[WORLD].run(_train_both, kind, recipe_name)[0]
    assert losses[-1] < losses[0], losses
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-3, atol=1e-5)
    for step, (g, ref) in enumerate(zip(grads, ref_grads)):
        for name in ref:
            tol = (1e-5 if step == 0 else 1e-2) * ref[name].abs().max().item()
            torch.testing.assert_close(g[name], ref[name], rtol=0, atol=tol, msg=f"grad {name} step {step}")
    for name, ref in ref_masters.items():
        torch.testing.assert_close(masters[name], ref, rtol=0, atol=5e-3, msg=name)


# ---- bytes on the wire ------------------------------------------------------------------------------
_ALL_REDUCES = (torch.ops._c10d_functional.all_reduce.default, torch.ops.c10d.allreduce_.default)


class WireBytes(CollectiveBytes):
    """CollectiveBytes (all-gathers, as the process group sees them) plus all-reduces."""

    def __init__(self):
        super().__init__()
        self.reduces: list[tuple[torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _ALL_REDUCES:
            ts = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.reduces.extend((t.dtype, t.numel() * t.element_size()) for t in ts)
        return super().__torch_dispatch__(func, types, args, kwargs)


def _wire_bytes(recipe_name):
    recipe = RECIPES[recipe_name]
    model, _ = _build("mlp", recipe, "2d")
    x = torch.randn(BATCH, DIM, device=DEVICE, requires_grad=True)
    model(x).sum().backward()  # warm-up: lazy init
    with WireBytes() as counted:
        model(x).sum().backward()
    return counted.calls, counted.reduces


@needs_4_ranks
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_dp_gathers_move_fp8_bytes_and_tp_moves_activations(pools, recipe_name):
    from test_placement import expected_gather_bytes

    recipe = RECIPES[recipe_name]
    calls, reduces = pools[WORLD].run(_wire_bytes, recipe_name)[0]
    # FSDP over dp: one gather per layer and direction (forward rowwise, backward columnwise), of the
    # tp-local weight's dp shard, in a uint8 buffer: FP8 data + block scales, never fp32 weights.
    tp_local = {"w1": (HIDDEN // TP, DIM), "w2": (DIM, HIDDEN // TP)}
    expected = sorted(expected_gather_bytes(shape, recipe, usage, DP)
                      for shape in tp_local.values() for usage in ("rowwise", "columnwise"))
    assert sorted(sent for _, sent, _ in calls) == expected, calls
    assert all(dtype == torch.uint8 for dtype, _, _ in calls), calls
    fp32_weight_bytes = sum(math.prod(s) for s in tp_local.values()) // DP * 4
    assert sum(sent for _, sent, _ in calls) < 0.6 * 2 * fp32_weight_bytes
    # TP: the row-parallel output (forward) and the column-parallel input gradient (backward) are
    # all-reduced over tp, fp32 activations of shape (BATCH, DIM); nothing else
    assert sorted(reduces) == [(torch.float32, BATCH * DIM * 4)] * 2, reduces
    print(f"{recipe_name}: dp all-gathers (uint8 bytes sent per rank) {[s for _, s, _ in calls]}; tp all-reduces {reduces}")


# ---- torch's src_data_rank=0 ----------------------------------------------------------------------------------
# (TP shards that start inside blocks, formerly refused here: tests/test_tp_split_blocks.py)


def _torch_default_src_rank():
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize_module

    model = d.quantize_module_(nn.Sequential(nn.Linear(DIM, DIM, bias=False)), d.MXFP8())
    mesh = init_device_mesh(DEVICE, (DP, TP), mesh_dim_names=("dp", "tp"))
    with pytest.raises(d.RecipeError, match="dtensor_fp8.parallelize_module.*src_data_rank=None"):
        torch_parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})
    # the documented route works on the same model
    d.parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})
    assert isinstance(model[0].weight.to_local(), d.QuantizedTensor)
    return True


@needs_4_ranks
def test_torch_default_src_data_rank_is_refused_with_the_fix(pools):
    pools[WORLD].run(_torch_default_src_rank)
