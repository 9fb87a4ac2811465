"""FP8 grouped GEMMs of expert weights on CUDA: ``torch._scaled_grouped_mm`` on the gathered planes.

[Note: torch's scaled grouped GEMM]
``torch._scaled_grouped_mm(A, B, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16)`` with a 2-D
``A`` ``[tokens, K]`` (row-major) and a 3-D ``B`` ``[E, K, N]`` (column-major in its last two dims:
each expert's ``N x K`` matrix row-major, as an expert weight's plane stores it) multiplies the rows
of expert ``e`` (``offs[e-1]:offs[e]``) by ``B[e]``. Its sm_90 / sm_100 kernel with float32 scales
(torch 2.11 ``GroupedBlas.cpp``, ``_meta_grouped_mm_common`` in ``torch/_meta_registrations.py``):

* both operands E4M3 (``float8_e4m3fn``); output bf16; ``K`` and ``N`` multiples of 16;
* "rowwise" scales: ``scale_a`` ``[tokens]`` (one per row of ``A``), ``scale_b`` ``[E, N]`` (one per
  output column of each expert), float32, contiguous.

So a GEMM runs here when every operand's scaling block spans the whole contraction (of each
expert, for the weight): per-tensor recipes (one scale per expert, or per activation tensor)
expand to such scales exactly. Block recipes (1x128, 128x128, MXFP8's 1x32) have several scales
along the contraction: torch's grouped kernel for those is MXFP8 on sm_100 only, whose per-group
padded and swizzled scale layout is not wired here; they run the emulated path (``grouped_mm.py``)
with the reason said once. Which blocks a plane has, and which operand recipes a weight's GEMMs
use, are the recipe's (``block_shape``, ``gemm_recipe()``: ``PerExpert`` declares E4M3 output
gradients, ``formats/experts.py``); nothing here asks which recipe it has.

The GEMMs of one grouped layer (``y = x W[e]^T`` per expert):

* forward: ``x`` quantized rowwise by the weight's input recipe x the rowwise plane, whose
  ``[E * out, in]`` bytes viewed ``[E, out, in]`` and transposed are ``B`` as it is (no copy);
* input gradient ``dx = dy W[e]``: ``dy`` quantized by the gradient recipe x the columnwise plane,
  each expert's matrix transposed byte for byte (one FP8 copy, ``K`` contiguous); the transpose
  cache of a transpose-derived recipe is dropped after use, as the dense GEMM does;
* weight gradient: the high-precision ``torch._grouped_mm(x^T, dy)`` of the emulated path (torch
  has no grouped scaled GEMM with ``offs`` along the contraction on sm_90).
"""

from __future__ import annotations

import torch

from . import _compat, gemm
from .formats.base import COLUMNWISE, ROWWISE
from .formats.planes import BlockShape, Plane
from .ops.copies import reads_from

#: torch's rowwise-scaled grouped GEMM (see the note): devices, operand dtype, dim multiple, output.
GROUPED_CAPABILITIES = ((9, 0), (10, 0))
GROUPED_FP8_DTYPE = torch.float8_e4m3fn
GROUPED_DIM_MULTIPLE = 16
GROUPED_OUT_DTYPE = torch.bfloat16


def spans_contraction(block: BlockShape, contract_dim: int, group: int) -> bool:
    """Whether a plane with ``block`` s has one scale along each contraction: the whole dim 1
    (``contract_dim=1``), or each group of ``group`` rows of dim 0 (``contract_dim=0``: an expert's
    rows of a stacked ``[E * group, in]`` plane).

    Args:
        block: the plane's block shape (``None``: the block spans that dim).
        contract_dim: the dim the GEMM contracts.
        group: rows of one expert (``contract_dim=0``).

    Example:
        >>> spans_contraction(BlockShape(256, None), 0, 256), spans_contraction(BlockShape(1, 32), 1, 1)
        (True, False)
    """
    if contract_dim == 1:
        return block.cols is None
    return block.rows is None or block.rows % group == 0


