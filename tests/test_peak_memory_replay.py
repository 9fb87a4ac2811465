"""``benchmarks/peak_memory.py``'s replay of an allocator trace, on traces written here (the GPU test,
``tests/gpu/test_peak_memory.py``, runs it on CUDA's own): the peak, what is alive then by site, and
the sites named by the innermost frame of this library, else of torch, else the innermost."""

from __future__ import annotations

import os

import torch

import dtensor_fp8
from dtensor_fp8.benchmarks.peak_memory import _site, live_at_peak

HERE = os.path.abspath(__file__)
LIB = os.path.join(os.path.dirname(os.path.abspath(dtensor_fp8.__file__)), "fsdp_buffers.py")
TORCH = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "nn", "functional.py")
# a file of another package that lies under a directory called "torch" (as /opt/torch/.venv/...)
OTHER = os.path.join(os.sep, "opt", "torch", ".venv", "lib", "site-packages", "_pytest", "python.py")


def _frame(filename, line, name):
    return {"filename": filename, "line": line, "name": name}


def test_site_prefers_this_library_then_torch_then_the_innermost_frame():
    assert _site([_frame(HERE, 1, "inner"), _frame(TORCH, 2, "linear"), _frame(LIB, 3, "gather")]) \
        == "fsdp_buffers.py:3:gather"
    assert _site([_frame(HERE, 1, "inner"), _frame(TORCH, 2, "linear"), _frame(OTHER, 4, "call")]) \
        == "functional.py:2:linear"
    assert _site([_frame(HERE, 1, "inner"), _frame(OTHER, 4, "call")]) == "test_peak_memory_replay.py:1:inner"
    assert _site([]) == "(no stack)"


def test_live_at_peak_replays_allocations_and_frees():
    here = [_frame(HERE, 7, "step")]
    trace = [
        {"action": "free_completed", "addr": 900, "size": 32, "frames": []},  # held before the trace
        {"action": "alloc", "addr": 1, "size": 64, "frames": [_frame(LIB, 3, "gather")]},
        {"action": "alloc", "addr": 2, "size": 16, "frames": here},
        {"action": "free_completed", "addr": 1, "size": 64, "frames": []},
        {"action": "free_completed", "addr": 2, "size": 16, "frames": []},
        {"action": "alloc", "addr": 3, "size": 8, "frames": here},
    ]
    rise, sites, freed_before = live_at_peak(trace)
    assert rise == 64 + 16 - 32  # above the bytes held when the trace began
    assert sites == {"fsdp_buffers.py:3:gather": 64, "test_peak_memory_replay.py:7:step": 16}
    assert freed_before == 32
