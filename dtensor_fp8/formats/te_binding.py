"""How a recipe's planes map onto Transformer Engine's tensor classes: one declaration per recipe.

[Note: the TE binding]
Each recipe class declares a :class:`TEBinding` (``Recipe.te_binding``): TE's tensor class, its
FP8 buffers (:class:`TEBuffer`: TE attribute and constructor keyword, which of our planes and
which part of it, transposed or not, padding), TE's quantizer class with the recipe fields that
are its arguments, and the TE recipe (``transformer_engine.common.recipe``) whose weight quantizer
it matches. Everything TE-shaped is derived from that declaration, here:

* :meth:`TEBinding.layout` — TE's buffers for our planes (``Recipe.te_layout``): data shared where
  TE lays it out as we do, transposed copies and padded scales built;
* :meth:`TEBinding.planes_from` — the inverse (``Recipe.from_te_layout``);
* :meth:`TEBinding.scale_extents` — the unpadded region of each padded scale tensor;
* :meth:`TEBinding.views_planes` — whether every rowwise buffer is a view of our planes (no copy),
  which lets FSDP's one-rank gather hand TE views of the shard itself (``te_tensor.py``);
* :func:`te_quantizer`, :func:`te_recipe_for` — TE's quantizer and recipe objects for a recipe.

The TE adapter (``te.py``, ``te_tensor.py``), the benchmarks and the recipes' TE-kernel fast path never ask which
recipe they hold: they read its binding. TE itself is imported lazily (``te_import.py``); nothing
here needs it except the two functions that build TE objects.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import te_import
from .planes import (COLUMNWISE, ROWWISE, USAGES, Plane, RecipeError, as_matrix_shape, dense, pad_2d, round_up, te_data,
                     transpose_2d, transposer_2d)

DATA = "data"
SCALE_INV = "scale_inv"


@dataclass(frozen=True)
class TEBuffer:
    """One FP8 buffer of a TE tensor and how it is made from our planes.

    Attributes:
        name: TE's attribute (``"_rowwise_scale_inv"``).
        arg: TE's constructor keyword for it (``"rowwise_scale_inv"``).
        usages: the usages it serves (a per-tensor ``_scale_inv`` serves both).
        plane: our stored plane it is made from.
        part: ``"data"`` (FP8 values, uint8 in TE, the logical N-D shape) or ``"scale_inv"``.
        transposed: TE stores it transposed (data ``(K, *leading)``, scales the transposed grid).
        pad: TE pads a scale tensor's rows / columns to multiples of these (its valid region is
            the block grid; TE leaves the padding uninitialized, ours is zero).
        flat: a per-tensor scale, stored with shape ``(1,)``.
        invalid_flag: TE attribute that, when true, marks this buffer stale (``_transpose_invalid``).
    """

    name: str
    arg: str
    usages: tuple[str, ...]
    plane: str
    part: str
    transposed: bool = False
    pad: tuple[int, int] = (1, 1)
    flat: bool = False
    invalid_flag: str | None = None


@dataclass(frozen=True)
class TEBinding:
    """A recipe's TE binding (see the note at the top).

    Attributes:
        tensor_class: TE's tensor class (``"Float8Tensor"``); ``storage_class`` its storage base.
        buffers: its FP8 buffers, in TE's order.
        quantizer_class: TE's quantizer class for this recipe.
        quantizer_state: what the bridge makes for the quantizer at call time: ``"scale"`` and
            ``"amax"`` (fp32 tensors of one element), ``"device"``.
        quantizer_fields: ``(TE quantizer argument and attribute, recipe field)`` pairs.
        tensor_flags: TE tensor constructor arguments with this recipe's fixed value (read back
            from the attribute ``"_" + argument`` of a TE tensor).
        te_recipe: class in ``transformer_engine.common.recipe`` whose weight quantizer this is;
            ``te_recipe_fields``: ``(its argument, recipe field)`` pairs.
        min_capability: the CUDA compute capability TE's kernels for this recipe need.
    """

    tensor_class: str
    storage_class: str
    buffers: tuple[TEBuffer, ...]
    quantizer_class: str
    quantizer_state: tuple[str, ...] = ()
    quantizer_fields: tuple[tuple[str, str], ...] = ()
    tensor_flags: tuple[tuple[str, object], ...] = ()
    te_recipe: str = ""
    te_recipe_fields: tuple[tuple[str, str], ...] = ()
    min_capability: tuple[int, int] = (0, 0)

    # ---- derived ---------------------------------------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.buffers)

    @functools.cache
    def buffers_for(self, usages: tuple[str, ...]) -> tuple[TEBuffer, ...]:
        """The buffers a TE tensor serving ``usages`` holds (the others are ``None``)."""
        return tuple(b for b in self.buffers if any(u in usages for u in b.usages))

    def _scale_for(self, data: TEBuffer) -> TEBuffer:
        return next(b for b in self.buffers if b.part == SCALE_INV and set(data.usages) <= set(b.usages))

    def layout(self, recipe, planes: dict[str, Plane], shape, usages=USAGES, reuse=None,
               transposed_data: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """TE's attribute names -> tensors for a tensor of logical ``shape`` serving ``usages``.

        Args:
            recipe: the recipe declaring this binding.
            planes: our stored planes (logical orientation).
            shape: the logical (N-D) shape.
            usages: the usages to serve.
            reuse: name -> an earlier padded scale tensor to overwrite (FSDP's later gathers).
            transposed_data: a transpose cache of the rowwise plane's data (``(K, M)``) to use
                for the transposed data buffer instead of transposing again.
        """
        reuse = reuse or {}
        out = {}
        for b in self.buffers_for(tuple(usages)):
            if transposed_data is not None and b.part == DATA and b.transposed and b.plane == ROWWISE:
                out[b.name] = transposed_data.view(torch.uint8).reshape(shape[-1], *shape[:-1])
            else:
                out[b.name] = self.make(b, planes[b.plane], shape, reuse.get(b.name))
        return out

    @staticmethod
    def make(b: TEBuffer, plane: Plane, shape, reuse: torch.Tensor | None = None) -> torch.Tensor:
        """One TE buffer from our plane (a view where TE's layout is ours, else built)."""
        return TEBinding.builder(b, plane, shape)(reuse)

    @staticmethod
    def builder(b: TEBuffer, plane: Plane, shape):
        """``fn(reuse=None) -> tensor`` making buffer ``b`` from ``plane``: the views of the plane
        it starts from are made once, here, so a caller that builds the same buffer at every
        FSDP gather (``te.py``) pays only for the copy itself."""
        if b.part == DATA:
            if not b.transposed:
                view = te_data(plane.data, shape)
                return lambda reuse=None: view
            transpose = transposer_2d(plane.data.view(torch.uint8))
            if len(shape) == 2:
                return lambda reuse=None: transpose()
            return lambda reuse=None: transpose().reshape(shape[-1], *shape[:-1])
        s = plane.scale_inv
        if s.dtype.itemsize == 1:  # E8M0 scales: TE stores bytes
            s = s.view(torch.uint8)
        if b.flat:
            flat = s.reshape(1)
            return lambda reuse=None: flat
        if b.transposed:
            s = s.t()
        rows, cols = round_up(s.shape[0], b.pad[0]), round_up(s.shape[1], b.pad[1])
        if (rows, cols) == tuple(s.shape) and not b.transposed:
            shared = dense(s)  # TE's shape is the grid: share it
            return lambda reuse=None: shared
        return lambda reuse=None: pad_2d(s, rows, cols, reuse)

    def is_view(self, b: TEBuffer, recipe, shape) -> bool:
        """Whether :meth:`make` returns a view of the plane (no copy) for a weight of ``shape``."""
        if b.transposed:
            return False
        if b.part == DATA or b.flat:
            return True
        rows, cols = recipe.block_shape(b.plane).grid(as_matrix_shape(shape))
        return (round_up(rows, b.pad[0]), round_up(cols, b.pad[1])) == (rows, cols)

    def views_planes(self, recipe, shape, usages) -> bool:
        """Whether every buffer serving the rowwise usage is a view of our planes for ``usages``
        (columnwise-only buffers may be built: TE drops them after its input-gradient GEMM)."""
        return all(self.is_view(b, recipe, shape) for b in self.buffers_for(tuple(usages)) if ROWWISE in b.usages)

    def scale_extents(self, recipe, shape) -> dict[str, tuple[int, int]]:
        """Valid (unpadded) extent of each padded scale tensor of :meth:`layout`."""
        matrix = as_matrix_shape(shape)
        out = {}
        for b in self.buffers:
            if b.part == SCALE_INV and not b.flat:
                rows, cols = recipe.block_shape(b.plane).grid(matrix)
                out[b.name] = (cols, rows) if b.transposed else (rows, cols)
        return out

    def planes_from(self, recipe, buffers: dict[str, torch.Tensor | None], shape) -> tuple[dict[str, Plane], tuple[str, ...]]:
        """Inverse of :meth:`layout`: ``(planes, usages)`` from TE's buffers (``None`` = absent).

        Each stored plane is read from the first of its data buffers present (untransposed
        first) and the scale buffer serving the same usage. The usages served are those whose
        data buffer is present, and the columnwise usage wherever it is a transpose of the
        rowwise plane read (TE's transpose is rebuilt locally when needed).
        """
        matrix = as_matrix_shape(shape)
        planes, served = {}, set()
        for b in self.buffers:
            if b.part != DATA or buffers.get(b.name) is None:
                continue
            served.update(b.usages)
            if b.plane in planes:
                continue
            planes[b.plane] = Plane(self._data_from(b, recipe, buffers[b.name], matrix),
                                    self._scale_from(self._scale_for(b), recipe, buffers, matrix))
        if not planes:
            raise RecipeError(f"{recipe.name}: the TE tensor holds none of {[b.name for b in self.buffers if b.part == DATA]}")
        if recipe.columnwise_is_transpose and ROWWISE in served:
            served.add(COLUMNWISE)
        return planes, tuple(u for u in USAGES if u in served)

    @staticmethod
    def _data_from(b: TEBuffer, recipe, t: torch.Tensor, matrix) -> torch.Tensor:
        m, k = matrix
        data = t.view(recipe.fp8_dtype)
        return transpose_2d(data.reshape(k, m)) if b.transposed else data.reshape(m, k)

    @staticmethod
    def _scale_from(b: TEBuffer, recipe, buffers, matrix) -> torch.Tensor:
        s = buffers[b.name]
        grid = recipe.block_shape(b.plane).grid(matrix)
        if b.flat:
            s = s.reshape(grid)
        elif b.transposed:
            s = s[: grid[1], : grid[0]].t()
        else:
            s = s[: grid[0], : grid[1]]
        s = dense(s)
        if s.dtype != recipe.scale_inv_dtype:
            same_size = s.dtype.itemsize == recipe.scale_inv_dtype.itemsize
            s = s.view(recipe.scale_inv_dtype) if same_size else s.to(recipe.scale_inv_dtype)
        return s


# ---- TE objects for a recipe (need TE) ----------------------------------------------------------------
def te_quantizer(recipe, *, rowwise: bool = True, columnwise: bool = True, device=None,
                 scale: torch.Tensor | None = None, scale_inv: torch.Tensor | None = None):
    """The TE quantizer that makes what ``recipe`` makes (bit-exact; tests/gpu/test_te_parity.py).

    Args:
        recipe: our recipe object.
        rowwise, columnwise: the quantizer's usages.
        device: device of the quantizer's state (default: that of ``scale`` / ``scale_inv``, else CUDA).
        scale: for recipes whose quantizer holds a scale (delayed scaling): that scale.
        scale_inv: the same as the ``scale_inv`` of a tensor (the quantizer holds ``1/scale_inv``);
            neither given: TE's initial scale 1.

    Example:
        >>> quantizer = te_quantizer(dtensor_fp8.CurrentScaling(), columnwise=False)
    """
    b = recipe.te_binding
    given = scale if scale is not None else scale_inv
    dev = device if device is not None else (given.device if given is not None else "cuda")
    kwargs = {te_name: getattr(recipe, field) for te_name, field in b.quantizer_fields}
    if "scale" in b.quantizer_state:
        if scale is not None:
            kwargs["scale"] = scale.float().reshape(1).to(dev)
        elif scale_inv is not None:
            kwargs["scale"] = torch.reciprocal(scale_inv.float().reshape(1)).to(dev)
        else:
            kwargs["scale"] = torch.ones(1, dtype=torch.float32, device=dev)
    if "amax" in b.quantizer_state:
        kwargs["amax"] = torch.zeros(1, dtype=torch.float32, device=dev)
    if "device" in b.quantizer_state:
        kwargs["device"] = dev
    return te_import.new_quantizer(b.quantizer_class, recipe.fp8_dtype, rowwise=rowwise, columnwise=columnwise, **kwargs)


def te_recipe_for(recipe):
    """The ``transformer_engine.common.recipe`` object for ``te.autocast`` whose weight quantizer
    matches ``recipe`` (TE's defaults otherwise: E4M3 forward / E5M2 gradients where TE's recipe
    says HYBRID).

    Example:
        >>> with te.autocast(enabled=True, recipe=te_recipe_for(dtensor_fp8.Blockwise(block_dims=2))):
        ...     y = layer(x)
    """
    b = recipe.te_binding
    if not b.te_recipe:
        raise RecipeError(f"{recipe.name}: no Transformer Engine recipe matches {recipe!r}")
    cls = getattr(te_import.require("te_recipe_for").recipe, b.te_recipe)
    return cls(**{te_name: getattr(recipe, field) for te_name, field in b.te_recipe_fields})


def te_unsupported_reason(recipe, capability: tuple[int, int]) -> str | None:
    """Why TE's kernels for ``recipe`` do not run on a device of ``capability`` (``None``: they do)."""
    need = recipe.te_binding.min_capability
    if tuple(capability) < need:
        return (f"TE's {recipe.name} kernels need sm_{need[0]}{need[1]}+, the device is "
                f"sm_{capability[0]}{capability[1]}")
    return None
