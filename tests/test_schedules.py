"""FP8 weights under the schedules large models train with, on real gloo process groups: gradient
accumulation that keeps the unsharded weights between micro-batches, 1F1B order, activation
checkpointing of part of a block, ``reshard_after_forward`` as bool and int.

Each schedule is compared with the plain one (``reshard_after_forward=True``, every unsharded
weight freed after each forward and backward) doing *the same arithmetic*: the same micro-batches
in the same order, the same gradient reduction (per micro-batch, or once for the accumulation when
the schedule turns gradient sync off), so nothing but which planes are gathered, when, and how
(FSDP2's all-gather, or a completion of the unsharded weight, fsdp.py) differs. Losses, every FP8
byte and scale of every shard, and the fp32 masters must then be bitwise equal (``torch.equal``);
nothing is compared with a tolerance. The weights are initialized so that MXFP8 / 1x128's two
planes hold different values: a forward that read the columnwise plane, or a completion that
brought the wrong bytes, changes the losses.
"""

import warnings

import pytest
import torch
import torch.utils.checkpoint
from torch import nn
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dtensor_fp8 as d
from dist_utils import DEVICE, WORLD_SIZES, CollectiveBytes

RECIPES = d.RECIPES
#: Recipes whose stored plane serves both directions: no schedule needs a second gather.
ONE_PLANE = ("current", "delayed", "blockwise2d")
DIM, BATCH, MICRO, STEPS = 512, 8, 3, 2  # 512 rows: whole 128-row blocks on each of 4 ranks


class Block(nn.Module):
    """Two FP8 linears with a residual; ``ckpt`` recomputes the first one (and its ReLU) in
    backward with ``torch.utils.checkpoint`` (``"reentrant"`` / ``"non_reentrant"``)."""

    def __init__(self, ckpt=None):
        super().__init__()
        self.up = nn.Linear(DIM, DIM, bias=False)
        self.down = nn.Linear(DIM, DIM, bias=False)
        self.ckpt = ckpt

    def _part(self, x):
        return torch.relu(self.up(x))

    def forward(self, x):
        if self.ckpt is None:
            h = self._part(x)
        else:
            h = torch.utils.checkpoint.checkpoint(self._part, x, use_reentrant=self.ckpt == "reentrant")
        return x + self.down(h)


def _model(recipe_name, ckpt=None):
    """Two blocks and a head; the same values whatever ``ckpt`` is."""
    torch.manual_seed(0)
    model = nn.Sequential(Block(ckpt), Block(ckpt), nn.Linear(DIM, DIM, bias=False))
    with torch.no_grad():
        for p in model.parameters():
            # Magnitudes spread per row and per element (2^0 .. 2^-11), so MXFP8 / 1x128's rowwise and
            # columnwise planes differ in many elements (as in test_fsdp._hp_model).
            p.mul_(torch.logspace(-1, 1, p.shape[0])[:, None] * 2.0 ** -torch.randint(0, 12, p.shape).float())
    return d.quantize_module_(model.to(DEVICE), RECIPES[recipe_name])


def _shard(model, reshard_after_forward=True, wrap=False):
    """``wrap``: ``"wrapper"`` (``checkpoint_wrapper``) or ``"composable"`` (composable
    ``checkpoint``) around each block, before ``fully_shard`` (as torchtitan applies AC)."""
    mesh = init_device_mesh(DEVICE, (torch.distributed.get_world_size(),))
    for i in (0, 1):
        if wrap == "composable":
            composable_checkpoint(model[i])
        elif wrap:
            model[i] = checkpoint_wrapper(model[i])
        fully_shard(model[i], mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh)  # the root (the head): does not reshard after forward
    return model


def _micro_batches(step):
    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [(torch.randn(BATCH, DIM, generator=g).to(DEVICE).requires_grad_(),
             torch.randn(BATCH, DIM, generator=g).to(DEVICE)) for _ in range(MICRO)]


def _loss(model, x, target):
    return (model(x) - target).pow(2).mean() / MICRO


