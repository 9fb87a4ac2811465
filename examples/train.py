"""Train a small transformer with FP8 parameters under FSDP2, checkpoint it, resume it.

    python examples/train.py                       # 2 CPU ranks (gloo), MXFP8, 40 steps
    python examples/train.py --recipe blockwise2d --steps 60
    python examples/train.py --device cuda --world-size 1    # NCCL on a GPU machine
    python examples/train.py --device cuda --world-size 1 --te --recipe blockwise2d   # TE TransformerLayers

What it does on every rank: builds the model on the meta device, turns its Linear weights into FP8
parameters there (``quantize_module_``), shards every block and the root with torch's own
``fully_shard``, materializes only this rank's shards (``to_empty``) and initializes them with
plain ``torch.nn.init`` code; the optimizer makes the FP8 bytes from those values (no rank ever
holds the whole model). It trains with FP32 master weights
(``MasterWeightOptimizer``, a ``torch.optim.Optimizer``: AdamW with weight decay on matrices only)
under a warm-up + cosine LR schedule (``torch.optim.lr_scheduler.LambdaLR``), saves a DCP
checkpoint halfway through torch's ``get_state_dict`` (model, optimizer, scheduler and step), then
builds a fresh model, resumes from that checkpoint with ``set_state_dict`` and finishes the run. Rank 0 prints a progress bar, the loss, and the bytes
each step's all-gathers moved, measured at the collective, next to the same model in bf16 under
plain FSDP2. The weights are gathered as FP8 bytes: forward gathers rowwise planes, backward
gathers columnwise planes.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dtensor_fp8
from dtensor_fp8.comm import CollectiveBytes

class Block(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.RMSNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.mlp_norm = nn.RMSNorm(dim)
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (w(h).view(b, s, self.heads, d // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.wo(a)
        return x + self.w2(F.gelu(self.w1(self.mlp_norm(x))))


def te_block(dim: int, heads: int, ffn: int, index: int) -> nn.Module:
    """A Transformer Engine TransformerLayer (fused QKV: TE consumes the FP8 weight as one tensor)."""
    import transformer_engine.pytorch as te

    return te.TransformerLayer(dim, ffn, heads, hidden_dropout=0.0, attention_dropout=0.0, fuse_qkv_params=True,
                               self_attn_mask_type="causal", layer_number=index + 1, params_dtype=torch.float32)


class Transformer(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, ffn: int, layers: int, use_te: bool = False):
        super().__init__()
        self.use_te = use_te
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            te_block(dim, heads, ffn, i) if use_te else Block(dim, heads, ffn) for i in range(layers)
        )
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def init_weights(self, seed: int) -> None:
        """Plain torch init, run on each rank's shards after ``to_empty`` (FP8 weights included)."""
        torch.manual_seed(seed)
        for p in self.parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, std=1 / math.sqrt(p.shape[-1]))

    def forward(self, tokens):
        x = self.embed(tokens)
        if self.use_te:  # TE layers take (seq, batch, hidden)
            x = x.transpose(0, 1)
        for layer in self.layers:
            x = layer(x)
        if self.use_te:
            x = x.transpose(0, 1)
        return self.head(self.norm(x))


def batches(vocab: int, batch: int, seq: int, step: int, rank: int, world: int):
    """A learnable synthetic language: token t+1 = (5 * t + 3) mod vocab, with 10% noise."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(vocab, (batch, 1), generator=g)
    seqs = [start]
    for _ in range(seq):
        nxt = (5 * seqs[-1] + 3) % vocab
        noise = torch.rand(batch, 1, generator=g) < 0.1
        seqs.append(torch.where(noise, torch.randint(vocab, (batch, 1), generator=g), nxt))
    tokens = torch.cat(seqs, 1)
    return tokens[:, :-1], tokens[:, 1:]


def build(args, device, mesh, fp8: bool):
    """The model, built on the meta device, converted and sharded there, then materialized shard by
    shard (TE layers: built on the device, their init needs real tensors)."""
    if args.te:
        torch.manual_seed(0)
        model = Transformer(args.vocab, args.dim, args.heads, args.ffn, args.layers, use_te=True).to(device)
    else:
        with torch.device("meta"):
            model = Transformer(args.vocab, args.dim, args.heads, args.ffn, args.layers)
    if fp8 and args.te:  # the TE layers' weights; embedding and head stay in high precision
        from dtensor_fp8.te import quantize_te_module_

        quantize_te_module_(model.layers, dtensor_fp8.RECIPES[args.recipe])
    elif fp8:  # every Linear of the blocks; the output head stays in high precision
        dtensor_fp8.quantize_module_(model, dtensor_fp8.RECIPES[args.recipe], filter_fn=lambda m, fqn: fqn.startswith("layers."))
    else:
        model = model.to(torch.bfloat16)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if not args.te:
        model.to_empty(device=device)  # this rank's shards only
        model.init_weights(seed=0)
    return model


def te_autocast(args):
    """TE's FP8 compute context for ``--te`` (the TE recipe matching ours), else a no-op."""
    if not args.te:
        return contextlib.nullcontext()
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as te_recipe

    make = {
        "delayed": te_recipe.DelayedScaling, "current": te_recipe.Float8CurrentScaling,
        "mxfp8": te_recipe.MXFP8BlockScaling, "blockwise2d": te_recipe.Float8BlockScaling,
        "blockwise1d": lambda: te_recipe.Float8BlockScaling(w_block_scaling_dim=1),
    }[args.recipe]
    return te.autocast(enabled=True, recipe=make())


def step_loss(model, args, x, y, device):
    with te_autocast(args):
        logits = model(x.to(device))
    return F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten())


