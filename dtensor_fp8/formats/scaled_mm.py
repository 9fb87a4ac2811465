"""What a scaled FP8 GEMM needs from each recipe: the operand recipes and the scale layouts.

[Note: FP8 GEMMs of a linear layer]
``y = x W^T`` and its two backward GEMMs, for a weight ``W`` of logical shape ``(M, K)`` and
activations ``x`` of ``(T, K)`` (T tokens):

* fprop ``y = x W^T``: ``x`` quantized rowwise (blocks along K) x ``W``'s rowwise plane;
* dgrad ``dx = dy W``: ``dy`` quantized rowwise (blocks along M) x ``W``'s columnwise plane (for
  per-tensor and 128x128 recipes: the transpose cache of the shared plane);
* wgrad ``dW = dy^T x``: ``dy``'s and ``x``'s columnwise planes (blocks along T).

This is Transformer Engine's recipe: all three GEMMs run in FP8 for every recipe
(``te.Linear`` with ``backward_override=None``); nothing is kept in high precision but the
fp32 accumulation and the output. Each GEMM operand is an FP8 matrix whose contraction dim is the
contiguous one (cuBLAS' "TN" layout); a plane whose contraction dim is dim 0 of its logical
orientation (the columnwise planes above) is transposed byte for byte first.

Which activation / gradient recipe a weight recipe implies is declared by the recipe
(:meth:`Recipe.gemm_recipe`, a :class:`GemmRecipe`); how a block geometry's scales are handed to
torch's scaled GEMM is the :data:`SCALE_LAYOUTS` table below (keyed by block shape, which every
recipe declares). The GEMM dispatch (``dtensor_fp8/gemm.py``) reads both and never asks which
recipe it has.

Scale layouts (torch's ``scaled_mm`` checks, ``torch/_meta_registrations.py`` and
``aten/src/ATen/native/cuda/ScaledBlas.cpp``; ``mat_a`` is ``(T, K)``, ``mat_b`` ``(K, N)``):

* tensorwise: one fp32 scale per operand (``torch._scaled_mm``; also runs on the CPU);
* 1x128: scale logical ``(rows, K/128)`` with strides ``(1, rows)`` (rows-major), for A and B;
* 128x128 (as B): logical ``(L4, N/128)`` with strides ``(1, L4)``, ``L4 = roundup(K/128, 4)``:
  each 128-row block's K-scales contiguous, padded to 4 (TE's rowwise 2-D scale tensor, transposed);
* 1x32 (MXFP8): E8M0 scales padded to ``(roundup(rows, 128), roundup(K/32, 4))`` and swizzled in
  cuBLAS' 128x4 tiles (``SwizzleType.SWIZZLE_32_4_4``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import BlockShape, Recipe, round_up

#: FP8 GEMM names, in the order the ``fast_accum`` flags are given.
GEMMS = ("fprop", "dgrad", "wgrad")


@dataclass(frozen=True)
class GemmRecipe:
    """The FP8 GEMMs of a linear layer whose weight has a given recipe (TE's recipe semantics).

    Attributes:
        input: recipe of the activations ``x`` (rowwise plane for fprop, columnwise for wgrad).
        grad: recipe of the output gradients ``dy`` (rowwise for dgrad, columnwise for wgrad).
        fast_accum: per GEMM (:data:`GEMMS`), whether the tensor cores' fast accumulation is
            used: TE's ``not use_split_accumulator`` (``MMParams`` of the TE recipe).
        name: TE's recipe, for messages.
    """

    input: Recipe
    grad: Recipe
    fast_accum: tuple[bool, bool, bool]
    name: str

    def fast(self, gemm: str) -> bool:
        return self.fast_accum[GEMMS.index(gemm)]


@dataclass(frozen=True)
class ScaleLayout:
    """How torch's scaled GEMM takes the scales of one block geometry.

    Attributes:
        kind: torch's ``ScalingType`` name (``"TensorWise"``, ``"BlockWise1x128"``, ...).
        min_capability / max_capability: CUDA compute capabilities torch runs it on.
        runs_on_cpu: torch has a CPU kernel for it (tensorwise only, torch 2.11+).
        k_multiple: the contraction dim must be a multiple of this (16: cuBLAS FP8 alignment).
        rows_multiple: the other dim, likewise.
    """

    kind: str
    min_capability: tuple[int, int]
    max_capability: tuple[int, int] | None
    runs_on_cpu: bool
    k_multiple: int
    rows_multiple: int

    def scale(self, scale_inv: torch.Tensor, rows: int, k: int, *, operand: str) -> torch.Tensor:
        """The scale tensor torch wants for an operand of logical ``(rows, k)`` (contraction ``k``)
        whose per-block ``scale_inv`` grid is given in that orientation; ``operand`` is ``"a"`` or
        ``"b"``."""
        if self.kind == "TensorWise":
            return scale_inv.float().reshape(())
        if self.kind == "BlockWise1x128":  # logical (rows, K/128), strides (1, rows)
            return scale_inv.float().t().contiguous().t()
        if self.kind == "BlockWise128x128":  # logical (L4, rows/128), strides (1, L4)
            gr, gk = scale_inv.shape
            out = scale_inv.new_zeros((gr, round_up(gk, 4)), dtype=torch.float32)
            out[:, :gk] = scale_inv
            return out.t()
        if self.kind == "BlockWise1x32":
            return swizzle_32_4_4(scale_inv)
        raise ValueError(f"no scale layout for {self.kind}")

    @property
    def swizzle(self) -> str:
        return "SWIZZLE_32_4_4" if self.kind == "BlockWise1x32" else "NO_SWIZZLE"


def swizzle_32_4_4(grid: torch.Tensor) -> torch.Tensor:
    """cuBLAS' block-scaling-factor layout for 1x32 (MXFP8) scales, flat.

    The ``(rows, K/32)`` grid is zero-padded to ``(roundup(rows, 128), roundup(K/32, 4))`` and cut
    into 128x4 tiles stored one after another (row tiles outer); inside a tile, scale ``(r, c)``
    sits at ``(r % 32) * 16 + (r // 32) * 4 + c``.

    Example:
        >>> swizzle_32_4_4(torch.zeros(128, 4, dtype=torch.uint8)).shape
        torch.Size([512])
    """
    rows, cols = grid.shape
    pr, pc = round_up(rows, 128), round_up(cols, 4)
    raw = grid.view(torch.uint8) if grid.dtype.itemsize == 1 else grid
    padded = raw.new_zeros((pr, pc))
    padded[:rows, :cols] = raw
    # (row tile, 4 sub-blocks of 32 rows, 32 rows, col tile, 4 cols) -> (row tile, col tile, 32, 4, 4)
    tiles = padded.view(pr // 128, 4, 32, pc // 4, 4).permute(0, 3, 2, 1, 4)
    out = tiles.reshape(-1)
    return out.view(grid.dtype) if grid.dtype.itemsize == 1 else out


#: Scale layout of each operand block geometry (in the GEMM's orientation: contraction along the
#: block's second extent). A geometry missing here has no FP8 GEMM (the emulated linear runs).
SCALE_LAYOUTS: dict[BlockShape, ScaleLayout] = {
    BlockShape(None, None): ScaleLayout("TensorWise", (8, 9), None, True, 16, 16),
    BlockShape(1, 128): ScaleLayout("BlockWise1x128", (9, 0), (9, 0), False, 128, 128),
    BlockShape(128, 128): ScaleLayout("BlockWise128x128", (9, 0), (9, 0), False, 128, 128),
    BlockShape(1, 32): ScaleLayout("BlockWise1x32", (10, 0), None, False, 32, 128),
}

#: Pairs of (A, B) scalings torch has a scaled GEMM for.
SUPPORTED_PAIRS = {
    ("TensorWise", "TensorWise"),
    ("BlockWise1x128", "BlockWise128x128"),
    ("BlockWise128x128", "BlockWise1x128"),
    ("BlockWise1x128", "BlockWise1x128"),
    ("BlockWise1x32", "BlockWise1x32"),
}


def gemm_block(block: BlockShape, contract_dim: int) -> BlockShape:
    """A plane's block shape in the GEMM's orientation: transposed when the plane is contracted
    over its dim 0 (its bytes are transposed for the GEMM)."""
    return block if contract_dim == 1 else BlockShape(block.cols, block.rows)


def layout_for(block: BlockShape) -> ScaleLayout | None:
    return SCALE_LAYOUTS.get(block)


def unsupported_pair(a: BlockShape, b: BlockShape, a_dtype: torch.dtype, b_dtype: torch.dtype) -> str | None:
    """Why torch has no scaled GEMM for operands of these geometries and FP8 dtypes, or ``None``."""
    la, lb = layout_for(a), layout_for(b)
    if la is None or lb is None or (la.kind, lb.kind) not in SUPPORTED_PAIRS:
        return f"torch has no scaled GEMM for {a} x {b} scaling"
    if a_dtype == b_dtype == torch.float8_e5m2:
        return "E5M2 x E5M2 GEMMs are not supported by cuBLAS"
    return None
