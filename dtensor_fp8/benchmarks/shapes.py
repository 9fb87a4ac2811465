"""The model shapes the step benchmarks time (``linear_step``, ``te_step``): named presets, the
command-line options that pick and adjust one, and what a step of it costs (GEMM parameters,
FLOPs per token, tokens/s and MFU).

Presets (``--shape NAME``; ``--layers`` ... ``--no-bias`` then override single fields):

* ``te-default``: the shape of every earlier te_step / linear_step run (docs/benchmarks.md before
  2026-12-05): 4 layers, hidden 4096, ffn 16384, 32 heads, seq 2048 x batch 2, LayerNorm, GELU,
  biases on.
* ``llama3-8b``: a Llama3-8B decoder layer (hidden 4096, ffn 14336, 32 query heads / 8 KV heads,
  RMSNorm, SwiGLU, no biases) at seq 8192 x batch 1, the step torchao's and torchtitan's published
  FP8 speedups are measured at. 8 of the model's 32 layers: every layer does the same work, so
  tokens/s and MFU of 8 layers are those of 32 up to the (absent) embedding and output head, and 8
  layers leave room on one H200 for the largest variant (FP32 masters) — the peak memory column
  says how much.
* ``toy``: the same structure (GQA, RMSNorm, SwiGLU) small enough for the CPU (the CPU suite runs it).
* ``byte-lm``: the decoder stack of the first ``convergence`` model (100.7 M GEMM weights: 4
  layers, hidden 1536, SwiGLU ffn 4096, 12 heads of 128 / 4 KV heads, RMSNorm) at seq 512 x batch
  16: 8192 tokens a step; the "102 M model" of the small-model tokens/s figures.
  Wide rather than deep: a step's host work (FSDP2's hooks, the FP8 casts) grows with the layers.
* ``byte-lm-small``: ``convergence``'s model now (25.2 M GEMM weights: 4 layers, hidden 768,
  SwiGLU ffn 2048, 6 heads of 128 / 2 KV heads, RMSNorm) at seq 256 x batch 32, 8192 tokens a
  step: small enough that 6 rows x 3 seeds run side by side on one GPU in one call. Every GEMM
  dimension is a multiple of 128, as the 128x128 and MXFP8 recipes' scaled GEMMs need.

MFU follows torchtitan's convention (``get_num_flop_per_token``): ``6 * N + 12 * L * H * D * S``
FLOPs per token, N the GEMM weights' parameter count, L layers, H query heads of D dims, S the
sequence length (causal attention counted as full, as torchtitan does), against the device's dense
bf16 peak (989 TFLOP/s for the H100/H200 SXM datasheet) for every row, FP8 ones included, so rows
compare directly.

Example:
    >>> shape = PRESETS["llama3-8b"]
    >>> shape.gemm_params / shape.layers  # 218,103,808 GEMM weights per layer
    218103808.0
    >>> round(mfu(shape, step_ms=400.0, peak_flops=989e12), 3)  # 8 layers, 8192 tokens in 400 ms
    0.283
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

MLPS = ("gelu", "swiglu")
NORMS = ("layernorm", "rmsnorm")


@dataclass(frozen=True)
class ModelShape:
    """A decoder stack's shape and its input.

    Attributes:
        layers, hidden, ffn: layers, model width, MLP width (SwiGLU: of each of gate and up).
        heads, kv_heads: query heads and key/value heads (``kv_heads < heads``: grouped-query attention).
        seq, batch: the input, ``(seq, batch, hidden)``.
        mlp: ``"gelu"`` (tanh approximation) or ``"swiglu"`` (gate and up fused in one weight).
        norm: ``"layernorm"`` or ``"rmsnorm"``.
        bias: biases on the linears.
    """

    layers: int = 4
    hidden: int = 4096
    ffn: int = 16384
    heads: int = 32
    kv_heads: int = 32
    seq: int = 2048
    batch: int = 2
    mlp: str = "gelu"
    norm: str = "layernorm"
    bias: bool = True

    def __post_init__(self):
        bad = []
        if min(self.layers, self.hidden, self.ffn, self.heads, self.kv_heads, self.seq, self.batch) < 1:
            bad.append("every size must be >= 1")
        if self.hidden % self.heads:
            bad.append(f"hidden {self.hidden} must be a multiple of heads {self.heads}")
        if self.heads % self.kv_heads:
            bad.append(f"heads {self.heads} must be a multiple of kv_heads {self.kv_heads}")
        if self.mlp not in MLPS or self.norm not in NORMS:
            bad.append(f"mlp must be one of {MLPS}, norm one of {NORMS} (got {self.mlp!r}, {self.norm!r})")
        if bad:
            raise ValueError(f"model shape {self}: " + "; ".join(bad) + ". Fix the --shape options.")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def tokens(self) -> int:
        """Tokens per step."""
        return self.seq * self.batch

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """One layer's GEMM weights, ``name -> (out_features, in_features)``: the fused QKV
        projection, the attention output projection, the (SwiGLU: fused gate and up) MLP input
        and its output."""
        kv = self.kv_heads * self.head_dim
        fc1 = 2 * self.ffn if self.mlp == "swiglu" else self.ffn
        return {"qkv": (self.hidden + 2 * kv, self.hidden), "proj": (self.hidden, self.hidden),
                "fc1": (fc1, self.hidden), "fc2": (self.hidden, self.ffn)}

    @property
    def gemm_params(self) -> int:
        """Parameters of every layer's GEMM weights (biases and norms excluded)."""
        return self.layers * sum(o * i for o, i in self.linear_shapes().values())

    @property
    def flops_per_token(self) -> int:
        """Training FLOPs per token, torchtitan's convention (the module docstring)."""
        return 6 * self.gemm_params + 12 * self.layers * self.heads * self.head_dim * self.seq

    def describe(self) -> str:
        attn = f"{self.heads} heads" + (f" / {self.kv_heads} KV heads" if self.kv_heads != self.heads else "")
        return (f"{self.layers} x layer(hidden {self.hidden}, ffn {self.ffn}, {attn}, {self.norm}, {self.mlp}, "
                f"bias {'on' if self.bias else 'off'}), input {self.seq}x{self.batch}")