# How each schedule runs one step's micro-batches. ``plain=True``: the same order and gradient
# reduction, with the plain schedule's gathers (every unsharded weight freed after each backward).
def _accumulate(model, batches, losses, *, keep, sync, plain):
    """Gradient accumulation: forward and backward per micro-batch; ``keep``: unsharded weights
    kept from one micro-batch's backward to the next one's forward
    (``set_reshard_after_backward(False)``); ``sync=False``: gradients reduced once, at the last."""
    for i, (x, target) in enumerate(batches):
        last = i == len(batches) - 1
        if not sync:
            model.set_requires_gradient_sync(last)
        if keep and not plain:
            model.set_reshard_after_backward(last)
        loss = _loss(model, x, target)
        loss.backward()
        losses.append(loss.item())


def _one_f_one_b(model, batches, losses, *, plain):
    """A pipeline stage's 1F1B order over 3 micro-batches, F0 F1 B0 F2 B1 B2, with what
    ``torch.distributed.pipelining`` sets before each backward of an FSDP2 stage (last backward,
    gradient sync and resharding only at the last): F2 runs on the weights B0 kept."""
    pending = []
    for op in ("F0", "F1", "B0", "F2", "B1", "B2"):
        i = int(op[1])
        if op[0] == "F":
            pending.append(_loss(model, *batches[i]))
            continue
        last = i == len(batches) - 1
        model.set_is_last_backward(last)
        model.set_requires_gradient_sync(last)
        if not plain:
            model.set_reshard_after_backward(last)
        loss = pending[i]
        loss.backward()
        losses.append(loss.item())


SCHEDULES = {
    # (a) gradient accumulation, the unsharded weights kept between micro-batches
    "keep_unsharded": dict(run=lambda m, b, l, plain: _accumulate(m, b, l, keep=True, sync=True, plain=plain)),
    "keep_unsharded_no_sync": dict(run=lambda m, b, l, plain: _accumulate(m, b, l, keep=True, sync=False, plain=plain)),
    # (b) 1F1B
    "1f1b": dict(run=_one_f_one_b),
    # (c) recompute inside a block, and checkpoint_wrapper around a whole block
    "checkpoint_part_reentrant": dict(ckpt="reentrant"),
    "checkpoint_part_non_reentrant": dict(ckpt="non_reentrant"),
    "checkpoint_wrapper": dict(wrap="wrapper"),
    "composable_checkpoint": dict(wrap="composable"),
    # (d) reshard_after_forward as bool (False) and int (2 of 4 ranks: a smaller post-forward mesh)
    "no_reshard_after_forward": dict(reshard_after_forward=False),
    "int_reshard_after_forward": dict(reshard_after_forward=2, world=4),
}


def _train(recipe_name, schedule, plain):
    """``STEPS`` steps of ``schedule`` (``plain``: its plain-schedule twin). Returns the losses, every
    shard's FP8 planes, the masters, the all-gather bytes received, the completions (all-gathers of a
    plane a gather did not bring, by weight) and the warnings."""
    import dtensor_fp8.fsdp_completion as completion

    spec = SCHEDULES[schedule]
    model = _model(recipe_name, None if plain else spec.get("ckpt"))
    wrap = spec.get("wrap", False) and not plain
    _shard(model, True if plain else spec.get("reshard_after_forward", True), wrap=wrap)
    opt = d.MasterWeightOptimizer(model, torch.optim.SGD, lr=0.02, momentum=0.9)
    names = {id(d.placement.local_tensor(p).param_state): n.replace("_checkpoint_wrapped_module.", "")
             for n, p in model.named_parameters()}
    completions = {}
    real = completion.GatheredWeight._all_gather

    def counting(self, t, stored):
        name = names[id(t.param_state)]
        completions[name] = completions.get(name, 0) + 1
        return real(self, t, stored)

    run = spec.get("run", lambda m, b, l, plain: _accumulate(m, b, l, keep=False, sync=True, plain=plain))
    losses = []
    completion.GatheredWeight._all_gather = counting
    try:
        with warnings.catch_warnings(record=True) as caught, CollectiveBytes() as wire:
            warnings.simplefilter("always")
            for step in range(STEPS):
                run(model, _micro_batches(step), losses, plain=plain)
                opt.step()
                opt.zero_grad()
    finally:
        completion.GatheredWeight._all_gather = real
    model.reshard()
    planes = {}
    for n, p in model.named_parameters():
        q = d.placement.local_tensor(p)
        for usage, plane in q.planes.items():
            key = (n.replace("_checkpoint_wrapped_module.", ""), usage)
            planes[key] = (plane.data.view(torch.uint8).clone(), plane.scale_inv.contiguous().view(torch.uint8).clone())
    masters = {n.replace("_checkpoint_wrapped_module.", ""): m.to_local().detach().clone() for n, m in opt.masters.items()}
    return losses, planes, masters, wire.received, completions, [str(w.message) for w in caught]


