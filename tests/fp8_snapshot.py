"""Byte snapshots of a training run's state, for bit-exact resume and reshard checks: every
parameter's local bytes (an FP8 weight's planes and scales), each FP8 weight's master where asked,
and the optimizer state's tensors."""

from __future__ import annotations

import torch

import dtensor_fp8 as d
from dtensor_fp8._compat import dtensor_local


def snapshot(named_parameters, optimizers, master_of=None) -> dict[str, torch.Tensor]:
    """``{name/usage: plane bytes, name/usage_scale: scale bytes, [name/master], name: tensor, opt/key: tensor}``
    of this rank's shards (``master_of(p)``: the FP8 parameter's master, when given)."""
    out = {}
    for n, p in named_parameters:
        local = dtensor_local(p)
        if isinstance(local, d.QuantizedTensor):
            for usage, plane in local.planes.items():
                out[f"{n}/{usage}"] = plane.data.view(torch.uint8).clone()
                out[f"{n}/{usage}_scale"] = plane.scale_inv.contiguous().view(torch.uint8).clone()
            if master_of is not None:
                out[f"{n}/master"] = dtensor_local(master_of(p)).detach().clone()
        else:
            out[n] = local.detach().clone()
    for key, value in optimizers.state_dict().items():
        if isinstance(value, torch.Tensor):
            out[f"opt/{key}"] = dtensor_local(value).detach().clone()
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def differing(expected: dict, got: dict) -> list[str]:
    """Keys missing on either side or whose bytes differ."""
    keys = sorted(set(expected) | set(got))
    return [k for k in keys if k not in got or k not in expected or not torch.equal(as_bytes(expected[k]), as_bytes(got[k]))]
