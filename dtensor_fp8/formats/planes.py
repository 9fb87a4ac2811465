"""What every formats module shares: usage names, :class:`Plane`, :class:`BlockShape`,
:class:`RecipeError` and the 2-D byte helpers (TE's data layout, transposes, padding).

A leaf of ``formats/``: it imports only torch and the TE kernel probe (``te_kernels``), so the
recipe interface (``base.py``), TE's buffer descriptions (``te_binding.py``) and the kernels can all
import it without importing each other back (see ``base.py``'s note on planes and usages).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import te_kernels

ROWWISE = "rowwise"
COLUMNWISE = "columnwise"
USAGES = (ROWWISE, COLUMNWISE)


@dataclass(frozen=True)
class BlockShape:
    """Extent of one scaling block; ``None`` means the block spans that whole dimension."""

    rows: int | None
    cols: int | None

    def extent(self, dim: int) -> int | None:
        return self.rows if dim == 0 else self.cols

    def grid(self, shape: tuple[int, int], phase: tuple[int, int] = (0, 0)) -> tuple[int, int]:
        """Scale-grid shape for a ``(rows, cols)`` matrix: the blocks its elements touch when its
        first element sits ``phase`` elements into a block along each dim (a shard that starts
        inside a block: see "block phase" in ``base.py``).

        Example:
            >>> BlockShape(128, 128).grid((64, 256), phase=(64, 0))   # rows 64..127 of one block
            (1, 2)
        """
        return tuple(1 if b is None else (-(-(p % b + n) // b) if n else 0)
                     for n, b, p in zip(shape, (self.rows, self.cols), phase))

    def first_block(self, dim: int, start: int, phase: int = 0) -> int:
        """Index, in the local scale grid of a matrix with ``phase`` along ``dim``, of the block
        holding its element ``start`` along ``dim``."""
        b = self.extent(dim)
        return 0 if b is None else (phase % b + start) // b

    def __str__(self) -> str:
        fmt = lambda b: "all" if b is None else str(b)  # noqa: E731
        return f"{fmt(self.rows)}x{fmt(self.cols)}"


@dataclass
class Plane:
    """One direction's FP8 storage, in the logical orientation (see the note above).

    Attributes:
        data: FP8 values, a float8 dtype, shape ``(M, K)``.
        scale_inv: dequantization multipliers per block (fp32, or float8_e8m0fnu for MXFP8),
            shape = the block grid of ``(M, K)``.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor

    def map(self, fn) -> "Plane":
        return Plane(fn(self.data), fn(self.scale_inv))


class RecipeError(ValueError):
    """A shape, layout or world size that a recipe cannot represent exactly."""


def as_matrix_shape(shape) -> tuple[int, int]:
    """TE's 2-D view of a tensor: leading dims flattened into rows."""
    if len(shape) < 2:
        raise RecipeError(f"FP8 weights must have at least 2 dims (TE quantizes 2-D matrices), got shape {tuple(shape)}")
    return math.prod(shape[:-1]), shape[-1]


def te_data(data2d: torch.Tensor, shape) -> torch.Tensor:
    """FP8 data as TE stores it where its layout is ours: a uint8 view of ``shape`` (TE's
    transposed copies are built by :func:`transposer_2d`)."""
    return data2d.view(torch.uint8).reshape(shape)


def transpose_2d(data: torch.Tensor) -> torch.Tensor:
    """``data.t().contiguous()`` for a 2-D one-byte (FP8 / uint8) tensor; TE's transpose kernel on CUDA."""
    if te_kernels.usable(data):
        if data.dtype == torch.uint8:  # TE's layout: bytes already (no view round trip)
            return te_kernels.transpose_bytes(data)
        return te_kernels.transpose_bytes(data.view(torch.uint8)).view(data.dtype)
    return data.t().contiguous()


def transposer_2d(u8: torch.Tensor):
    """``fn() -> transpose_2d(u8)`` for this very 2-D uint8 tensor, the fast path chosen once (see
    ``te_kernels.transposer``); a caller that transposes the same buffer again and again (the FSDP
    hook of a TE module, at every backward gather) pays only for the kernel.

    Example:
        >>> transpose = transposer_2d(plane.data.view(torch.uint8))
        >>> transpose()  # == plane.data.view(torch.uint8).t().contiguous()
    """
    if u8.dtype == torch.uint8 and u8.is_contiguous() and te_kernels.usable(u8):
        return te_kernels.transposer(u8)
    return lambda: transpose_2d(u8)


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` with row-major strides. ``contiguous()`` keeps odd strides on size-1 dims (e.g. the
    transpose of a ``(1, n)`` slice), which ``view(dtype)`` to another element size rejects."""
    expected, step = [], 1
    for n in reversed(t.shape):
        expected.append(step)
        step *= max(n, 1)
    if list(t.stride()) == expected[::-1]:
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_2d(t: torch.Tensor, rows: int, cols: int, reuse: torch.Tensor | None = None) -> torch.Tensor:
    """Zero-padded copy of a 2-D tensor (TE's padded scale tensors).

    ``reuse``: an earlier result of the same shape to overwrite instead (one copy, no new
    tensor; its padding is still zero, as only the valid region is ever written).
    """
    if reuse is not None and reuse.shape == (rows, cols) and reuse.dtype == t.dtype and reuse.device == t.device:
        reuse[: t.shape[0], : t.shape[1]].copy_(t)
        return reuse
    out = t.new_zeros((rows, cols))
    out[: t.shape[0], : t.shape[1]] = t
    return out
