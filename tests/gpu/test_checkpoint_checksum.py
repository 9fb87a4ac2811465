"""A checkpoint item's checksum is the same computed from a CUDA tensor (torch's reduction, as
``save_checkpoint`` computes it from a GPU state dict) and from its CPU copy (numpy's, as
``load_checkpoint`` verifies it), including block sums that wrap around 2**64."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from dtensor_fp8.checkpoint.checksum import tensor_checksum  # noqa: E402

CASES = [
    ("uint8 planes", lambda g: torch.randint(0, 256, (1024, 512), dtype=torch.uint8, generator=g)),
    ("fp32 master, not a 4 KiB multiple", lambda g: torch.randn(1000, 37, generator=g)),
    ("bf16", lambda g: torch.randn(333, 129, generator=g).to(torch.bfloat16)),
    ("e4m3", lambda g: torch.randn(4096, 3, generator=g).to(torch.float8_e4m3fn)),
    ("int64 near the limits (sums wrap)", lambda g: torch.randint(-2**62, 2**62, (8192,), generator=g)),
    ("0-dim step", lambda g: torch.tensor(123.0)),
    ("empty", lambda g: torch.zeros(0, 5)),
]


@pytest.mark.parametrize("name,make", CASES, ids=[c[0] for c in CASES])
def test_cuda_and_cpu_checksums_agree(name, make):
    cpu = make(torch.Generator().manual_seed(0))
    cuda = cpu.cuda()
    assert tensor_checksum(cuda) == tensor_checksum(cpu)
    if cpu.dim() == 2 and cpu.numel():
        assert tensor_checksum(cuda.t()) == tensor_checksum(cpu.t().contiguous())  # logical order
        assert tensor_checksum(cuda[3:]) == tensor_checksum(cpu[3:].clone())  # off an 8-byte boundary