def bf16_wire_bytes(args, device, mesh) -> int:
    """Bytes one training step's all-gathers move for the same model in bf16 under FSDP2."""
    model = build(args, device, mesh, fp8=False)
    x, y = batches(args.vocab, args.batch, args.seq, 0, 0, 1)
    with CollectiveBytes() as counted:
        step_loss(model, args, x, y, device).backward()
    return counted.received


def optimizer(model, args):
    """AdamW over FP32 masters, weight decay on matrices only, warm-up + cosine learning rate."""
    decay = [p for p in model.parameters() if p.dim() == 2]
    other = [p for p in model.parameters() if p.dim() != 2]
    opt = dtensor_fp8.MasterWeightOptimizer(model, torch.optim.AdamW, [{"params": decay}, {"params": other,
                                            "weight_decay": 0.0}], lr=args.lr, weight_decay=0.1)
    warmup = max(1, args.steps // 10)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, args.steps - warmup))))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule)


def progress(step: int, total: int, loss: float, wire: int, bf16: int, tag: str, lr: float) -> None:
    width = 24
    filled = int(width * step / total)
    bar = "#" * filled + "-" * (width - filled)
    ratio = f"x{wire / bf16:.2f}" if bf16 else "one rank: FSDP2 runs no all-gather"
    print(f"\r[{bar}] step {step:3d}/{total} {tag:7s} loss {loss:7.4f} lr {lr:.1e}  all-gather bytes/step "
          f"{wire / 2**20:6.3f} MiB (bf16 FSDP2: {bf16 / 2**20:6.3f} MiB, {ratio})", end="", flush=True)


@contextlib.contextmanager
def trusted_te_extra_state(enabled: bool):
    """TE keeps delayed-scaling metadata (amax histories, scales) as a pickle in each module's extra
    state and unpickles it only when told the checkpoint is trusted
    (``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1``). This run wrote its checkpoint a moment ago; set it
    yourself only for checkpoints you trust."""
    if not enabled:
        yield
        return
    before = os.environ.get("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE")
    os.environ["NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE")
        else:
            os.environ["NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"] = before


def worker(rank: int, args) -> None:
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=args.world_size,
                            store=dist.FileStore(args.store, args.world_size), timeout=timedelta(seconds=120))
    mesh = init_device_mesh(args.device, (args.world_size,))
    bf16 = bf16_wire_bytes(args, device, mesh)

    def train(model, opt, sched, steps, tag):
        loss_value = float("nan")
        for step in steps:
            x, y = batches(args.vocab, args.batch, args.seq, step, rank, args.world_size)
            with CollectiveBytes() as counted:
                loss = step_loss(model, args, x, y, device)
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            loss_value = total.item() / args.world_size
            if rank == 0:
                progress(step + 1, args.steps, loss_value, counted.received, bf16, tag, sched.get_last_lr()[0])
        return loss_value

    model = build(args, device, mesh, fp8=True)
    opt, sched = optimizer(model, args)
    half = args.steps // 2
    first = train(model, opt, sched, range(half), "train")
    model_sd, optim_sd = get_state_dict(model, opt)
    path = dtensor_fp8.save_checkpoint({"model": model_sd, "optim": optim_sd, "sched": sched.state_dict(),
                                        "step": half}, args.ckpt, half)
    if rank == 0:
        print(f"\nsaved {path} (FP8 planes as uint8 tensors, FP32 masters, optimizer and scheduler state)")

    # Resume into a fresh model, as a restarted job would.
    model = build(args, device, mesh, fp8=True)
    opt, sched = optimizer(model, args)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd, "sched": sched.state_dict(), "step": 0}
    dtensor_fp8.load_checkpoint(state, dtensor_fp8.latest_checkpoint(args.ckpt))
    with trusted_te_extra_state(args.te):
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sched.load_state_dict(state["sched"])
    if rank == 0:
        print(f"resumed from {dtensor_fp8.latest_checkpoint(args.ckpt)} at step {state['step']}, "
              f"lr {sched.get_last_lr()[0]:.2e}")
    last = train(model, opt, sched, range(state["step"], args.steps), "resumed")
    fp8_params = sum(1 for p in model.parameters() if isinstance(p.to_local(), dtensor_fp8.QuantizedTensor))
    assert fp8_params > 0, "no FP8 parameter survived"
    if rank == 0:
        print(f"\nloss {first:.4f} at step {half} -> {last:.4f} at step {args.steps}; "
              f"{fp8_params} FP8 weight tensors stayed FP8 shards throughout")
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", choices=sorted(dtensor_fp8.RECIPES), default="mxfp8")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--te", action="store_true", help="Transformer Engine TransformerLayers (GPU, TE installed)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--ckpt", default=None, help="checkpoint directory (default: a temporary one)")
    args = p.parse_args(argv)
    if args.te and args.device != "cuda":
        p.error("--te needs --device cuda (Transformer Engine's FP8 GEMMs run on NVIDIA GPUs)")
    if args.te and args.recipe == "mxfp8" and torch.cuda.get_device_capability() < (10, 0):
        p.error("--te --recipe mxfp8 needs an sm_100+ GPU: TE's MXFP8 kernels are compiled only for Blackwell; "
                "use --recipe blockwise2d, current or delayed on this GPU")
    args.ckpt = args.ckpt or tempfile.mkdtemp(prefix="dtensor_fp8_ckpt_")
    fd, args.store = tempfile.mkstemp(prefix="dtensor_fp8_store_")
    os.close(fd)
    os.unlink(args.store)
    start = time.time()
    print(f"{args.world_size} {args.device} ranks, recipe {args.recipe}, checkpoints in {args.ckpt}")
    torch.multiprocessing.spawn(worker, args=(args,), nprocs=args.world_size)
    print(f"done in {time.time() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
