"""Byte-equality checks of the recipes' Triton fast path against their pure-torch reference.

Shared by ``tests/test_triton_kernels.py`` (Triton's CPU interpreter, in a subprocess with
``TRITON_INTERPRET=1``) and ``tests/gpu/test_triton_gpu.py`` (CUDA). Every check runs the same
recipe call twice, Triton only (``kernel_paths(te=False, triton=True)``, asserted to be the path
taken) and reference only, and compares FP8 data and scale_inv as raw bytes: quantize (both
planes), GEMM-operand quantization (columnwise planes written transposed), and the
in-place, batched requantization of an optimizer step.

Inputs: TE's golden input (tests/golden) and the special values the spec tests use (NaN, +-Inf,
+-0, fp32 and FP8 subnormals, outliers spanning 2^-40 .. 2^40, whole zero blocks), in fp32 /
bf16 / fp16, with ragged shapes for the blockwise recipes.
"""

from __future__ import annotations

import sys

import torch

import dtensor_fp8 as d
from dtensor_fp8.formats import te_kernels, triton_kernels

RECIPES = {
    "delayed_e4m3": d.DelayedScaling(), "delayed_e5m2": d.DelayedScaling(fp8_dtype=torch.float8_e5m2),
    "current_e4m3": d.CurrentScaling(), "current_e5m2_pow2": d.CurrentScaling(torch.float8_e5m2, force_pow_2_scales=True),
    "current_eps": d.CurrentScaling(amax_epsilon=1e-3), "delayed_margin": d.DelayedScaling(margin=2),
    "mxfp8_e4m3": d.MXFP8(), "mxfp8_e5m2": d.MXFP8(torch.float8_e5m2),
    "block1d": d.Blockwise(block_dims=1), "block2d": d.Blockwise(block_dims=2),
    "block1d_fp32_scales_eps": d.Blockwise(block_dims=1, force_pow_2_scales=False, amax_epsilon=1e-6),
    "block2d_e5m2": d.Blockwise(block_dims=2, fp8_dtype=torch.float8_e5m2),
}
HP_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CASES = ("golden", "random", "specials", "ragged")


def make_input(case: str, dtype: torch.dtype, device, recipe) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((case, str(dtype))) % 2**31)
    if case == "golden":
        from conftest import load_golden

        x = load_golden()["input"].float()
    elif case == "random":
        x = torch.randn(256, 384, generator=g) * torch.logspace(-3, 3, 384)
    elif case == "ragged":
        if isinstance(recipe, d.MXFP8):  # MXFP8 needs multiples of 32
            x = torch.randn(96, 160, generator=g)
        else:
            x = torch.randn(200, 300, generator=g) * torch.logspace(-2, 2, 300)
    else:
        x = torch.randn(256, 256, generator=g)
        lim = torch.finfo(dtype).max
        x[0, :8] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, lim, -lim, 1.0])
        x[1, :] = float("nan")  # a block of NaN only
        x[2:4, :] = 0.0  # whole zero rows (zero blocks for 1x32 / 1x128)
        x[128:, 128:] = 0.0  # a zero 128x128 block
        x[4, :64] = 2.0 ** -40  # below every FP8 format's range after scaling with outliers
        x[5, 3] = 2.0 ** 40 if dtype != torch.float16 else 60000.0
        x[6, :] = torch.logspace(-40, 10, 256, base=2.0)  # FP8 subnormals after scaling
        x[40:72, 7] = -(2.0 ** -130)  # fp32 subnormals (flush to zero in bf16 / fp16)
        x[100, 100] = float("nan")
    return x.to(dtype).to(device)


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype.itemsize == 1 else t.contiguous().view(torch.uint8)


def _same(fast, ref, what: str, errors: list) -> None:
    for field in ("data", "scale_inv"):
        a, b = getattr(fast, field), getattr(ref, field)
        if a.shape != b.shape or a.dtype != b.dtype:
            errors.append(f"{what}.{field}: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}")
        elif not torch.equal(_u8(a), _u8(b)):
            errors.append(f"{what}.{field}: {int((_u8(a) != _u8(b)).sum())} bytes differ")


def _triton_only():
    return te_kernels.kernel_paths(te=False, triton=True)