def _compare(recipe_name, schedule):
    return _train(recipe_name, schedule, plain=False), _train(recipe_name, schedule, plain=True)


#: Completions per weight per step the schedule needs, for MXFP8 / 1x128 (the per-tensor and
#: 128x128 recipes need none: their gathered weight serves both directions).
COMPLETIONS = {
    "keep_unsharded": {"0.up.weight": MICRO - 1, "0.down.weight": MICRO - 1,
                       "1.up.weight": MICRO - 1, "1.down.weight": MICRO - 1},  # forwards 2..MICRO
    "keep_unsharded_no_sync": {"0.up.weight": MICRO - 1, "0.down.weight": MICRO - 1,
                               "1.up.weight": MICRO - 1, "1.down.weight": MICRO - 1},
    "1f1b": {"0.up.weight": 1, "0.down.weight": 1, "1.up.weight": 1, "1.down.weight": 1},  # F2 after B0
    "checkpoint_part_reentrant": {"0.up.weight": MICRO, "1.up.weight": MICRO},  # each recompute of `up`
    "checkpoint_part_non_reentrant": {"0.up.weight": MICRO, "1.up.weight": MICRO},
    # the backward gather completes the recompute's rowwise plane at once (fsdp.py: seen at the first gather)
    "checkpoint_wrapper": {"0.up.weight": MICRO, "0.down.weight": MICRO, "1.up.weight": MICRO, "1.down.weight": MICRO},
    "composable_checkpoint": {"0.up.weight": MICRO, "0.down.weight": MICRO,
                              "1.up.weight": MICRO, "1.down.weight": MICRO},
    "no_reshard_after_forward": {},  # gathers both planes in forward, no backward gather
    "int_reshard_after_forward": {},  # resharded after forward (True): one direction each gather
}