def rowwise_scales(plane: Plane, block: BlockShape, contract_dim: int, group: int) -> torch.Tensor:
    """The float32 scale of each row of the GEMM's output dim, from a plane's block grid (see the
    note; check :func:`spans_contraction` first).

    Args:
        plane: a plane ``(rows, cols)`` in its logical orientation and its scale grid.
        block: its block shape.
        contract_dim: 1: contraction along ``cols`` (returns ``[rows]``); 0: along each group of
            ``group`` rows (returns ``[rows // group, cols]``).
        group: rows of one expert (``contract_dim=0``).

    Example:
        >>> rowwise_scales(q.plane("rowwise"), q.recipe.block_shape("rowwise"), 1, q.shape[1])  # [E * out]
    """
    rows, cols = plane.data.shape
    grid = plane.scale_inv.float()
    block_rows = block.rows or rows
    if contract_dim == 1:
        return grid[:, 0].repeat_interleave(block_rows)[:rows].contiguous()
    first_rows = torch.arange(0, rows, group, device=grid.device) // block_rows
    return grid[first_rows].repeat_interleave(block.cols or cols, dim=1)[:, :cols].contiguous()


def unsupported_reason(A: torch.Tensor, q) -> str | None:
    """Why the grouped GEMM of ``A`` with the expert weight ``q`` ``[E, out, in]`` cannot run torch's
    scaled grouped GEMM here (``None``: it can).

    Args:
        A: the routed tokens ``[tokens, in]``.
        q: the per-expert :class:`QuantizedTensor` (the base of ``B_t``).

    Example:
        >>> unsupported_reason(x.cuda(), q.cuda())   # a per-tensor expert weight on an H100
        None
    """
    m = gemm.mode()
    if m == "off":
        return f"{gemm.ENV_SWITCH}=off"
    if A.device.type != "cuda":
        return f"{A.device.type}: torch has scaled grouped GEMMs on CUDA only"
    cc = torch.cuda.get_device_capability(A.device)
    if cc not in GROUPED_CAPABILITIES or not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch's scaled grouped GEMM runs on sm_90 / sm_100, the device is sm_{cc[0]}{cc[1]}"
    recipe, (_, out, inn) = q.recipe, q.shape
    g = gemm.gemm_recipe(recipe)
    if g is None:
        return f"{recipe.name} declares no FP8 GEMM"
    if A.dtype != torch.bfloat16:
        return f"activations are {A.dtype}: torch's grouped GEMMs take bf16 (the weight gradient's too)"
    if any(q.phase):
        return "the weight starts inside its blocks (a piece of a larger one)"
    if _compat.is_traced(A) and gemm._has_operand_state(recipe, A.device):
        return "under torch.compile: the operand scaling state is kept outside the graph"
    operands = {"the weight's": recipe.fp8_dtype, "activations'": g.input.fp8_dtype, "gradients'": g.grad.fp8_dtype}
    for what, dtype in operands.items():
        if dtype != GROUPED_FP8_DTYPE:
            return f"{what} FP8 dtype is {dtype}: torch's scaled grouped GEMM multiplies {GROUPED_FP8_DTYPE} only"
    blocks = {"forward: the weight's rowwise": (recipe.block_shape(ROWWISE), 1, out),
              "input gradient: the weight's columnwise": (recipe.block_shape(COLUMNWISE), 0, out),
              "forward: the activations'": (g.input.block_shape(ROWWISE), 1, 1),
              "input gradient: the output gradients'": (g.grad.block_shape(ROWWISE), 1, 1)}
    for what, (block, contract_dim, group) in blocks.items():
        if not spans_contraction(block, contract_dim, group):
            return (f"{what} blocks ({block}) hold several scales along the contraction: torch's grouped "
                    "GEMM with such scales is MXFP8 on sm_100, not wired yet (grouped_fp8.py)")
    bad = {k: v for k, v in {"out": out, "in": inn}.items() if v % GROUPED_DIM_MULTIPLE}
    if bad:
        return f"scaled grouped GEMMs need dims divisible by {GROUPED_DIM_MULTIPLE}, got {bad}"
    return None