def check(name: str, case: str, dtype_name: str, device) -> list[str]:
    """Every Triton path of recipe ``name`` against the reference on one input; returns the errors."""
    recipe, dtype = RECIPES[name], HP_DTYPES[dtype_name]
    x = make_input(case, dtype, device, recipe)
    what = f"{name}/{case}/{dtype_name}"
    errors: list[str] = []
    with _triton_only():
        if triton_kernels.fast_path(recipe, x) != "triton":
            return [f"{what}: the Triton path is not taken (device {x.device}, interpreter {triton_kernels.interpreting()})"]
    kw = {"scale": torch.tensor(0.375, device=device)} if isinstance(recipe, d.DelayedScaling) else {}
    # quantize: every stored plane from one call
    with _triton_only():
        fast = d.quantize(x, recipe, **kw)
    with te_kernels.reference_only():
        ref = d.quantize(x, recipe, **kw)
    for usage in ref.planes:
        _same(fast.planes[usage], ref.planes[usage], f"{what}/quantize/{usage}", errors)
    if kw:  # delayed scaling without a given scale: the first scale seeded from x's amax
        with _triton_only():
            fast = d.quantize(x, recipe)
        with te_kernels.reference_only():
            ref = d.quantize(x, recipe)
        _same(fast.planes["rowwise"], ref.planes["rowwise"], f"{what}/quantize(seeded scale)", errors)
    # GEMM operands (activations / gradients), with the operand recipes of a weight of this recipe
    g = recipe.gemm_recipe()
    for role, op_recipe in (("input", g.input), ("grad", g.grad)):
        for rowwise, columnwise in ((True, True), (True, False), (False, True)):
            if isinstance(op_recipe, d.MXFP8) and (x.shape[0] % 32 or x.shape[1] % 32):
                continue
            with _triton_only():
                fp, fs = op_recipe.quantize_operand(x, rowwise=rowwise, columnwise=columnwise,
                                                    state=op_recipe.operand_state(x.device))
            with te_kernels.reference_only():
                rp, rs = op_recipe.quantize_operand(x, rowwise=rowwise, columnwise=columnwise,
                                                    state=op_recipe.operand_state(x.device))
            if set(fp) != set(rp):
                errors.append(f"{what}/operand/{role}: usages {sorted(fp)} vs {sorted(rp)}")
            for usage in rp:
                _same(fp[usage], rp[usage], f"{what}/operand/{role}/{usage}/{rowwise},{columnwise}", errors)
            for key in rs or {}:
                if not torch.equal(_u8(fs[key]), _u8(rs[key])):
                    errors.append(f"{what}/operand/{role}/state.{key} differs")
    # An optimizer step: two weights' planes requantized in place, in one batch, from new masters
    if case in ("random", "specials"):
        ws = [x, (x.float() * 3 + 1).to(dtype)]
        hps = [(w.float() * 1.5 - 0.25).to(dtype) for w in ws]
        with te_kernels.reference_only():
            fast_qs = [d.quantize(w, recipe, **kw) for w in ws]
            ref_qs = [d.quantize(w, recipe, **kw) for w in ws]
        for usage in recipe.stored_usages(True, True):
            fast_planes = [q.planes[usage] for q in fast_qs]
            ptrs = [(p.data.data_ptr(), p.scale_inv.data_ptr()) for p in fast_planes]
            states = [recipe.initial_scaling_state(p) for p in fast_planes]
            ref_states = [recipe.initial_scaling_state(q.planes[usage]) for q in ref_qs]
            with _triton_only():
                new_fast = recipe.requantize_planes_(usage, hps, fast_planes, [None, None], states)
            with te_kernels.reference_only():
                new_ref = recipe.requantize_planes_(usage, hps, [q.planes[usage] for q in ref_qs], [None, None], ref_states)
            for i in range(2):
                _same(fast_qs[i].planes[usage], ref_qs[i].planes[usage], f"{what}/requantize_/w{i}/{usage}", errors)
                if new_ref[i] is not None:
                    for key in new_ref[i]:
                        if not torch.equal(_u8(new_fast[i][key]), _u8(new_ref[i][key])):
                            errors.append(f"{what}/requantize_/w{i}/state.{key} differs")
            if [(p.data.data_ptr(), p.scale_inv.data_ptr()) for p in fast_planes] != ptrs:
                errors.append(f"{what}/requantize_/{usage}: planes were not written in place")
    return errors


def cases(names=None):
    """``(recipe, case, dtype)`` triples checked (fp16 only for the specials)."""
    out = []
    for name in names or RECIPES:
        for case in CASES:
            for dt in HP_DTYPES:
                if dt == "fp16" and case != "specials":
                    continue
                if case == "golden" and dt != "bf16":
                    continue
                out.append((name, case, dt))
    return out


def main(argv: list[str]) -> int:
    """``python kernel_checks.py DEVICE [CASE:DTYPE,...]``: print each case's result (every recipe);
    exit 1 on errors. Without the second argument every case runs."""
    device = argv[0]
    todo = cases()
    if len(argv) > 1:
        wanted = {tuple(c.split(":")) for c in argv[1].split(",")}
        todo = [c for c in todo if (c[1], c[2]) in wanted]
    failed = 0
    for name, case, dt in todo:
        errors = check(name, case, dt, device)
        print(f"{'FAIL' if errors else 'ok'} {name}/{case}/{dt}" + "".join(f"\n    {e}" for e in errors[:6]), flush=True)
        failed += bool(errors)
    print(f"{len(todo) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
