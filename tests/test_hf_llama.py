"""A model nobody here wrote: Hugging Face ``transformers``' ``LlamaForCausalLM`` (built from a
config, random init, no download) with FP8 decoder-layer weights under FSDP2 on real ranks, driven
the way a training loop drives it: torch AdamW through ``MasterWeightOptimizer`` with param groups,
a warm-up + cosine LR schedule, ``clip_grad_norm_``, gradient accumulation, torch's
``get_state_dict`` / ``set_state_dict`` + DCP, and a bf16 export that ``save_pretrained`` /
``from_pretrained`` round-trip.

``transformers`` is a test extra (``pip install -e ".[test]"``), never a dependency of the library.
"""

import math
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dtensor_fp8 as d
from dist_utils import DEVICE, WORLD_SIZES

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 256, 32, 4
LR, STEPS, WARMUP = 2e-3, 12, 3
FP8_WEIGHTS = 14  # q, k, v, o, gate, up, down in each of 2 decoder layers


def _config():
    # hidden 512, 8 heads of 64, GQA with 4 KV heads: k_proj / v_proj are 256 x 512, so every FP8
    # weight shards into whole 128-row blocks on 2 ranks (the blockwise recipes' alignment).
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2 * SEQ,
        tie_word_embeddings=False, attn_implementation="sdpa")


def _model(recipe_name, seed=0, shard=True):
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(_config()).to(DEVICE)
    if recipe_name != "fp32":
        d.quantize_module_(model, d.RECIPES[recipe_name], filter_fn=lambda m, fqn: fqn.startswith("model.layers."))
    if shard:
        mesh = init_device_mesh(DEVICE, (dist.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _param_groups(model):
    """Weight decay on matrices only; norms and embeddings without (the usual split)."""
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() != 2 or "embed" in n]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _schedule(step):
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))


def _optimizer(model, recipe_name):
    if recipe_name == "fp32":
        opt = torch.optim.AdamW(_param_groups(model), lr=LR)
    else:
        opt = d.MasterWeightOptimizer(model, torch.optim.AdamW, _param_groups(model), lr=LR)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, _schedule)


