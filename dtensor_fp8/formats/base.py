"""The recipe interface: the only place that knows how FP8 bytes and scales are laid out.

[Note: planes, usages and the logical orientation]
A quantized weight ``W`` of logical shape ``(M, K)`` has up to two *planes*:

* ``rowwise``: read by the forward GEMM ``y = x W^T``; blocks run along K (e.g. MXFP8 1x32).
* ``columnwise``: read by the backward GEMM ``dx = dy W``; blocks run along M (e.g. MXFP8 32x1).

Every plane is stored here in the *logical* orientation: ``data`` has shape ``(M, K)`` and
``scale_inv`` has the shape of the block grid ``(ceil(M / block_rows), ceil(K / block_cols))``,
where a block extent of ``None`` means "the whole dimension" (per-tensor scaling: grid ``(1, 1)``).
Because of that, sharding a plane along dim 0 (or 1) is slicing data rows and scale rows at the
same block boundary, and gathering is concatenation: the placement and FSDP code never needs to
know the recipe. Transformer Engine's physical layouts (transposed columnwise storage, padded
scale tensors) are produced only at the TE boundary, by :meth:`Recipe.te_layout` from the
recipe's declared ``te_binding`` (``te_binding.py``).

For per-tensor and 128x128 blockwise recipes the columnwise plane is the rowwise plane with the
same bytes (``columnwise_is_transpose``): only the rowwise plane is stored and moved, and TE's
transposed copy (the "transpose cache") is built locally after a gather and discarded when the
parameter is resharded.
"""

from __future__ import annotations

import abc
import math
from typing import TYPE_CHECKING

import torch

from .. import _compat

# The pieces every formats module shares live in the leaf module planes.py (re-exported here:
# ``from .formats.base import Plane`` keeps working); te_binding.py imports them from there, so
# nothing in formats/ imports a module that imports it back (tests/test_structure.py checks it).
from .planes import (COLUMNWISE, ROWWISE, USAGES, BlockShape, Plane, RecipeError, as_matrix_shape, dense,  # noqa: F401
                     pad_2d, round_up, te_data, transpose_2d, transposer_2d)

if TYPE_CHECKING:
    from .te_binding import TEBinding

