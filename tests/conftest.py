import functools
import gzip
import io
import os
from pathlib import Path

# The suites compare F.linear with quantized weights against the emulated linear's exact results
# (which plane a gather delivered, bit-exact training across world sizes). On CUDA (the NCCL runs
# of the same suites) F.linear would run FP8 GEMMs that also quantize activations and gradients;
# keep the emulated linear unless a run asks otherwise. Tests of the FP8 GEMMs opt in with
# dtensor_fp8.gemm.fp8_gemms() (tests/test_gemm.py, tests/gpu/test_gemm_gpu.py). dtensor_fp8.settings
# reads the variable once, at its first use, so after this line (tests/test_settings.py checks it);
# rank processes inherit it.
os.environ.setdefault("DTENSOR_FP8_GEMMS", "off")

import pytest
import torch

#: Transformer Engine 2.20.2's own quantized buffers (see tests/golden/README.md).
GOLDEN = Path(__file__).resolve().parent / "golden" / "te-2.20.2-quant.pt.gz"


@functools.cache
def load_golden() -> dict:
    """The golden vectors: ``input`` and, per TE quantizer case, ``buffers`` (TE's tensors by
    attribute name), ``dequant_fp32``, ``quantizer_scalars``, ``scale`` and ``class``. Tensors are
    stored once by content and referenced by hash; this expands the references."""
    with gzip.open(GOLDEN, "rb") as f:
        raw = torch.load(io.BytesIO(f.read()), weights_only=True)
    tensors = raw["tensors"]
    out = {"input": raw["input"], "meta": raw["meta"]}
    for name, e in raw["entries"].items():
        out[name] = {**e, "buffers": {k: tensors[h] for k, h in e["buffers"].items()},
                     "dequant_fp32": tensors[e["dequant_fp32"]]}
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a tensor, for byte-for-byte comparison."""
    t = t.contiguous()
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t.view(torch.uint8)


def assert_bytes_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert a.dtype.itemsize == b.dtype.itemsize, f"{what}: itemsize {a.dtype} vs {b.dtype}"
    ua, ub = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    if not torch.equal(ua, ub):
        diff = (ua != ub).nonzero()
        raise AssertionError(f"{what}: {diff.shape[0]} differing bytes, first at {diff[0].tolist()}")


def valid_region(name: str, m: int, k: int, recipe) -> tuple[int, int] | None:
    """Unpadded extent of TE's padded scale tensors (TE leaves the padding uninitialized), written
    from TE's ``get_scale_shape`` independently of the library's layout code."""
    import dtensor_fp8 as d

    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    if isinstance(recipe, d.Blockwise):
        if recipe.block_dims == 1:
            return {"_rowwise_scale_inv": (cdiv(k, 128), m), "_columnwise_scale_inv": (cdiv(m, 128), k)}.get(name)
        return {"_rowwise_scale_inv": (cdiv(m, 128), cdiv(k, 128)), "_columnwise_scale_inv": (cdiv(k, 128), cdiv(m, 128))}.get(name)
    if isinstance(recipe, d.MXFP8):
        return {"_rowwise_scale_inv": (m, k // 32), "_columnwise_scale_inv": (m // 32, k)}.get(name)
    return None


@pytest.fixture(scope="session")
def golden():
    return load_golden()


def pytest_configure(config):
    # A run killed by `timeout` still reports: the ranks' and this process's stacks, then pytest's
    # summary of what ran (tests/rank_logs.py).
    import dist_utils
    import rank_logs

    rank_logs.install_sigterm_report(dist_utils.LIVE_POOLS, config)


@pytest.fixture(scope="session")
def pools():
    from dist_utils import Pools

    p = Pools()
    yield p
    p.close()


@pytest.fixture(scope="session")
def gloo_cuda_pools(pools):
    """Rank pools with every rank on cuda:0 over gloo (tests/gpu/test_multirank_*.py), whatever
    ``DTENSOR_FP8_TEST_BACKEND`` is; the suite's own pools when it is ``gloo-cuda``."""
    from dist_utils import Pools

    if pools.backend == "gloo-cuda":
        yield pools
        return
    p = Pools("gloo-cuda")
    yield p
    p.close()
