"""The process's kernel and GEMM switches: read from the environment once, overridable in-process.

[Note: one settings object]
Which implementation runs is chosen by a few environment variables. They are parsed together, at
the first :func:`current` call (so a test harness or launcher may set them before that, even after
importing the package), into one frozen :class:`Settings`; nothing else in the package reads
``os.environ`` (``tests/test_structure.py`` checks it). Code that wants other switches for a while
(tests comparing paths, benchmarks timing each) uses :func:`override`, which never writes the
environment. The switches are process-wide, as the environment is: an override applies to every
thread, the autograd engine's included (a backward run inside ``with override(...)`` sees it).

==================================== =================== =========================================
variable                             values (default)    ``Settings`` field: what it switches
==================================== =================== =========================================
``DTENSOR_FP8_GEMMS``                auto, on, off       ``fp8_gemms``: where ``F.linear`` with a
                                     (``auto``)          quantized weight runs FP8 GEMMs
                                                         (``gemm.py``: CUDA only; also the CPU;
                                                         never)
``DTENSOR_FP8_TE_KERNELS``           1, 0 (1)            ``te_kernels``: TE's kernels as the
                                                         recipes' fast path (``formats/te_kernels.py``)
``DTENSOR_FP8_TRITON``               1, 0 (1)            ``triton``: the Triton kernels
                                                         (``formats/triton_kernels.py``)
``DTENSOR_FP8_TRITON_SOFTWARE_CAST`` 0, 1 (0)            ``triton_software_cast``: the kernels cast
                                                         to FP8 with integer operations
``TRITON_INTERPRET``                 Triton's: 1, true,  ``triton_interpret``: Triton's CPU
                                     on are true (off)   interpreter runs the kernels (CPU tensors
                                                         too); read as Triton reads it
==================================== =================== =========================================

An empty variable counts as unset. Any other value of ours raises a :class:`ValueError` naming the
variable and the values it takes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping

#: Values of ``DTENSOR_FP8_GEMMS`` / ``Settings.fp8_gemms``: ``auto`` (FP8 GEMMs on CUDA where torch
#: has them), ``on`` (also on the CPU, where torch's kernel runs: tensorwise), ``off`` (the emulated
#: linear everywhere).
FP8_GEMM_MODES = ("auto", "on", "off")
FP8_GEMMS_VAR = "DTENSOR_FP8_GEMMS"
TE_KERNELS_VAR = "DTENSOR_FP8_TE_KERNELS"
TRITON_VAR = "DTENSOR_FP8_TRITON"
TRITON_SOFTWARE_CAST_VAR = "DTENSOR_FP8_TRITON_SOFTWARE_CAST"
TRITON_INTERPRET_VAR = "TRITON_INTERPRET"  # Triton's own variable
_SWITCH_VALUES = {"1": True, "0": False}
_TRITON_TRUE = ("1", "true", "on")  # what Triton's getenv_bool reads as true (case-insensitive)


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    """The switches in force (see the table at the top of ``settings.py``).

    Attributes:
        fp8_gemms: ``"auto"``, ``"on"`` or ``"off"``.
        te_kernels: TE's kernels may serve as the recipes' fast path.
        triton: the Triton kernels may serve as the recipes' fast path.
        triton_software_cast: the Triton kernels cast to FP8 with integer operations.
        triton_interpret: Triton's CPU interpreter runs the kernels.
    """

    fp8_gemms: str = "auto"
    te_kernels: bool = True
    triton: bool = True
    triton_software_cast: bool = False
    triton_interpret: bool = False

    def __post_init__(self):
        if self.fp8_gemms not in FP8_GEMM_MODES:
            raise ValueError(f"fp8_gemms={self.fp8_gemms!r}: must be one of {FP8_GEMM_MODES}")
        for field in ("te_kernels", "triton", "triton_software_cast", "triton_interpret"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"{field}={getattr(self, field)!r}: must be True or False")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Settings:
        """The settings an environment asks for (unset or empty variables: the defaults).

        Args:
            environ: the environment (``os.environ``, or a dict in tests).

        Raises:
            ValueError: a variable of ours has a value it does not take (the message names both).

        Example:
            >>> Settings.from_environ({"DTENSOR_FP8_GEMMS": "off", "DTENSOR_FP8_TRITON": "0"})
            Settings(fp8_gemms='off', te_kernels=True, triton=False, triton_software_cast=False, triton_interpret=False)
        """
        gemms = environ.get(FP8_GEMMS_VAR) or "auto"
        if gemms not in FP8_GEMM_MODES:
            raise ValueError(f"{FP8_GEMMS_VAR}={gemms!r}: must be one of {', '.join(FP8_GEMM_MODES)} (unset: auto)")
        return cls(
            fp8_gemms=gemms,
            te_kernels=_switch(environ, TE_KERNELS_VAR, True),
            triton=_switch(environ, TRITON_VAR, True),
            triton_software_cast=_switch(environ, TRITON_SOFTWARE_CAST_VAR, False),
            triton_interpret=(environ.get(TRITON_INTERPRET_VAR) or "").lower() in _TRITON_TRUE,
        )


def _switch(environ: Mapping[str, str], name: str, default: bool) -> bool:
    value = environ.get(name) or ""
    if not value:
        return default
    if value not in _SWITCH_VALUES:
        raise ValueError(f"{name}={value!r}: must be 1 (on) or 0 (off) (unset: {int(default)})")
    return _SWITCH_VALUES[value]


_current: Settings | None = None


def current() -> Settings:
    """The settings in force: the innermost :func:`override`, else the environment as it was at the
    first call (parsed then, once).

    Raises:
        ValueError: at the first call, for a malformed variable (see :meth:`Settings.from_environ`).

    Example:
        >>> dtensor_fp8.settings.current().fp8_gemms
        'auto'
    """
    global _current
    if _current is None:
        _current = Settings.from_environ(os.environ)
    return _current


@contextlib.contextmanager
def override(**changes) -> Iterator[Settings]:
    """Within the block, the given switches replace those in force (process-wide, see the note at
    the top); on exit, the settings in force before come back, also after an exception.

    Args:
        **changes: :class:`Settings` fields and their values (``fp8_gemms="off"``,
            ``te_kernels=False``, ...); an unknown field or a bad value raises ``ValueError`` /
            ``TypeError`` before anything changes.

    Example:
        >>> with dtensor_fp8.settings.override(fp8_gemms="off", te_kernels=False, triton=False):
        ...     y = torch.nn.functional.linear(x, q)   # the emulated linear, reference codecs
    """
    global _current
    before = current()
    wanted = dataclasses.replace(before, **changes)
    _current = wanted
    try:
        yield wanted
    finally:
        _current = before
