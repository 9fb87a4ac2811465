"""The lifecycle of one FP8 weight: where its FP8 bytes stand, and what a load brought since the last step.

[Note: an FP8 weight's lifecycle]
Each FP8 parameter's owner record (``FP8ParamState.lifecycle``, ``param_state.py``) holds one
:class:`Lifecycle`, changed only through its transition methods, each of which checks the state it
starts from (as FSDP2's ``FSDPParam`` does with ``_assert_in_states``). Two independent parts:

* **the bytes** (:class:`BytesState`): a weight quantized from values is ``MADE``. A weight built on
  the meta device (``quantize_module_``) is ``META``; ``to_empty`` allocates it (``ALLOCATED``,
  values all zero); the user's init writes its values (``INIT_WRITTEN``: an in-place ``nn.init``
  op, ``weight.copy_(values)``, a high-precision load, or a copy of another pending weight's
  values); ``finish_init_`` quantizes them (``MADE``) and refuses a weight still ``ALLOCATED``, which
  would otherwise train from zeros. An init may also run on the meta device, before ``to_empty``
  (``META`` -> ``INIT_WRITTEN`` -> ``ALLOCATED``: the values it wrote were never allocated)::

      MADE                                  (quantized from values)
      META --to_empty--> ALLOCATED --init--> INIT_WRITTEN --finish_init_--> MADE
        \\--init (on meta)--> INIT_WRITTEN --to_empty--> ALLOCATED

* **what a load brought since the last optimizer step** (:class:`LoadedSinceStep`): FP8 bytes
  from a checkpoint's entry (``model.load_state_dict``), the optimizer's master
  (``MasterWeightOptimizer.load_state_dict``), or both, in either order. At the next step the master
  follows loaded bytes unless its own saved value came too (``param_writes.py``); the step, and
  any write of new values, forget both.

Only this module writes these states; ``tests/test_structure.py`` checks it.
"""

from __future__ import annotations

import enum


class BytesState(enum.Enum):
    """Where an FP8 weight's bytes stand (see the note above)."""

    #: the FP8 bytes are quantized values: quantized at build, or made by ``finish_init_``
    MADE = "made"
    #: built on the meta device: no bytes and no values yet
    META = "meta"
    #: ``to_empty`` allocated the weight; its values (all zero) are still to be written by the init
    ALLOCATED = "allocated"
    #: the values are written; ``finish_init_`` is to quantize them into the bytes
    INIT_WRITTEN = "init written"


class LoadedSinceStep(enum.Flag):
    """What loads brought into a weight since the last optimizer step (see the note above)."""

    NOTHING = 0
    #: FP8 bytes from a checkpoint's entry (into a weight whose optimizer master exists)
    BYTES = enum.auto()
    #: the optimizer's master, from its state dict
    MASTER = enum.auto()


#: the states in which the FP8 bytes are still to be made from the values plane (``hp_init``)
PENDING = frozenset({BytesState.META, BytesState.ALLOCATED, BytesState.INIT_WRITTEN})


class LifecycleError(RuntimeError):
    """A transition of an FP8 weight's lifecycle from a state it does not start from."""


