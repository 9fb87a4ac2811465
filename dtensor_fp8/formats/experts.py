"""Routed MoE expert weights: a 3-D weight ``[E, out, in]`` quantized per expert, for every recipe.

[Note: per-expert quantization as a block geometry]
A grouped GEMM reads expert ``e``'s matrix ``W[e]`` (``out x in``) as a weight of its own, so each
expert gets exactly the scales that quantizing ``W[e]`` alone gives: its own per-tensor scale (and
delayed-scaling history), its own 128x128 / 1x128 / 1x32 blocks, none crossing into the next
expert. :class:`PerExpert` is that recipe: it wraps a 2-D recipe (the *base*) and the expert's row
count ``out``, and it stores the planes as everything else in dtensor_fp8 does, in the 2-D
"leading dims flattened into rows" orientation, ``(E * out, in)`` with a scale grid of
``(E * rows_per_expert_grid, cols_grid)``: the stack, expert after expert, of the base recipe's
own planes of each ``W[e]``, byte for byte. Seen from the rest of the library it is a recipe whose
block along dim 0 never crosses an expert boundary:

* per-tensor scaling: a block of ``out`` rows x the whole row (one scale per expert);
* block recipes: the base block when ``out`` is a multiple of its rows (then no block crosses an
  expert anyway), or one block of ``out`` rows per expert when ``out`` is smaller than a block
  (each expert's single ragged block row). Any other ``out`` would make ragged blocks inside the
  flattened matrix, which a uniform grid cannot describe: refused with the fix (pad ``out``).

So slicing, FSDP2's gathers, scale slots, requantization and DCP run on it unchanged and never
branch on it: the expert dim is a batch dim folded into the block grid. The codec methods here
are the base recipe's reference ones driven by that geometry (vectorized over experts: one
amax / cast pass over all experts), except where a base rule is per tensor rather than per block
(delayed scaling's scale and history), which run once per expert. The base's CUDA fast paths
(Triton, TE) are not used: they take 2-D tensors with the base's geometry (a next step: batch them).

Example:
    >>> recipe = PerExpert(CurrentScaling(), expert_rows=256)
    >>> planes = recipe.quantize_planes(w.reshape(-1, w.shape[-1]), ("rowwise",))   # w: [8, 256, 512]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import COLUMNWISE, ROWWISE, BlockShape, Plane, Recipe, RecipeError
from .scaled_mm import GemmRecipe


def expert_block_rows(base: Recipe, usage: str, rows: int) -> int:
    """Rows of one scaling block of ``base``'s ``usage`` plane in the flattened ``(E * rows, K)``
    matrix of experts with ``rows`` rows each (see the note); raises when there is none."""
    block = base.block_shape(usage).rows
    if block is None or rows <= block:
        return rows
    if rows % block == 0:
        return block
    raise RecipeError(
        f"{base.name}: expert weights with {rows} output rows per expert cannot be quantized per expert: the "
        f"{usage} plane's blocks are {base.block_shape(usage)} and {rows} is neither a multiple of {block} nor at "
        f"most {block}, so an expert's last block row would be ragged inside the stacked weight. Fix: pad the "
        f"expert's output dim to {-(-rows // block) * block}, or keep these experts in high precision.")


@dataclass(frozen=True, repr=True)
class PerExpert(Recipe):
    """``base`` applied to each expert of a 3-D weight ``[E, expert_rows, K]`` on its own.

    The planes are stored flattened, ``(E * expert_rows, K)``, with the scales of each expert's
    blocks in its own scale rows (see the note above). Make one with :func:`per_expert`.

    Args:
        base: the 2-D recipe (``DelayedScaling``, ``CurrentScaling``, ``MXFP8``, ``Blockwise``).
        expert_rows: the output rows of one expert's matrix (``W.shape[1]``).

    Example:
        >>> recipe = PerExpert(MXFP8(), expert_rows=128)
        >>> recipe.block_shape("columnwise")
        BlockShape(rows=32, cols=1)
    """

    base: Recipe
    expert_rows: int

    kernel_order = ()  # the reference path, batched over experts (see the note)
    scaling_state_per_index = True  # delayed scaling: one amax history and scale per expert

    def __post_init__(self):
        if isinstance(self.base, PerExpert) or not isinstance(self.base, Recipe):
            raise RecipeError(f"PerExpert: base must be a 2-D recipe, got {self.base!r}")
        if self.expert_rows < 1:
            raise RecipeError(f"PerExpert: expert_rows must be >= 1, got {self.expert_rows}")
        for usage in (ROWWISE, COLUMNWISE):
            expert_block_rows(self.base, usage, self.expert_rows)

    # ---- what the rest of the library reads -----------------------------------------------------
    @property
    def name(self) -> str:
        return f"{self.base.name}-per-expert"

    @property
    def fp8_dtype(self) -> torch.dtype:  # type: ignore[override]
        return self.base.fp8_dtype

    @property
    def scale_inv_dtype(self) -> torch.dtype:  # type: ignore[override]
        return self.base.scale_inv_dtype

    @property
    def columnwise_is_transpose(self) -> bool:  # type: ignore[override]
        return self.base.columnwise_is_transpose

    @property
    def te_binding(self):
        raise RecipeError(
            f"{self.name}: Transformer Engine has no tensor class for a 3-D weight quantized per expert (its "
            "GroupedLinear keeps one 2-D weight per expert). Read expert e's planes from the stacked planes "
            "(rows e*out..(e+1)*out, see formats/experts.py) and build TE's 2-D tensor from those.")

    def block_shape(self, usage: str) -> BlockShape:
        base = self.base.block_shape(usage)
        return BlockShape(expert_block_rows(self.base, usage, self.expert_rows), base.cols)

    def check_shape(self, shape) -> None:
        if len(shape) != 3 or shape[1] != self.expert_rows:
            raise RecipeError(
                f"{self.name}: expects a 3-D expert weight [experts, {self.expert_rows}, in], got shape {tuple(shape)}. "
                "Make the recipe with per_expert(recipe, weight.shape).")
        self.base.check_shape(tuple(shape[1:]))

    def gemm_recipe(self):
        """The base recipe's operand recipes, with the output gradients cast like the activations.

        torch's scaled grouped GEMM multiplies E4M3 by E4M3 only (``grouped_fp8.py``), so the
        gradients of a HYBRID recipe (E5M2 in the dense GEMMs, TE's default) are E4M3 here, as in
        torchao's FP8 MoE training; the weight and activations are the base recipe's."""
        g = self.base.gemm_recipe()
        if g is None:
            return None
        return GemmRecipe(input=g.input, grad=g.input, fast_accum=g.fast_accum,
                          name=f"{g.name}, E4M3 gradients (grouped GEMM)")

    # ---- tensor-parallel pieces of each expert (Shard(1): rows of every expert) ------------------
    def expert_rows_share_scale(self, usage: str) -> bool:
        """Whether one scale covers all of an expert's rows in ``usage``'s plane (per-tensor bases:
        every row piece of the expert keeps that one scale, reduced over the pieces' ranks)."""
        return self.base.block_shape(usage).rows is None

    def expert_rows_piece(self, start: int, stop: int, shape=None) -> "PerExpert":
        """The recipe of rows ``[start, stop)`` of every expert (a tensor-parallel ``Shard(1)`` piece
        of ``[E, out, in]``: torchtitan's column-parallel ``w1`` / ``w3``), or a :class:`RecipeError`
        when the cut splits a scaling block of an expert (see the note in ``ops/expert_rows.py``).

        Args:
            start, stop: the piece's rows within each expert.
            shape: the weight's shape, for the message.

        Example:
            >>> PerExpert(MXFP8(), 256).expert_rows_piece(128, 256)
            PerExpert(base=MXFP8(...), expert_rows=128)
        """
        for usage in (ROWWISE, COLUMNWISE):
            if self.expert_rows_share_scale(usage):
                continue
            block = expert_block_rows(self.base, usage, self.expert_rows)
            if start % block or (stop % block and stop != self.expert_rows):
                fits = [n for n in range(1, 17) if self.expert_rows % n == 0 and (self.expert_rows // n) % block == 0]
                raise RecipeError(
                    f"{self.name}: rows [{start}, {stop}) of each expert of an expert weight of shape "
                    f"{tuple(shape) if shape is not None else ('E', self.expert_rows, 'in')} cut inside the {usage} "
                    f"plane's {block}-row blocks of each expert; tensor-parallel pieces of an expert's output dim "
                    f"(Shard(1)) must be whole blocks. Fix: a tensor-parallel degree in {fits or '[1]'} for "
                    f"{self.expert_rows} rows, or pad the expert's output dim to a multiple of {block} x the degree, "
                    "or keep these experts in high precision.")
        return PerExpert(self.base, stop - start)

    def of_whole(self, shape) -> "PerExpert":
        """The recipe of the whole ``[E, out, in]`` weight a piece of each expert's rows was cut from."""
        return self.with_expert_rows(tuple(shape)[1])

    def with_expert_rows(self, rows: int) -> "PerExpert":
        """This recipe for experts of ``rows`` output rows (row pieces joined back: ``ops/expert_rows.py``)."""
        return PerExpert(self.base, rows)

    # ---- per-tensor rules, applied per expert ---------------------------------------------------
    def _per_expert_scalar(self, usage: str) -> bool:
        """Whether ``base``'s block for ``usage`` is its whole tensor (a rule per tensor, run per expert)."""
        block = self.base.block_shape(usage)
        return block.rows is None and block.cols is None

    def scale_from_amax(self, amax, usage, hp_dtype=torch.float32):
        if not self._per_expert_scalar(usage):  # elementwise rules: all experts' blocks at once
            return self.base.scale_from_amax(amax, usage, hp_dtype)
        pairs = [self.base.scale_from_amax(a.reshape(1, 1), usage, hp_dtype) for a in amax.reshape(-1)]
        shape = amax.shape
        return (torch.cat([p[0].reshape(1) for p in pairs]).reshape(shape),
                torch.cat([p[1].reshape(1) for p in pairs]).reshape(shape))

    def given_scale(self, scale, like):
        """Delayed scaling's caller-given scale: one number for every expert, or one per expert."""
        experts = like.shape[0] // self.expert_rows
        scale = torch.as_tensor(scale, dtype=torch.float32, device=like.device).reshape(-1)
        if scale.numel() not in (1, experts):
            raise RecipeError(f"{self.name}: scale= has {scale.numel()} values for {experts} experts; give one or one "
                              "per expert")
        pairs = [self.base.given_scale(s, like) for s in scale.expand(experts)]
        return (torch.cat([p[0].reshape(1, 1) for p in pairs]), torch.cat([p[1].reshape(1, 1) for p in pairs]))

    # ---- delayed scaling's state: one per expert -------------------------------------------------
    def initial_scaling_state(self, current: Plane):
        """The base recipe's state of each expert, stacked (``None`` for stateless recipes)."""
        states = [self.base.initial_scaling_state(Plane(current.data[:0], s.reshape(1, 1)))
                  for s in current.scale_inv.reshape(-1)] if self._per_expert_scalar(ROWWISE) else []
        if not states or states[0] is None:
            return None
        return {k: torch.stack([s[k] for s in states]) for k in states[0]}

    def requantize_plane(self, hp, usage, current, *, amax=None, state=None):
        if state is None or not self._per_expert_scalar(usage):
            if state is None and self.base.initial_scaling_state(Plane(current.data[:0], current.scale_inv[:1])) is not None:
                # a stateful recipe without a state keeps the current scales (as the base does)
                from .scaling import reciprocal
                return self.quantize_plane(hp, usage, scale=reciprocal(current.scale_inv.float())), state
            return self.quantize_plane(hp, usage, amax=amax), state
        rows, planes, states = self.expert_rows, [], []
        for e in range(hp.shape[0] // rows):
            one = {k: v[e] for k, v in state.items()}
            cur = Plane(current.data[e * rows:(e + 1) * rows], current.scale_inv[e:e + 1])
            plane, new = self.base.requantize_plane(hp[e * rows:(e + 1) * rows], usage, cur,
                                                    amax=None if amax is None else amax[e:e + 1], state=one)
            planes.append(plane)
            states.append(new)
        return (Plane(torch.cat([p.data for p in planes]), torch.cat([p.scale_inv.reshape(1, 1) for p in planes])),
                {k: torch.stack([s[k].reshape(state[k][0].shape) for s in states]) for k in state})

    def requantize_planes(self, usage, hps, currents, amaxes, states):
        return (self.requantize_plane(hp, usage, cur, amax=a, state=s)
                for hp, cur, a, s in zip(hps, currents, amaxes, states))


def per_expert(recipe: Recipe, shape) -> PerExpert:
    """The recipe that quantizes each expert of a 3-D weight of ``shape`` ``[E, out, in]`` as
    ``recipe`` quantizes a 2-D ``[out, in]`` matrix (see the note above).

    Args:
        recipe: a 2-D recipe, e.g. ``MXFP8()`` (a ``PerExpert`` is returned as it is when its rows fit).
        shape: the expert weight's shape ``[experts, out, in]``.

    Example:
        >>> q = dtensor_fp8.quantize(w, per_expert(Blockwise(block_dims=2), w.shape))   # w: [8, 256, 512]
        >>> torch.equal(q.dequantize()[3], dtensor_fp8.quantize(w[3], Blockwise(block_dims=2)).dequantize())
        True
    """
    shape = tuple(shape)
    if len(shape) != 3:
        raise RecipeError(f"per_expert: expert weights are 3-D [experts, out, in], got shape {shape}")
    if isinstance(recipe, PerExpert):
        recipe = recipe.base
    out = PerExpert(recipe, shape[1])
    out.check_shape(shape)
    return out
