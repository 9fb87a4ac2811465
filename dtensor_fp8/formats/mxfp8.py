"""MXFP8 (OCP Microscaling v1.0, as Transformer Engine implements it): E4M3 data, one E8M0
(power-of-two) scale per 32 elements; 1x32 blocks for the rowwise plane and 32x1 blocks for the
columnwise plane, which therefore holds different bytes and is stored and moved on its own.

[Note: E8M0 rounding]
The OCP spec derives the shared exponent as ``floor(log2(amax)) - emax_elem`` (torchao's default
"floor" rule). TE instead computes ``float_to_e8m0(amax * (1 / fp8_max))`` and rounds that value
*up* to a power of two (``cvt.rp.satfinite.ue8m0x2.f32`` on sm_100; a bit-level emulation on other
archs, transformer_engine/common/util/ptx.cuh), so an element never saturates. Elements are then
multiplied by the exact reciprocal ``exp2f_rcp(e) = 2^(127 - e)`` and cast to
E4M3 with round-to-nearest-even and saturation. torch's own fp32 -> float8_e8m0fnu cast rounds to
nearest and maps inf to 0xFF, so the rounding up is written here with integer bit operations.
Special amax values: NaN -> 0xFF, Inf -> 0xFE, 0 -> 0x00.

TE's storage (``MXFP8Quantizer.get_scale_shape``, non-swizzled): data ``(M, K)`` for both planes;
rowwise scales ``(roundup(M, 128), roundup(K/32, 4))``, columnwise ``(roundup(M/32, 4),
roundup(K, 128))``, E8M0 bytes, padding zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _compat
from .base import COLUMNWISE, ROWWISE, BlockShape, Recipe, RecipeError, as_matrix_shape, round_up
from .per_tensor import _check_fp8_dtype
from .te_binding import TEBinding, TEBuffer
from .triton_kernels import fast_path, kernels
from .scaled_mm import GemmRecipe

BLOCK = 32
_FP32_MANTISSA_BITS = 23
_FP32_MANTISSA_MASK = (1 << _FP32_MANTISSA_BITS) - 1


def float_to_e8m0(val: torch.Tensor) -> torch.Tensor:
    """E8M0 byte of a positive fp32 value rounded up to a power of two (TE's ``float_to_e8m0``).

    Returns a uint8 tensor.
    """
    bits = val.float().contiguous().view(torch.int32)
    exponent = (bits >> _FP32_MANTISSA_BITS) & 0xFF
    mantissa = bits & _FP32_MANTISSA_MASK
    # Round up unless exact, unless already at the largest finite exponent (satfinite), and
    # keep denormals <= 2^-127 at exponent 0 (they round to 2^-127, E8M0's smallest value).
    round_up_ = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    exponent = exponent + round_up_.to(exponent.dtype)
    exponent = torch.where(torch.isinf(val), torch.full_like(exponent, 0xFE), exponent)
    exponent = torch.where(torch.isnan(val), torch.full_like(exponent, 0xFF), exponent)
    exponent = torch.where(val == 0, torch.zeros_like(exponent), exponent)
    return exponent.to(torch.uint8)


def e8m0_reciprocal(biased_exponent: torch.Tensor) -> torch.Tensor:
    """TE's ``exp2f_rcp`` (common/util/ptx.cuh): ``2^(127 - e)`` as fp32 bits ``(254 - e) << 23``;
    ``e == 254`` gives the denormal 2^-127 (0x00400000) and ``e == 255`` NaN."""
    e = biased_exponent.to(torch.int32)
    bits = (254 - e) << _FP32_MANTISSA_BITS
    bits = torch.where(e == 254, torch.full_like(bits, 0x00400000), bits)
    bits = torch.where(e == 255, torch.full_like(bits, 0x7FFFFFFF), bits)
    return bits.view(torch.float32)


@torch.library.custom_op("dtensor_fp8::e8m0_from_bytes", mutates_args=())
def _e8m0_from_bytes(biased: torch.Tensor) -> torch.Tensor:
    return biased.view(torch.float8_e8m0fnu).clone()


@_e8m0_from_bytes.register_fake
def _(biased: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(biased, dtype=torch.float8_e8m0fnu)


def as_e8m0(biased: torch.Tensor) -> torch.Tensor:
    """uint8 biased exponents as ``float8_e8m0fnu`` scales: a view, or under torch.compile a copy
    made by an opaque op, because inductor's C++ code generator has no E8M0 type (torch 2.13:
    ``float8_e8m0fnu missing from DTYPE_TO_CPP``) and would fuse the view into a kernel."""
    if _compat.is_traced(biased):  # is_compiling() is False where torch 2.11 runs a subclass's op on fake tensors
        return _e8m0_from_bytes(biased)
    return biased.view(torch.float8_e8m0fnu)


@dataclass(frozen=True, repr=True)
class MXFP8(Recipe):
    """MXFP8: E4M3 data with an E8M0 scale per 1x32 (rowwise) / 32x1 (columnwise) block.

    Args:
        fp8_dtype: ``torch.float8_e4m3fn`` (default) or ``torch.float8_e5m2``.

    Example:
        >>> q = dtensor_fp8.quantize(torch.randn(256, 512), MXFP8())
    """

    fp8_dtype: torch.dtype = torch.float8_e4m3fn

    scale_inv_dtype = torch.float8_e8m0fnu
    # TE's MXFP8Tensor: both planes (M, K) as ours; E8M0 scales as bytes, padded; TE's kernels
    # are built for sm_100+ only (on sm_90 TE's quantize writes nothing, see DESIGN.md).
    te_binding = TEBinding(
        "MXFP8Tensor", "MXFP8TensorStorage",
        (TEBuffer("_rowwise_data", "rowwise_data", (ROWWISE,), ROWWISE, "data"),
         TEBuffer("_rowwise_scale_inv", "rowwise_scale_inv", (ROWWISE,), ROWWISE, "scale_inv", pad=(128, 4)),
         TEBuffer("_columnwise_data", "columnwise_data", (COLUMNWISE,), COLUMNWISE, "data"),
         TEBuffer("_columnwise_scale_inv", "columnwise_scale_inv", (COLUMNWISE,), COLUMNWISE, "scale_inv", pad=(4, 128))),
        "MXFP8Quantizer", tensor_flags=(("with_gemm_swizzled_scales", False),), te_recipe="MXFP8BlockScaling",
        min_capability=(10, 0),
    )

    def __post_init__(self):
        _check_fp8_dtype("MXFP8", self.fp8_dtype)

    @property
    def name(self) -> str:
        return "mxfp8"

    def block_shape(self, usage: str) -> BlockShape:
        return BlockShape(1, BLOCK) if usage == ROWWISE else BlockShape(BLOCK, 1)

    def check_shape(self, shape):
        m, k = as_matrix_shape(shape)
        if m % BLOCK or k % BLOCK:
            flat = f" (leading dims flattened: {m} x {k})" if len(shape) > 2 else ""
            raise RecipeError(
                f"mxfp8: shape {tuple(shape)} is not supported: TE's MXFP8 quantizer needs both matrix "
                f"dimensions{flat} divisible by {BLOCK}. Pad the weight to a multiple of {BLOCK} in both "
                f"({round_up(m, BLOCK)} x {round_up(k, BLOCK)}) or keep this layer in high precision."
            )

    # ---- Triton fast path (triton_mxfp8.py): both planes from one read; TE's MXFP8 kernels
    # need sm_100+ and are not used ----------------------------------------------------------------
    kernel_order = ("triton",)

    def _triton(self, hp) -> bool:
        return fast_path(self, hp) == "triton" and hp.dim() == 2 and hp.shape[0] % BLOCK == 0 and hp.shape[1] % BLOCK == 0

    def quantize_plane(self, hp, usage, *, amax=None, scale=None):
        if amax is None and scale is None and self._triton(hp):
            return kernels("mxfp8").quantize(hp, self.fp8_dtype, rowwise=usage == ROWWISE,
                                             columnwise=usage == COLUMNWISE)[usage]
        return super().quantize_plane(hp, usage, amax=amax, scale=scale)

    def quantize_planes(self, hp, usages, *, scale=None):
        if scale is None and self._triton(hp):
            return kernels("mxfp8").quantize(hp, self.fp8_dtype, rowwise=ROWWISE in usages, columnwise=COLUMNWISE in usages)
        return super().quantize_planes(hp, usages, scale=scale)

    def quantize_operand(self, hp, *, rowwise, columnwise, state=None):
        if self._triton(hp):  # the columnwise plane written transposed, as the wgrad GEMM reads it
            return kernels("mxfp8").quantize(hp, self.fp8_dtype, rowwise=rowwise, columnwise=columnwise,
                                             columnwise_transposed=True), state
        return super().quantize_operand(hp, rowwise=rowwise, columnwise=columnwise, state=state)

    def requantize_planes_(self, usage, hps, planes, amaxes, states):
        if all(a is None for a in amaxes) and all(self._triton(hp) for hp in hps) and all(
                p.data.is_contiguous() and p.scale_inv.is_contiguous() for p in planes):
            quantize = kernels("mxfp8").quantize
            for hp, plane in zip(hps, planes, strict=True):  # written into the existing storage
                quantize(hp, self.fp8_dtype, rowwise=usage == ROWWISE, columnwise=usage == COLUMNWISE, out={usage: plane})
            return list(states)
        return super().requantize_planes_(usage, hps, planes, amaxes, states)

    def gemm_recipe(self):
        # TE's MXFP8BlockScaling: E4M3 (its default format) activations and gradients, 1x32 / 32x1.
        operand = MXFP8(torch.float8_e4m3fn)
        return GemmRecipe(input=operand, grad=operand, fast_accum=(False, False, False), name="MXFP8BlockScaling")

    def scale_from_amax(self, amax, usage, hp_dtype=torch.float32):
        # TE multiplies by the fp32-rounded reciprocal (Quantized_Limits::max_norm_rcp), not a division.
        # torch.full, not torch.tensor: no host-to-device copy, so the optimizer step's CUDA graph
        # can capture it (master.py).
        fp8_max_rcp = torch.full((), 1.0 / torch.finfo(self.fp8_dtype).max, dtype=torch.float32, device=amax.device)
        biased = float_to_e8m0(amax.float() * fp8_max_rcp)
        return e8m0_reciprocal(biased), as_e8m0(biased)

    def decode(self, data, scale_inv, usage, dtype):
        # E8M0 -> fp32 through torch's native cast: exact for every byte but 0xFF (NaN).
        return super().decode(data, scale_inv.float(), usage, dtype)