def _quantized_rows(operand_recipe, hp: torch.Tensor, weight, state_key: str):
    """``hp`` ``[tokens, K]`` quantized rowwise by ``operand_recipe`` (delayed scaling: with and into
    the weight's operand state) and its per-row scales."""
    states = gemm._states(weight, hp.device)
    planes, state = operand_recipe.quantize_operand(hp.contiguous(), rowwise=True, columnwise=False,
                                                    state=states.get(state_key))
    if state is not None:
        states[state_key] = state
    plane = planes[ROWWISE]
    return plane, rowwise_scales(plane, operand_recipe.block_shape(ROWWISE), 1, 1)


def _run(name: str, a: Plane, scale_a, mat_b, scale_b, offs, fast_accum: bool) -> torch.Tensor:
    for log in gemm._recorders:  # gemm.recording(): what ran, for tests
        log.append({"gemm": name, "a": gemm.Operand(a.data, scale_a, BlockShape(1, None)),
                    "b": gemm.Operand(mat_b, scale_b, BlockShape(None, 1))})
    return torch._scaled_grouped_mm(a.data, mat_b, scale_a, scale_b, offs=offs, out_dtype=GROUPED_OUT_DTYPE,
                                    use_fast_accum=fast_accum)


class ScaledGroupedMM(torch.autograd.Function):
    """``torch._grouped_mm(x, W.transpose(-2, -1), offs)`` with FP8 forward and input-gradient GEMMs
    (see the note); ``weight_t`` is a :class:`QuantizedTransposeView` of a per-expert weight."""

    @staticmethod
    def forward(ctx, x, weight_t, offs):
        q = reads_from(weight_t.base)
        recipe, g = q.recipe, gemm.gemm_recipe(q.recipe)
        experts, out, inn = q.shape
        xa, scale_a = _quantized_rows(g.input, x, q, "input")
        w = q.plane(ROWWISE)
        scale_b = rowwise_scales(w, recipe.block_shape(ROWWISE), 1, out).view(experts, out)
        mat_b = w.data.view(experts, out, inn).transpose(-2, -1)  # [E, in, out], column-major: no copy
        y = _run("grouped_fprop", xa, scale_a, mat_b, scale_b, offs, g.fast("fprop"))
        ctx.save_for_backward(x, offs)
        ctx.weight_t = weight_t  # read again in backward: FSDP2's backward gather re-points it
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, offs = ctx.saved_tensors
        grad_x = grad_w_t = None
        if ctx.needs_input_grad[0]:
            q = reads_from(ctx.weight_t.base)
            recipe, g = q.recipe, gemm.gemm_recipe(q.recipe)
            experts, out, inn = q.shape
            dya, scale_a = _quantized_rows(g.grad, grad_out, q, "grad")
            w = q.plane(COLUMNWISE)
            scale_b = rowwise_scales(w, recipe.block_shape(COLUMNWISE), 0, out)  # [E, in]
            # each expert's matrix transposed byte for byte ([E, in, out] contiguous), seen as [E, out, in]
            mat_b = w.data.view(experts, out, inn).transpose(1, 2).contiguous().transpose(-2, -1)
            q.discard_transpose_cache()  # a transpose-derived recipe's cache is not this layout
            grad_x = _run("grouped_dgrad", dya, scale_a, mat_b, scale_b, offs, g.fast("dgrad")).to(grad_out.dtype)
        if ctx.needs_input_grad[1]:
            # [E, in, out]: the gradient of W^T (autograd's transpose backward turns it into W's)
            grad_w_t = torch._grouped_mm(x.t(), grad_out.to(x.dtype), offs=offs).to(ctx.weight_t.dtype)
        return grad_x, grad_w_t, None