PRESETS = {
    "te-default": ModelShape(),
    "llama3-8b": ModelShape(layers=8, hidden=4096, ffn=14336, heads=32, kv_heads=8, seq=8192, batch=1,
                            mlp="swiglu", norm="rmsnorm", bias=False),
    "toy": ModelShape(layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, seq=64, batch=2,
                      mlp="swiglu", norm="rmsnorm", bias=False),
    "byte-lm": ModelShape(layers=4, hidden=1536, ffn=4096, heads=12, kv_heads=4, seq=512, batch=16,
                          mlp="swiglu", norm="rmsnorm", bias=False),
    "byte-lm-small": ModelShape(layers=4, hidden=768, ffn=2048, heads=6, kv_heads=2, seq=256, batch=32,
                                mlp="swiglu", norm="rmsnorm", bias=False),
}

#: Dense bf16 peak FLOP/s by device-name fragment (vendor datasheets, SXM parts), for MFU.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "B200": 2250e12, "A100": 312e12}

_INT_FIELDS = ("layers", "hidden", "ffn", "heads", "kv_heads", "seq", "batch")


def add_shape_arguments(parser, default: str = "te-default") -> None:
    """``--shape`` (preset ``default`` unless given) and the per-field overrides ``--layers
    --hidden --ffn --heads --kv-heads --seq --batch --mlp --norm --bias/--no-bias``;
    :func:`shape_from_args` reads them.

    Example:
        >>> p = argparse.ArgumentParser(); add_shape_arguments(p)
        >>> shape_from_args(p, p.parse_args(["--shape", "llama3-8b", "--layers", "2"])).layers
        2
    """
    parser.add_argument("--shape", choices=sorted(PRESETS), default=default,
                        help=f"model shape preset (default {default}); the options below override its fields")
    for name in _INT_FIELDS:
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, default=None)
    parser.add_argument("--mlp", choices=MLPS, default=None)
    parser.add_argument("--norm", choices=NORMS, default=None)
    parser.add_argument("--bias", action="store_true", default=None)
    parser.add_argument("--no-bias", dest="bias", action="store_false")


def shape_from_args(parser, args) -> ModelShape:
    """The preset ``args.shape`` with the fields given on the command line replaced; an
    inconsistent result (e.g. hidden not a multiple of heads) ends the program through
    ``parser.error`` with the reason.
    """
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(ModelShape)
                 if getattr(args, f.name, None) is not None}
    try:
        return dataclasses.replace(PRESETS[args.shape], **overrides)
    except ValueError as e:
        parser.error(str(e))


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a device by its name (``torch.cuda.get_device_name()``), if known."""
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in device_name), None)


def tokens_per_s(shape: ModelShape, step_ms: float) -> float:
    """Tokens a second at ``step_ms`` per step."""
    return shape.tokens / (step_ms / 1e3)


def mfu(shape: ModelShape, step_ms: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilization at ``step_ms`` per step (``None`` when the peak is unknown).

    Args:
        shape: the model stepped.
        step_ms: one training step's time.
        peak_flops: the device's dense bf16 FLOP/s (:func:`peak_flops`).
    """
    if not peak_flops:
        return None
    return shape.flops_per_token * tokens_per_s(shape, step_ms) / peak_flops
