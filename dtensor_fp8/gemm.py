"""FP8 GEMMs for ``F.linear`` with a :class:`QuantizedTensor` weight, on its planes as they are.

[Note: the FP8 linear]
``nn.Linear`` / ``F.linear(x, W)`` with a quantized ``W`` reaches ``linear.py`` through
``QuantizedTensor.__torch_function__``. Where torch has the scaled GEMMs for the weight's recipe on
this device (:func:`unsupported_reason`), the three GEMMs of the layer run in FP8
(``formats/scaled_mm.py`` has the operand layouts and TE's semantics):

* fprop reads ``W``'s rowwise plane as FSDP gathered it (no dequantize, no copy; ``W`` row-major
  is the column-major ``B`` operand cuBLAS wants);
* dgrad reads the columnwise plane: for per-tensor and 128x128 recipes the transpose cache of the
  shared plane (built by FSDP's post-all-gather hook, or here, and discarded after its one use),
  else the columnwise plane's bytes transposed;
* wgrad multiplies the columnwise planes of ``dy`` and ``x``.

Activations and output gradients are quantized with the recipes the weight's recipe declares
(:meth:`Recipe.gemm_recipe`), by the same recipe code that quantizes weights (its kernels
included), so their bytes are what :meth:`Recipe.quantize_operand` gives. Delayed scaling keeps
an amax history per weight for its activations and one for its gradients (TE keeps one per
module), in the weight's owner record (``QuantizedTensor.param_state``, shared by FSDP's shard
and the unsharded weight it gathers; saved in the model's state dict). A GEMM records its local
amax only: no collective runs inside compute. Once per step the recorded amaxes are reduced over
the weight's own mesh groups and the histories updated (``operand_scaling.py``), as TE reduces
and updates once per region, so every rank holding the weight keeps the same history.

Elsewhere the emulated linear of ``linear.py`` runs: on the CPU unless asked for
(``DTENSOR_FP8_GEMMS=on`` or :func:`fp8_gemms`; torch's CPU kernel covers tensorwise scaling
only), and on CUDA for shapes or recipes torch has no scaled GEMM for (e.g. MXFP8 before
sm_100), with a warning that says why, once per process and reason.

This module never branches on the recipe class: it reads the recipe's block shapes,
``gemm_recipe()`` and ``columnwise_is_transpose``, and the scale-layout table.

[Note: shards that start inside blocks]
A weight that is a piece of a larger one (a tensor-parallel shard run on its own rows, e.g.
``F.linear(x, w.to_local())``) may start inside its scaling blocks (``QuantizedTensor.phase``):
its scale grid holds the scale of every block it touches, but its block grid is offset from its
origin, and torch's block-scaled GEMMs read blocks from the operand's origin. Each GEMM that reads
the weight pads the weight's plane in front with zero FP8 rows / columns to whole blocks of every
plane (one front for all GEMMs, :meth:`Recipe.gemm_front`, so their dims stay multiples of the
blocks; :meth:`Recipe.aligned_plane`: an FP8 copy, never a high-precision one) and pads the other
operand the same way along the contracted dim (zeros, before it is quantized, so its blocks line
up with the weight's): the zeros contribute nothing to the contraction, and the extra output rows
or columns (the padding of the weight's other dim) are cut off. The alternative, splitting the
GEMM at the first block boundary into an unaligned head and an aligned rest, needs the head as a
GEMM of its own whose operand still starts inside a block: it has the same problem. Padding costs
one copy of the weight's FP8 bytes and of the activation per GEMM, only for such pieces (none at
phase 0); the weight-gradient GEMM reads no weight and runs on the unpadded operands.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass

import torch

from . import _compat, settings
from .formats.base import COLUMNWISE, ROWWISE, BlockShape, Plane, transpose_2d
from .formats.scaled_mm import gemm_block, layout_for, unsupported_pair

#: ``auto``: FP8 GEMMs on CUDA where torch has them; ``on``: also on the CPU (where torch's kernel
#: runs: tensorwise); ``off``: always the emulated linear.
MODES = settings.FP8_GEMM_MODES
ENV_SWITCH = settings.FP8_GEMMS_VAR
_warned: set[str] = set()
_recorders: list[list] = []
_HP_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def mode() -> str:
    """The FP8-GEMM mode in force: the innermost :func:`fp8_gemms` (or ``settings.override``),
    else ``$DTENSOR_FP8_GEMMS`` as read once by :mod:`dtensor_fp8.settings`, else ``"auto"``."""
    return settings.current().fp8_gemms


@contextlib.contextmanager
def fp8_gemms(m: str = "on"):
    """Choose where ``F.linear`` with a quantized weight runs FP8 GEMMs, within the block.

    Args:
        m: ``"auto"`` (CUDA only), ``"on"`` (also the CPU, where torch has the kernel) or
            ``"off"`` (the emulated linear everywhere).

    Example:
        >>> with dtensor_fp8.gemm.fp8_gemms("on"):
        ...     y = torch.nn.functional.linear(x, q)  # FP8 GEMM on the CPU too (tensorwise recipes)
    """
    if m not in MODES:
        raise ValueError(f"fp8_gemms: mode must be one of {MODES}, got {m!r}")
    with settings.override(fp8_gemms=m):
        yield


@contextlib.contextmanager
def recording():
    """Record every FP8 GEMM run within the block: a list of ``{"gemm", "a", "b"}`` entries
    (:class:`Operand` s exactly as handed to torch's scaled GEMM), for tests that compare operand
    bytes with what the recipes give.

    Example:
        >>> with dtensor_fp8.gemm.recording() as log:
        ...     torch.nn.functional.linear(x, q).sum().backward()
        >>> [e["gemm"] for e in log]
        ['fprop', 'dgrad', 'wgrad']
    """
    log: list = []
    _recorders.append(log)
    try:
        yield log
    finally:
        _recorders.remove(log)


@dataclass
class Operand:
    """One scaled-GEMM operand: FP8 ``data`` ``(rows, k)`` row-major (contraction dim ``k``
    contiguous), its per-block ``scale_inv`` grid in that orientation, and the block shape."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    block: BlockShape


def operand(plane: Plane, block: BlockShape, contract_dim: int, transposed: torch.Tensor | None = None) -> Operand:
    """A plane (logical orientation) as the operand of a GEMM contracting its dim ``contract_dim``;
    contracting dim 0 transposes the bytes (``transposed``: an existing transposed copy)."""
    if contract_dim == 1:
        return Operand(plane.data, plane.scale_inv, block)
    if transposed is None:
        # A plane written transposed by its kernel is a .t() view: its bytes are already K-major.
        transposed = plane.data.t() if plane.data.t().is_contiguous() else transpose_2d(plane.data)
    data = transposed
    return Operand(data, plane.scale_inv.t(), gemm_block(block, 0))


def _scaled_mm_fn():
    F = torch.nn.functional
    return getattr(F, "scaled_mm", None), getattr(F, "ScalingType", None), getattr(F, "SwizzleType", None)


def scaled_mm(a: Operand, b: Operand, out_dtype: torch.dtype, *, fast_accum: bool, gemm: str = "") -> torch.Tensor:
    """``a.data @ b.data.T`` dequantized by the operands' scales, accumulated in fp32, as
    ``out_dtype``: ``torch._scaled_mm`` for tensorwise scales, ``torch.nn.functional.scaled_mm``
    for block scales.

    Args:
        a, b: operands contracting their dim 1 (``b`` is passed as the column-major ``b.data.t()``).
        out_dtype: output dtype.
        fast_accum: the tensor cores' fast accumulation (TE's ``use_split_accumulator=False``).
        gemm: name recorded by :func:`recording`.

    Example:
        >>> y = scaled_mm(operand(xq, BlockShape(None, None), 1), operand(wq, BlockShape(None, None), 1), torch.bfloat16, fast_accum=True)
    """
    for log in _recorders:
        log.append({"gemm": gemm, "a": a, "b": b})
    la, lb = layout_for(a.block), layout_for(b.block)
    sa = la.scale(a.scale_inv, a.data.shape[0], a.data.shape[1], operand="a")
    sb = lb.scale(b.scale_inv, b.data.shape[0], b.data.shape[1], operand="b")
    if la.kind == lb.kind == "TensorWise":
        return torch._scaled_mm(a.data, b.data.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype, use_fast_accum=fast_accum)
    return scaled_mm_v2(a.data, b.data.t(), sa, la.kind, la.swizzle, sb, lb.kind, lb.swizzle, out_dtype, fast_accum)


def scaled_mm_v2(mat_a, mat_b, scale_a, kind_a: str, swizzle_a: str, scale_b, kind_b: str, swizzle_b: str,
                 out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """``torch.nn.functional.scaled_mm`` with one scale per operand, called as the aten op it wraps.

    Dynamo traces an aten op in every torch version, while torch 2.11's dynamo cannot see through
    the Python binding that ``F.scaled_mm`` calls and broke the graph at every block-scaled GEMM of
    a compiled model. The arguments are ``F.scaled_mm``'s: its enums as their ints, swizzles as an
    empty list when there are none.

    Args:
        mat_a, mat_b: FP8 ``(M, K)`` row-major and ``(K, N)`` column-major.
        scale_a, scale_b: the operands' scales in ``kind_a`` / ``kind_b``'s layout.
        kind_a, kind_b: ``F.ScalingType`` member names (``"TensorWise"``, ``"BlockWise1x128"``, ...).
        swizzle_a, swizzle_b: ``F.SwizzleType`` member names (``"NO_SWIZZLE"``: none).
        out_dtype: the output dtype.
        fast_accum: the tensor cores' fast accumulation.

    Example:
        >>> y = scaled_mm_v2(a, b.t(), sa, "TensorWise", "NO_SWIZZLE", sb, "TensorWise", "NO_SWIZZLE", torch.bfloat16, False)
    """
    _, scaling, swizzle = _scaled_mm_fn()

    def swizzles(name):
        return [] if name == "NO_SWIZZLE" else [getattr(swizzle, name).value]

    return torch.ops.aten._scaled_mm_v2.default(
        mat_a, mat_b, [scale_a], [getattr(scaling, kind_a).value], swizzles(swizzle_a),
        [scale_b], [getattr(scaling, kind_b).value], swizzles(swizzle_b), None, out_dtype, [], fast_accum)


@functools.lru_cache(maxsize=None)
def gemm_recipe(recipe):
    """``recipe.gemm_recipe()``, made once per recipe (recipes are frozen, hashable dataclasses)."""
    return recipe.gemm_recipe()


def _gemm_blocks(recipe):
    """``{gemm: (a block, b block, a dtype, b dtype)}`` in the GEMMs' orientation (see the note in
    formats/scaled_mm.py), for a weight recipe and the operand recipes it declares."""
    w, g = recipe, gemm_recipe(recipe)
    x, dy = g.input, g.grad
    return {
        "fprop": (gemm_block(x.block_shape(ROWWISE), 1), gemm_block(w.block_shape(ROWWISE), 1), x.fp8_dtype, w.fp8_dtype),
        "dgrad": (gemm_block(dy.block_shape(ROWWISE), 1), gemm_block(w.block_shape(COLUMNWISE), 0), dy.fp8_dtype, w.fp8_dtype),
        "wgrad": (gemm_block(dy.block_shape(COLUMNWISE), 0), gemm_block(x.block_shape(COLUMNWISE), 0), dy.fp8_dtype, x.fp8_dtype),
    }


def unsupported_reason(x: torch.Tensor, weight) -> str | None:
    """Why ``F.linear(x, weight)`` cannot run FP8 GEMMs here (``None``: it can).

    Args:
        x: activations ``(..., K)``.
        weight: a QuantizedTensor ``(M, K)``.
    """
    m = mode()
    if m == "off":
        return f"{ENV_SWITCH}=off"
    if x.device.type == "cpu" and m == "auto":
        return "CPU (FP8 GEMMs run on CUDA; DTENSOR_FP8_GEMMS=on tries torch's CPU kernel)"
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        return f"shapes x {tuple(x.shape)}, weight {tuple(weight.shape)} are not a 2-D linear"
    if _compat.is_traced(x) and _has_operand_state(weight.recipe, x.device):
        # The operand states live in the weight's owner record: a compiled graph sees a traced
        # stand-in for the weight, so its updates would never reach the record (delayed scaling's
        # histories would not advance). The emulated linear compiles exactly.
        return "under torch.compile: the operand scaling state (delayed scaling's amax histories) is kept outside the graph"
    tokens = x.numel() // max(x.shape[-1], 1)
    cc = torch.cuda.get_device_capability(x.device) if x.device.type == "cuda" else None
    key = (weight.recipe, x.device.type, cc, tokens, weight.shape[0], weight.shape[1], weight.phase,
           x.dtype, weight.dtype)
    if any(isinstance(v, torch.SymInt) for v in key[3:6]):
        # Dynamic shapes under torch.compile (dynamo marks a dim dynamic once it sees two sizes): a
        # SymInt cannot key the cache; the same checks uncached, their divisibility tests guards.
        return _unsupported.__wrapped__(*key)
    # Called at every F.linear: the answer depends only on these, so it is computed once for them.
    return _unsupported(*key)


def _has_operand_state(recipe, device) -> bool:
    g = gemm_recipe(recipe)
    return g is not None and (g.input.operand_state(device) is not None or g.grad.operand_state(device) is not None)


@functools.lru_cache(maxsize=4096)
def _unsupported(recipe, device_type, cc, tokens, rows, cols, phase, x_dtype, w_dtype) -> str | None:
    if gemm_recipe(recipe) is None:
        return f"{recipe.name} declares no FP8 GEMM"
    if x_dtype not in _HP_DTYPES or w_dtype not in _HP_DTYPES:
        return f"dtypes x {x_dtype}, weight {w_dtype} (FP8 GEMMs output bf16/fp16/fp32)"
    dims = None
    for gemm, (ba, bb, da, db) in _gemm_blocks(recipe).items():
        why = unsupported_pair(ba, bb, da, db)
        if why is not None:
            return f"{gemm}: {why}"
        if dims is None:
            # A piece starting inside its blocks runs on operands padded to whole blocks (see the
            # note on shards that start inside blocks): the GEMMs' dims are the padded ones.
            front = recipe.gemm_front(phase) if any(phase) else (0, 0)
            dims = {"tokens": tokens, "out_features": rows + front[0], "in_features": cols + front[1]}
        for layout in (layout_for(ba), layout_for(bb)):
            if cc is None:
                if device_type != "cpu" or not layout.runs_on_cpu:
                    return f"{gemm}: torch has no {device_type} kernel for {layout.kind} scaled GEMMs"
            elif cc < layout.min_capability or (layout.max_capability is not None and cc > layout.max_capability):
                need = f"sm_{layout.min_capability[0]}{layout.min_capability[1]}" + (
                    "+" if layout.max_capability is None else
                    ("" if layout.max_capability == layout.min_capability else f"..sm_{layout.max_capability[0]}{layout.max_capability[1]}"))
                return f"{gemm}: torch's {layout.kind} scaled GEMM needs {need}, the device is sm_{cc[0]}{cc[1]}"
            multiple = max(layout.k_multiple, layout.rows_multiple)
            bad = {k: v for k, v in dims.items() if v % multiple}
            if bad:
                return f"{gemm}: {layout.kind} scaled GEMMs need dims divisible by {multiple}, got {bad}"
        if layout_for(ba).kind != "TensorWise" and _scaled_mm_fn()[0] is None:
            return "this torch has no torch.nn.functional.scaled_mm"
    return None


def expected_on(device_type: str) -> bool:
    """Whether the mode in force asks for FP8 GEMMs on ``device_type``: CUDA unless ``"off"``,
    the CPU only under ``"on"``.

    Example:
        >>> with dtensor_fp8.gemm.fp8_gemms("auto"):
        ...     dtensor_fp8.gemm.expected_on("cpu")
        False
    """
    m = mode()
    return m == "on" or (m == "auto" and device_type != "cpu")


def fallback_reason(x: torch.Tensor, weight) -> str | None:
    """Why ``F.linear(x, weight)`` runs the emulated linear (``None``: it runs FP8 GEMMs), said
    once per process and reason where FP8 GEMMs were expected (:func:`note_fallback`).

    Args:
        x: activations ``(..., K)``.
        weight: a QuantizedTensor ``(M, K)``.

    Example:
        >>> fallback_reason(torch.randn(4, 256), q)   # on the CPU: "CPU (FP8 GEMMs run on CUDA; ...)"
    """
    reason = unsupported_reason(x, weight)
    if reason is not None:
        note_fallback(reason, x, weight, stacklevel=5)
    return reason


def note_fallback(reason: str, x: torch.Tensor, weight, *, subject: str | None = None, stacklevel: int = 4) -> None:
    """Warn, once per process and reason, that an emulated GEMM runs where FP8 GEMMs were expected
    (:func:`expected_on`).

    Args:
        reason: why no FP8 GEMM runs.
        x: the activation (its device decides whether FP8 GEMMs were expected).
        weight: the quantized weight.
        subject: what runs emulated (default: ``F.linear``'s emulated linear; the grouped GEMM says its own).
        stacklevel: as ``warnings.warn``'s, counted from the caller's caller of this function.
    """
    if not expected_on(x.device.type):
        return
    key = f"{weight.recipe.name}: {reason}"
    if key in _warned:
        return
    _warned.add(key)
    if subject is None:
        subject = f"F.linear with a {weight.recipe.name} weight of shape {tuple(weight.shape)} runs the emulated linear"
    warnings.warn(f"dtensor_fp8: {subject} (planes dequantized, high-precision GEMM), not FP8 GEMMs: {reason}. "
                  "Said once per process.", stacklevel=stacklevel)


def _states(weight, device) -> dict:
    """The operand scaling states of ``weight``'s parameter (its owner record's)."""
    return weight.param_state.scaling.ensure_operand_states(weight.recipe, device)


def operand_states(weight) -> dict:
    """The activation / gradient scaling states of ``weight`` (delayed scaling's amax histories and
    scales; empty for recipes whose operands keep none).

    Example:
        >>> sorted(operand_states(layer.weight))   # delayed scaling
        ['grad', 'input']
    """
    return _states(weight, weight.device)


def _pad_cols_front(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` (2-D) with ``n`` zero columns before its first (see the note on shards that start
    inside blocks)."""
    return torch.nn.functional.pad(t, (n, 0)) if n else t


def _quantize_padded(quantizer, hp: torch.Tensor, pad: int, *, rowwise: bool, columnwise: bool, state):
    """``quantizer.quantize_operand(hp, ...)``, its rowwise plane from ``hp`` with ``pad`` zero
    columns in front (the contraction against a weight starting inside its blocks; see the note) and
    its columnwise plane from ``hp`` as it is (the weight-gradient GEMM reads no weight)."""
    if not pad:
        return quantizer.quantize_operand(hp, rowwise=rowwise, columnwise=columnwise, state=state)
    planes, state = (quantizer.quantize_operand(_pad_cols_front(hp, pad), rowwise=True, columnwise=False, state=state)
                     if rowwise else ({}, state))
    if columnwise:
        col, state = quantizer.quantize_operand(hp, rowwise=False, columnwise=True, state=state)
        planes = {**planes, **col}
    return planes, state


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, needs_wgrad: bool):
        g = gemm_recipe(weight.recipe)
        x2 = x.reshape(-1, x.shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        # A weight starting inside its blocks: whole-block operands (see the note above).
        front = weight.recipe.gemm_front(weight.phase)
        w_plane, _ = weight.recipe.aligned_plane(weight.plane(ROWWISE), ROWWISE, weight.phase, front)
        states = _states(weight, x.device)
        planes, new_state = _quantize_padded(g.input, x2, front[1], rowwise=True, columnwise=needs_wgrad,
                                             state=states.get("input"))
        if new_state is not None:
            states["input"] = new_state
        a = operand(planes[ROWWISE], g.input.block_shape(ROWWISE), 1)
        b = operand(w_plane, weight.recipe.block_shape(ROWWISE), 1)
        y = scaled_mm(a, b, x.dtype, fast_accum=g.fast("fprop"), gemm="fprop")
        if front[0]:
            y = y[:, front[0]:]
        if bias is not None:
            y = y + bias
        saved = [weight]
        if needs_wgrad:
            x_col = planes[COLUMNWISE]
            saved += [x_col.data, x_col.scale_inv]
        ctx.save_for_backward(*saved)
        ctx.has_bias, ctx.needs_wgrad, ctx.x_dtype = bias is not None, needs_wgrad, x.dtype
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        weight, *x_col = ctx.saved_tensors
        g, w_recipe = gemm_recipe(weight.recipe), weight.recipe
        dy = grad_out.reshape(-1, grad_out.shape[-1])
        if not dy.is_contiguous():
            dy = dy.contiguous()
        need_dx = ctx.needs_input_grad[0]
        need_dw = ctx.needs_input_grad[1] and ctx.needs_wgrad
        grad_x = grad_w = grad_b = None
        front = (0, 0)
        if need_dx:  # raises with the fix when the gather did not bring the columnwise plane
            front = w_recipe.gemm_front(weight.phase)
            w_plane, _ = w_recipe.aligned_plane(weight.plane(COLUMNWISE), COLUMNWISE, weight.phase, front)
        if need_dx or need_dw:
            states = _states(weight, dy.device)
            planes, new_state = _quantize_padded(g.grad, dy, front[0], rowwise=need_dx, columnwise=need_dw,
                                                 state=states.get("grad"))
            if new_state is not None:
                states["grad"] = new_state
        if need_dx:
            # The transpose cache is of the unpadded plane: a padded one is transposed here.
            cache = weight.create_transpose_cache() if w_recipe.columnwise_is_transpose and not any(front) else None
            b = operand(w_plane, w_recipe.block_shape(COLUMNWISE), 0, transposed=cache)
            a = operand(planes[ROWWISE], g.grad.block_shape(ROWWISE), 1)
            grad_x = scaled_mm(a, b, ctx.x_dtype, fast_accum=g.fast("dgrad"), gemm="dgrad")
            if front[1]:
                grad_x = grad_x[:, front[1]:]
            grad_x = grad_x.reshape(*grad_out.shape[:-1], weight.shape[1])
            # The transpose cache lives from the backward gather to its one use (see fsdp.py).
            weight.discard_transpose_cache()
        if need_dw:
            a = operand(planes[COLUMNWISE], g.grad.block_shape(COLUMNWISE), 0)
            b = operand(Plane(*x_col), g.input.block_shape(COLUMNWISE), 0)
            grad_w = scaled_mm(a, b, weight.dtype, fast_accum=g.fast("wgrad"), gemm="wgrad")
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = dy.sum(0)
        return grad_x, grad_w, grad_b, None


def fp8_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with FP8 GEMMs on ``weight``'s planes (check
    :func:`unsupported_reason` first; :func:`dtensor_fp8.quantized_linear` does).

    Args:
        x: activations ``(..., K)``, bf16 / fp16 / fp32.
        weight: QuantizedTensor ``(M, K)`` holding the rowwise usage (and the columnwise usage by
            the time backward needs the input gradient).
        bias: optional ``(M,)``.

    Example:
        >>> y = fp8_linear(x.cuda(), dtensor_fp8.quantize(w.cuda(), dtensor_fp8.CurrentScaling()))
    """
    needs_wgrad = torch.is_grad_enabled() and weight.requires_grad
    return _FP8Linear.apply(x, weight, bias, needs_wgrad)
