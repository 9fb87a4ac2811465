"""Per-tensor FP8 scaling: one fp32 scale for the whole tensor (TE's ``Float8Tensor``).

Delayed scaling takes its scale from an amax history (TE's ``DelayedScaling`` recipe); current
scaling computes it from this tensor's amax (TE's ``Float8CurrentScaling``). Both store one plane:
the columnwise plane is the same bytes, transposed by TE (``_transpose``) for the backward GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import te_kernels
from .base import COLUMNWISE, ROWWISE, BlockShape, Recipe, Plane, RecipeError
from .triton_kernels import fast_path, kernels
from .scaling import quotient, reciprocal, scale_from_amax
from .te_binding import TEBinding, TEBuffer
from .scaled_mm import GemmRecipe

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_WHOLE_TENSOR = BlockShape(None, None)


def _check_fp8_dtype(recipe: str, fp8_dtype: torch.dtype, allowed=_FP8_DTYPES) -> None:
    if fp8_dtype not in allowed:
        raise RecipeError(f"{recipe}: fp8_dtype must be one of {allowed} (TE's E4M3 / E5M2), got {fp8_dtype}")


class _PerTensor(Recipe):
    columnwise_is_transpose = True

    def block_shape(self, usage: str) -> BlockShape:
        return _WHOLE_TENSOR

    def _path(self, hps) -> str | None:
        """The fast path every tensor of ``hps`` can take (see ``triton_kernels.fast_path``)."""
        paths = {fast_path(self, hp) for hp in hps}
        return paths.pop() if len(paths) == 1 else None

    def block_amax(self, hp: torch.Tensor, usage: str) -> torch.Tensor:
        path = fast_path(self, hp)  # same value, one pass
        if path == "triton":
            return kernels("per_tensor").amax(hp)
        if path == "te":
            return te_kernels.tensor_amax(hp)
        return super().block_amax(hp, usage)

    def block_amaxes(self, usage: str, hps) -> list[torch.Tensor]:
        if self._path(hps) is not None:  # one vector, one kernel per tensor
            return list(self._amaxes(hps, [None] * len(hps), usage).reshape(-1, 1, 1).unbind(0))
        return super().block_amaxes(usage, hps)

    def encode(self, hp: torch.Tensor, scale: torch.Tensor, usage: str) -> torch.Tensor:
        path = fast_path(self, hp)  # same bytes, one pass
        if path == "triton":
            return kernels("per_tensor").cast(hp, scale, self.fp8_dtype)[0]
        if path == "te":
            return te_kernels.cast_with_scale(hp, scale, self.fp8_dtype)
        return super().encode(hp, scale, usage)

    def _amaxes(self, hps, amaxes, usage) -> torch.Tensor:
        """Per-tensor amaxes as one ``(n,)`` vector (given ones kept, missing ones computed)."""
        if all(a is None for a in amaxes):
            path = self._path(hps)  # same values, written straight into one vector
            if path == "triton":
                return kernels("per_tensor").amaxes(list(hps))
            if path == "te":
                return te_kernels.tensor_amaxes(list(hps))
        return torch.cat([(self.block_amax(hp, usage) if a is None else a).float().reshape(1)
                          for hp, a in zip(hps, amaxes)])

    def _scale_rule(self):
        """The rule the Triton cast applies to an amax in the kernel (``triton_per_tensor.ScaleRule``):
        the same scale as :meth:`scale_from_amax`."""
        raise NotImplementedError

    def _triton_cast(self, hp, *, scale=None, amax=None, rowwise=True, transposed=False):
        """One Triton cast with every scalar on the device: with ``scale`` when given, else with
        :meth:`_scale_rule` applied in the kernel to ``amax`` (``hp``'s own by default). The
        kernel also writes ``scale_inv``. This is the per-call path of ``quantize`` and of the GEMM
        operands: the reference's scale rule in torch ops costs ~20 kernel launches and ~0.5 ms of
        host time per call on an H200 (docs/benchmarks.md), the kernels ~0.1 ms of GPU time.

        Returns:
            ``(data or None, transposed data or None, scale_inv (1, 1) fp32)``.
        """
        k = kernels("per_tensor")
        if scale is None and amax is None:
            amax = k.amax(hp)
        scale_inv = torch.empty((1, 1), dtype=torch.float32, device=hp.device)
        data, data_t = k.cast(hp, scale, self.fp8_dtype, rowwise=rowwise, transposed=transposed, amax=amax,
                              rule=self._scale_rule() if scale is None else None, scale_inv_out=scale_inv)
        return data, data_t, scale_inv

    def quantize_plane(self, hp, usage, *, amax=None, scale=None):
        if hp.dim() == 2 and fast_path(self, hp) == "triton":  # same bytes, scalars on the device
            if scale is not None:
                scale = self._given_scale_tensor(scale, hp)
            data, _, scale_inv = self._triton_cast(hp, scale=scale, amax=amax)
            return Plane(data, scale_inv)
        return super().quantize_plane(hp, usage, amax=amax, scale=scale)

    def _given_scale_tensor(self, scale, like):
        return self.given_scale(scale, like)[0]

    def _operand_planes(self, hp, rowwise: bool, columnwise: bool, *, scale=None) -> dict[str, Plane]:
        """A GEMM operand's planes by usage: the FP8 bytes with ``scale`` (fp32, one element) or
        with the scale this recipe derives from ``hp``'s amax; for the columnwise usage their
        transpose, written in the same pass where the Triton kernel runs (the wgrad GEMM reads the
        transpose)."""
        if fast_path(self, hp) == "triton":
            data, data_t, scale_inv = self._triton_cast(hp, scale=scale, rowwise=rowwise, transposed=columnwise)
            planes = {COLUMNWISE: Plane(data_t.t(), scale_inv)} if columnwise else {}
            if rowwise:
                planes[ROWWISE] = Plane(data, scale_inv)
            return planes
        if scale is None:
            scale, scale_inv = self.scale_from_amax(self.block_amax(hp, ROWWISE), ROWWISE)
        else:
            scale_inv = reciprocal(scale)
        plane = Plane(self.encode(hp, scale.reshape(1, 1), ROWWISE), scale_inv.float().reshape(1, 1))
        return {u: plane for u, on in ((ROWWISE, rowwise), (COLUMNWISE, columnwise)) if on}

    def _encode_each(self, hps, usage, scales: torch.Tensor, scale_invs: torch.Tensor):
        """Planes from per-tensor scales, one at a time (see ``Recipe.requantize_planes``)."""
        return (Plane(self.encode(hp, scale.reshape(1, 1), usage), scale_inv.reshape(1, 1))
                for hp, scale, scale_inv in zip(hps, scales, scale_invs))

    def _casts_in_place(self, hps, planes) -> bool:
        """Whether a fast-path cast can write each new plane straight into the existing one."""
        return self._path(hps) is not None and all(p.data.is_contiguous() and p.scale_inv.is_contiguous()
                                                   for p in planes)

    def _write_planes(self, hps, planes, scales: torch.Tensor, scale_invs: torch.Tensor) -> None:
        """Cast each tensor into its existing plane with a fast-path kernel (the bytes ``encode``
        makes), then store every scale_inv with one batched copy."""
        if self._path(hps) == "triton":
            cast = kernels("per_tensor").cast
            scales = scales.float()
            for i, (hp, p) in enumerate(zip(hps, planes, strict=True)):
                cast(hp, scales[i : i + 1], self.fp8_dtype, out=p.data)
        else:
            te_kernels.cast_with_scales_into(list(hps), scales.float(), [p.data for p in planes], self.fp8_dtype)
        torch._foreach_copy_([p.scale_inv.view(-1) for p in planes], list(scale_invs.float().reshape(-1, 1).unbind(0)))


#: TE's ``Float8Tensor``: ``_data`` is our rowwise plane's bytes (shared), ``_transpose`` the
#: transposed copy Hopper's backward GEMM reads (the transpose cache), ``_scale_inv`` our scale.
_FLOAT8_TENSOR_BUFFERS = (
    TEBuffer("_data", "data", (ROWWISE,), ROWWISE, "data"),
    TEBuffer("_transpose", "data_transpose", (COLUMNWISE,), ROWWISE, "data", transposed=True,
             invalid_flag="_transpose_invalid"),
    TEBuffer("_scale_inv", "fp8_scale_inv", (ROWWISE, COLUMNWISE), ROWWISE, "scale_inv", flat=True),
)


@dataclass(frozen=True, repr=True)
class DelayedScaling(_PerTensor):
    """Per-tensor delayed scaling: the scale comes from an amax history (TE ``DelayedScaling``).

    ``quantize(x, DelayedScaling(), scale=s)`` quantizes with the given scale; without one the
    first scale is seeded from ``x``'s own amax (see the note in :meth:`scale_from_amax`; TE's own
    initial scale is 1.0). :meth:`record_amax` and :meth:`update_scale` implement TE's rule for the
    next scale. A GEMM operand's first cast, before its state's first update, uses a power of two
    from its own amax (see the note in :meth:`_operand_scale`).

    Args:
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        margin: the scale is divided by ``2**margin``.
        amax_history_len: length of the amax history window.
        amax_compute_algo: ``"max"`` (max over the window) or ``"most_recent"``.

    Example:
        >>> recipe = DelayedScaling(fp8_dtype=torch.float8_e4m3fn)
        >>> q = dtensor_fp8.quantize(torch.randn(256, 256), recipe, scale=torch.tensor(0.5))
    """

    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"

    keeps_operand_state = True  # (not a field: no annotation) its operands' amax histories

    te_binding = TEBinding(
        "Float8Tensor", "Float8TensorStorage", _FLOAT8_TENSOR_BUFFERS, "Float8Quantizer",
        quantizer_state=("scale", "amax"), te_recipe="DelayedScaling",
        te_recipe_fields=(("margin", "margin"), ("amax_history_len", "amax_history_len"),
                          ("amax_compute_algo", "amax_compute_algo")),
    )

    def __post_init__(self):
        _check_fp8_dtype("DelayedScaling", self.fp8_dtype)
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise RecipeError(f"DelayedScaling: amax_compute_algo must be 'max' or 'most_recent', got {self.amax_compute_algo!r}")
        if self.amax_history_len < 1:
            raise RecipeError(f"DelayedScaling: amax_history_len must be >= 1, got {self.amax_history_len}")

    @property
    def name(self) -> str:
        return "delayed"

    def scale_from_amax(self, amax, usage, hp_dtype=torch.float32):
        # [Note: the first delayed scale]
        # TE starts a delayed-scaling tensor at scale 1 and corrects it from the amax history after
        # the first FP8 forward. A weight is quantized here once, when it becomes an FP8 parameter,
        # and scale 1 would keep it in FP8's subnormal range or at zero until the first optimizer
        # step (an init of std 0.002 loses 37 % of its weights to zero in E4M3). So the first
        # quantization (no explicit scale) seeds the scale from the weight's own amax with TE's
        # update rule, as if the history held that one amax: ``fp8_max * 2^-margin / amax`` (1 for
        # a zero, infinite or NaN amax; an infinite quotient becomes FLT_MAX). ``scale=`` still
        # quantizes with exactly the given scale, and later requantizations follow the history.
        scale = self._update_scales(amax.float().reshape(1, 1), torch.ones(1, device=amax.device))[1]
        scale = scale.reshape(amax.shape)
        return scale, reciprocal(scale)

    def _scale_rule(self):
        # The first scale (see [Note: the first delayed scale]): TE's update rule for a history
        # holding one amax is scale_from_amax's rule with fp8_max * 2^-margin as the numerator.
        return kernels("per_tensor").ScaleRule(torch.finfo(self.fp8_dtype).max * 2.0 ** (-self.margin))

    def _given_scale_tensor(self, scale, like):
        # Only the scale: the Triton cast writes its reciprocal.
        return torch.as_tensor(scale, dtype=torch.float32, device=like.device)

    def gemm_recipe(self):
        # TE's DelayedScaling with its default HYBRID format: E4M3 activations, E5M2 gradients,
        # each with its own amax history; fprop with fast accumulation (TE's _2X_ACC_FPROP=False).
        same = dict(margin=self.margin, amax_history_len=self.amax_history_len, amax_compute_algo=self.amax_compute_algo)
        return GemmRecipe(input=DelayedScaling(torch.float8_e4m3fn, **same), grad=DelayedScaling(torch.float8_e5m2, **same),
                          fast_accum=(True, False, False), name="DelayedScaling(fp8_format=HYBRID)")

    def operand_state(self, device):
        return {"amax_history": torch.zeros(self.amax_history_len, device=device),
                "scale": torch.ones(1, device=device)}

    def quantize_operand(self, hp, *, rowwise, columnwise, state=None):
        """TE's delayed scaling of an activation or gradient: the cast uses the scale the history
        gave so far and records its local amax in ``history[0]`` (a running max: a recompute of
        the same forward records nothing new). The update that rolls the history and gives the
        next scale is :meth:`update_operand_states_`, run once per step after the recorded amaxes
        were reduced over the weight's ranks (TE reduces and updates once per autocast region)."""
        if state is None:
            state = self.operand_state(hp.device)
        amax = self.block_amax(hp, ROWWISE)
        planes = self._operand_planes(hp, rowwise, columnwise, scale=self._operand_scale(state, amax))
        history = self.record_amax(state["amax_history"], amax)
        return planes, {"amax_history": history, "scale": state["scale"]}

    def _operand_scale(self, state, amax: torch.Tensor) -> torch.Tensor:
        """The scale an operand is cast with: its state's, or before the state's first update (no
        amax in the history but the current window's, scale still 1) a power of two from this
        tensor's own amax.

        [Note: the first operand scale]
        TE casts an operand with scale 1 until its first update. An output gradient (E5M2) of a
        mean loss is around 1e-4 to 1e-3: at scale 1 much of it falls into E5M2's subnormals
        (below 6.1e-5), and how much depends on its absolute size, which data parallelism changes
        (each rank's loss is a mean over its own batch: its gradient is ``world`` times the one
        process's, exactly). FSDP2 at 2 ranks then differed from the one-process run by as much
        as the FP8 error itself. A power of two from the tensor's own amax keeps the cast in the
        normal range, and a power-of-two factor between runs (or ranks) changes no byte's
        rounding: the runs stay equivalent from the first step (at every later step the scales
        of the two runs differ by that exact factor). A recompute of the same forward (activation
        checkpointing) casts the same tensor with the same scale; the scale kept in the state, and
        its update, are TE's.
        """
        scale = state["scale"].float().reshape(1)
        fresh = (state["amax_history"][1:] == 0).all() & (scale == 1).all()
        first = scale_from_amax(amax.float().reshape(1), torch.finfo(self.fp8_dtype).max * 2.0 ** (-self.margin),
                                force_pow_2_scales=True, amax_epsilon=0.0)
        return torch.where(fresh, first, scale)

    def recorded_operand_amax(self, state):
        return state["amax_history"][:1]

    def update_operand_states_(self, states):
        if not states:
            return
        histories, scales = self._update_scales(torch.stack([s["amax_history"].float() for s in states]),
                                                torch.cat([s["scale"].float().reshape(1) for s in states]))
        kept = [t for s in states for t in (s["amax_history"], s["scale"])]
        fresh = [t for h, sc, s in zip(histories.unbind(0), scales.unbind(0), states, strict=True)
                 for t in (h, sc.reshape(s["scale"].shape))]
        torch._foreach_copy_(kept, fresh)  # in place: checkpoint templates and graphs refer to these tensors

    def initial_scaling_state(self, current):
        history = torch.zeros(self.amax_history_len, device=current.scale_inv.device)
        return {"amax_history": history, "scale": reciprocal(current.scale_inv.float().reshape(1))}

    def requantize_plane(self, hp, usage, current, *, amax=None, state=None):
        return next(iter(self.requantize_planes(usage, [hp], [current], [amax], [state])))

    def requantize_planes(self, usage, hps, currents, amaxes, states):
        if all(s is None for s in states):  # keep the current scales (copy_ into existing FP8 tensors)
            return ((self.quantize_plane(hp, usage, scale=reciprocal(cur.scale_inv.float())), None)
                    for hp, cur in zip(hps, currents))
        if any(s is None for s in states):  # a mix: each tensor on its own
            return (next(iter(self.requantize_planes(usage, [hp], [cur], [a], [s])))
                    for hp, cur, a, s in zip(hps, currents, amaxes, states))
        scales, new_states = self._next_scales(usage, hps, amaxes, states)
        return zip(self._encode_each(hps, usage, scales, reciprocal(scales)), new_states)

    def requantize_planes_(self, usage, hps, planes, amaxes, states):
        if any(s is None for s in states) or not self._casts_in_place(hps, planes):
            return super().requantize_planes_(usage, hps, planes, amaxes, states)
        scales, new_states = self._next_scales(usage, hps, amaxes, states)
        self._write_planes(hps, planes, scales, reciprocal(scales))
        return new_states

    def _next_scales(self, usage, hps, amaxes, states):
        """Every tensor's new scale (``(n,)``) and scaling state, computed together."""
        # TE's order: the cast records its amax in history[0]; the update then rolls the history
        # and derives the scale used from now on. All tensors' histories are updated together.
        amax = self._amaxes(hps, amaxes, usage)
        histories = self.record_amax(torch.stack([s["amax_history"] for s in states]), amax)
        histories, scales = self._update_scales(histories, torch.cat([s["scale"].float().reshape(1) for s in states]))
        # Views of the batch's tensors, no copies: callers store them or copy them into the states
        # they keep (requantize_from_hp_ updates its states in place).
        return scales, [{"amax_history": h, "scale": s.reshape(state["scale"].shape)}
                        for h, s, state in zip(histories.unbind(0), scales.unbind(0), states)]

    def given_scale(self, scale: torch.Tensor | float, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = torch.as_tensor(scale, dtype=torch.float32, device=like.device).reshape(1, 1)
        return scale, reciprocal(scale)

    def record_amax(self, amax_history: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
        """What TE's cast kernel does to the history: ``history[0] = max(history[0], amax)`` (NaN
        ignored, as ``fmaxf``); a new tensor. The optimizer step records every weight's amax with it.

        Args:
            amax_history: shape ``(amax_history_len,)``, or ``(n, amax_history_len)`` for ``n``
                tensors at once; entry 0 accumulates the current window.
            amax: the amax of the tensor just quantized (shape ``()`` / ``(n,)``).

        Example:
            >>> DelayedScaling().record_amax(torch.zeros(1024), torch.tensor(3.0))[0]
            tensor(3.)
        """
        history = amax_history.float().clone()
        history[..., 0] = torch.fmax(history[..., 0], amax.float().reshape(history.shape[:-1]))
        return history

    def update_scale(self, amax_history: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """TE's fused delayed-scaling update (common/recipe/delayed_scaling.cu, ``kernel_bulk``).

        With ``last = history[0]``: if ``last != 0`` the history becomes
        ``[0, old[2:], last]`` (``old[1]`` leaves the window); the amax is ``max(last, old[1:])``
        for ``"max"`` or ``last`` for ``"most_recent"``; the scale is
        ``(fp8_max * 2^-margin) / amax`` when that amax is finite and positive, else the previous
        scale; an infinite scale becomes ``FLT_MAX``.

        Returns:
            ``(new_history, new_scale)``.
        """
        history, new = self._update_scales(amax_history.float().reshape(1, -1), scale.float().reshape(1))
        return history.reshape(amax_history.shape), new.reshape(scale.shape)

    def _update_scales(self, histories: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`update_scale` for ``n`` tensors at once: histories ``(n, L)``, scales ``(n,)``."""
        last = histories[:, 0]
        if self.amax_compute_algo == "max" and histories.shape[1] > 1:
            # fmaxf reduction: a NaN anywhere in the window is ignored (torch's amax would propagate it).
            rest = histories[:, 1:]
            amax = torch.fmax(last, torch.where(torch.isnan(rest), torch.zeros_like(rest), rest).amax(dim=1))
        else:
            amax = last
        if histories.shape[1] > 1:
            rolled = torch.cat([histories.new_zeros(len(histories), 1), histories[:, 2:], last[:, None]], dim=1)
        else:
            rolled = torch.zeros_like(histories)
        changed = last != 0
        rolled_or_kept = torch.where(changed[:, None], rolled, histories)
        amax = torch.where(changed, amax, last)
        new = quotient(torch.finfo(self.fp8_dtype).max * 2.0 ** (-self.margin), amax)
        new = torch.where(torch.isfinite(amax) & (amax > 0), new, scales)
        # TE replaces an Inf scale after choosing new vs previous, so a kept Inf scale becomes FLT_MAX too.
        new = torch.where(torch.isinf(new), torch.full_like(new, torch.finfo(torch.float32).max), new)
        return rolled_or_kept, new


@dataclass(frozen=True, repr=True)
class CurrentScaling(_PerTensor):
    """Per-tensor current scaling: ``scale = fp8_max / amax(x)`` (TE ``Float8CurrentScaling``).

    Args:
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        force_pow_2_scales: round the scale down to a power of two.
        amax_epsilon: lower bound on amax.

    Example:
        >>> q = dtensor_fp8.quantize(torch.randn(256, 256), CurrentScaling())
    """

    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    force_pow_2_scales: bool = False
    amax_epsilon: float = 0.0

    te_binding = TEBinding(
        "Float8Tensor", "Float8TensorStorage", _FLOAT8_TENSOR_BUFFERS, "Float8CurrentScalingQuantizer",
        quantizer_state=("device",),
        quantizer_fields=(("force_pow_2_scales", "force_pow_2_scales"), ("amax_epsilon", "amax_epsilon")),
        te_recipe="Float8CurrentScaling",
    )

    def __post_init__(self):
        _check_fp8_dtype("CurrentScaling", self.fp8_dtype)

    @property
    def name(self) -> str:
        return "current"

    def scale_from_amax(self, amax, usage, hp_dtype=torch.float32):
        scale = scale_from_amax(
            amax, torch.finfo(self.fp8_dtype).max,
            force_pow_2_scales=self.force_pow_2_scales, amax_epsilon=self.amax_epsilon,
        )
        return scale, reciprocal(scale)

    def _scale_rule(self):
        return kernels("per_tensor").ScaleRule(torch.finfo(self.fp8_dtype).max, self.amax_epsilon, self.force_pow_2_scales)

    def gemm_recipe(self):
        # TE's Float8CurrentScaling with its default HYBRID format: E4M3 activations, E5M2
        # gradients, the weight's QParams for both; fprop with fast accumulation (MMParams).
        same = dict(force_pow_2_scales=self.force_pow_2_scales, amax_epsilon=self.amax_epsilon)
        return GemmRecipe(input=CurrentScaling(torch.float8_e4m3fn, **same), grad=CurrentScaling(torch.float8_e5m2, **same),
                          fast_accum=(True, False, False), name="Float8CurrentScaling(fp8_format=HYBRID)")

    def quantize_operand(self, hp, *, rowwise, columnwise, state=None, reduce_amax=None):
        return self._operand_planes(hp, rowwise, columnwise), state

    def requantize_planes(self, usage, hps, currents, amaxes, states):
        # The scale is a function of each tensor's amax alone: compute all of them in one go.
        scales, scale_invs = self.scale_from_amax(self._amaxes(hps, amaxes, usage), usage)
        return zip(self._encode_each(hps, usage, scales, scale_invs), states)

    def requantize_planes_(self, usage, hps, planes, amaxes, states):
        if not self._casts_in_place(hps, planes):
            return super().requantize_planes_(usage, hps, planes, amaxes, states)
        scales, scale_invs = self.scale_from_amax(self._amaxes(hps, amaxes, usage), usage)
        self._write_planes(hps, planes, scales, scale_invs)
        return list(states)
