"""``python -m dtensor_fp8.benchmarks <subcommand> [options]``.

Each subcommand is a module of this package with a ``main(argv: list[str]) -> int``; add one by
adding its name to :data:`SUBCOMMANDS` (modules are imported only when chosen).
"""

from __future__ import annotations

import importlib
import sys

#: subcommand -> (module, one-line description)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "quantize": ("dtensor_fp8.benchmarks.quantize", "quantize GB/s of our recipes vs TE's kernels vs a device copy"),
    "wire": ("dtensor_fp8.benchmarks.fsdp", "FSDP2 all-gather bytes per parameter per step, by recipe vs bf16"),
    "memory": ("dtensor_fp8.benchmarks.fsdp", "per-rank sharded-parameter, master and peak memory, by recipe vs bf16"),
    "build": ("dtensor_fp8.benchmarks.build", "per-rank peak memory of build + shard + init + optimizer + step: FP8 meta flow vs FP32 FSDP2"),
    "linear_step": ("dtensor_fp8.benchmarks.linear_step", "plain-torch nn.Linear blocks under FSDP2: bf16 vs FP8 params with FP8 GEMMs, ms / peak GiB"),
    "te_step": ("dtensor_fp8.benchmarks.te_step", "TE TransformerLayer train step ms / peak GiB: bf16, TE FP8, ours under FSDP2"),
    "gpu_gaps": ("dtensor_fp8.benchmarks.gpu_gaps", "where the GPU waited for the host in a --profile --trace Chrome trace"),
    "convergence": ("dtensor_fp8.benchmarks.convergence", "byte-level LM on the stdlib's sources: FP8 recipes and torchao vs bf16, paired over seeds, to 1 %"),
    "checkpoint": ("dtensor_fp8.benchmarks.checkpoint", "checksum cost of save_checkpoint / load_checkpoint vs DCP's own save / load"),
    "torchtitan": ("dtensor_fp8.benchmarks.torchtitan", "torchtitan's Llama3 debug model: all-gather bytes / step and peak memory, bf16 vs torchao float8 vs ours"),
    "moe": ("dtensor_fp8.benchmarks.moe", "MoE expert weights: all-gather bytes (FSDP2, EP x FSDP2), build / save / load memory, GPU step time, FP8 vs bf16"),
    "layouts": ("dtensor_fp8.benchmarks.layouts", "which (FSDP, TP) layouts each recipe accepts on Llama3 / DeepSeek-V3 / Qwen3 shapes, and B/param/step with and without AC"),
    "all": ("dtensor_fp8.benchmarks.report", "everything this machine runs: report.json + report.png (the default)"),
}


def _usage() -> str:
    lines = ["usage: python -m dtensor_fp8.benchmarks <subcommand> [options]", "", "subcommands:"]
    lines += [f"  {name:<11} {desc}" for name, (_, desc) in SUBCOMMANDS.items()]
    lines += ["", "python -m dtensor_fp8.benchmarks <subcommand> --help for its options"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if not argv or argv[0].startswith("-"):
        argv = ["all", *argv]
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"unknown subcommand {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