def _plane_bytes(recipe_name):
    """The bytes each rank receives when one plane of one (DIM, DIM) weight is all-gathered: the FP8
    data and the block scales (E8M0 per 32 values, FP32 per 128 or per 128x128; per-tensor scales are
    not sent). Every shard here is whole blocks, so nothing is padded."""
    return DIM * DIM + {"mxfp8": DIM * DIM // 32, "blockwise1d": DIM * DIM // 128 * 4,
                        "blockwise2d": (DIM // 128) ** 2 * 4}.get(recipe_name, 0)


#: Planes of the 5 weights (4 in the blocks, the root's head) that cross the wire per micro-batch,
#: (MXFP8 / 1x128, per-tensor / 128x128): the floor. The plain schedule gathers each block weight
#: forward (rowwise) and backward (columnwise), the head once with both (the root does not reshard
#: after forward: one plane for the one-plane recipes). A recompute reads the rowwise plane again:
#: one more plane for each recomputed weight of a two-plane recipe (completed), none for one-plane
#: recipes (their backward gather serves it).
WIRE_PLANES = {
    "plain": (4 * 2 + 2, 4 * 2 + 1),
    "checkpoint_wrapper": (4 * 3 + 2, 4 * 2 + 1),
    "composable_checkpoint": (4 * 3 + 2, 4 * 2 + 1),
    "checkpoint_part_reentrant": (2 * 3 + 2 * 2 + 2, 4 * 2 + 1),  # `up` recomputed, `down` not
    "checkpoint_part_non_reentrant": (2 * 3 + 2 * 2 + 2, 4 * 2 + 1),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_schedule_trains_bitwise_like_the_plain_schedule(pools, recipe_name, schedule):
    world = SCHEDULES[schedule].get("world", 2)
    if world not in WORLD_SIZES:
        if world != 2 or 1 not in WORLD_SIZES:
            pytest.skip(f"needs {world} ranks")
        world = 1  # one rank (the single-GPU suite): the unsharded weight views the shard, both planes
    for rank, (got, plain) in enumerate(pools[world].run(_compare, recipe_name, schedule)):
        losses, planes, masters, received, completions, caught = got
        ref_losses, ref_planes, ref_masters, ref_received, ref_completions, _ = plain
        assert losses == ref_losses, (rank, losses, ref_losses)
        assert planes.keys() == ref_planes.keys() and len({n for n, _ in planes}) == 5, sorted(planes)
        for key, (data, scale) in planes.items():
            assert torch.equal(data, ref_planes[key][0]) and torch.equal(scale, ref_planes[key][1]), (rank, key)
        assert masters.keys() == ref_masters.keys()
        for name, master in masters.items():
            assert torch.equal(master, ref_masters[name]), (rank, name)
        assert ref_completions == {}, "the plain schedule never completes a weight"
        expected = {} if recipe_name in ONE_PLANE or world == 1 else {
            n: c * STEPS for n, c in COMPLETIONS[schedule].items()}
        assert completions == expected, (rank, completions)
        if schedule in WIRE_PLANES and world > 1:  # activation checkpointing: exactly the floor, every step
            two_plane = recipe_name not in ONE_PLANE
            per_step = {k: MICRO * _plane_bytes(recipe_name) * v[0 if two_plane else 1] for k, v in WIRE_PLANES.items()}
            assert ref_received == STEPS * per_step["plain"], (rank, ref_received / STEPS, per_step["plain"])
            assert received == STEPS * per_step[schedule], (rank, received / STEPS, per_step[schedule])
        if schedule == "int_reshard_after_forward":
            assert sum("reshard_after_forward=<int>" in w for w in caught) == 2, caught  # once per block
            assert received == ref_received, (received, ref_received)
        if schedule.startswith("keep_unsharded") and recipe_name in ONE_PLANE and world > 1:
            # The forwards after the first read the planes the backward gathered: 2 + 2 (MICRO - 1)
            # block gathers per step instead of 2 MICRO (the root's head gathers once a micro-batch).
            assert received < ref_received, (received, ref_received)



def _completion_lifetime():
    """MXFP8: a backward that keeps the unsharded weights, then a forward that completes them.
    What the completed planes' buffers hold at each point, and whether FSDP2 holds their list."""
    model = _shard(_model("mxfp8"))
    block = model[0]
    shard = d.placement.local_tensor(block.up.weight)
    record = shard.param_state.gather
    fsdp_param = next(p for p in fully_shard.state(block)._fsdp_param_group.fsdp_params if p.sharded_param is block.up.weight)
    x = torch.randn(BATCH, DIM, device=DEVICE)
    model(x).sum().backward()  # first gathers: FSDP2 gets the record's list as the inner tensors to free
    seen = {"fsdp_holds_the_list": fsdp_param._unsharded_inner_tensors is record.inner_tensors}
    model.set_reshard_after_backward(False)
    model(x).sum().backward()  # the unsharded weight stays, with the columnwise plane only
    unsharded = d.placement.local_tensor(block.up.weight)
    seen["kept_usages"] = unsharded.usages
    during = []
    hook = block.up.register_forward_hook(lambda *_: during.append(
        [t.untyped_storage().size() for t in record.inner_tensors]))
    model.set_reshard_after_backward(True)
    y = model(x)  # completes the blocks' weights; FSDP2 reshards each block after its forward
    hook.remove()
    seen["during_forward"] = during[0]
    seen["after_forward"] = [t.untyped_storage().size() for t in record.inner_tensors]
    y.sum().backward()
    seen["after_backward"] = len(record.inner_tensors)  # the backward's gather emptied the list
    return seen


def test_completed_planes_are_freed_when_fsdp_reshards(pools):
    """A completion's buffers (the rowwise data and its scales) live while FSDP2 holds the weight
    unsharded, in the list FSDP2 frees at reshard (the one the first post-all-gather hook handed it),
    and the next gather drops them."""
    if 2 not in WORLD_SIZES:
        pytest.skip("needs 2 ranks")
    for seen in pools[2].run(_completion_lifetime):
        assert seen["fsdp_holds_the_list"]
        assert seen["kept_usages"] == ("columnwise",)
        data, scales = seen["during_forward"]
        assert data == DIM * DIM and scales == 2 * (DIM // 2) * (DIM // 32), seen  # uint8: bytes
        assert seen["after_forward"] == [0, 0], seen  # freed by FSDP2's reshard
        assert seen["after_backward"] == 0, seen


def _train_2d(recipe_name, plain):
    """The attention block of tests/test_tp.py on a (dp=2, tp=2) mesh, gradient accumulation that keeps
    the unsharded weights (``plain``: its plain twin): losses, the local FP8 bytes, completions."""
    import dtensor_fp8.fsdp_completion as completion
    from test_tp import _build

    model, dp_mesh = _build("attention", RECIPES[recipe_name], "2d", seed=3, alternating=True)
    opt = d.MasterWeightOptimizer(model, torch.optim.SGD, lr=0.05, momentum=0.9)
    completions = []
    real = completion.GatheredWeight._all_gather
    completion.GatheredWeight._all_gather = lambda self, t, stored: completions.append(stored) or real(self, t, stored)
    losses = []
    try:
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step * 10 + dp_mesh.get_local_rank())  # the same on both tp ranks
            batches = [(torch.randn(2, 4, 512, generator=g).to(DEVICE), torch.randn(2, 4, 512, generator=g).to(DEVICE))
                       for _ in range(MICRO)]
            for i, (x, target) in enumerate(batches):
                if not plain:
                    model.set_reshard_after_backward(i == MICRO - 1)
                loss = (model(x) - target).pow(2).mean() / MICRO
                loss.backward()
                losses.append(loss.item())
            opt.step()
            opt.zero_grad()
    finally:
        completion.GatheredWeight._all_gather = real
    model.reshard()
    planes = {(n, u): plane.data.view(torch.uint8).clone() for n, p in model.named_parameters()
              if isinstance(q := d.placement.local_tensor(p), d.QuantizedTensor) for u, plane in q.planes.items()}
    return losses, planes, len(completions)


def _compare_2d(recipe_name):
    return _train_2d(recipe_name, plain=False), _train_2d(recipe_name, plain=True)


@pytest.mark.parametrize("recipe_name", ["mxfp8", "blockwise1d", "current"])
def test_keep_unsharded_under_tensor_parallelism(pools, recipe_name):
    """FSDP2 over dp with tensor parallelism inside: the weights the GEMMs read are the tp-local
    unsharded tensors (through DTensor's ``t`` / ``mm``): a completion over the dp group gives them
    the bytes the plain schedule's forward gathers."""
    if 4 not in WORLD_SIZES:
        pytest.skip("needs 4 ranks")
    for (losses, planes, completions), (ref_losses, ref_planes, ref_completions) in pools[4].run(_compare_2d, recipe_name):
        assert losses == ref_losses
        assert planes.keys() == ref_planes.keys()
        assert all(torch.equal(planes[k], ref_planes[k]) for k in planes)
        # 4 weights (q, k, v, out), forwards 2..MICRO of each step
        assert (completions, ref_completions) == (0 if recipe_name in ONE_PLANE else 4 * (MICRO - 1) * STEPS, 0)