class Recipe(abc.ABC):
    """One FP8 recipe: block geometry, scale rule, and the TE storage layout.

    Subclasses are the public recipe objects (``DelayedScaling``, ``CurrentScaling``,
    ``MXFP8``, ``Blockwise``). Everything generic (block amax, scaling, saturating cast,
    dequantize, slicing rules) lives here and is driven by :meth:`block_shape`.
    """

    fp8_dtype: torch.dtype
    #: Fast paths tried in order on a CUDA input (``triton_kernels.fast_path``): ``"triton"``
    #: (formats/triton_*.py), ``"te"`` (formats/te_kernels.py); the pure-torch reference otherwise.
    kernel_order: tuple[str, ...] = ("triton", "te")
    #: True when the columnwise plane holds the same bytes as the rowwise plane, so only the
    #: rowwise plane is stored/moved and TE's transposed copy is built locally.
    columnwise_is_transpose: bool = False

    # ---- what a subclass defines -------------------------------------------------------------
    @property
    @abc.abstractmethod
    def name(self) -> str:
        """Short recipe name used in messages, e.g. ``"mxfp8"``."""

    @abc.abstractmethod
    def block_shape(self, usage: str) -> BlockShape:
        """Scaling block of the plane for ``usage`` (``"rowwise"`` / ``"columnwise"``)."""

    @abc.abstractmethod
    def scale_from_amax(
        self, amax: torch.Tensor, usage: str, hp_dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-block ``(scale, scale_inv)`` from per-block amax (fp32) of a ``hp_dtype`` input.

        ``scale`` (fp32) multiplies high-precision values before the FP8 cast; ``scale_inv`` is
        what is stored (dtype :attr:`scale_inv_dtype`).
        """

    @property
    @abc.abstractmethod
    def te_binding(self) -> "TEBinding":
        """How this recipe maps onto Transformer Engine's tensors (``te_binding.py``): TE's tensor
        class, buffers, quantizer and recipe, declared once; the TE methods below derive from it."""

    # ---- Transformer Engine's storage (derived from te_binding) -------------------------------------
    def te_layout(self, planes: dict[str, Plane], shape, usages=USAGES, reuse=None) -> dict[str, torch.Tensor]:
        """TE's attribute names -> tensors for a tensor of logical ``shape`` serving ``usages``
        (FP8 data as uint8, TE's padded scales and transposed storage; shared with the planes
        where TE's layout is ours). ``reuse``: name -> an earlier padded scale tensor to
        overwrite (FSDP's later gathers of the same weight)."""
        return self.te_binding.layout(self, planes, shape, usages, reuse)

    def from_te_layout(self, buffers: dict[str, torch.Tensor], shape) -> dict[str, Plane]:
        """Inverse of :meth:`te_layout`: planes in the logical orientation, as 2-D matrices."""
        return self.te_binding.planes_from(self, buffers, shape)[0]

    def te_scale_extents(self, shape) -> dict[str, tuple[int, int]]:
        """Valid (unpadded) extent of each padded scale tensor in :meth:`te_layout` (TE does not
        initialize the padding, so only this region is comparable)."""
        return self.te_binding.scale_extents(self, shape)

    def check_shape(self, shape: tuple[int, ...]) -> None:
        """Raise :class:`RecipeError` for (logical, possibly N-D) shapes TE rejects for this recipe."""

    scale_inv_dtype: torch.dtype = torch.float32
    #: True when the weight scaling state (:meth:`initial_scaling_state`) holds one row per index
    #: along the weight's dim 0 (one expert of an expert weight: ``experts.py``), so a checkpoint
    #: shards it with the weight's dim 0; False: one state for the whole weight, the same on every rank.
    scaling_state_per_index: bool = False
    #: True when an activation / gradient quantizer of this recipe keeps scaling state across steps
    #: (:meth:`operand_state` returns one: delayed scaling's amax history); False when its scales are
    #: a function of the data alone, so a once-per-step operand update has nothing to do for it.
    keeps_operand_state: bool = False

    # ---- geometry ------------------------------------------------------------------------------
    def stored_usage(self, usage: str) -> str:
        """The plane that is stored and moved to serve ``usage``."""
        _check_usage(usage)
        return ROWWISE if self.columnwise_is_transpose else usage

    def stored_usages(self, rowwise: bool, columnwise: bool) -> tuple[str, ...]:
        wanted = [u for u, on in ((ROWWISE, rowwise), (COLUMNWISE, columnwise)) if on]
        return tuple(dict.fromkeys(self.stored_usage(u) for u in wanted))

    def narrow_planes(self, planes: dict[str, Plane], dim: int, start: int, end: int, phase: int) -> dict[str, Plane]:
        """Rows (``dim`` 0) or columns (``dim`` 1) ``[start, end)`` of ``planes``, as views, with the
        scales of every block they touch, where the planes start at block ``phase`` along ``dim``.

        Example:
            >>> top = MXFP8().narrow_planes(planes, 0, 0, 96, 0)   # rows 0..95 and their 3 scale rows
        """
        out = {}
        for usage, plane in planes.items():
            block = self.block_shape(usage).extent(dim)
            if block is None:  # one scale for the whole dim: shared by every slice
                scale = plane.scale_inv
            else:
                first = (phase % block + start) // block
                last = -(-(phase % block + end) // block) if end > start else first
                scale = plane.scale_inv.narrow(dim, first, last - first)
            out[usage] = Plane(plane.data.narrow(dim, start, end - start), scale)
        return out

    def empty_planes(self, shape: tuple[int, int], usages: tuple[str, ...], device) -> dict[str, Plane]:
        """Uninitialized planes (FP8 data and block scales) of a ``shape`` weight for the stored
        planes of ``usages``: a weight built on the meta device, whose bytes come later.

        Example:
            >>> MXFP8().empty_planes((64, 64), ("rowwise", "columnwise"), "meta")["columnwise"].scale_inv.shape
            torch.Size([2, 64])
        """
        return {u: Plane(torch.empty(shape, dtype=self.fp8_dtype, device=device),
                         torch.empty(self.block_shape(u).grid(shape), dtype=self.scale_inv_dtype, device=device))
                for u in self.stored_usages(ROWWISE in usages, COLUMNWISE in usages)}

    def of_whole(self, shape) -> "Recipe":
        """The recipe of the whole weight of ``shape`` that a piece with this recipe was cut from: itself,
        unless its blocks depend on the weight's shape (an expert weight's tensor-parallel piece of each
        expert's rows: ``formats/experts.py``). State dicts name the whole weight's recipe.

        Example:
            >>> MXFP8().of_whole((256, 128)) == MXFP8()
            True
        """
        return self

    def shard_alignment(self, dim: int, usages: tuple[str, ...] = USAGES) -> int:
        """Multiple that a shard boundary along ``dim`` must be, for the stored planes of ``usages``.

        A block spanning a whole dimension (per-tensor scale) does not constrain boundaries: its
        single scale is replicated on every shard.
        """
        extents = [self.block_shape(u).extent(dim) for u in dict.fromkeys(self.stored_usage(u) for u in usages)]
        return math.lcm(1, *[e for e in extents if e is not None])

    def spans_dim(self, usage: str, dim: int) -> bool:
        """True when one scaling block covers the whole of ``dim`` (its amax must be reduced
        across every shard of that dim)."""
        return self.block_shape(usage).extent(dim) is None

    # ---- quantize / dequantize -----------------------------------------------------------------
    def block_amax(self, hp: torch.Tensor, usage: str, *, magnitudes: torch.Tensor | None = None) -> torch.Tensor:
        """Per-block max of ``|hp|`` (fp32), NaN ignored as TE's ``fmaxf`` reduction does.

        Args:
            hp: 2-D high-precision values.
            usage: the plane whose blocks are meant.
            magnitudes: ``hp.abs()``, when the caller has it (both planes of one tensor share it).
        """
        # |x| and max are exact in the input dtype. A block holding a NaN has a NaN max: only then is
        # the pass that turns NaN into 0 (Inf kept) paid, for the whole tensor.
        x = hp.abs() if magnitudes is None else magnitudes
        block = self.block_shape(usage)
        # is_traced, not is_compiling: torch 2.11's dynamo runs a subclass's F.linear on fake tensors
        # outside its tracing, where is_compiling() is False (the data-dependent bool broke the graph).
        traced = _compat.is_traced(x)
        if traced:  # no data-dependent branch in a graph; inductor fuses the pass
            x = torch.nan_to_num(x, nan=0.0, posinf=float("inf"))
        amax = _to_blocks(x, block)[0].amax(dim=(1, 3))
        if not traced and bool(amax.isnan().any()):
            amax = _to_blocks(torch.nan_to_num(x, nan=0.0, posinf=float("inf")), block)[0].amax(dim=(1, 3))
        return amax.float()

    def block_amaxes(self, usage: str, hps) -> list[torch.Tensor]:
        """:meth:`block_amax` of several tensors (an optimizer step's batch); per-tensor recipes
        compute them into one vector on CUDA.

        Args:
            usage: the plane whose blocks are meant.
            hps: 2-D high-precision tensors.

        Example:
            >>> CurrentScaling().block_amaxes("rowwise", [w1, w2])  # [amax grid of w1, of w2]
        """
        return [self.block_amax(hp, usage) for hp in hps]

    def encode(self, hp: torch.Tensor, scale: torch.Tensor, usage: str) -> torch.Tensor:
        """``saturate(hp * scale)`` cast to FP8 with round-to-nearest-even, per block."""
        blocks, shape = _to_blocks(hp.float(), self.block_shape(usage))
        scaled = blocks * scale[:, None, :, None]
        fp8_max = torch.finfo(self.fp8_dtype).max
        # Saturating cast (TE converts with __NV_SATFINITE); NaN stays NaN.
        out = _from_blocks(scaled.clamp_(-fp8_max, fp8_max).to(self.fp8_dtype), shape)
        # TE writes the canonical NaN byte 0x7F whatever the input NaN's sign (seen on the H200);
        # torch's CPU cast keeps the sign (0xFF). After the clamp the only codes with all low seven
        # bits set are NaNs (E4M3: S.1111.111; E5M2: S.11111.11, Inf being clamped away), so fix
        # them on the bytes, a quarter of the fp32 traffic.
        raw = out.view(torch.uint8)
        raw.masked_fill_(raw == 0xFF, 0x7F)  # the other NaN code, 0x7F, is already canonical
        return out

    def decode(self, data: torch.Tensor, scale_inv: torch.Tensor, usage: str, dtype: torch.dtype) -> torch.Tensor:
        """``fp8 * scale_inv`` in fp32, then cast to ``dtype`` (TE's dequantize order)."""
        blocks, shape = _to_blocks(data.float(), self.block_shape(usage))
        out = blocks * scale_inv.float()[:, None, :, None]
        return _from_blocks(out, shape).to(dtype)

    def given_scale(self, scale: torch.Tensor | float, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, scale_inv)`` grids from a caller-given scale (delayed scaling only)."""
        raise RecipeError(
            f"{self.name}: this recipe computes its scales from the data; scale= is only accepted by "
            "DelayedScaling. Drop the scale argument."
        )

    def quantize_plane(
        self, hp: torch.Tensor, usage: str, *, amax: torch.Tensor | None = None, scale=None
    ) -> Plane:
        """Quantize a 2-D high-precision matrix into the plane for ``usage``.

        Args:
            hp: 2-D bf16/fp16/fp32 tensor.
            usage: ``"rowwise"`` or ``"columnwise"``.
            amax: per-block amax to use instead of the local one (a reduced amax when the
                blocks span shards held by other ranks).
            scale: an explicit per-tensor scale (delayed scaling).

        Example:
            >>> plane = MXFP8().quantize_plane(torch.randn(64, 64), "rowwise")
        """
        if scale is not None:
            scale, scale_inv = self.given_scale(scale, hp)
        else:
            if amax is None:
                amax = self.block_amax(hp, usage)
            scale, scale_inv = self.scale_from_amax(amax, usage, hp.dtype)
        return Plane(self.encode(hp, scale, usage), scale_inv)

    # ---- FP8 GEMMs (see formats/scaled_mm.py) -------------------------------------------------
    def gemm_recipe(self):
        """The FP8 GEMMs of a linear layer with a weight of this recipe (a
        :class:`~dtensor_fp8.formats.scaled_mm.GemmRecipe`: activation and gradient recipes, fast
        accumulation per GEMM), or ``None`` when it has none (the emulated linear runs)."""
        return None

    def operand_state(self, device: torch.device):
        """Scaling state an activation / gradient quantizer of this recipe keeps across steps
        (delayed scaling's amax history and scale); ``None`` for recipes whose scales are a
        function of the data alone."""
        return None

    def quantize_operand(self, hp: torch.Tensor, *, rowwise: bool, columnwise: bool, state=None):
        """Quantize a GEMM operand (activations, output gradients): the stored planes serving the
        usages asked for, and the scaling state for the next call (a stateful recipe records the
        operand's local amax in it; :meth:`update_operand_states_` later turns the recorded amaxes,
        reduced over ranks, into the next scales).

        Args:
            hp: 2-D high-precision tensor.
            rowwise, columnwise: the usages needed.
            state: from :meth:`operand_state` or the previous call (stateful recipes).

        Returns:
            ``(planes by usage, state)``: a plane for each usage asked for (for transpose-derived
            recipes both usages may be the same plane, or the columnwise one a transposed copy
            of the same bytes viewed in the logical orientation).

        Example:
            >>> planes, _ = CurrentScaling().quantize_operand(x, rowwise=True, columnwise=True)
        """
        stored = {u: self.quantize_plane(hp, u) for u in self.stored_usages(rowwise, columnwise)}
        return {u: stored[self.stored_usage(u)] for u, on in ((ROWWISE, rowwise), (COLUMNWISE, columnwise)) if on}, state

    def recorded_operand_amax(self, state) -> torch.Tensor | None:
        """The amax a stateful operand quantizer recorded since its last update, shape ``(1,)`` (a
        view into ``state``; the caller reduces it over ranks in place), or ``None`` for recipes
        without operand state.

        Example:
            >>> DelayedScaling().recorded_operand_amax(state)   # history[0]
            tensor([3.5])
        """
        return None

    def update_operand_states_(self, states: list) -> None:
        """Turn the recorded (and reduced) amaxes of ``states`` into their next scales, in place (TE's
        delayed-scaling update, once per step for all operands of this recipe); a no-op for recipes
        without operand state.

        Args:
            states: operand states of this recipe (from :meth:`operand_state`).

        Example:
            >>> DelayedScaling().update_operand_states_([input_state, grad_state])
        """

    def quantize_planes(self, hp: torch.Tensor, usages: tuple[str, ...], *, scale=None) -> dict[str, Plane]:
        """:meth:`quantize_plane` of each stored usage in ``usages``; recipes with a kernel that
        writes several planes from one read of ``hp`` override this.

        Example:
            >>> planes = MXFP8().quantize_planes(w, ("rowwise", "columnwise"))
        """
        from .triton_kernels import fast_path  # formats/ modules import the kernels lazily

        if scale is not None or len(usages) < 2 or fast_path(self, hp) is not None:
            return {u: self.quantize_plane(hp, u, scale=scale) for u in usages}
        # The reference: two planes from one |hp| (its costliest pass after the cast).
        magnitudes = hp.abs()
        return {u: self.quantize_plane(hp, u, amax=self.block_amax(hp, u, magnitudes=magnitudes)) for u in usages}

    def initial_scaling_state(self, current: Plane):
        """Per-weight scaling state kept across requantizations (delayed scaling's amax history);
        ``None`` for recipes whose scales are a function of the data alone."""
        return None

    def requantize_plane(self, hp: torch.Tensor, usage: str, current: Plane, *, amax=None, state=None):
        """New values for an existing plane, e.g. after an optimizer step.

        Args:
            hp: high-precision values (this rank's shard).
            usage: the plane.
            current: the plane being replaced.
            amax: per-block amax to use (reduced across ranks where blocks span shards).
            state: scaling state from :meth:`initial_scaling_state` or a previous call; with
                ``None`` a stateful recipe keeps ``current``'s scale.

        Returns:
            ``(plane, state)``.
        """
        return self.quantize_plane(hp, usage, amax=amax), state

    def requantize_planes(self, usage: str, hps, currents, amaxes, states):
        """:meth:`requantize_plane` for many tensors of this recipe at once (an optimizer step).

        Args:
            usage: the plane, the same for all.
            hps, currents, amaxes, states: per tensor, as :meth:`requantize_plane` takes them
                (an amax or state may be ``None``).

        Returns:
            An iterator of ``(plane, state)`` in order, each made when it is asked for, so a
            caller that stores each plane before taking the next holds one fresh plane at a time.
            Recipes whose scales come from per-tensor values override this to compute every
            scale with one set of kernels instead of one per tensor (the step is otherwise bound
            by kernel launches, not by bytes).
        """
        return (self.requantize_plane(hp, usage, cur, amax=a, state=s)
                for hp, cur, a, s in zip(hps, currents, amaxes, states))

    def requantize_planes_(self, usage: str, hps, planes, amaxes, states) -> list:
        """:meth:`requantize_planes` written into the existing ``planes`` (data and scale_inv, in
        place), as an optimizer step updates a model's FP8 weights; returns the new states.

        Recipes with a kernel that casts straight into existing storage override this (no fresh
        plane, no copy); here each fresh plane is copied in before the next is made.

        Args:
            usage, hps, amaxes, states: as :meth:`requantize_planes` takes them.
            planes: the planes to overwrite (also the current planes: a stateful recipe without a
                state keeps its scale).

        Example:
            >>> states = DelayedScaling().requantize_planes_("rowwise", [master], [q.plane("rowwise")], [None], [state])
        """
        new_states = []
        for plane, (fresh, state) in zip(planes, self.requantize_planes(usage, hps, planes, amaxes, states), strict=True):
            plane.data.copy_(fresh.data)
            plane.scale_inv.copy_(fresh.scale_inv)
            new_states.append(state)
        return new_states

    def dequantize_plane(self, plane: Plane, usage: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.decode(plane.data, plane.scale_inv, usage, dtype)

    # ---- block phase: pieces that start inside a block ------------------------------------------
    # [Note: block phase]
    # A shard whose boundary falls inside a scaling block (FSDP2 at a degree whose chunks are not
    # whole blocks, an uneven dim, a ColwiseParallel (dim 0) or RowwiseParallel (dim 1) shard, TP x
    # FSDP2) starts ``phase`` elements into its first block along each dim. It stores its own FP8 rows and the scale of
    # every block it touches: its local scale grid is ``block_shape(u).grid(shape, phase)``, and a
    # block shared with a neighbour has the same scale on both ranks (the amax over exactly the
    # block's elements, reduced over the ranks that share it: ``requantize.py``). The ``*_at``
    # methods below serve such a piece with the phase-0 codec by padding it in front with zeros
    # (which change no amax and are cut off again): the codecs themselves, their fast paths and
    # their golden vectors stay those of whole blocks.
    def phase_period(self, dim: int) -> int:
        """The period of block boundaries along ``dim`` over every plane (1: no boundary, a
        per-tensor scale): a piece's phase along ``dim`` is its start modulo this."""
        return self.shard_alignment(dim, USAGES)

    def usage_phase(self, usage: str, phase: tuple[int, int]) -> tuple[int, int]:
        """``phase`` as the plane ``usage``'s blocks see it (modulo their extents)."""
        block = self.block_shape(usage)
        return tuple(0 if block.extent(d) is None else phase[d] % block.extent(d) for d in (0, 1))

    def block_amax_at(self, hp: torch.Tensor, usage: str, phase: tuple[int, int] = (0, 0)) -> torch.Tensor:
        """:meth:`block_amax` of a piece at ``phase``: the partial amax of every block it touches
        (its local grid; a block shared with a neighbour needs the neighbour's part too)."""
        front = self.usage_phase(usage, phase)
        if not any(front):
            return self.block_amax(hp, usage)
        return self.block_amax(_pad_front(hp, front), usage)

    def quantize_plane_at(self, hp: torch.Tensor, usage: str, phase: tuple[int, int] = (0, 0), *,
                          amax: torch.Tensor | None = None) -> Plane:
        """:meth:`quantize_plane` of a piece at ``phase`` (see the note on block phase).

        Args:
            hp: the piece's 2-D high-precision values.
            usage: the plane.
            phase: where the piece starts inside its first block, per dim.
            amax: the amax of every block it touches (its local grid), reduced over the ranks
                sharing a block; the piece's own partial amaxes when omitted.

        Example:
            >>> Blockwise(block_dims=2).quantize_plane_at(rows_64_to_191, "rowwise", (64, 0), amax=amax)
        """
        front = self.usage_phase(usage, phase)
        if not any(front):
            return self.quantize_plane(hp, usage, amax=amax)
        plane = self.quantize_plane(_pad_front(hp, front), usage, amax=amax)
        return Plane(plane.data[front[0]:, front[1]:].contiguous(), plane.scale_inv)

    def dequantize_plane_at(self, plane: Plane, usage: str, dtype: torch.dtype = torch.float32,
                            phase: tuple[int, int] = (0, 0)) -> torch.Tensor:
        """:meth:`dequantize_plane` of a piece at ``phase``."""
        aligned, front = self.aligned_plane(plane, usage, phase)
        if not any(front):
            return self.dequantize_plane(plane, usage, dtype)
        return self.decode(aligned.data, aligned.scale_inv, usage, dtype)[front[0]:, front[1]:].contiguous()

    def gemm_front(self, phase: tuple[int, int]) -> tuple[int, int]:
        """The zero rows / columns every FP8 GEMM of a piece at ``phase`` puts in front of its
        operands: the largest :meth:`usage_phase` of its planes. One front for all planes keeps the
        GEMMs' dims the same whole-block sizes, also where one plane's blocks are single rows or
        columns along a dim (1x128's rowwise plane along dim 0) and the other's are not: torch's
        block-scaled GEMMs want every dim a multiple of 128.

        Example:
            >>> Blockwise(block_dims=1).gemm_front((64, 0))   # the columnwise plane's 128-row blocks
            (64, 0)
        """
        fronts = [self.usage_phase(u, phase) for u in USAGES]
        return tuple(max(f[d] for f in fronts) for d in (0, 1))

    def aligned_plane(self, plane: Plane, usage: str, phase: tuple[int, int] = (0, 0),
                      front: tuple[int, int] | None = None) -> tuple[Plane, tuple[int, int]]:
        """The plane of a piece at ``phase`` as the plane of a matrix whose blocks start at its
        origin: ``front`` zero FP8 rows / columns before its first ones (the byte 0 is +0 in every
        FP8 format). Its scale grid already holds the scale of every block the piece touches; a
        ``front`` beyond the plane's own phase (:meth:`gemm_front`) adds whole blocks in front, each
        with a copy of the first scale (they scale zeros). A GEMM reads it as a whole-block operand:
        the zeros contribute nothing to a contraction, and the ``front`` extra output rows / columns
        are cut off by the caller (``gemm.py``'s note on shards that start inside blocks). No copy
        when ``front`` is zero.

        Args:
            plane: the piece's plane.
            usage: the plane's usage (its blocks).
            phase: the piece's block phase (``QuantizedTensor.phase``).
            front: the zeros to put in front (default: the plane's own :meth:`usage_phase`); each
                dim's excess over it a whole number of the plane's blocks.

        Returns:
            ``(plane, front)``: ``front`` is ``(rows, cols)`` of zeros in front.

        Example:
            >>> aligned, front = Blockwise(block_dims=2).aligned_plane(piece.plane("rowwise"), "rowwise", (64, 0))
            >>> front, aligned.data.shape[0] == piece.shape[0] + 64
            ((64, 0), True)
        """
        own = self.usage_phase(usage, phase)
        front = own if front is None else tuple(front)
        if not any(front):
            return plane, front
        data = _pad_front(plane.data.view(torch.uint8), front).view(plane.data.dtype)
        block = self.block_shape(usage)
        grid_front = []
        for d in (0, 1):
            extra, extent = front[d] - own[d], block.extent(d)
            if extra and extent is not None and (extra < 0 or extra % extent):
                raise RecipeError(f"{self.name}: a front of {front[d]} along dim {d} is not the {usage} plane's phase "
                                  f"{own[d]} plus whole blocks of {extent}; use gemm_front(phase)")
            grid_front.append(0 if not extra or extent is None else extra // extent)  # None: one scale along d
        scale_inv = plane.scale_inv
        if any(grid_front):
            scale_inv = torch.cat([scale_inv[:1].expand(grid_front[0], -1), scale_inv], 0)
            scale_inv = torch.cat([scale_inv[:, :1].expand(-1, grid_front[1]), scale_inv], 1)
        return Plane(data, scale_inv), front

    # ---- transpose cache (TE's physical layout for transpose-derived recipes) -------------------
    def transpose_cache(self, plane: Plane) -> torch.Tensor:
        """TE's transposed FP8 copy of a plane's data, ``(K, M)`` contiguous."""
        return transpose_2d(plane.data)

    def __repr__(self) -> str:  # dataclass subclasses override
        return f"{type(self).__name__}()"


def _check_usage(usage: str) -> None:
    if usage not in USAGES:
        raise ValueError(f"usage must be one of {USAGES}, got {usage!r}")


def _pad_front(x: torch.Tensor, front: tuple[int, int]) -> torch.Tensor:
    """``x`` (2-D) with ``front`` zero rows / columns before its first ones."""
    out = x.new_zeros((x.shape[0] + front[0], x.shape[1] + front[1]))
    out[front[0]:, front[1]:] = x
    return out


def _to_blocks(x: torch.Tensor, block: BlockShape) -> tuple[torch.Tensor, tuple[int, int]]:
    """View a 2-D tensor as ``(grid_rows, block_rows, grid_cols, block_cols)``, zero-padding the
    ragged last blocks (zeros never change an amax and are cut off again by ``_from_blocks``)."""
    if x.dim() != 2:
        raise ValueError(f"expected a 2-D tensor, got shape {tuple(x.shape)}")
    m, k = x.shape
    br = m if block.rows is None else block.rows
    bc = k if block.cols is None else block.cols
    gr, gc = block.grid((m, k))
    pad_r, pad_c = gr * max(br, 1) - m, gc * max(bc, 1) - k
    if pad_r or pad_c:
        x = torch.nn.functional.pad(x, (0, pad_c, 0, pad_r))
    return x.reshape(gr, max(br, 1), gc, max(bc, 1)), (m, k)


def _from_blocks(blocks: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    gr, br, gc, bc = blocks.shape
    out = blocks.reshape(gr * br, gc * bc)
    if out.shape != shape:
        out = out[: shape[0], : shape[1]]
    return out.contiguous()
