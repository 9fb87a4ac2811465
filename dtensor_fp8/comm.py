"""Counting the bytes that reach all-gather collectives (tests, benchmarks, the example)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_FUNCTIONAL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
_LEGACY_GATHER = torch.ops.c10d._allgather_base_.default  # (output, input, group, ...): FSDP2's path


class CollectiveBytes(TorchDispatchMode):
    """Counts the bytes each rank hands to (``sent``) and receives from (``received``) all-gathers,
    at the plain-tensor level.

    A collective called on a tensor subclass is re-dispatched to the subclass with this mode still
    active, so what is counted is what reaches the process group (FP8 planes as uint8 and their
    scales), not the nominal high-precision size.
    """

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[torch.dtype, int, int]] = []  # (dtype, sent bytes, received bytes)

    @property
    def sent(self) -> int:
        return sum(s for _, s, _ in self.calls)

    @property
    def received(self) -> int:
        return sum(r for _, _, r in self.calls)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _FUNCTIONAL_GATHER or func is _LEGACY_GATHER:
            inp = args[0] if func is _FUNCTIONAL_GATHER else args[1]
            if type(inp) is not torch.Tensor:
                with self:
                    return type(inp).__torch_dispatch__(func, types, args, kwargs)
            nbytes = inp.numel() * inp.element_size()
            world = args[1] if func is _FUNCTIONAL_GATHER else args[0].numel() // max(inp.numel(), 1)
            self.calls.append((inp.dtype, nbytes, nbytes * world))
        return func(*args, **kwargs)
