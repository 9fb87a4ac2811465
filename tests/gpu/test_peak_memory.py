"""``linear_step --memory-at-peak``: the replay of the allocator's history finds the step's peak
(CUDA's own ``max_memory_allocated``) and names where what is alive then was allocated."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from dtensor_fp8.benchmarks.peak_memory import memory_at_peak  # noqa: E402

MIB = 1024 ** 2


def _big_temporary():
    return torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")


def test_the_peak_and_its_sites_are_the_allocators(tmp_path):
    held = [torch.empty(32 * MIB, dtype=torch.uint8, device="cuda")]  # freed inside the step

    def step():
        held.pop()  # a tensor from before the step, freed in it
        a = _big_temporary()
        b = torch.empty(16 * MIB, dtype=torch.uint8, device="cuda")
        del a, b
        return torch.empty(8 * MIB, dtype=torch.uint8, device="cuda")

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = memory_at_peak(step, str(tmp_path / "peak.txt"))
    assert abs(out["peak_gib"] * 1024 ** 3 - torch.cuda.max_memory_allocated()) < 2 * MIB
    table = (tmp_path / "peak.txt").read_text()
    # alive at the peak: the 64 MiB temporary and the 16 MiB tensor, each named by its line here
    assert "_big_temporary" in table and "step" in table, table
    assert "of it freed by the peak 0.031 GiB" in table, table
