from pathlib import Path

import pytest
import torch

GOLDEN = Path(__file__).resolve().parents[1].parent / "shared" / "golden" / "te-2.20.2-h200-quant-ref.pt"


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
    if not GOLDEN.exists():
        pytest.fail(f"golden vectors missing at {GOLDEN} (shared/ must sit beside the checkout)")
    return torch.load(GOLDEN, weights_only=False)


@pytest.fixture(scope="session")
def pools():
    from dist_utils import Pools

    p = Pools()
    yield p
    p.close()
