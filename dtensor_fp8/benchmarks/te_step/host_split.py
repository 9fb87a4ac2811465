"""``te_step --host-split``: where a step's host time goes.

:class:`HostSplit` wraps, while it is entered, FSDP2's per-group steps (``unshard``,
``wait_for_unshard``, ``post_backward``, ``reshard``), the FP8 all-gather hooks (ours and TE's) and
our optimizer-step requantization (and the inner ``torch.optim.Adam.step``), and sums the host
time spent inside each per step. The entries nest (on one rank ``wait_for_unshard`` runs both
all-gather hooks), so they are read side by side, not added. Each wrapped call costs about a
microsecond more. The step itself reports its phases (forward, backward, optimizer step,
zero_grad) through :meth:`HostSplit.add_phases`.

Example:
    >>> with HostSplit() as split:
    ...     step()
    >>> split.per_step(1)["dtensor_fp8 post-all-gather hook"]  # ms
"""

from __future__ import annotations

import functools
import time

import torch

from ...formats import te_import

#: Labels of the two hooks whose ratio te_step reports: ours (variants d, e) and TE's (b).
OUR_POST_HOOK = "dtensor_fp8 post-all-gather hook"
WAIT_FOR_UNSHARD = "FSDP2 wait_for_unshard (copy-out + post-all-gather hooks)"
TE_POST_HOOKS = tuple(f"TE {c}.fsdp_post_all_gather" for c in ("Float8Tensor", "Float8BlockwiseQTensor", "MXFP8Tensor"))


class HostSplit:
    """Context manager summing the host time spent inside FSDP2's per-group steps, the all-gather
    hooks and the requantization (see the module docstring); restores everything on exit."""

    def __init__(self):
        self.totals: dict[str, float] = {}
        self._saved: list = []

    @staticmethod
    def _targets():
        from ... import _compat
        from ... import fsdp as dfsdp
        from ... import optim as doptim
        from ...tensor import QuantizedTensor

        FSDPParamGroup = _compat.fsdp_param_group_class()  # noqa: N806
        out = [(FSDPParamGroup, "unshard", "FSDP2 unshard (all-gather issue)"),
               (FSDPParamGroup, "wait_for_unshard", WAIT_FOR_UNSHARD),
               (FSDPParamGroup, "post_backward", "FSDP2 post_backward (reduce-scatter)"),
               (FSDPParamGroup, "reshard", "FSDP2 reshard"),
               (dfsdp, "fsdp_pre_all_gather", "dtensor_fp8 pre-all-gather hook"),
               (QuantizedTensor, "fsdp_post_all_gather", OUR_POST_HOOK),
               (doptim.MasterWeightOptimizer, "requantize_", "dtensor_fp8 requantize (optimizer step)"),
               (torch.optim.Adam, "step", "torch Adam.step (inside the optimizer step)")]
        te = te_import.load()
        if te is not None:
            for cls_name in ("Float8Tensor", "Float8BlockwiseQTensor", "MXFP8Tensor"):
                cls = getattr(te, cls_name)
                out += [(cls, n, f"TE {cls_name}.{n}") for n in ("fsdp_pre_all_gather", "fsdp_post_all_gather")
                        if n in vars(cls)]
        return out

    def __enter__(self):
        for owner, name, label in self._targets():
            original = vars(owner)[name]
            self._saved.append((owner, name, original))
            setattr(owner, name, self._wrap(original, label))
        return self

    def _wrap(self, fn, label):
        totals = self.totals

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[label] = totals.get(label, 0.0) + time.perf_counter() - t0
        return timed

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def add_phases(self, **seconds: float) -> None:
        """Host time of a step's phases (forward, backward, ...), measured by the step itself."""
        for phase, t in seconds.items():
            label = f"step phase: {phase}"
            self.totals[label] = self.totals.get(label, 0.0) + t

    def per_step(self, steps: int) -> dict[str, float]:
        """Milliseconds per step inside each wrapped function, over ``steps`` steps."""
        return {k: v * 1e3 / steps for k, v in self.totals.items()}
