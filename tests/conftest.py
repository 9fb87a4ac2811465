import os
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