def _tokens(step, micro=0, batch=BATCH):
    """A learnable language: t+1 = (5 t + 3) mod VOCAB with 10 % noise; each rank its own batch."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * dist.get_rank() + micro)
    seqs = [torch.randint(VOCAB, (batch, 1), generator=g)]
    for _ in range(SEQ - 1):
        noise = torch.rand(batch, 1, generator=g) < 0.1
        seqs.append(torch.where(noise, torch.randint(VOCAB, (batch, 1), generator=g), (5 * seqs[-1] + 3) % VOCAB))
    return torch.cat(seqs, 1).to(DEVICE)


def _global_mean(x: float) -> float:
    t = torch.tensor([x], device=DEVICE)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def _train(model, opt, sched, steps, start=0):
    losses, norms = [], []
    for step in range(start, start + steps):
        x = _tokens(step)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        norms.append((norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item())
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(_global_mean(loss.item()))
    return losses, norms


def _fp8_shards(model) -> int:
    return sum(isinstance(p.to_local(), d.QuantizedTensor) for p in model.parameters())


def _snapshot(model, opt) -> dict:
    """Every FP8 plane, master and high-precision parameter, gathered, as bytes."""
    out = {}
    for name, p in model.named_parameters():
        q = p.to_local()
        if isinstance(q, d.QuantizedTensor):
            for usage in q.usages:
                plane = d.for_usage(p, usage).full_tensor().plane(usage)
                out[f"{name}/{usage}"] = plane.data.view(torch.uint8).cpu()
                out[f"{name}/{usage}/scale"] = plane.scale_inv.contiguous().view(torch.uint8).cpu()
        else:
            out[name] = p.full_tensor().detach().cpu().view(torch.uint8)
    for name, m in getattr(opt, "masters", {}).items():
        out[f"{name}/master"] = m.full_tensor().detach().cpu().view(torch.uint8)
    return out


# ---- training ---------------------------------------------------------------------------------------------
def _run_training(recipe_name):
    model = _model(recipe_name)
    opt, sched = _optimizer(model, recipe_name)
    stepping = opt.inner if recipe_name != "fp32" else opt  # the optimizer that does the arithmetic
    lrs = []
    stepping.register_step_pre_hook(lambda o, *_: lrs.append([g["lr"] for g in o.param_groups]))
    losses, norms = _train(model, opt, sched, STEPS)
    return losses, norms, lrs, _fp8_shards(model)


@pytest.mark.parametrize("recipe_name", list(d.RECIPES))
def test_trains_like_fp32_fsdp2(pools, recipe_name):
    """Same init, data, groups, schedule and clipping as fp32 FSDP2 with torch AdamW. Tolerance:
    each step's loss within 2 % of fp32's and the final one within 1 %: FP8 weights change each
    forward by their rounding (E4M3: 2^-4 relative per weight), which moved the loss of ~5 by at
    most 0.4 % (final step: 0.27 %) over all recipes when measured on 2 gloo ranks; gradient norms
    (a single step's, of a small batch) by at most 1.8 % there and 6.6 % on one H200 rank, whose
    batch is half as large (tolerance 10 %)."""
    world = WORLD_SIZES[0]
    ref_losses, ref_norms, ref_lrs, _ = pools[world].run(_run_training, "fp32")[0]
    losses, norms, lrs, fp8 = pools[world].run(_run_training, recipe_name)[0]
    # It learns (one rank's batches are noisy: compared as means of three steps).
    assert sum(ref_losses[-3:]) < 0.95 * sum(ref_losses[:3]), f"the reference did not learn: {ref_losses}"
    assert fp8 == FP8_WEIGHTS  # every FP8 weight stayed an FP8 shard through 12 steps
    # The warm-up + cosine schedule reached the arithmetic of every step, in both groups.
    assert lrs == ref_lrs == [[LR * _schedule(s)] * 2 for s in range(STEPS)]
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 0.02 * b, (step, losses, ref_losses)
    assert abs(losses[-1] - ref_losses[-1]) <= 0.01 * ref_losses[-1], (losses, ref_losses)
    for a, b in zip(norms, ref_norms):  # clip_grad_norm_ over an FP8 model's gradients
        assert math.isfinite(a) and abs(a - b) <= 0.10 * b, (norms, ref_norms)


# ---- gradient accumulation ------------------------------------------------------------------------------
def _accumulated(recipe_name, micro_batches):
    model = _model(recipe_name)
    # SGD: the step is linear in the gradient (Adam's first step is ~lr * sign(g), which turns the
    # rounding of near-zero gradients into lr-sized differences).
    opt = d.MasterWeightOptimizer(model, torch.optim.SGD, lr=0.5)
    before = {n: m.detach().full_tensor().cpu().clone() for n, m in opt.masters.items()}
    x = _tokens(0, batch=BATCH)
    for i, chunk in enumerate(x.chunk(micro_batches)):
        model.set_requires_gradient_sync(i == micro_batches - 1)  # FSDP2's idiom: reduce once
        (model(input_ids=chunk, labels=chunk).loss / micro_batches).backward()
    grads = {n: p.grad.full_tensor().cpu() for n, p in model.named_parameters()}
    opt.step()
    opt.zero_grad()
    model.set_requires_gradient_sync(True)
    y = _tokens(1)
    with torch.no_grad():
        after = _global_mean(model(input_ids=y, labels=y).loss.item())
    masters = {n: m.detach().full_tensor().cpu() for n, m in opt.masters.items()}
    moved = all(not torch.equal(masters[n], before[n]) for n in masters)
    return grads, masters, after, moved


@pytest.mark.parametrize("recipe_name", list(d.RECIPES))
def test_gradient_accumulation_equals_one_big_batch(pools, recipe_name):
    """Two micro-batches (the first without gradient sync) give the gradients one batch of both
    gives, and the same step. Tolerance: 1e-4 relative (plus 1e-6 of the tensor's largest element)
    on every gradient and master, 1e-5 on the next loss — the only difference is the order fp32
    sums the two halves' contributions in (HF's loss is a mean per micro-batch, so each half carries
    the weight it has in the big batch: every sequence has the same length)."""
    world = WORLD_SIZES[0]
    big_g, big, big_loss, moved = pools[world].run(_accumulated, recipe_name, 1)[0]
    acc_g, acc, acc_loss, _ = pools[world].run(_accumulated, recipe_name, 2)[0]
    assert moved, "the step did not move every master: the comparison shows nothing"
    assert big.keys() == acc.keys() and len(big) == FP8_WEIGHTS and big_g.keys() == acc_g.keys()
    for name in big_g:
        scale = big_g[name].abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(acc_g[name], big_g[name], rtol=1e-4, atol=1e-6 * scale, msg=name)
    for name in big:
        torch.testing.assert_close(acc[name], big[name], rtol=1e-4, atol=1e-6 * big[name].abs().max().item(), msg=name)
    assert abs(acc_loss - big_loss) <= 1e-5 * big_loss, (acc_loss, big_loss)


# ---- checkpoint + resume through torch's state-dict helpers ---------------------------------------------
def _save_midway(root, recipe_name, save_at, total):
    model = _model(recipe_name)
    opt, sched = _optimizer(model, recipe_name)
    _train(model, opt, sched, save_at)
    model_sd, optim_sd = get_state_dict(model, opt)
    d.save_checkpoint({"model": model_sd, "optim": optim_sd, "sched": sched.state_dict(), "step": save_at},
                      root, save_at)
    losses, _ = _train(model, opt, sched, total - save_at, start=save_at)
    return losses, _snapshot(model, opt)


def _resume(root, recipe_name, total):
    model = _model(recipe_name, seed=1)  # another init: everything must come from the checkpoint
    opt, sched = _optimizer(model, recipe_name)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd, "sched": sched.state_dict(), "step": 0}
    d.load_checkpoint(state, d.latest_checkpoint(root))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sched.load_state_dict(state["sched"])
    losses, _ = _train(model, opt, sched, total - state["step"], start=state["step"])
    return losses, _snapshot(model, opt), state["step"]


@pytest.mark.parametrize("recipe_name", list(d.RECIPES))
def test_get_state_dict_and_dcp_resume_exactly(pools, tmp_path, recipe_name):
    """Saved at step 3 of 6 with torch's ``get_state_dict`` (+ the scheduler and a step counter),
    resumed into a differently initialized model: the last 3 losses, every FP8 byte and every
    master are bit-identical to the uninterrupted run."""
    world = WORLD_SIZES[0]
    root = str(tmp_path / "ckpt")
    expected = pools[world].run(_save_midway, root, recipe_name, 3, 6)
    resumed = pools[world].run(_resume, root, recipe_name, 6)
    for (losses, snap), (r_losses, r_snap, step) in zip(expected, resumed):
        assert step == 3
        assert r_losses == losses
        assert snap.keys() == r_snap.keys()
        for key in snap:
            assert torch.equal(snap[key], r_snap[key]), key


# ---- bf16 export -> save_pretrained -> from_pretrained -------------------------------------------------
def _export(out_dir, recipe_name):
    model = _model(recipe_name)
    opt, sched = _optimizer(model, recipe_name)
    _train(model, opt, sched, 2)
    hp = d.export_hp_state_dict(model, torch.bfloat16)
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in hp.items()}
    x = _tokens(99)
    with torch.no_grad():
        logits = model(input_ids=x).logits
    if dist.get_rank() == 0:
        plain = transformers.LlamaForCausalLM(_config()).to(torch.bfloat16)
        assert set(full) == set(plain.state_dict())  # the unquantized model's keys, exactly
        plain.load_state_dict({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in full.items()},
                              strict=True)
        plain.save_pretrained(out_dir)
    dist.barrier()
    return x.cpu(), logits.float().cpu()


@pytest.mark.parametrize("recipe_name", list(d.RECIPES))
def test_bf16_export_round_trips_through_save_pretrained(pools, tmp_path, recipe_name):
    """The FP8 model's bf16 export loads ``strict=True`` into the unquantized model (no
    non-persistent buffers such as ``rotary_emb.inv_freq`` in it), survives ``save_pretrained`` /
    ``from_pretrained``, and gives the FP8 model's logits to bf16 precision (each exported weight is
    its FP8 value rounded to bf16, activations run in bf16: 2^-8 relative per operation)."""
    out_dir = str(tmp_path / "hf")
    x, logits = pools[WORLD_SIZES[0]].run(_export, out_dir, recipe_name)[0]
    assert os.path.exists(os.path.join(out_dir, "config.json"))
    loaded = transformers.LlamaForCausalLM.from_pretrained(out_dir, torch_dtype=torch.bfloat16)
    with torch.no_grad():
        got = loaded(input_ids=x).logits.float()
    err = (got - logits).norm() / logits.norm()
    assert err < 2e-2, err
    assert got.argmax(-1).eq(logits.argmax(-1)).float().mean() > 0.95
