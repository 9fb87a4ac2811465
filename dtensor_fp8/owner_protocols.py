"""Who an FP8 weight's owner record calls back, declared as Protocols.

The owner record (``param_state.FP8ParamState``) sits low in the package: the tensor and every op
reach it. It holds references *up* to objects of higher layers, and what it does with them is
declared here, so an import shows who is called, and from where:

==========================  ==============================  ======================================  ==========================
slot of the record          Protocol                        implemented by                          called by
==========================  ==============================  ======================================  ==========================
``links.home`` (weak)       :class:`ParameterHome`          the ``nn.Module`` holding the weight    ``current_layout`` (a write
                                                            (``quantize_module_``, ``te.py``)       into a local shard)
``links.master`` (weak)     ``torch.nn.Parameter``          the optimizer's master                  ``param_writes.py``
                                                            (``optim_masters.py``)
``gather.group`` (weak)     :class:`GatheringGroup`         FSDP2's ``FSDPParamGroup``              ``fsdp.py`` (through
                                                                                                    ``_compat``)
``gather.unsharded_view``   :class:`UnshardedView`          ``te_tensor.TEUnshardedView``           ``fsdp_post_all_gather``,
                                                                                                    ``fsdp_buffers.gather_plan``
``gather.gathered``         :class:`PlaneCompletion`        ``fsdp_completion.GatheredWeight``      ``QuantizedTensor.plane``
                                                                                                    (a read of a plane the
                                                                                                    gather did not bring: it
                                                                                                    all-gathers)
==========================  ==============================  ======================================  ==========================
"""

from __future__ import annotations

from typing import Protocol

import torch

from .formats.base import Plane

# A QuantizedTensor is annotated as the torch.Tensor it is: this module sits below tensor.py (whose
# owner record holds these slots), so it does not import it, not even for annotations.


class ParameterHome(Protocol):
    """The module an FP8 weight is a parameter of (``FP8ParamState.links.home``): the record reads the
    parameter it is now (after ``fully_shard``: the DTensor) to learn its layout."""

    _parameters: dict[str, torch.nn.Parameter | None]


class GatheringGroup(Protocol):
    """FSDP2's ``FSDPParamGroup`` gathering a weight (``FP8ParamState.gather.group``), kept at its first
    gather; only ``_compat.py`` reads its fields (``fsdp_group_modules``,
    ``fsdp_group_reshards_to_smaller_mesh``), as each torch version lays them out."""

    mesh_info: object
    post_forward_mesh_info: object


class PlaneCompletion(Protocol):
    """The current FSDP2 gather of a weight that brought one of the two planes its recipe stores
    (``FP8ParamState.gather.gathered``; ``fsdp_completion.GatheredWeight``): a read of the other plane
    on the unsharded weight completes it, all-gathering that plane over FSDP2's group."""

    def complete_(self, tensor: torch.Tensor, usage: str) -> bool:
        """Give ``tensor`` (the unsharded weight of this gather, or an alias of it) the plane serving
        ``usage``: ``True`` if it now holds it, ``False`` if ``tensor`` is no such weight."""


class UnshardedView(Protocol):
    """What FSDP2 gathers of a module's FP8 weights hand out as the unsharded parameter, where that
    is not a :class:`QuantizedTensor` (registered with ``fsdp.register_unsharded_view``; ``te_tensor.py``'s
    ``TEUnshardedView`` builds TE tensors that TE's GEMMs read). ``fsdp_post_all_gather`` calls it.

    Every method follows FSDP2's post-all-gather contract: at the first gather (``out is None``) it
    returns ``(tensor, inner_tensors_to_free)``; at later ones it updates ``out`` (the same object,
    a DTensor over the tp mesh under tensor parallelism) in place and returns ``None``.
    """

    def __call__(self, planes: dict[str, Plane], recipe, shape: tuple[int, int], dtype: torch.dtype,
                 usages: tuple[str, ...], out, orig_rows: int):
        """A gather over several ranks: the unsharded parameter over the gathered ``planes``
        (views of FSDP's all-gather buffers) of a weight of the padded ``shape`` (``orig_rows``:
        its rows before padding), serving ``usages``, of nominal ``dtype``."""

    def views_shard(self, shard: torch.Tensor) -> bool:
        """Whether a one-rank gather of ``shard`` can hand out a view of the shard itself (then
        nothing is sent and :meth:`from_shard` is called instead of the view). The same answer
        for both directions: FSDP sizes its all-gather outputs once per weight."""

    def from_shard(self, shard: torch.Tensor, usages: tuple[str, ...], dtype: torch.dtype, out):
        """A one-rank gather where :meth:`views_shard` said so: the unsharded parameter over
        ``shard``'s own planes, serving ``usages``."""


__all__ = ["ParameterHome", "GatheringGroup", "PlaneCompletion", "UnshardedView"]
