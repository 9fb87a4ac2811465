"""All-gather bytes per step and per-rank peak memory on torchtitan's Llama3 debug model, side by side:
torchtitan's bf16 FSDP2, torchtitan's float8 converter (torchao) and dtensor_fp8's converter, every recipe.

    python -m dtensor_fp8.benchmarks torchtitan [--worlds 2,4] [--recipes delayed,...] [--ac off,selective] [--out DIR]

Each variant at each world size runs in fresh processes (CPU / gloo, FSDP2 over all ranks) through
torchtitan's own functions: ``model_registry("debugmodel", converters=[...])``,
``parallelize_llama`` with torchtitan's defaults (``spmd_backend="spmd_types"``; parameters in FP32,
gathered in ``mixed_precision_param="bfloat16"``; torchtitan's reshard-after-forward policy),
``init_weights``, its optimizers container (``default_adamw``, or
``dtensor_fp8.integrations.torchtitan.master_weight_adamw`` for dtensor_fp8) and its loss. The CPU
adjustments of tests/test_torchtitan.py apply (SDPA attention, a SUM reduce-scatter, the ranks'
device for torchtitan's meshes).

Variants:

* ``bf16``: torchtitan's model as its configs build it: every all-gather moves bf16.
* ``torchao_float8``: torchtitan's ``Float8LinearConverter`` (needs torchao; on the CPU
  ``emulate=True``, which torchtitan maps to torchao's tensorwise config): torchao's
  ``Float8Linear`` keeps high-precision weights, and torchtitan 0.3 gathers them in bf16 (it no
  longer has FP8 all-gathers).
* ``<recipe>``: dtensor_fp8's ``FP8ParameterConverter``: the Linear weights' FP8 planes are gathered
  (forward: rowwise; backward: columnwise where the recipe stores it, else the rowwise plane again),
  the embedding and norms in bf16 as in ``bf16``.

Activation checkpointing (``--ac``, each variant once per setting): ``off`` (``ac_config=None``),
``selective`` (``SelectiveAC.Config()``: what torchtitan's ``llama3_debugmodel`` Trainer config sets,
per-op SAC around every block through ``checkpoint_wrapper``), ``full`` (``FullAC.Config()``, the
70B / 405B configs' choice). Under either, the blocks' forward is recomputed inside backward from
the backward gather's weights: MXFP8 / 1x128 then move a third plane (the recompute's rowwise plane,
completed at the backward gather: fsdp.py's note), the other recipes and bf16 nothing more.

A variant that cannot run at a world size (a blockwise recipe whose 128-row blocks a shard of the
debug model's 768-row weights would split at 4 ranks) is recorded with dtensor_fp8's refusal.

Counted: the bytes each rank receives from FSDP2's all-gathers in one training step after a
warm-up step (:class:`dtensor_fp8.comm.CollectiveBytes`, at the plain-tensor level: FP8 planes as
uint8 plus their scales), by dtype. Goal: every dtensor_fp8 recipe at most :data:`GOAL` x ``bf16``.
Peak memory: the rank's peak resident set over build + init + optimizer + two steps, minus its
resident set after the process group started and torchtitan was imported, with glibc's mmap threshold fixed (see build.py's
note on measuring peak memory on the CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
from collections import defaultdict
from datetime import timedelta

import torch
import torch.distributed as dist

#: dtensor_fp8's all-gather bytes per step, at most this fraction of torchtitan's bf16 FSDP2's
GOAL = 0.55
#: The same under activation checkpointing for the two-plane recipes (MXFP8, 1x128): their blocks'
#: weights move three planes a step (forward rowwise; backward columnwise + the recompute's
#: rowwise), 3 x 1.03 bytes against bf16's 2 x 2; the one-plane recipes keep :data:`GOAL`.
GOAL_AC_TWO_PLANES = 0.80
TWO_PLANES = ("mxfp8", "blockwise1d")


def goal_of(variant: str, ac: str) -> float:
    """The bytes goal (fraction of bf16's) of ``variant`` under activation checkpointing ``ac``."""
    return GOAL_AC_TWO_PLANES if ac != "off" and variant in TWO_PLANES else GOAL
SEQ = 64
BATCH = 2
VOCAB = 2048


def _converters(variant: str):
    if variant == "bf16":
        return None
    if variant == "torchao_float8":
        from torchtitan.components.quantization import Float8LinearConverter

        return [Float8LinearConverter.Config(emulate=True)]
    from dtensor_fp8.integrations.torchtitan import FP8ParameterConverter

    return [FP8ParameterConverter.Config(recipe=variant)]


def _ac_config(ac: str):
    """torchtitan's activation-checkpointing config for ``ac`` (``off``, ``selective``, ``full``)."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    configs = {"off": lambda: None, "selective": SelectiveAC.Config, "full": FullAC.Config}
    if ac not in configs:
        raise ValueError(f"--ac {ac!r}: expected one of {sorted(configs)} (torchtitan's debug config: selective)")
    return configs[ac]()


def _run(rank: int, world: int, store: str, variant: str, out: str, ac: str = "off") -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world, store=dist.FileStore(store, world),
                            timeout=timedelta(seconds=600))
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims, utils as dist_utils
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry, parallelize_llama
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    from dtensor_fp8.comm import CollectiveBytes
    from dtensor_fp8.integrations.torchtitan import master_weight_adamw

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # after the imports, which every variant makes
    parallel_dims_module.device_type = "cpu"  # torchtitan takes "cuda" without an accelerator
    parallelism, training = ParallelismConfig(), TrainingConfig(local_batch_size=BATCH, seq_len=SEQ)
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    config = model_registry("debugmodel", converters=_converters(variant)).model
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()  # FlexAttention has no CPU backward
    set_llama3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel)
    with torch.device("meta"):
        model = config.build()
    torch.manual_seed(0)
    model = parallelize_llama(model, parallel_dims=dims, training=training, parallelism=parallelism,
                              compile_config=CompileConfig(), ac_config=_ac_config(ac), dump_folder="")
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM; the same sum
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    fp8 = variant not in ("bf16", "torchao_float8")
    optimizers = (master_weight_adamw if fp8 else default_adamw)(lr=1e-3).build(model_parts=[model])
    loss_fn = CrossEntropyLoss.Config(global_vocab_size=VOCAB).build()
    numel = sum(p.numel() for p in model.parameters())

    def step(seed: int) -> None:
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed * world + rank))
        inputs, labels, extra = annotate_input_spmd_types(
            dims, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(),
            {"positions": torch.arange(SEQ).expand(BATCH, SEQ).contiguous()})
        with dist_utils.get_spmd_context(parallel_dims=dims)():
            loss, _ = loss_fn(model(inputs, **extra), labels, torch.tensor(float(world * BATCH * SEQ)))
            loss.backward()
        optimizers.step()
        optimizers.zero_grad()

    step(0)  # lazy init and the optimizer's first step, outside the count
    with CollectiveBytes() as counted:
        step(1)
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    by_dtype: dict[str, int] = defaultdict(int)
    for dtype, _, received in counted.calls:
        by_dtype[str(dtype).removeprefix("torch.")] += received
    mine = {"received": counted.received, "by_dtype": dict(by_dtype), "peak": (rss1 - rss0) * 1024}
    gathered = [None] * world
    dist.all_gather_object(gathered, mine, group=dist.group.WORLD)
    if rank == 0:
        with open(os.path.join(out, f"{variant}-{world}-{ac}.json"), "w") as f:
            json.dump({"variant": variant, "world_size": world, "ac": ac, "numel": numel, "ranks": gathered}, f)
    dist.barrier(group=dist.group.WORLD)
    dist.destroy_process_group()


def measure(worlds, variants, acs=("off",)) -> list[dict]:
    """Every variant at every world size and activation-checkpointing setting (``acs``: ``off``,
    ``selective``, ``full``), each in fresh processes; rank 0's gathered figures."""
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by glibc when each spawned rank starts
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in worlds:
            for ac in acs:
                for variant in variants:
                    store = os.path.join(tmp, f"store-{variant}-{world}-{ac}")
                    try:
                        torch.multiprocessing.spawn(_run, args=(world, store, variant, tmp, ac), nprocs=world)
                    except torch.multiprocessing.ProcessRaisedException as err:  # e.g. blocks a shard would split
                        results.append({"variant": variant, "world_size": world, "ac": ac,
                                        "refused": str(err).strip().splitlines()[-1]})
                        continue
                    with open(os.path.join(tmp, f"{variant}-{world}-{ac}.json")) as f:
                        results.append(json.load(f))
    return results


def table(results: list[dict]) -> str:
    """A markdown table: all-gather MiB per step per rank (max over ranks), its ratio to ``bf16``
    at the same world size and activation checkpointing, the part gathered in bf16 (parameters left in high precision), the FP8
    weights' bytes against the same weights in ``bf16`` (the rest: (all - bf16 part) / (bf16's all -
    that part); those parameters are gathered alike in both), and per-rank peak memory."""
    mib = 2**20
    ref = {(r["world_size"], r.get("ac", "off")): max(x["received"] for x in r["ranks"])
           for r in results if r["variant"] == "bf16" and "ranks" in r}
    lines = ["| variant | world | AC | all-gather MiB / step / rank | vs bf16 | of which bf16 MiB | FP8 weights vs bf16 "
             "| peak MiB / rank | goal |", "|---|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in results:
        ac = r.get("ac", "off")
        if "refused" in r:
            lines.append(f"| {r['variant']} | {r['world_size']} | {ac} | refused: {r['refused'][:160]} | | | | | |")
            continue
        rank0 = r["ranks"][0]
        received = max(x["received"] for x in r["ranks"])
        bf16 = rank0["by_dtype"].get("bfloat16", 0)
        peak = max(x["peak"] for x in r["ranks"])
        base = ref.get((r["world_size"], ac), float("nan"))
        fp8 = "" if r["variant"] in ("bf16", "torchao_float8") else f"{(received - bf16) / (base - bf16):.3f}x"
        goal = "" if not fp8 else ("met" if received / base <= goal_of(r["variant"], ac) else "missed")
        lines.append(f"| {r['variant']} | {r['world_size']} | {ac} | {received / mib:.2f} | {received / base:.3f}x | "
                     f"{bf16 / mib:.2f} | {fp8} | {peak / mib:.0f} | {goal} |")
    return "\n".join(lines)


def _torchao() -> bool:
    try:
        from torchtitan.components.quantization import Float8Linear
    except ImportError:
        return False
    return Float8Linear is not None


def main(argv: list[str]) -> int:
    from ..formats import RECIPES

    p = argparse.ArgumentParser(prog="python -m dtensor_fp8.benchmarks torchtitan", description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--ac", default="off,selective",
                   help="activation checkpointing settings: off, selective (torchtitan's debug config), full")
    p.add_argument("--out", default="bench_out")
    args = p.parse_args(argv)
    try:
        import torchtitan  # noqa: F401
    except ImportError:
        print("torchtitan is not installed: pip install -e '.[torchtitan]' and torchtitan==0.3.0 --no-deps "
              "(pyproject.toml's torchtitan extra; torch >= 2.14)", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    variants = ["bf16"] + (["torchao_float8"] if _torchao() else []) + args.recipes.split(",")
    if "torchao_float8" not in variants:
        print("torchao is not installed: torchtitan's float8 converter is left out", file=sys.stderr)
    acs = args.ac.split(",")
    for ac in acs:
        _ac_config(ac)  # an unknown setting fails here, before any rank starts
    results = measure([int(w) for w in args.worlds.split(",")], variants, acs)
    print(f"# torchtitan {_version('torchtitan')} Llama3 debug model, FSDP2 over CPU / gloo ranks, "
          f"torch {torch.__version__}; one training step after a warm-up")
    print(table(results))
    path = os.path.join(args.out, "torchtitan.json")
    with open(path, "w") as f:
        json.dump({"torch": torch.__version__, "torchtitan": _version("torchtitan"), "torchao": _version("torchao"),
                   "goal": GOAL, "goal_ac_two_planes": GOAL_AC_TWO_PLANES, "results": results}, f, indent=1)
    print(f"wrote {path}")
    return 0


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