class Lifecycle:
    """One FP8 weight's lifecycle (see the note above): a new one is ``MADE`` with nothing loaded.

    Example:
        >>> q = dtensor_fp8.module.fp8_parameter_values(torch.empty(256, 128, device="meta"), dtensor_fp8.MXFP8())
        >>> q.param_state.lifecycle.bytes_state
        <BytesState.META: 'meta'>
    """

    __slots__ = ("_bytes_state", "_loaded_since_step")

    def __init__(self) -> None:
        self._bytes_state = BytesState.MADE
        self._loaded_since_step = LoadedSinceStep.NOTHING

    def __repr__(self) -> str:
        return f"Lifecycle({self._bytes_state.name}, loaded since step: {self._loaded_since_step.name})"

    # ---- reads -------------------------------------------------------------------------------------------

    @property
    def bytes_state(self) -> BytesState:
        """Where the FP8 bytes stand."""
        return self._bytes_state

    @property
    def bytes_pending(self) -> bool:
        """Whether the FP8 bytes are still to be made from the values plane (``hp_init``)."""
        return self._bytes_state in PENDING

    @property
    def loaded_since_step(self) -> LoadedSinceStep:
        """What loads brought since the last optimizer step."""
        return self._loaded_since_step

    @property
    def master_follows_loaded_bytes(self) -> bool:
        """Whether the master is to take the loaded FP8 bytes' values at the next step: bytes were
        loaded, and the optimizer's own master (more precise than their FP8 rounding) was not."""
        return self._loaded_since_step == LoadedSinceStep.BYTES

    # ---- copies ------------------------------------------------------------------------------------------

    def copied(self) -> "Lifecycle":
        """The lifecycle of a copy of the weight (``copy.deepcopy``, a pickle): the same bytes state,
        nothing loaded (a copy links to no master, so no load is waiting for one)."""
        twin = Lifecycle()
        twin._bytes_state = self._bytes_state
        return twin

    @classmethod
    def from_flags(cls, bytes_pending: bool, init_written: bool | None) -> "Lifecycle":
        """The lifecycle a record pickled before this class existed described with two flags
        (``bytes_pending``, ``init_written``: ``None`` before ``to_empty``, ``False`` after it, ``True``
        once the init wrote the values)."""
        restored = cls()
        if bytes_pending:
            restored._bytes_state = {None: BytesState.META, False: BytesState.ALLOCATED}.get(
                init_written, BytesState.INIT_WRITTEN)
        return restored

    # ---- transitions of the bytes -----------------------------------------------------------------------

    def _require(self, transition: str, legal, fix: str) -> None:
        if self._bytes_state not in legal:
            raise LifecycleError(
                f"{transition} of an FP8 weight whose bytes are {self._bytes_state.name}: legal only from "
                f"{', '.join(sorted(s.name for s in legal))}. {fix}")

    def mark_built_on_meta(self) -> None:
        """``MADE`` -> ``META``: a new FP8 weight built on the meta device (``quantize_module_``).

        Example:
            >>> q.param_state.lifecycle.mark_built_on_meta()   # a fresh record of a meta weight
        """
        self._require("mark_built_on_meta", {BytesState.MADE},
                      "Only a new weight (fp8_parameter_values on a meta tensor) starts on the meta device.")
        self._bytes_state = BytesState.META

    def mark_to_empty(self) -> None:
        """A pending state -> ``ALLOCATED``: ``to_empty`` allocated the weight on a real device; the
        user's init is to write its values (``finish_init_`` refuses it until then).

        Example:
            >>> q.param_state.lifecycle.mark_to_empty()   # from empty_like(meta_weight, device="cuda")
        """
        self._require("mark_to_empty", PENDING,
                      "to_empty allocates a weight built on the meta device; this one's bytes are made (copy new "
                      "values in with weight.copy_ instead).")
        self._bytes_state = BytesState.ALLOCATED

    def mark_init_written(self) -> None:
        """A pending state -> ``INIT_WRITTEN``: the user's init wrote the values (an in-place init op,
        ``weight.copy_(values)``, a high-precision load).

        Example:
            >>> q.param_state.lifecycle.mark_init_written()   # after nn.init.normal_ ran on hp_init
        """
        self._require("mark_init_written", PENDING,
                      "Only a weight whose bytes are pending takes values as its init; a weight whose bytes are made "
                      "is written through param_writes.write_hp_values_.")
        self._bytes_state = BytesState.INIT_WRITTEN

    def mark_copied_pending_values(self) -> None:
        """Any state -> ``INIT_WRITTEN``: another weight's pending values were copied into this one's
        values plane (``copy_`` from a weight whose bytes are pending): its bytes are to be made from them.

        Example:
            >>> dst.param_state.lifecycle.mark_copied_pending_values()
        """
        self._bytes_state = BytesState.INIT_WRITTEN

    def mark_made(self) -> None:
        """``INIT_WRITTEN`` -> ``MADE``: ``finish_init_`` quantized the written values into the bytes.

        Example:
            >>> q.param_state.lifecycle.mark_made()   # once the planes hold quantize(hp_init)
        """
        self._require("mark_made", {BytesState.INIT_WRITTEN},
                      "finish_init_ makes the bytes of a weight whose init wrote its values: call model.to_empty(...) "
                      "and your init first.")
        self._bytes_state = BytesState.MADE

    # ---- transitions of what a load brought (legal from any state: loads may repeat before a step) -------

    def mark_bytes_loaded(self) -> None:
        """FP8 bytes were loaded from a checkpoint's entry into the weight (whose master exists).

        Example:
            >>> dst.param_state.lifecycle.mark_bytes_loaded()   # in copy_ from a loaded entry
        """
        self._loaded_since_step |= LoadedSinceStep.BYTES

    def mark_master_loaded(self) -> None:
        """The optimizer's master of the weight was loaded from its state dict.

        Example:
            >>> local_tensor(p).param_state.lifecycle.mark_master_loaded()
        """
        self._loaded_since_step |= LoadedSinceStep.MASTER

    def reset_loaded(self) -> None:
        """Forget what loads brought: the optimizer step consumed it, or new values were written
        (their master took them).

        Example:
            >>> record.lifecycle.reset_loaded()
        """
        self._loaded_since_step = LoadedSinceStep.NOTHING


__all__ = ["BytesState", "LoadedSinceStep", "PENDING", "Lifecycle", "LifecycleError"]
