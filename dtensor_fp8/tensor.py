"""``QuantizedTensor``: a high-precision-looking tensor that holds FP8 planes.

[Note: what a QuantizedTensor is]
A wrapper subclass with the *nominal* dtype (bf16/fp32) and logical shape of the weight it
replaces. It holds the planes its recipe stores (``rowwise`` and/or ``columnwise``, each FP8 data +
``scale_inv`` in the logical orientation, see ``formats/base.py``), the usages it can serve, and,
for transpose-derived recipes, an optional transpose cache (TE's physical ``(K, M)`` copy).

A tensor may hold a subset of the planes: FSDP's forward gather produces one with only the rowwise
plane, the backward gather one with only the columnwise plane. Reading a plane the tensor does not
hold raises; it is never recomputed from high precision behind the caller's back.

Every aten op it supports is in ``ops.py`` (the op table); anything else raises with the fix.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map_only

from .formats.base import COLUMNWISE, ROWWISE, USAGES, Recipe, Plane, RecipeError


def one_byte_as_uint8(t: torch.Tensor) -> torch.Tensor:
    """FP8 / E8M0 tensors viewed as their bytes (gloo rejects float8 dtypes; plain torch reads
    uint8 everywhere); wider dtypes (fp32 scales) unchanged."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


class QuantizedTensor(torch.Tensor):
    """FP8 planes + recipe, looking like a high-precision tensor of ``dtype`` and ``shape``.

    Build one with :func:`dtensor_fp8.quantize`; the constructor takes planes already made.

    Args:
        planes: stored planes by usage (``"rowwise"`` / ``"columnwise"``), logical orientation.
        recipe: the recipe object that made them.
        shape: logical shape (2-D).
        dtype: nominal high-precision dtype (what ``dequantize()`` returns by default).
        usages: which usages this tensor can serve; defaults to what ``planes`` allow.
        transpose: optional transpose cache (transpose-derived recipes only).
    """

    _planes: dict[str, Plane]
    _recipe: Recipe
    _usages: tuple[str, ...]
    _transpose: torch.Tensor | None

    @staticmethod
    def __new__(cls, planes, recipe, shape, dtype, usages=None, transpose=None, requires_grad=False):
        if not planes:
            raise RecipeError(f"{recipe.name}: a QuantizedTensor needs at least one plane")
        some = next(iter(planes.values())).data
        return torch.Tensor._make_wrapper_subclass(
            cls, torch.Size(shape), dtype=dtype, device=some.device, requires_grad=requires_grad
        )

    def __init__(self, planes, recipe, shape, dtype, usages=None, transpose=None, requires_grad=False):
        self._planes = dict(planes)
        self._recipe = recipe
        if usages is None:
            usages = tuple(u for u in USAGES if recipe.stored_usage(u) in self._planes)
        self._usages = tuple(u for u in USAGES if u in usages)
        for u in self._usages:
            if recipe.stored_usage(u) not in self._planes:
                raise RecipeError(f"{recipe.name}: usage {u!r} needs the {recipe.stored_usage(u)!r} plane, which is absent")
        self._transpose = transpose

    # ---- accessors --------------------------------------------------------------------------------
    @property
    def recipe(self) -> Recipe:
        return self._recipe

    @property
    def usages(self) -> tuple[str, ...]:
        """Usages this tensor can serve (``"rowwise"`` for forward, ``"columnwise"`` for backward)."""
        return self._usages

    @property
    def planes(self) -> dict[str, Plane]:
        return dict(self._planes)

    def plane(self, usage: str) -> Plane:
        """The stored plane that serves ``usage``; raises if this tensor does not hold it."""
        stored = self._recipe.stored_usage(usage)
        if usage not in self._usages or stored not in self._planes:
            raise RecipeError(
                f"{self._recipe.name}: this QuantizedTensor of shape {tuple(self.shape)} holds usages "
                f"{self._usages}, not {usage!r}. Gather/quantize with {usage} usage enabled "
                "(e.g. quantize(..., columnwise=True)); planes are never rebuilt from high precision implicitly."
            )
        return self._planes[stored]

    def dequantize(self, dtype: torch.dtype | None = None, usage: str | None = None) -> torch.Tensor:
        """High-precision values from one plane (rowwise when held, else columnwise).

        Args:
            dtype: output dtype; defaults to the nominal dtype.
            usage: which plane to read.

        Example:
            >>> w = quantize(torch.randn(64, 64), MXFP8()).dequantize(torch.float32)
        """
        usage = usage or self._usages[0]
        return self._recipe.dequantize_plane(self.plane(usage), usage, dtype or self.dtype).reshape(self.shape)

    def repoint_(self, planes: dict[str, Plane], usages: tuple[str, ...] | None = None,
                 transpose: torch.Tensor | None = None) -> "QuantizedTensor":
        """Point this tensor at other planes of the same recipe and logical shape, in place (the one
        way to change what a QuantizedTensor holds: FSDP2 re-uses its unsharded parameter object
        across gathers).

        Args:
            planes: the new planes by usage.
            usages: usages they serve (default: what ``planes`` allow).
            transpose: a transpose cache matching ``planes`` (default: none).

        Example:
            >>> unsharded.repoint_(gathered.planes, gathered.usages)
        """
        if usages is None:
            usages = tuple(u for u in USAGES if self._recipe.stored_usage(u) in planes)
        for u in usages:
            if self._recipe.stored_usage(u) not in planes:
                raise RecipeError(f"{self._recipe.name}: usage {u!r} needs the {self._recipe.stored_usage(u)!r} plane, which is absent")
        self._planes, self._usages, self._transpose = dict(planes), tuple(u for u in USAGES if u in usages), transpose
        return self

    # ---- transpose cache ----------------------------------------------------------------------------
    @property
    def transpose_cache(self) -> torch.Tensor | None:
        """TE's transposed ``(K, M)`` copy of the shared plane, if built (see :meth:`create_transpose_cache`)."""
        return self._transpose

    def create_transpose_cache(self) -> torch.Tensor | None:
        """Build TE's transposed copy of the shared plane (transpose-derived recipes); idempotent."""
        if self._recipe.columnwise_is_transpose and COLUMNWISE in self._usages and self._transpose is None:
            self._transpose = self._recipe.transpose_cache(self._planes[ROWWISE])
        return self._transpose

    def discard_transpose_cache(self) -> None:
        self._transpose = None

    def columnwise_matrix(self, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized ``(M, K)`` values as the backward GEMM reads them: from the columnwise
        plane, or for transpose-derived recipes from the transpose cache (built if missing)."""
        if self._recipe.columnwise_is_transpose and COLUMNWISE in self._usages:
            transposed = self.create_transpose_cache()
            plane = self._planes[ROWWISE]
            return self._recipe.decode(transposed.t(), plane.scale_inv, COLUMNWISE, dtype)
        return self.dequantize(dtype, COLUMNWISE)

    # ---- construction helpers -------------------------------------------------------------------
    def _rebuild(self, planes, shape=None, usages=None, transpose=None, dtype=None) -> "QuantizedTensor":
        return QuantizedTensor(
            planes, self._recipe, self.shape if shape is None else shape, dtype or self.dtype,
            self._usages if usages is None else usages, transpose,
        )

    def with_usages(self, *usages: str) -> "QuantizedTensor":
        """A view holding only the planes needed for ``usages`` (no copy): gather this one to move
        only one direction's bytes, e.g. ``q.with_usages("rowwise")`` for forward."""
        for u in usages:
            self.plane(u)
        stored = {self._recipe.stored_usage(u) for u in usages}
        return self._rebuild({k: v for k, v in self._planes.items() if k in stored}, usages=usages)

    def inner_tensors(self) -> list[torch.Tensor]:
        return [t for p in self._planes.values() for t in p.tensors()]

    def __tensor_flatten__(self):
        names = [f"{u}_{part}" for u in self._planes for part in ("data", "scale_inv")]
        return names, (self._recipe, self._usages, tuple(self._planes), self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        recipe, usages, stored, dtype = ctx
        planes = {u: Plane(inner[f"{u}_data"], inner[f"{u}_scale_inv"]) for u in stored}
        return QuantizedTensor(planes, recipe, outer_size, dtype, usages)

    def __repr__(self) -> str:
        return (
            f"QuantizedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, recipe={self._recipe!r}, "
            f"usages={self._usages}, planes={tuple(self._planes)})"
        )

    # ---- dispatch ---------------------------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            from .linear import quantized_linear

            return quantized_linear(*args, **kwargs)
        # No conversion of results to this class: ops that produce plain tensors (GEMMs on the
        # planes, ``view(-1)``'s raw bytes) must stay plain (torch's default would re-wrap them).
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from .ops import QUANTIZED_OPS

        kwargs = kwargs or {}
        impl = QUANTIZED_OPS.get(func) or QUANTIZED_OPS.get(func.overloadpacket)
        if impl is None:
            shapes = tree_map_only(QuantizedTensor, lambda t: f"QuantizedTensor{tuple(t.shape)}", args)
            raise NotImplementedError(
                f"dtensor_fp8: {func} is not supported on a QuantizedTensor (args: {shapes}). FP8 weights "
                "are never silently dequantized: call .dequantize() for a high-precision copy, or use "
                "torch.nn.functional.linear, which runs on the FP8 planes."
            )
        return impl(func, args, kwargs)

